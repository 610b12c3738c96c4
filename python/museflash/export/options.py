"""What the user asked the export to do, and the checks that need nothing but the flags.

It imports no torch, so the command line can define its flags and answer --help at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from museflash.bundle import BUILTIN_PAIRS, KVWrite
from museflash.compression import PRESETS

# The capacity without --max-context-length: the model's own context (its config's
# max_position_embeddings) up to MAX_DEFAULT_CONTEXT_LENGTH, so a chat gets all of SmolLM2's 8192
# while Llama 3.1's 131,072 (17 GB of fp16 state at 8B) must be asked for; DEFAULT_CONTEXT_LENGTH
# when the config does not say. The context buckets keep a call's cost to what it fills.
MAX_DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_CONTEXT_LENGTH = 512
# Default context buckets (docs/buckets.md): at most DEFAULT_BUCKETS contexts, the capacity
# among them, from SMALLEST_DEFAULT_BUCKET up; each bucket adds a main, a prefill and (when
# main verifies a block) a decode.
DEFAULT_BUCKETS = 5
SMALLEST_DEFAULT_BUCKET = 512
# Tokens drafted per step when --num-draft-tokens is not given (capped by the drafter's
# block_size - 1). Chosen by measurement (docs/benchmarks.md, //:demo_figures): on both demo
# pairs k = 7 decoded fastest on the Python export backend, and on the Swift engine for v1;
# k = 15 was slower on every engine, because a 16-token main costs far more than it returns.
# Third-party MLX figures for the real DFlash2 pair agree: block 5 faster than block 16.
DEFAULT_NUM_DRAFT_TOKENS = 7


class ExportError(ValueError):
    """The export cannot proceed; the message names the problem and the fix."""


@dataclass
class ExportOptions:
    output_dir: Path
    checkpoint: Path | None = None
    drafter_checkpoint: Path | None = None
    # Without checkpoints: the built-in pair to export (bundle.BUILTIN_PAIRS): the trained demo
    # pair under demo/ (docs/demo.md), or the tiny random pair the tests export.
    builtin: str = "demo"
    overwrite: bool = False
    fused_target: bool = False
    dflash_drafter: bool = False
    with_drafter: bool = False
    num_draft_tokens: int | None = None
    # Capacity of the global KV caches; None: the model's max_position_embeddings up to
    # MAX_DEFAULT_CONTEXT_LENGTH (plan.context_length).
    max_context_length: int | None = None
    prefill_length: int = 32
    decode_length: int | None = None
    model_name: str | None = None
    # Processes converting functions at once, this one included; None: up to 2 (CPU count).
    conversion_processes: int | None = None
    # Show coremltools' per-pass progress bars and library warnings on the console.
    verbose: bool = False
    # Weight compression: a preset (compression.PRESETS; None = not given = "none"), or the
    # rules of a JSON file (compression.read_rules). Exclusive.
    compression: str | None = None
    compression_config: Path | None = None
    # The fp16 range audit's calibration prompts (one per line), instead of the built-in ones.
    calibration_prompts: Path | None = None
    # How main and prefill write the target's global KV caches (bundle.KVWrite).
    kv_write: str = KVWrite.BLEND.value
    # The target's context buckets (docs/buckets.md); None: plan.context_buckets' default.
    context_buckets: tuple[int, ...] | None = None
    # A bucketed function is converted once, at a template span, and each bucket's package is
    # written from it (export/spans.py). Not a flag: False converts every bucket, for the tests
    # and the benchmark that compare the two.
    span_templates: bool = True
    # Nodes of the target's `tree` function (docs/trees.md); None: the block of a DFlash
    # export (none without one); 0: no tree function.
    tree_nodes: int | None = None
    # More bundles from the same conversion: (compression preset, output directory) each. The
    # functions are traced and converted once; each bundle gets its own weights and merge.
    also_export: tuple[tuple[str, Path], ...] = ()
    # Run the converted target's prefill and main against fp32 eager before publishing
    # (export/self_check.py); --no-self-check skips it, and metadata.json records that.
    self_check: bool = True
    # Today's graph before the fp16 work: plain RMSNorms and no residual scaling. Not a flag:
    # for the tests that show it failing on large activations and for the figures.
    legacy_fp16: bool = False

    @property
    def output_dirs(self) -> list[Path]:
        """Every directory the export publishes: --output-dir, then each --also-export's."""
        return [Path(self.output_dir), *(Path(directory) for _, directory in self.also_export)]

    @property
    def wants_drafter(self) -> bool:
        """The drafter checkpoint is read (for the fused target's encoder or a drafter)."""
        return self.fused_target or self.dflash_drafter or self.with_drafter


def check_flag_rules(options: ExportOptions) -> None:
    if options.dflash_drafter and options.with_drafter:
        raise ExportError(
            "--dflash-drafter and --with-drafter are mutually exclusive: pick the DFlash drafter "
            "or the older ring drafter"
        )
    if options.dflash_drafter and not options.fused_target:
        raise ExportError(
            "--dflash-drafter requires --fused-target (the drafter reads the target's "
            "drafter_features output)"
        )
    if options.drafter_checkpoint is not None and not options.wants_drafter:
        raise ExportError(
            "--drafter-checkpoint is only used with --fused-target, --dflash-drafter or "
            "--with-drafter"
        )
    if (options.checkpoint is None) != (options.drafter_checkpoint is None) and (
        options.wants_drafter
    ):
        raise ExportError(
            "give both --checkpoint and --drafter-checkpoint, or neither (the built-in demo "
            "pair); a target and a drafter from different sources would be mixed"
        )
    if options.builtin not in BUILTIN_PAIRS:
        raise ExportError(f"--builtin {options.builtin!r} is not a built-in pair; choose one of "
                          f"{list(BUILTIN_PAIRS)} (or give --checkpoint)")
    if options.compression is not None and options.compression not in PRESETS:
        raise ExportError(f"--compression {options.compression!r} is not a preset; choose one "
                          f"of {list(PRESETS)}, or give rules with --compression-config FILE")
    if options.compression is not None and options.compression_config is not None:
        raise ExportError("--compression and --compression-config are exclusive: a preset, or "
                          "the rules of a file (which can state a preset's rules itself)")
    check_also_export(options)
    if options.kv_write not in [k.value for k in KVWrite]:
        raise ExportError(f"--kv-write {options.kv_write!r} is not a strategy; choose one of "
                          f"{[k.value for k in KVWrite]} (docs/kv-write.md)")
    if options.conversion_processes is not None and options.conversion_processes < 1:
        raise ExportError(f"--conversion-processes {options.conversion_processes} must be at "
                          "least 1 (1 converts every function in this process)")
    if options.tree_nodes is not None and options.tree_nodes != 0:
        if options.tree_nodes < 2:
            raise ExportError(f"--tree-nodes {options.tree_nodes} must be at least 2 (the root "
                              "and one candidate), or 0 for no tree function")
        if not options.dflash_drafter:
            raise ExportError("--tree-nodes needs --dflash-drafter: a tree verifies the "
                              "drafter's candidates (drop --tree-nodes, or add the drafter)")
    for name in ("max_context_length", "prefill_length"):
        if getattr(options, name) is not None and getattr(options, name) < 1:
            raise ExportError(f"--{name.replace('_', '-')} must be at least 1")
    if options.max_context_length is not None:
        check_context_length(options.max_context_length, options.prefill_length)
    from museflash.checkpoint.gguf import is_gguf  # imports torch

    if is_gguf(options.checkpoint):
        if not Path(options.checkpoint).is_file():
            raise ExportError(f"--checkpoint {options.checkpoint}: GGUF file not found")
    elif options.checkpoint is not None and not Path(options.checkpoint).is_dir():
        raise ExportError(f"--checkpoint {options.checkpoint} is not a directory or a .gguf "
                          "file; point it at the checkpoint folder that holds config.json and "
                          "the safetensors files, or at a GGUF file")
    if options.drafter_checkpoint is not None and not Path(options.drafter_checkpoint).is_dir():
        raise ExportError(f"--drafter-checkpoint {options.drafter_checkpoint} is not a "
                          "directory; point it at the checkpoint folder that holds config.json "
                          "and the safetensors files")


def parse_also_export(value: str) -> tuple[str, Path]:
    """--also-export PRESET=DIR as (preset, directory)."""
    preset, equals, directory = value.partition("=")
    if not equals or not preset or not directory:
        raise ExportError(f"--also-export {value!r} is not PRESET=DIR; give a compression "
                          f"preset and a directory, e.g. 4bit=exported-4bit")
    return preset, Path(directory)


def check_also_export(options: ExportOptions) -> None:
    """Each --also-export names a preset other than the main bundle's and a directory of its
    own."""
    main = None if options.compression_config is not None else (options.compression or "none")
    seen: dict[Path, str] = {Path(options.output_dir).absolute(): "--output-dir"}
    presets: set[str] = set()
    for preset, directory in options.also_export:
        flag = f"--also-export {preset}={directory}"
        if preset not in PRESETS:
            raise ExportError(f"{flag}: {preset!r} is not a preset; choose one of "
                              f"{list(PRESETS)}")
        if preset == main or preset in presets:
            raise ExportError(f"{flag}: a {preset} bundle is already being written; give each "
                              "compression once, other than --compression's")
        where = Path(directory).absolute()
        if where in seen:
            raise ExportError(f"{flag}: {directory} is already the directory of {seen[where]}; "
                              "give each bundle a directory of its own")
        presets.add(preset)
        seen[where] = flag


def check_context_length(context: int, prefill_length: int) -> None:
    if context % 32:
        suggestion = -(-context // 32) * 32
        raise ExportError(
            f"--max-context-length {context} is not a multiple of 32 (the global KV cache is a "
            f"Core ML state and the Neural Engine wants state dimensions in multiples of 32); "
            f"use {suggestion}")
    if prefill_length > context:
        raise ExportError(f"--prefill-length {prefill_length} exceeds --max-context-length "
                          f"{context}")


def parse_context_buckets(value: str | None) -> tuple[int, ...] | None:
    """--context-buckets 512,2048,8192 as (512, 2048, 8192); None when not given."""
    if value is None:
        return None
    try:
        buckets = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ExportError(f"--context-buckets {value!r} is not a comma-separated list of "
                          "integers; give slot counts, e.g. 512,2048,8192") from None
    return buckets


def check_context_buckets(buckets: tuple[int, ...], context: int, max_query: int) -> None:
    """Each bucket a multiple of 32 (a slice of a Core ML state the Neural Engine wants
    aligned), ascending, at most the capacity, and holding a whole call of the longest query
    (the prefill chunk or the verify block)."""
    flag = f"--context-buckets {','.join(map(str, buckets))}"
    if not buckets:
        raise ExportError(f"{flag}: give at least one bucket, e.g. {context}")
    if list(buckets) != sorted(set(buckets)):
        raise ExportError(f"{flag}: the buckets are not strictly ascending; list each once, "
                          "smallest first")
    for bucket in buckets:
        if bucket % 32:
            raise ExportError(f"{flag}: {bucket} is not a multiple of 32 (the Neural Engine "
                              f"wants state slices in multiples of 32); use "
                              f"{-(-bucket // 32) * 32}")
        if bucket > context:
            raise ExportError(f"{flag}: {bucket} exceeds the capacity {context}; raise "
                              f"--max-context-length or drop the bucket")
        if bucket < max_query:
            raise ExportError(f"{flag}: {bucket} is below the longest call ({max_query} "
                              "tokens: the prefill chunk or the verify block), which a bucket "
                              "must hold; drop it or use a larger one")


def default_context_buckets(context: int, max_query: int) -> tuple[int, ...]:
    """The buckets below `context` by default: DEFAULT_BUCKETS contexts in all, spaced evenly
    in log scale from SMALLEST_DEFAULT_BUCKET to the capacity and rounded down to multiples of
    32 (a doubling when the capacity is 16 times the smallest), without one shorter than the
    longest call. None below a capacity of twice the smallest."""
    if context < 2 * SMALLEST_DEFAULT_BUCKET:
        return ()
    steps = min(DEFAULT_BUCKETS - 1, max(1, round(math.log2(context / SMALLEST_DEFAULT_BUCKET))))
    ratio = (context / SMALLEST_DEFAULT_BUCKET) ** (1 / steps)
    buckets = {int(SMALLEST_DEFAULT_BUCKET * ratio ** i) // 32 * 32 for i in range(steps)}
    return tuple(sorted(b for b in buckets if max_query <= b < context))
