"""museflash export: Muse Glimmer (+ DFlash or ring drafter) to Core ML.

  ./bazelw run //:export -- --fused-target --dflash-drafter [--checkpoint DIR
      --drafter-checkpoint DIR] [--output-dir exported] [--overwrite]

Without --checkpoint/--drafter-checkpoint a built-in pair is exported: --builtin demo (the
default: the pair trained on the Python standard library, under demo/), --builtin tiny
(random weights, 0.8 MB, what the tests export) or --builtin tiny-dflash2 (the tiny target
with a random DFlash2 drafter in z-lab's layout).
Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import sys
import traceback

from absl import flags, logging

from museflash.bundle import BUILTIN_PAIRS
from museflash.cli.command import run_command
from museflash.export.options import (
    DEFAULT_NUM_DRAFT_TOKENS,
    ExportError,
    ExportOptions,
    parse_also_export,
    parse_context_buckets,
)
from museflash.export.progress import log_path_for, quiet_console
from museflash.export.publish import OutputDirError
from museflash.paths import resolve_user_path

# torch and the exporter load when an export runs (in _export), not when the flags are defined:
# --help and a mistyped flag answer at once.

flags.DEFINE_string("checkpoint", None, "Target checkpoint directory (Hugging Face layout).")
flags.DEFINE_string("drafter-checkpoint", None, "Drafter checkpoint directory.")
flags.DEFINE_enum("builtin", "demo", list(BUILTIN_PAIRS),
                  "Without --checkpoint: the built-in pair to export (demo: the trained pair "
                  "under demo/, made by //:train_demo and //:train_demo_drafter; tiny: a random "
                  "0.8 MB pair; *-massive: with planted massive activations, docs/fp16.md).")
flags.DEFINE_string("output-dir", "exported", "Directory to write the bundle into.")
flags.DEFINE_bool("overwrite", False, "Replace a non-empty --output-dir.")
flags.DEFINE_bool("fused-target", False,
                  "Export the fused target (logits + drafter_features in one graph).")
flags.DEFINE_bool("dflash-drafter", False,
                  "Export the two-entrypoint DFlash drafter (needs --fused-target).")
flags.DEFINE_bool("with-drafter", False,
                  "Export the older ring drafter (exclusive with --dflash-drafter).")
flags.DEFINE_integer("num-draft-tokens", None,
                     "Tokens drafted per step, k: the exported block is k + 1, the query "
                     "length of draft, inject_kv and main (default: "
                     f"{DEFAULT_NUM_DRAFT_TOKENS}, measured fastest on the demo pairs, or the "
                     "drafter's block_size - 1 when smaller).")
flags.DEFINE_integer("max-context-length", None,
                     "Capacity of the global KV caches (default: the model's own, "
                     "max_position_embeddings, up to 8192; a larger one must be asked for: "
                     "the export prints what the states take in memory).")
flags.DEFINE_string("context-buckets", None,
                    "Comma-separated context buckets, ascending multiples of 32 up to the "
                    "capacity, e.g. 512,2048,8192: each gets its own main and prefill (and "
                    "decode), which attend to (and write) only that many slots of the shared "
                    "caches, and the engines call the smallest holding the call (default: 5 "
                    "contexts doubling from 512 up to the capacity, none below 1024; "
                    "docs/buckets.md).")
flags.DEFINE_integer("tree-nodes", None,
                     "Nodes of the target's `tree` function, which verifies a tree of the "
                     "drafter's candidates in one call (default: the block, --num-draft-tokens "
                     "+ 1, with --dflash-drafter; 0: none). On a Mac a call of 16 or 32 rows "
                     "costs about one row's: export 16 there. See docs/trees.md.")
flags.DEFINE_integer("prefill-length", 32, "Query length of the target's prefill function.")
flags.DEFINE_integer("decode-length", None,
                     "Query length of the target's main function (default: the block, "
                     "--num-draft-tokens + 1, or 1 without a drafter).")
flags.DEFINE_string("model-name", None, "Name recorded in metadata.json.")
flags.DEFINE_bool("verbose", False,
                  "Show coremltools' progress bars and library warnings on the console instead "
                  "of in a log file beside --output-dir.")
flags.DEFINE_integer("conversion-processes", None,
                     "Processes converting functions at once, this one included (default: up "
                     "to 2; each adds ~0.35 GB of memory). 1 converts everything in-process.")
flags.DEFINE_string("compression", None,
                    "Weight compression preset: none (default), 8bit (int8 per output channel), "
                    "4bit (affine uint4 per block of 32, Q4_1's blocks; embedding and "
                    "lm_head int8), palettize4 (4-bit look-up table per 32 output channels; "
                    "embedding and lm_head int8). See docs/compression.md.")
flags.DEFINE_multi_string("also-export", [],
                          "PRESET=DIR: also write the bundle with this compression preset to "
                          "DIR, from the same conversion (repeatable; e.g. 4bit=exported-4bit "
                          "beside an fp16 --output-dir). Each extra bundle costs its weights "
                          "and merge, not another trace and conversion.")
flags.DEFINE_string("compression-config", None,
                    "JSON file of ordered compression rules (first match wins); exclusive with "
                    "--compression. See docs/compression.md.")

flags.DEFINE_string("calibration-prompts", None,
                    "UTF-8 text file, one prompt per line, for the fp16 range audit (run in "
                    "fp32 before conversion, docs/fp16.md); default: built-in <bos>-led "
                    "sequences of code, prose and punctuation.")

flags.DEFINE_string("kv-write", "blend",
                    "How main and prefill write the target's global KV caches: blend (one-hot "
                    "blend over the whole cache, O(context) per call; the default, proven on "
                    "every compute unit) or slice (one slice_update at the runtime position, "
                    "O(query) per call; it crashes Apple's 2026 betas, untested on a Mac). The "
                    "sliding rings use the blend either way. See docs/kv-write.md.")

flags.DEFINE_boolean("self-check", True,
                     "Before publishing, run the converted target's prefill and main in the fp16 "
                     "interpreter on the calibration tokens against fp32 eager, and refuse a "
                     "program that disagrees (docs/fp16.md). --no-self-check skips it; "
                     "metadata.json and check-contract then say so.")

FLAGS = flags.FLAGS


def options_from_flags() -> ExportOptions:
    also = [parse_also_export(value) for value in FLAGS["also-export"].value]
    return ExportOptions(
        output_dir=resolve_user_path(FLAGS["output-dir"].value),
        checkpoint=resolve_user_path(FLAGS["checkpoint"].value),
        drafter_checkpoint=resolve_user_path(FLAGS["drafter-checkpoint"].value),
        builtin=FLAGS.builtin,
        overwrite=FLAGS["overwrite"].value,
        fused_target=FLAGS["fused-target"].value,
        dflash_drafter=FLAGS["dflash-drafter"].value,
        with_drafter=FLAGS["with-drafter"].value,
        num_draft_tokens=FLAGS["num-draft-tokens"].value,
        max_context_length=FLAGS["max-context-length"].value,
        prefill_length=FLAGS["prefill-length"].value,
        decode_length=FLAGS["decode-length"].value,
        model_name=FLAGS["model-name"].value,
        conversion_processes=FLAGS["conversion-processes"].value,
        verbose=FLAGS.verbose,
        compression=FLAGS.compression,
        compression_config=resolve_user_path(FLAGS["compression-config"].value),
        calibration_prompts=resolve_user_path(FLAGS["calibration-prompts"].value),
        kv_write=FLAGS["kv-write"].value,
        context_buckets=parse_context_buckets(FLAGS["context-buckets"].value),
        tree_nodes=FLAGS["tree-nodes"].value,
        self_check=FLAGS["self-check"].value,
        also_export=tuple((preset, resolve_user_path(str(directory)))
                          for preset, directory in also),
    )


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"export: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    # coremltools logs every graph pass at INFO through absl's handler; keep the stage lines.
    logging.set_verbosity(logging.WARNING)
    try:
        options = options_from_flags()
    except ExportError as error:
        print(f"export: error: {error}", file=sys.stderr)
        return 2
    if options.verbose:
        failure = _export(options, keep_traceback=False)
    else:
        log = log_path_for(options.output_dir)
        try:
            with quiet_console(log):
                failure = _export(options, keep_traceback=True)
        except OSError as error:
            failure = (2, f"export: error: cannot write the console log {log} ({error}); pass "
                          "--verbose to keep library output on the console")
        else:
            # A problem with the input is said in full by its one line: the log is kept only
            # for an internal failure, whose traceback and library output it holds.
            if failure is None or failure[0] == 2:
                log.unlink(missing_ok=True)
            else:
                failure = (failure[0], f"{failure[1]} (library output: {log})")
    if failure is None:
        return 0
    print(failure[1], file=sys.stderr)
    return failure[0]


def _export(options: ExportOptions, keep_traceback: bool) -> tuple[int, str] | None:
    """None on success, else (exit status, one line): 2 for a problem with the input, 1 for
    an internal failure (its traceback goes to stderr, which is the log when quiet)."""
    from museflash.checkpoint.tensor_files import CheckpointError
    from museflash.export.pipeline import export_bundle
    from museflash.models.dflash import DrafterTargetMismatchError

    try:
        export_bundle(options)
    except (ExportError, OutputDirError, CheckpointError, DrafterTargetMismatchError) as error:
        return 2, f"export: error: {error}"
    except Exception as error:
        if not keep_traceback:
            raise
        traceback.print_exc()
        return 1, f"export: failed: {type(error).__name__}: {error}"
    return None


def run() -> None:
    run_command(main, "export")


if __name__ == "__main__":
    run()
