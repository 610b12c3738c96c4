"""The export's self-check (docs/fp16.md, "The export runs its own program"): after the merge
and before the atomic publish, the converted target's `prefill` and `main` (each in its
smallest context bucket, where there are buckets) run in the numpy interpreter, the program's
fp16 numerics, on the calibration tokens, against the eager fp32 model, with verify's
tolerances. A bundle whose program disagrees is refused in one line naming the function, the
output or cache, and the first layer whose written cache is off; nothing is written.

What it covers: up to SELF_CHECK_TOKENS calibration tokens through `prefill` from empty
caches, then MAIN_BLOCKS `main` calls after them. What it leaves to `//:verify`: the other
functions (`decode`, `tree`, the drafter's), the buckets above the smallest, positions past
those tokens, random cache contents, and the speculative loop. A target whose fp32 reference
would take more than REFERENCE_LIMIT bytes is not checked (recorded as such), so the check's
memory stays bounded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from museflash.bundle import (
    AssetKind,
    AssetRole,
    FunctionName,
    InputName,
    Metadata,
    SelfCheck,
    bucket_function_name,
)
from museflash.checkpoint.load import load_target
from museflash.checkpoint.tensor_files import checkpoint_shapes
from museflash.compression import Scheme
from museflash.export.options import ExportError
from museflash.runtime.interpreter import Interpreter, NonFiniteError, load_program
from museflash.runtime.parity import (
    OUTPUT_TOLERANCE,
    STATE_TOLERANCE,
    Discrepancy,
    parity_step,
    sync_states,
)

SELF_CHECK_TOKENS = 64  # calibration tokens fed to `prefill`, at most
MAIN_BLOCKS = 2  # `main` calls after them
REFERENCE_LIMIT = 4 << 30  # fp32 bytes of the eager reference beyond which nothing is run


def _calls(metadata: Metadata, tokens: int) -> list[tuple[str, str, int, int | None, int]]:
    """(Core ML name, eager entry point, query length, bucket, start) of each call: `prefill`
    over whole chunks of the calibration stream, then MAIN_BLOCKS `main` blocks, all below the
    smallest bucket's context (or the capacity)."""
    asset = metadata.asset(AssetRole.TARGET)
    smallest = asset.buckets[0] if asset.buckets else None
    limit = smallest.context if smallest else metadata.context_length
    prefill = asset.function(FunctionName.PREFILL).query_length
    main = asset.function(FunctionName.MAIN).query_length
    room = min(tokens, SELF_CHECK_TOKENS, limit - MAIN_BLOCKS * main)
    calls = []
    chunks = max(1, room // prefill) if room >= prefill else 0
    for function, entry, length, count, start in (
            (FunctionName.PREFILL, "prefill", prefill, chunks, 0),
            (FunctionName.MAIN, "forward", main, MAIN_BLOCKS, chunks * prefill)):
        name = bucket_function_name(function, smallest.context) if smallest else str(function)
        bucket = smallest.context if smallest else None
        calls += [(name, entry, length, bucket, start + i * length) for i in range(count)]
    return [call for call in calls if call[4] + call[2] <= limit]


def _layer_ids(target, state: str) -> list[int]:
    config = target.config
    ids = config.sliding_layer_ids if "sliding" in state.lower() else config.global_layer_ids
    return list(ids)


def _first_layer_off(target, states: dict[str, np.ndarray]) -> str:
    """The first model layer whose written cache is off beyond the state tolerance."""
    off = []
    for name, actual in states.items():
        reference = getattr(target, name).detach().float().numpy()
        for index, layer in enumerate(_layer_ids(target, name)):
            want, got = reference[index], actual[index].astype(np.float32)
            scale = float(np.abs(want).max())
            rel = float(np.abs(got - want).max()) / scale if scale > 0 else 0.0
            if rel > STATE_TOLERANCE.rel_tol:
                off.append((layer, name, rel))
    if not off:
        return "no layer's cache is off"
    layer, name, rel = min(off)
    return f"first off at layer {layer} ({name}, rel {rel:.2g})"


def reference_bytes(target_dir: Path, drafter_dir: Path | None) -> int:
    """fp32 bytes of the checkpoints' tensors: what the eager reference holds."""
    return sum(4 * int(np.prod(shape)) for shape in
               checkpoint_shapes(target_dir, drafter_dir).values())


def self_check(package: Path, metadata: Metadata, target_dir: Path, drafter_dir: Path | None,
               sequences: list[list[int]], schemes: dict[str, Scheme]) -> SelfCheck:
    """Runs the check on the staged target `package` described by `metadata`; returns its
    record, or refuses (ExportError) in one line."""
    size = reference_bytes(target_dir, drafter_dir)
    if size > REFERENCE_LIMIT:
        return SelfCheck(checked=False, reason=f"the fp32 reference would take {size >> 20} MB, "
                         f"over the self-check's {REFERENCE_LIMIT >> 20} MB; run //:verify")
    stream = [token for sequence in sequences for token in sequence]
    calls = _calls(metadata, len(stream))
    asset = metadata.asset(AssetRole.TARGET)
    fused = asset.kind == AssetKind.FUSED_TARGET
    target = load_target(target_dir, drafter_dir if fused else None, dtype=torch.float32,
                         max_context=metadata.context_length,
                         max_query_len=metadata.max_query_length(), compressed=schemes or None)
    interpreters = {name: Interpreter(load_program(package, name), name)
                    for name in dict.fromkeys(call[0] for call in calls)}
    states = next(iter(interpreters.values())).zero_states()
    sync_states(target, states)
    worst: dict[str, Discrepancy] = {}
    for name, entry, length, bucket, start in calls:
        ids = np.array([stream[start:start + length]], np.int32)
        inputs = {InputName.INPUT_IDS: ids,
                  InputName.POSITION_IDS: np.arange(start, start + length, dtype=np.int32)}
        view = target.with_entry_point(entry, span=bucket)
        where = f"positions {start}..{start + length - 1}"
        try:
            report = parity_step(interpreters[name], view, inputs, states)
        except NonFiniteError as error:
            raise ExportError(f"self-check: target.{name} ({where}) went non-finite: {error}; "
                              "nothing was written") from error
        for table, tolerance in ((report.outputs, OUTPUT_TOLERANCE),
                                 (report.states, STATE_TOLERANCE)):
            for key, found in table.items():
                if key not in worst or found.max_rel > worst[key].max_rel:
                    worst[key] = found
                if not found.within(tolerance):
                    raise ExportError(
                        f"self-check: target.{name} ({where}) computes {key} off by rel "
                        f"{found.max_rel:.3g} against fp32 eager (limit {tolerance.rel_tol:g}); "
                        f"{_first_layer_off(view, states)}; the converted program does not "
                        "compute the checkpoint, so nothing was written: give "
                        "--calibration-prompts with text like yours to the fp16 audit, try "
                        "another --compression, or report it with this line (--no-self-check "
                        "publishes it anyway)")
    outputs = [d.max_rel for key, d in worst.items() if key not in states]
    cache = [d.max_rel for key, d in worst.items() if key in states]
    return SelfCheck(checked=True, functions=list(interpreters),
                     tokens=sum(call[2] for call in calls),
                     output_rel=round(max(outputs, default=0.0), 6),
                     state_rel=round(max(cache, default=0.0), 6))
