"""Trace one entry point of a module and convert it into a single-function Core ML package."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from museflash.bundle import INT32_OUTPUTS, OutputName
from museflash.export.options import ExportError
from museflash.export.plan import AssetPlan, FunctionPlan, InputPlan
from museflash.export.progress import Progress, tree_bytes

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
    # A forward hook, not a wrapper module: a wrapper would rename the buffers ("m.x") and
    # with them the Core ML state names.
    handle = module.register_forward_hook(_cast_bf16_outputs)
    try:
        with torch.no_grad():
            return torch.export.export(module, example_args).run_decompositions({})
    finally:
        handle.remove()


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
    validate_every_pass: bool = False,
    compact_placeholders: bool = True,
):
    """The program as a single-function ML program package. `compact_placeholders` writes the
    module's placeholders as one row each, which only this exporter's merge reads: pass False
    for a package coremltools itself must load back."""
    import coremltools as ct

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
    with nullcontext() if validate_every_pass else validated_once_per_pipeline(), \
            placeholders_written_compactly(module) if compact_placeholders else nullcontext(), \
            placeholders_handled_by_row() if compact_placeholders else nullcontext():
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


@contextmanager
def placeholders_written_compactly(module: torch.nn.Module) -> Iterator[None]:
    """While converting, a constant that is one of `module`'s placeholders
    (`checkpoint.PlaceholderWeights`: a 2-D fp16 row broadcast over the weight, stride 0, its
    row one of the module's placeholder rows) is written to the part package's weight file as
    that one row. coremltools would copy it out whole two or three times and
    write it: for each function that uses the model's weights, as many bytes again as the
    model, in memory traffic and in scratch disk (measured at Muse Glimmer 30B's layer width:
    the conversion of a 4-layer `main` took 45.6 s writing 4.4 GB of placeholders, 22 s
    without). The merge takes such a one-row blob for the placeholder whose row it is
    (`export.merge.compact_placeholder`); the merged package is unchanged."""
    from coremltools.converters.mil.backend.mil import helper

    rows = {p[0].detach().numpy().tobytes() for p in module.parameters()
            if p.dim() == 2 and p.shape[0] > 1 and p.stride(0) == 0
            and p.dtype == torch.float16}
    original = helper._get_offset_by_writing_data

    def write(output_var, blob_writer):
        value = output_var.val
        if (_broadcast_row(value) and value.dtype == np.float16
                and value[0].tobytes() in rows):
            return blob_writer.write_fp16_data(np.ascontiguousarray(value[0]).view(np.uint16))
        return original(output_var, blob_writer)

    helper._get_offset_by_writing_data = write
    try:
        yield
    finally:
        helper._get_offset_by_writing_data = original


def _broadcast_row(value) -> bool:
    """A 2-D array that is one row repeated by a stride of 0: how every placeholder reaches
    coremltools (`checkpoint.PlaceholderWeights`)."""
    return (isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[0] > 1
            and value.strides[0] == 0)


@contextmanager
def placeholders_handled_by_row() -> Iterator[None]:
    """Two coremltools steps touch every element of a constant that only needs its row when the
    constant is a placeholder; measured at Muse Glimmer 30B's layer width they took 15.5 s of
    the 30 s a 4-layer `main` took to trace and convert (the conversion alone: 23.6 s with
    them, 7.0 s without). Inside this block:

    - Type and value inference run again on ops that passes touch; for a const whose output
      already holds the very array its input holds nothing can change, yet the check compares
      the array with itself element by element. Such a placeholder const skips it.
    - Constant deduplication keys each const by a hash of its first values, taken from
      `value.reshape(-1)`, which copies a stride-0 array whole, and compares colliding consts
      with np.allclose. `_find_constants` makes the same groups, taking a placeholder's first
      values and comparisons from its row.

    The converted program is unchanged (the benchmark compares it with a plain conversion)."""
    from coremltools.converters.mil.mil.operation import Operation
    from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
        const_deduplication,
    )

    original_inference = Operation.type_value_inference
    original_find = const_deduplication.find_constants

    def inference(self, overwrite_output=False):
        outputs = self._output_vars
        if (self.op_type == "const" and outputs is not None and len(outputs) == 1
                and _broadcast_row(outputs[0].sym_val)
                and getattr(getattr(self, "val", None), "sym_val", None) is outputs[0].sym_val):
            outputs[0]._set_nonreplaceable_vars_upstream()
            return
        original_inference(self, overwrite_output)

    Operation.type_value_inference = inference
    const_deduplication.find_constants = staticmethod(_find_constants)
    try:
        yield
    finally:
        Operation.type_value_inference = original_inference
        const_deduplication.find_constants = staticmethod(original_find)


def _find_constants(blocks) -> dict:
    """coremltools' const_deduplication.find_constants (each unique const -> the consts that
    duplicate it) with the same keys and tolerances, reading a placeholder by its row."""
    from coremltools.converters.mil.mil import ListVar
    from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
        const_deduplication as dedup,
    )

    duplicates: dict = {}
    groups: dict[tuple, list] = {}
    for block in blocks:
        for op in list(block.operations):
            if op.op_type != "const" or isinstance(op.outputs[0], ListVar):
                continue
            var = op.outputs[0]
            value = var.val
            if not dedup.should_be_deduplicated(value):
                continue
            digest = hashlib.sha1(np.ascontiguousarray(
                flat_prefix(value, dedup.LENGTH_OF_HASHKEY))).hexdigest()
            key = (var.dtype, var.shape, digest)
            if hasattr(op, "weight_key"):
                key = (op.weight_key, *key)
            atol = dedup.DTYPE2ATOL.get(var.dtype, 1e-12)
            group = groups.setdefault(key, [])
            same = next((other for other in group if all_close(value, other.val, atol)), None)
            if same is None:
                group.append(var)
                duplicates[var] = []
            else:
                duplicates[same].append(var)
    return duplicates


def flat_prefix(value: np.ndarray, count: int) -> np.ndarray:
    """value.reshape(-1)[:count], without copying a broadcast row out whole."""
    if _broadcast_row(value):
        row = value[0]
        return np.tile(row, -(-count // row.size))[:min(count, value.size)]
    return value.reshape(-1)[:count]


def all_close(a: np.ndarray, b: np.ndarray, atol: float) -> bool:
    """np.allclose(a, b, rtol=0, atol=atol); two broadcast rows of one shape by their rows."""
    if _broadcast_row(a) and _broadcast_row(b) and a.shape == b.shape:
        return bool(np.allclose(a[0], b[0], rtol=0.0, atol=atol))
    return bool(np.allclose(a, b, rtol=0.0, atol=atol))


@contextmanager
def validated_once_per_pipeline() -> Iterator[None]:
    """coremltools validates the whole program after every graph pass (~110 per function);
    measured, that is a third of conversion time, and it grows with ops x fan-out. The checks
    have no side effects, so inside this block they run once after each pipeline instead: an
    invalid program still fails, only later. The output is unchanged
    (the benchmark compares it with a plain conversion)."""
    from coremltools.converters.mil.mil.passes import pass_pipeline
    from coremltools.converters.mil.mil.program import Program

    manager = pass_pipeline.PassPipelineManager
    original_apply = manager.apply_pipeline
    original_validate = Program.validate

    def apply_validating_at_the_ends(prog, pipeline):
        Program.validate = lambda self, check_essential_scope=False: None
        try:
            original_apply(prog, pipeline)
        finally:
            Program.validate = original_validate
        prog.validate(check_essential_scope=True)

    manager.apply_pipeline = staticmethod(apply_validating_at_the_ends)
    try:
        yield
    finally:
        manager.apply_pipeline = staticmethod(original_apply)


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
    """Traces and converts one entry point into the single-function package `part`."""
    label = f"{asset.role}.{function.name}" + (f", {where}" if where else "")
    view = module.with_entry_point(function.entry_point)
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
