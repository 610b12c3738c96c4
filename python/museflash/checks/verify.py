"""Check an export against the checkpoints it was made from, then decode with it.

1. Parity: every exported function, run by the numpy ML-program interpreter, against eager
   torch loaded from the source checkpoints (fp32 compute, fp16 caches like the states), from
   the same cache contents (positions before the checked ones written by the eager model over
   a seeded prompt: the target's caches by the target, the DFlash drafter's ring by the drafter
   from the target's drafter_features; every other slot random), on positions that wrap every
   ring.
2. Speculative decoding over the exported artifacts only, on a deterministic prompt; it must
   reproduce the exported target's own greedy output (lossless). Agreement with eager fp32
   greedy decoding is reported but not required (the export computes in fp16). A ring-drafter
   export (--with-drafter) gets parity only: the loop drives DFlash's inject_kv/draft.
3. A compressed export: parity is against eager models carrying the same quantized or
   palettized weights (expanded in fp32), which proves the packing; the quality lost against
   the checkpoint's own weights is reported (top-1 agreement, KL), not gated.

Exit status of `run_verify`: 0 all passed, 1 a mismatch, 2 unusable input (VerifyInputError).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from museflash.builtin.demo_checkpoint import SourceError, checkpoint_dirs
from museflash.bundle import (
    METADATA_FILE,
    TOKENIZER_FILE,
    AssetKind,
    AssetRole,
    BundleError,
    DrafterKind,
    FunctionName,
    InputName,
    Metadata,
    NormForm,
    OutputName,
    StateKind,
    bucket_function_name,
)
from museflash.checkpoint.chat_template import read_chat_template, render_chat
from museflash.checkpoint.configs import read_config
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.tensor_files import CheckpointError, checkpoint_shapes
from museflash.checks.norm_form import folded_norm_count, graph_norm_form
from museflash.compression import CompressionError, Rule, Scheme
from museflash.export.fp16_range import audit_checkpoint
from museflash.export.placeholders import compressed_weights
from museflash.runtime.interpreter import Interpreter, NonFiniteError, load_program
from museflash.runtime.package_check import PackageError, check_packages
from museflash.runtime.parity import (
    OUTPUT_TOLERANCE,
    STATE_TOLERANCE,
    Discrepancy,
    ParityReport,
    module_states,
    parity_step,
    sync_states,
)
from museflash.runtime.speculative import (
    DEFAULT_LOOKUP_MIN_MATCH,
    ExportedDrafter,
    ExportedTarget,
    eager_greedy_generate,
    greedy_generate,
    load_role_interpreters,
    speculative_generate,
)
from museflash.runtime.tree import TokenTree

STEPS_PER_CHECK = 4


class VerifyInputError(ValueError):
    """The export or the checkpoints cannot be used; one line saying what to fix."""


@dataclass
class VerifyOptions:
    export_dir: Path
    prompt_tokens: int | None = None
    new_tokens: int = 24
    checkpoint: Path | None = None
    drafter_checkpoint: Path | None = None
    echo: Callable[[str], None] = print


@dataclass
class CheckResult:
    """Worst discrepancy per output/state name over all steps of one function check."""

    name: str
    outputs: dict[str, Discrepancy] = field(default_factory=dict)
    states: dict[str, Discrepancy] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    note: str = ""

    def add(self, report: ParityReport) -> None:
        for table, new in ((self.outputs, report.outputs), (self.states, report.states)):
            for key, value in new.items():
                if key not in table or _worse(value, table[key]):
                    table[key] = value
        bad = report.failures(OUTPUT_TOLERANCE, STATE_TOLERANCE)
        self.failures.extend(str(d) for d in bad)

    @property
    def ok(self) -> bool:
        return not self.failures

    def line(self) -> str:
        parts = [f"{d.name} max abs {d.max_abs:.3g} rel {d.max_rel:.3g}"
                 for d in self.outputs.values()]
        if self.states:
            worst = max(self.states.values(), key=lambda d: d.max_rel)
            parts.append(f"states max rel {worst.max_rel:.3g} ({worst.name})")
        note = f" [{self.note}]" if self.note else ""
        return f"parity {self.name}: " + "; ".join(parts) + (" OK" if self.ok else " FAILED") + note


def _worse(a: Discrepancy, b: Discrepancy) -> bool:
    if a.mismatched_shape or not np.isfinite(a.max_abs):
        return True
    return a.max_rel > b.max_rel


# --- Parity ----------------------------------------------------------------------------------


def _random_states(interpreter: Interpreter, seed: int) -> dict[str, np.ndarray]:
    """Nonzero everywhere, so reading a never-written or stale slot shows up."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float16)
            for name, (shape, _) in interpreter.state_specs.items()}


def _wrapping_starts(capacity: int, length: int, limit: int) -> list[int]:
    """STEPS_PER_CHECK consecutive chunk starts whose span crosses `capacity` (a ring wrap)
    while staying below `limit` (the global cache's last position + 1)."""
    start = max(0, capacity - (STEPS_PER_CHECK * length) // 2)
    start = min(start, max(0, limit - STEPS_PER_CHECK * length))
    return [start + i * length for i in range(STEPS_PER_CHECK)
            if start + (i + 1) * length <= limit]


def compression_schemes(metadata: Metadata, target_dir: Path,
                        drafter_dir: Path | None) -> dict[str, Scheme]:
    """Checkpoint key -> scheme of each weight the export stored compressed: its recorded
    rules applied again to the checkpoints (as the export applied them)."""
    if metadata.compression is None:
        return {}
    rules = [Rule(match=r.match, mode=str(r.mode), bits=r.bits, block_size=r.block_size,
                  group_size=r.group_size) for r in metadata.compression.rules]
    try:
        return compressed_weights(rules, checkpoint_shapes(target_dir, drafter_dir),
                                  strict=False)
    except CompressionError as error:
        raise VerifyInputError(f"{METADATA_FILE} compression rules: {error}") from error


def load_reference_models(metadata: Metadata, target_dir: Path, drafter_dir: Path | None,
                          compressed: dict[str, Scheme] | None = None):
    """The eager fp32 models, carrying the weights as the export stores them (`compressed`:
    quantized or palettized, then expanded)."""
    context = metadata.context_length
    max_query = metadata.max_query_length()
    fused = metadata.asset(AssetRole.TARGET).kind == AssetKind.FUSED_TARGET
    target = load_target(target_dir, drafter_dir if fused else None, dtype=torch.float32,
                         max_context=context, max_query_len=max_query, compressed=compressed)
    drafters = {}
    for role, ring in ((AssetRole.DFLASH_DRAFTER, False), (AssetRole.RING_DRAFTER, True)):
        if role in metadata.assets:
            drafters[role] = load_drafter(
                drafter_dir, target, target_dir=target_dir, dtype=torch.float32,
                max_query_len=max_query, ring=ring, max_context=context,
                compressed=compressed)
    return target, drafters


def _check_geometry(name: str, module: torch.nn.Module, interpreter: Interpreter) -> None:
    for state, (shape, _) in interpreter.state_specs.items():
        mine = tuple(getattr(module, state).shape)
        if mine != tuple(shape):
            raise VerifyInputError(
                f"{name}: state {state} has shape {list(shape)} in the package but "
                f"{list(mine)} in the model rebuilt from the checkpoint; the checkpoint's "
                "config.json does not describe this export")


def _check_norm_form(name: str, metadata: Metadata, function) -> None:
    """metadata.json's fp16_range.norm against the form the graph's norms are written in."""
    if metadata.fp16_range is None:
        return
    recorded = NormForm(metadata.fp16_range.norm).value
    found = graph_norm_form(function)
    if found != recorded:
        raise VerifyInputError(f"metadata.json fp16_range.norm is {recorded!r} but {name}'s "
                               f"graph writes its norms in the {found!r} form; the record "
                               "does not describe this bundle: re-export it")
    folds = len(metadata.fp16_range.folded_norms or [])
    found_folds = folded_norm_count(function)
    if found_folds != folds:
        raise VerifyInputError(f"metadata.json fp16_range.folded_norms lists {folds} norms but "
                               f"{name}'s graph folds the weight into the factor in "
                               f"{found_folds}; the record does not describe this bundle: "
                               "re-export it")


def check_target(export_dir: Path, metadata: Metadata, target, function: FunctionName,
                 entry: str, seed: int,
                 interpreters: dict[str, Interpreter] | None = None,
                 bucket: int | None = None) -> CheckResult:
    """`interpreters`: the target's functions already loaded (load_roles), else loaded here.
    `bucket`: check the copy of `function` in that context bucket (`main_64`), against the
    eager view over the same slots, at positions below it."""
    asset = metadata.asset(AssetRole.TARGET)
    name = bucket_function_name(function, bucket) if bucket else str(function)
    interpreter = (interpreters[name] if interpreters is not None else
                   Interpreter(load_program(export_dir / asset.path, name), name))
    _check_geometry(f"target.{name}", target, interpreter)
    _check_norm_form(f"target.{name}", metadata, interpreter.function)
    length = asset.function(function).query_length
    states = _random_states(interpreter, seed)
    sync_states(target, states)
    result = CheckResult(f"target.{name}")
    rng = np.random.default_rng(seed + 1)
    ring = asset.capacity(StateKind.SLIDING_KV) or 0
    starts = _wrapping_starts(ring, length, bucket or metadata.context_length)
    if starts:
        _write_prefix(target, metadata, states, starts[0], length)
    view = target.with_entry_point(entry, span=bucket)
    for start in starts:
        inputs = {InputName.INPUT_IDS: with_peak_tokens(
                      metadata, rng.integers(0, metadata.vocab_size, (1, length))),
                  InputName.POSITION_IDS: np.arange(start, start + length, dtype=np.int32)}
        if function == FunctionName.TREE:
            inputs.update(_seeded_tree_inputs(rng, length, start))
        result.add(parity_step(interpreter, view, inputs, states))
    result.note = _span_note(starts, length, ring)
    return result


def _seeded_tree_inputs(rng: np.random.Generator, nodes: int,
                        start: int) -> dict[InputName, np.ndarray]:
    """Positions and mask of a seeded random tree of `nodes` nodes rooted at `start` (each
    node's parent drawn among the earlier ones): siblings share a position, so a mask or a
    write slot that is wrong shows in the logits and the caches."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, nodes)], np.int32)
    tree = TokenTree(np.zeros(nodes, np.int32), parents, np.zeros(nodes, np.int8))
    return {InputName.POSITION_IDS: (start + tree.depths()).astype(np.int32),
            InputName.TREE_MASK: tree.ancestor_mask().astype(np.int32)}


# The target functions parity checks: (function, the eager model's entry point, seed).
TARGET_CHECKS = ((FunctionName.MAIN, "forward", 1), (FunctionName.PREFILL, "prefill", 3),
                 (FunctionName.DECODE, "forward", 9), (FunctionName.TREE, "forward", 13))


def target_checks(metadata: Metadata) -> list[tuple[FunctionName, str, int, int | None]]:
    """(function, entry point, seed, bucket) of each target function verify checks: the
    whole-capacity main, prefill, one-token decode and tree (where the bundle has them), and
    their copies in the smallest context bucket (the others differ from it only in the span)."""
    asset = metadata.asset(AssetRole.TARGET)
    own = asset.own_functions
    checks = [(function, entry, seed, None) for function, entry, seed in TARGET_CHECKS
              if function in own]
    if asset.buckets:
        smallest = asset.buckets[0]
        checks += [(function, entry, seed + 10, smallest.context)
                   for function, entry, seed in TARGET_CHECKS
                   if function in smallest.all_functions]
    return checks


def _write_prefix(target, metadata: Metadata, states: dict[str, np.ndarray], end: int,
                  chunk: int) -> None:
    """Positions [0, end) of the caches written by the eager model over a seeded `<bos>`-led
    prompt, in `chunk`-token calls, as a real prompt writes them; `states` and the model's
    buffers then hold the same values. The checked chunks attend to those positions, and a
    residual channel that attention writes can nearly cancel over random keys and values,
    which no prompt makes (docs/fp16.md, the `prefill` state failure). Slots no position
    below `end` reaches keep their random contents, so a read of a never-written or stale
    slot still shows."""
    if end <= 0:
        return
    ids = _prefix_ids(metadata, end)
    module = target.with_entry_point("forward")
    with torch.no_grad():
        for first in range(0, end, chunk):
            last = min(first + chunk, end)
            module(torch.from_numpy(ids[first:last].reshape(1, -1)),
                   torch.arange(first, last, dtype=torch.int32))
    states.update(module_states(target, states))


def _prefix_ids(metadata: Metadata, end: int) -> np.ndarray:
    """The seeded `<bos>`-led prompt of `end` tokens whose positions the prefixes write (never
    the mask token)."""
    avoid = metadata.speculative_decoding.mask_token_id if metadata.speculative_decoding else -1
    return np.array(deterministic_prompt(end, metadata.vocab_size, avoid, metadata),
                    dtype=np.int32)


def _write_drafter_prefix(drafter, target, metadata: Metadata, states: dict[str, np.ndarray],
                          end: int, block: int) -> None:
    """The drafter's ring positions [0, end) written by the eager drafter's inject_kv from the
    eager target's drafter_features over the same seeded prompt, as decoding writes
    them; `states` and the drafter's buffers then hold the same values. The checked blocks
    attend to those positions: over N(0, 1) keys and values the draft logits of the SmolLM2
    drafter moved by up to rel 0.019 (fp16) and 0.056 (int8 weights) between the package and
    eager, against 0.001 to 0.0016 over written ones (docs/smollm2.md). Slots no position below
    `end` reaches keep their random contents."""
    if end <= 0:
        return
    ids = torch.from_numpy(_prefix_ids(metadata, end))
    forward, inject = target.with_entry_point("forward"), drafter.with_entry_point("inject_kv")
    with torch.no_grad():
        for first in range(0, end, block):
            positions = torch.arange(first, min(first + block, end), dtype=torch.int32)
            _, features = forward(ids[first:first + len(positions)].reshape(1, -1), positions)
            inject(features.to(torch.float16).float(), positions)
    states.update(module_states(drafter, states))


def _span_note(starts: list[int], length: int, ring: int) -> str:
    if not starts:
        return "no positions fit"
    last = starts[-1] + length - 1
    wrapped = "wraps" if ring and last >= ring else "does NOT wrap"
    return f"positions {starts[0]}..{last}, {wrapped} the ring of {ring}"


class _Fp32Inputs:
    """The package takes fp16 features; the fp32 reference module gets the same values as
    fp32 (cache buffers are read through to the module for the state comparison)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args: torch.Tensor):
        return self.module(*(a.float() if a.is_floating_point() else a for a in args))

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def check_dflash_drafter(export_dir: Path, metadata: Metadata, drafter, target,
                         seed: int,
                         interpreters: dict[str, Interpreter] | None = None) -> CheckResult:
    if interpreters is None:
        interpreters = load_role_interpreters(export_dir, metadata,
                                  [AssetRole.DFLASH_DRAFTER])[AssetRole.DFLASH_DRAFTER]
    asset = metadata.asset(AssetRole.DFLASH_DRAFTER)
    inject = interpreters[FunctionName.INJECT_KV]
    draft = interpreters[FunctionName.DRAFT]
    _check_geometry(str(AssetRole.DFLASH_DRAFTER), drafter, inject)
    spec = metadata.speculative_decoding
    block, width = spec.block_size, spec.drafter_hidden_size
    states = _random_states(inject, seed)
    sync_states(drafter, states)
    result = CheckResult("dflash_drafter.inject_kv+draft")
    ties = 0
    rng = np.random.default_rng(seed + 1)
    ring = asset.capacity(StateKind.SLIDING_KV) or 0
    # Context block then a draft block right after it, as in the decoding loop; the next
    # inject starts where the draft block did (its rows are overwritten).
    starts = _wrapping_starts(ring, block, metadata.context_length - block)
    if starts:
        _write_drafter_prefix(drafter, target, metadata, states, starts[0], block)
    peaks = metadata.fp16_range.peak_tokens if metadata.fp16_range else []
    for step, start in enumerate(starts):
        features = rng.standard_normal((1, block, width)).astype(np.float16)
        positions = np.arange(start, start + block, dtype=np.int32)
        result.add(parity_step(inject, _Fp32Inputs(drafter.with_entry_point("inject_kv")),
                               {InputName.FEATURES: features,
                                InputName.POSITION_IDS: positions}, states))
        anchor = int(rng.integers(0, metadata.vocab_size))
        if peaks and step % 2 == 0:  # every other block anchored on a massive-activation token
            anchor = peaks[(step // 2) % len(peaks)]
        ids = np.array([[anchor] + [spec.mask_token_id] * (block - 1)], dtype=np.int32)
        report = parity_step(draft, drafter.with_entry_point("draft"),
                             {InputName.INPUT_IDS: ids,
                              InputName.POSITION_IDS: positions + block}, states)
        ties += _accept_selector_near_tie(report, drafter, ids, positions + block)
        result.add(report)
    result.note = _span_note(starts, 2 * block, ring) + (
        f"; draft_tokens took another path at {ties} near-tie(s) of selector scores"
        if ties else "")
    return result


def _accept_selector_near_tie(report, drafter, ids: np.ndarray, positions: np.ndarray) -> int:
    """A DFlash2 `draft_tokens` that differs from eager is accepted when, under the eager
    model's own scores, the exported path is at every position within the output tolerance
    of the best candidate (fp16 rounding can swap two almost equal scores); the discrepancy
    is then the worst score gap against the logits' scale. Returns 1 when it accepted one."""
    tokens = OutputName.DRAFT_TOKENS
    found = report.outputs.get(tokens)
    if found is None or found.mismatched_shape or found.max_abs == 0:
        return 0
    with torch.no_grad():
        gaps = drafter.path_gaps(torch.from_numpy(ids), torch.from_numpy(positions),
                                 torch.from_numpy(np.asarray(report.actual[tokens]).reshape(-1)))
    scale = report.outputs[OutputName.LOGITS].scale
    gap = float(gaps.max())
    if not np.isfinite(gap) or gap > OUTPUT_TOLERANCE.rel_tol * scale:
        return 0
    report.outputs[tokens] = Discrepancy(f"{tokens} (score gap)", gap, scale)
    return 1


def check_ring_drafter(export_dir: Path, metadata: Metadata, ring_drafter,
                       seed: int) -> CheckResult:
    asset = metadata.asset(AssetRole.RING_DRAFTER)
    main = FunctionName.MAIN
    interpreter = Interpreter(load_program(export_dir / asset.path, main), main)
    _check_geometry(str(AssetRole.RING_DRAFTER), ring_drafter, interpreter)
    states = _random_states(interpreter, seed)
    sync_states(ring_drafter, states)
    result = CheckResult("ring_drafter.main")
    rng = np.random.default_rng(seed + 1)
    ring = asset.capacity(StateKind.SLIDING_KV) or 0
    first = max(0, ring - 4)
    positions = range(first, min(first + 8, metadata.context_length))
    for position in positions:
        inputs = {InputName.INPUT_IDS: rng.integers(0, metadata.vocab_size, (1, 1))
                  .astype(np.int32),
                  InputName.POSITION_IDS: np.array([position], dtype=np.int32)}
        result.add(parity_step(interpreter, ring_drafter, inputs, states))
    result.note = _span_note([positions[0]], len(positions), ring)
    return result


# --- Decoding --------------------------------------------------------------------------------


def check_fp16_range(metadata: Metadata, target_dir: Path, drafter_dir: Path | None) -> str:
    """The export's recorded residual scales against a fresh fp16 range audit of the same
    checkpoints (built-in calibration only: a --calibration-prompts file is not in the
    bundle). A mismatch is an error: the bundle was built with other numerics than its
    checkpoint needs."""
    audit = metadata.fp16_range
    if audit is None:
        return "fp16 range: not recorded (exported before the audit existed); re-export"
    drafter_scale = ("none" if audit.drafter_residual_scale is None
                     else f"{audit.drafter_residual_scale:g}")
    if audit.calibration != "builtin":
        return (f"fp16 range: scales {audit.target_residual_scale:g} (target) / "
                f"{drafter_scale} (drafter), calibrated on {audit.calibration} (not "
                "re-audited here)")
    spec = metadata.speculative_decoding
    fresh, _ = audit_checkpoint(
        target_dir, drafter_dir, fused=spec is not None,
        with_drafter=metadata.drafter_role == AssetRole.DFLASH_DRAFTER,
        context=metadata.context_length, block=spec.block_size if spec else 1,
        vocab_size=metadata.vocab_size, config=read_config(target_dir), prompts=None,
        calibration="builtin", norm=audit.norm, scale=audit.norm == NormForm.MAX_ABS)
    recorded = (audit.target_residual_scale, audit.drafter_residual_scale,
                [f.norm for f in audit.folded_norms or []])
    expected = (fresh.target_residual_scale, fresh.drafter_residual_scale,
                [f.norm for f in fresh.folded_norms or []])
    if recorded != expected:
        raise VerifyInputError(f"metadata.json fp16_range records residual scales and folded "
                               f"norms {recorded} but the checkpoint's audit gives {expected}; "
                               "re-export")
    return (f"fp16 range: residual scales {audit.target_residual_scale:g} (target) / "
            f"{drafter_scale} (drafter) match a fresh audit; largest |x| "
            f"{audit.peak_after_scaling:.4g}, norms {audit.norm}")


def prefill_length(metadata: Metadata) -> int:
    return metadata.asset(AssetRole.TARGET).function(FunctionName.PREFILL).query_length


def default_prompt_length(metadata: Metadata) -> int:
    """One and a half prefill chunks (so the overlapping last chunk is exercised)."""
    prefill = prefill_length(metadata)
    block = metadata.speculative_decoding.block_size if metadata.speculative_decoding else 1
    return max(prefill + prefill // 2 + 1, block)


def with_peak_tokens(metadata: Metadata, ids: np.ndarray, every: int = 4) -> np.ndarray:
    """int32 `ids` [1, T] with the tokens the export's fp16 range audit found carrying the
    largest activations put at every `every`-th position (0: none), so parity runs on the
    activations that overflow fp16 (docs/fp16.md); unchanged for a bundle without the audit."""
    ids = np.array(ids, dtype=np.int32)
    peaks = metadata.fp16_range.peak_tokens if metadata.fp16_range else []
    if peaks and every:
        slots = range(0, ids.shape[1], every)
        ids[0, list(slots)] = [peaks[i % len(peaks)] for i in range(len(slots))]
    return ids


def deterministic_prompt(length: int, vocab: int, avoid: int,
                         metadata: Metadata | None = None) -> list[int]:
    """Seeded ids; with `metadata` whose fp16 range audit names a <bos> and peak tokens, led by
    that <bos>, with the peak tokens among the ids and as the last one (the first draft's
    anchor)."""
    rng = np.random.default_rng(20240601)
    tokens = rng.integers(0, vocab, length)
    tokens[tokens == avoid] = 0
    audit = metadata.fp16_range if metadata else None
    if audit and audit.peak_tokens:
        tokens = with_peak_tokens(metadata, tokens.reshape(1, -1), every=7)[0]
        tokens[-1] = audit.peak_tokens[0]
    if audit and audit.bos_token_id is not None:
        tokens[0] = audit.bos_token_id
    return tokens.tolist()


# The conversation verify renders with an export's own chat template, when it has one: the
# shape of prompt an instruct model sees (no <bos> unless the template writes one).
CHAT_PROBE = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def chat_prompt(export_dir: Path) -> list[int] | None:
    """CHAT_PROBE rendered with the export's chat template (tokenizer_config.json) and encoded
    by its tokenizer.json, generation prompt added; None without a template."""
    from tokenizers import Tokenizer

    found = read_chat_template(export_dir)
    if found is None or not (export_dir / TOKENIZER_FILE).is_file():
        return None
    template, special = found
    text = render_chat(template, CHAT_PROBE, special_tokens=special)
    return Tokenizer.from_file(str(export_dir / TOKENIZER_FILE)).encode(
        text, add_special_tokens=False).ids


@dataclass
class DecodeCheck:
    ok: bool
    lines: list[str]
    acceptance: float
    tokens_per_target_call: float


def check_decoding(export_dir: Path, metadata: Metadata, target_dir: Path, prompt_tokens: int,
                   new_tokens: int,
                   loaded: dict[AssetRole, dict[str, Interpreter]] | None = None) -> DecodeCheck:
    spec = metadata.speculative_decoding
    context = metadata.context_length
    prompt = deterministic_prompt(prompt_tokens, metadata.vocab_size, spec.mask_token_id,
                                  metadata)
    loaded = loaded or load_role_interpreters(export_dir, metadata,
                                  [AssetRole.TARGET, AssetRole.DFLASH_DRAFTER])
    target = ExportedTarget(export_dir, metadata, loaded[AssetRole.TARGET])
    drafter = ExportedDrafter(export_dir, metadata, loaded[AssetRole.DFLASH_DRAFTER])
    # Every step drafted (what checks the drafter's path), then the loop as generate runs it,
    # whose steps may copy from the context instead.
    speculative, copying = (speculative_generate(target, drafter, prompt, new_tokens,
                                                 mask_token_id=spec.mask_token_id,
                                                 num_draft_tokens=spec.num_draft_tokens,
                                                 context_length=context,
                                                 lookup_min_match=lookup)
                            for lookup in (0, DEFAULT_LOOKUP_MIN_MATCH))
    plain = greedy_generate(target, prompt, new_tokens, context_length=context)
    eager_model = load_target(target_dir, dtype=torch.float32, max_context=context,
                              max_query_len=max(len(prompt), 1), cache_dtype=torch.float32)
    eager = eager_greedy_generate(eager_model, prompt, new_tokens)
    lossless = speculative.tokens == plain.tokens
    copying_lossless = copying.tokens == plain.tokens
    agree = _common_prefix(eager, plain.tokens)
    # A DFlash2 `draft` proposes its candidate selector's path (`draft_tokens`), not its rows'
    # argmax; the loop is lossless either way, so say which one ran.
    proposals = ("; proposals: the selector's draft_tokens"
                 if spec.drafter_kind == DrafterKind.DFLASH2 else "")
    lines = [
        f"speculative: prompt {len(prompt)} tokens, {new_tokens} new: {speculative.summary()}"
        f"{proposals}",
        f"lossless: speculative {'==' if lossless else '!='} target-only greedy over the "
        f"export ({_common_prefix(speculative.tokens, plain.tokens)}/{new_tokens} tokens agree)",
        f"lossless with lookup {DEFAULT_LOOKUP_MIN_MATCH} (generate's default): "
        f"{'==' if copying_lossless else '!='} target-only greedy "
        f"({_common_prefix(copying.tokens, plain.tokens)}/{new_tokens} tokens agree; "
        f"{copying.lookup_steps} of {len(copying.accepted)} steps copied from the context)",
        f"eager fp32 greedy (informational): first {agree}/{new_tokens} tokens agree with the "
        "export",
    ]
    tree_lossless = True
    if target.tree_length:
        trees = speculative_generate(target, drafter, prompt, new_tokens,
                                     mask_token_id=spec.mask_token_id,
                                     num_draft_tokens=spec.num_draft_tokens,
                                     context_length=context, tree_budget=target.tree_length)
        tree_lossless = trees.tokens == plain.tokens
        lines.append(
            f"lossless with trees of {target.tree_length} nodes (docs/trees.md): "
            f"{'==' if tree_lossless else '!='} target-only greedy "
            f"({_common_prefix(trees.tokens, plain.tokens)}/{new_tokens} tokens agree; "
            f"{trees.tokens_per_verify_call:.2f} tokens per tree call, "
            f"{trees.moved_rows} cache rows moved into place)")
    chat = chat_prompt(export_dir)
    chat_lossless = True
    if chat is not None and len(chat) + new_tokens + spec.block_size <= context:
        chat_speculative = speculative_generate(target, drafter, chat, new_tokens,
                                                mask_token_id=spec.mask_token_id,
                                                num_draft_tokens=spec.num_draft_tokens,
                                                context_length=context, lookup_min_match=0)
        chat_plain = greedy_generate(target, chat, new_tokens, context_length=context)
        chat_lossless = chat_speculative.tokens == chat_plain.tokens
        lines.append(
            f"chat template prompt ({len(chat)} tokens): speculative "
            f"{'==' if chat_lossless else '!='} target-only greedy "
            f"({_common_prefix(chat_speculative.tokens, chat_plain.tokens)}/{new_tokens} "
            f"tokens agree; {chat_speculative.summary()})")
    return DecodeCheck(lossless and copying_lossless and tree_lossless and chat_lossless, lines,
                       speculative.acceptance_rate, speculative.tokens_per_target_call)


def compression_quality(metadata: Metadata, target_dir: Path, stored_target: torch.nn.Module,
                        prompt_tokens: int) -> str:
    """`stored_target` (the eager reference, carrying the stored compressed weights) against
    the checkpoint's own weights, on the deterministic prompt: next-token top-1 agreement and
    mean KL(checkpoint || stored)."""
    prompt = deterministic_prompt(prompt_tokens, metadata.vocab_size,
                                  metadata.speculative_decoding.mask_token_id)
    ids = torch.tensor([prompt], dtype=torch.long)
    logits = []
    checkpoint_target = load_target(target_dir, dtype=torch.float32,
                                    max_context=metadata.context_length)
    for model in (checkpoint_target, stored_target):
        with torch.no_grad():
            logits.append(model.batch_logits(ids)[0].float())
    reference, stored = (torch.log_softmax(x, dim=-1) for x in logits)
    agree = (reference.argmax(-1) == stored.argmax(-1)).float().mean().item()
    kl = (reference.exp() * (reference - stored)).sum(-1).mean().item()
    groups = ", ".join(f"{g.tensors} x {g.mode}{g.bits}" for g in metadata.compression.groups)
    return (f"compression (informational; {groups}): eager with the stored weights vs the "
            f"checkpoint's, {len(prompt)} positions: top-1 agreement {100 * agree:.1f}%, "
            f"mean KL {kl:.4f} nats")


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


# --- Driver ----------------------------------------------------------------------------------


def _validate(options: VerifyOptions) -> Metadata:
    export_dir = Path(options.export_dir)
    if not export_dir.is_dir():
        raise VerifyInputError(f"--export-dir {export_dir} is not a directory")
    try:
        metadata = Metadata.read(export_dir)
        drafter_role = metadata.drafter_role
        if drafter_role is None:
            raise VerifyInputError(f"{export_dir} has no drafter; verify needs an export made "
                                   "with --fused-target --dflash-drafter (or --with-drafter)")
        for role in (AssetRole.TARGET, drafter_role):
            path = export_dir / metadata.asset(role).path
            if not path.is_dir():
                raise VerifyInputError(f"{path} is missing (listed in {METADATA_FILE})")
        check_packages(export_dir, metadata)
        prompt = options.prompt_tokens or default_prompt_length(metadata)
        spec = metadata.speculative_decoding
        needed = max(prefill_length(metadata), spec.block_size)
    except (BundleError, PackageError) as error:
        raise VerifyInputError(str(error)) from error
    if prompt < needed:
        raise VerifyInputError(f"--prompt-tokens {prompt} is shorter than one prefill chunk / "
                               f"drafter block ({needed})")
    if options.new_tokens < 1:
        raise VerifyInputError("--new-tokens must be at least 1")
    last = prompt + options.new_tokens + spec.block_size - 1
    if last > metadata.context_length:
        raise VerifyInputError(
            f"--prompt-tokens {prompt} + --new-tokens {options.new_tokens} need "
            f"{last} positions but the export's context_length is {metadata.context_length}")
    return metadata


def run_verify(options: VerifyOptions) -> int:
    echo = options.echo
    try:
        metadata = _validate(options)
        export_dir = Path(options.export_dir)
        # _validate admits exactly one drafter: DFlash, or the older ring drafter.
        dflash = metadata.drafter_role == AssetRole.DFLASH_DRAFTER
        prompt = options.prompt_tokens or default_prompt_length(metadata)
        with checkpoint_dirs(metadata, options.checkpoint, options.drafter_checkpoint) as (
                target_dir, drafter_dir, described):
            echo(f"verify: {export_dir} ({metadata.model_name}) against {described}")
            try:
                compressed = compression_schemes(metadata, target_dir, drafter_dir)
                target, drafters = load_reference_models(metadata, target_dir, drafter_dir,
                                                         compressed)
            except CheckpointError as error:
                raise VerifyInputError(str(error)) from error
            # Each package parsed once for every check and the decoding loop.
            loaded = load_role_interpreters(export_dir, metadata, [AssetRole.TARGET] + (
                [AssetRole.DFLASH_DRAFTER] if dflash else []))
            checks = [check_target(export_dir, metadata, target, function, entry, seed,
                                   loaded[AssetRole.TARGET], bucket)
                      for function, entry, seed, bucket in target_checks(metadata)]
            if dflash:
                checks.append(check_dflash_drafter(export_dir, metadata,
                                                   drafters[AssetRole.DFLASH_DRAFTER], target,
                                                   seed=5,
                                                   interpreters=loaded[AssetRole.DFLASH_DRAFTER]))
            else:
                checks.append(check_ring_drafter(export_dir, metadata,
                                                 drafters[AssetRole.RING_DRAFTER], seed=7))
            for check in checks:
                echo(check.line())
            echo(check_fp16_range(metadata, target_dir, drafter_dir))
            if dflash:
                decoding = check_decoding(export_dir, metadata, target_dir, prompt,
                                          options.new_tokens, loaded)
            else:
                # The reference loop drives DFlash's inject_kv/draft; the older ring drafter
                # decodes token by token on its own caches and has no loop here.
                decoding = DecodeCheck(True, ["speculative: not run (the reference loop drives "
                                              "a DFlash drafter; this export has a ring "
                                              "drafter)"], 0.0, 1.0)
            for line in decoding.lines:
                echo(line)
            if compressed:
                echo(compression_quality(metadata, target_dir, target, prompt))
    except (VerifyInputError, SourceError) as error:
        echo(f"verify: error: {error}")
        return 2
    except NonFiniteError as error:
        echo(f"verify: FAILED fp16 overflow: {error}")
        return 1
    failed = [c for c in checks if not c.ok]
    figures = (f"acceptance {100 * decoding.acceptance:.1f}%, "
               f"{decoding.tokens_per_target_call:.2f} tokens per target call"
               if dflash else "parity only")
    if failed or not decoding.ok:
        reasons = [f"{c.name} ({c.failures[0]})" for c in failed]
        if not decoding.ok:
            reasons.append("speculative output differs from the target's greedy output")
        echo(f"verify: FAILED {'; '.join(reasons)} [{figures}]")
        return 1
    lossless = "lossless, " if dflash else ""
    echo(f"verify: OK parity of {len(checks)} checks within tolerance "
         f"(outputs {OUTPUT_TOLERANCE.rel_tol:g}, states {STATE_TOLERANCE.rel_tol:g} of scale), "
         f"{lossless}{figures}")
    return 0
