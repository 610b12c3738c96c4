"""Trace one entry point of a module and convert it into a single-function Core ML package."""

from __future__ import annotations

import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from museflash.bundle import INT32_OUTPUTS, OutputName
from museflash.export.coreml_patches import (
    constexpr_tracking_skipped_without_constexpr,
    placeholders_handled_by_row,
    placeholders_written_compactly,
    program_text_skipped_in_pipelines,
    small_constants_deduplicated,
    validated_once_per_pipeline,
)
from museflash.export.options import ExportError
from museflash.export.plan import AssetPlan, FunctionPlan, InputPlan
from museflash.export.progress import Progress, tree_bytes
from museflash.export.spans import SpanError, SpanSites

DISABLE_BF16_CAST_ENV = "DISABLE_BFLOAT16_CAST_FOR_LOGITS"


def _cast_bf16_outputs(_module, _inputs, output):
    """bf16 graph outputs become fp16 (Core ML has no bf16 I/O), every element of tuple and
    list outputs included; DISABLE_BFLOAT16_CAST_FOR_LOGITS=1 leaves them alone."""
    if os.environ.get(DISABLE_BF16_CAST_ENV) == "1":
        return output

    def cast(value):
        if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
            return value.to(torch.float16)
        if isinstance(value, (tuple, list)):
            return type(value)(cast(v) for v in value)
        return value

    return cast(output)


def trace(module: torch.nn.Module, example_args: tuple) -> torch.export.ExportedProgram:
    """The module's ATen-dialect program, as coremltools reads it: what
    `torch.export.export(...).run_decompositions({})` gives, traced in one pass instead of two
    (`_one_pass_export`)."""
    # A forward hook, not a wrapper module: a wrapper would rename the buffers ("m.x") and
    # with them the Core ML state names.
    handle = module.register_forward_hook(_cast_bf16_outputs)
    try:
        with torch.no_grad():
            return _one_pass_export(module, example_args)
    finally:
        handle.remove()


def _one_pass_export(module: torch.nn.Module, example_args: tuple) -> torch.export.ExportedProgram:
    """`torch.export.export` traces a training-dialect program that `run_decompositions({})`
    traces again into the ATen dialect: two passes over every op, 12.4-12.9 s of a SmolLM2
    function's 22 s. Torch's private `_export(pre_dispatch=False)` traces the ATen dialect in
    one pass (5.9-6.9 s); inside the override `run_decompositions({})` itself uses, it keeps
    the same composite ops whole (linear, softmax, matmul), so the converted program is the
    two-pass one op for op. What differs: the two-pass graph holds no-op
    `_assert_tensor_metadata` checks, which use up coremltools' counter of constant names, so
    a few consts are numbered differently (measured on the demo's 11 functions and SmolLM2's
    `main_512`, 2026-12-07). Private names of the pinned torch (requirements_lock.txt): when
    they are gone, the public two passes."""
    try:
        from torch.export._trace import _export
        from torch.export.exported_program import (
            _override_composite_implicit_decomp,
            _split_decomp_table_to_cia_and_python_decomp,
        )
    except ImportError:
        return torch.export.export(module, example_args).run_decompositions({})
    kept, _ = _split_decomp_table_to_cia_and_python_decomp({})
    with _override_composite_implicit_decomp(kept):
        return _export(module, example_args, strict=False, pre_dispatch=False)


def check_no_data_dependent_scalars(program: torch.export.ExportedProgram) -> None:
    """The position contract promises no tensor-to-scalar reads in the graph."""
    banned = {"aten._local_scalar_dense", "aten.item"}
    found = sorted({str(node.target) for node in program.graph.nodes
                    if node.op == "call_function"
                    and any(str(node.target).startswith(b) for b in banned)})
    if found:
        raise ExportError(f"exported graph contains data-dependent scalar reads {found}")


def convert(
    program: torch.export.ExportedProgram,
    inputs: list[InputPlan],
    outputs: list[str],
    module: torch.nn.Module,
    state_names: tuple[str, ...],
    plain_passes: bool = False,
    compact_placeholders: bool = True,
):
    """The program as a single-function ML program package. `compact_placeholders` writes the
    module's placeholders as one row each, which only this exporter's merge reads: pass False
    for a package coremltools itself must load back. `plain_passes` runs coremltools' pass
    pipelines as shipped, without the shortcuts of export/coreml_patches.py (the benchmark's
    naive path, which checks that they change nothing)."""
    import coremltools as ct

    from museflash.export import kv_ops  # noqa: F401  (registers the custom KV op's converter)

    mutated = set(program.graph_signature.buffers_to_mutate.values())
    if mutated != {str(n) for n in state_names}:
        raise ExportError(
            f"entry point writes caches {sorted(mutated)} but the package declares states "
            f"{sorted(str(n) for n in state_names)}; every function must write every shared "
            "cache"
        )
    states = [
        ct.StateType(
            wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16),
            name=str(n),
        )
        for n in state_names
    ]
    with ExitStack() as patches:
        patches.enter_context(small_constants_deduplicated())
        if not plain_passes:
            patches.enter_context(validated_once_per_pipeline())
            patches.enter_context(constexpr_tracking_skipped_without_constexpr())
            patches.enter_context(program_text_skipped_in_pipelines())
        if compact_placeholders:
            patches.enter_context(placeholders_written_compactly(module))
            patches.enter_context(placeholders_handled_by_row())
        return ct.convert(
            program,
            pass_pipeline=_pass_pipeline(outputs),
            # A new list: ct.convert appends the states to the list it is given.
            inputs=[ct.TensorType(name=str(i.name), shape=i.shape, dtype=i.dtype)
                    for i in inputs],
            outputs=[ct.TensorType(name=str(n), dtype=_output_dtype(n)) for n in outputs],
            states=states,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16,
            skip_model_load=True,
        )


# Outputs computed from token ids as data (topk indices, ids gathered from them).
TOKEN_ID_OUTPUTS = frozenset({OutputName.DRAFT_TOKENS})
INT16_CAST_PASS = "common::add_int16_cast"


def _pass_pipeline(outputs: list[str]):
    """coremltools' default passes, without the 16-bit integer casts for a function whose
    outputs are token ids: that pass gives `topk` uint16 indices whatever the axis length and
    casts int32 values fed to gathers to 16 bits, so every id of a vocabulary above 65,535
    (Muse Glimmer's is 202,048) would wrap. Functions that only index with ids keep it (it
    leaves gathers over axes longer than int16 alone)."""
    import coremltools as ct

    pipeline = ct.PassPipeline.DEFAULT
    if TOKEN_ID_OUTPUTS.intersection(outputs):
        pipeline.remove_passes([INT16_CAST_PASS])
    return pipeline


def _output_dtype(name: str):
    return np.int32 if name in INT32_OUTPUTS else np.float16


def convert_function(module: torch.nn.Module, asset: AssetPlan, function: FunctionPlan,
                     part: Path, progress: Progress, where: str = "") -> None:
    """Traces and converts one entry point into the single-function package `part`; for a
    template, writes the functions it stands for beside `part` instead (export/spans.py)."""
    _convert_one(module, asset, function, part, progress, where)
    if function.written:
        _write_spans(module, asset, function, part, progress, where)


def _write_spans(module: torch.nn.Module, asset: AssetPlan, template: FunctionPlan,
                 part: Path, progress: Progress, where: str) -> None:
    """The functions a template stands for, written from its converted part (then removed);
    or, when its span cannot be told by value (spans.SpanError), each converted."""
    label = f"{asset.role}.{template.function}" + (f", {where}" if where else "")
    written = [(span, part.with_name(f"{name}.mlpackage")) for name, span in template.written]
    with progress.stage("write", f"{label}, {len(written)} spans") as info:
        try:
            sites = SpanSites(part, template.bucket)
        except SpanError as error:
            sites, info["summary"] = None, f"{error}: converting them one by one"
        else:
            for span, path in written:
                sites.write_part(span, path)
        shutil.rmtree(part)
    if sites is None:  # correct either way, only slower
        for name, _ in template.written:
            _convert_one(module, asset, asset.function(name),
                         part.with_name(f"{name}.mlpackage"), progress, where)


def _convert_one(module: torch.nn.Module, asset: AssetPlan, function: FunctionPlan,
                 part: Path, progress: Progress, where: str = "") -> None:
    label = f"{asset.role}.{function.name}" + (f", {where}" if where else "")
    view = module.with_entry_point(function.entry_point, span=function.bucket)
    with progress.stage("trace", label):
        program = trace(view, function.example_args)
        check_no_data_dependent_scalars(program)
    with progress.stage("convert", label) as info:
        model = convert(program, function.inputs, function.outputs, module, asset.states)
        del program
        # coremltools wrote the package to a temporary directory; keep it instead of copying.
        shutil.move(model.package_path, part)
        model.is_temp_package = False
        del model
        info["bytes"] = tree_bytes(part)
