"""Every change this exporter makes to coremltools' internals, in one place.

Each is a context manager that swaps one coremltools function for the length of a conversion
and restores it on the way out, and none but the last below changes the converted program: the
benchmark compares the export with a plain conversion spec for spec and weight for weight
(docs/export-memory.md), and tests/python/test_coreml_conversion.py checks the deduplication
against coremltools' own.
They were written and measured against coremltools 9.0, the version requirements_lock.txt pins;
each reaches into an internal that a later coremltools may move or change, so an upgrade must
re-run those tests and the benchmark's comparison before trusting them.

- `placeholders_written_compactly` replaces
  `converters.mil.backend.mil.helper._get_offset_by_writing_data`: a placeholder weight is
  written to a part package as its one row instead of being copied out whole and written
  (as many bytes as the model, per function).
- `placeholders_handled_by_row` replaces `mil.operation.Operation.type_value_inference` and
  `const_deduplication.find_constants`: type and value inference of a placeholder const, and the
  deduplication's hash and comparison of it, read its row instead of every element.
- `validated_once_per_pipeline` replaces `PassPipelineManager.apply_pipeline` (and, inside it,
  `Program.validate`): the program is validated once after each pass pipeline instead of after
  every one of its ~110 passes.
- `constexpr_tracking_skipped_without_constexpr` replaces `Block._propagate_nonreplaceable_vars`
  (and wraps `Var._is_nonreplaceable_var`): the walk that re-derives each var's constexpr
  ancestors whenever a block context closes is skipped until a constexpr var has been seen
  (this exporter compresses after converting).
- `program_text_skipped_in_pipelines` replaces the `__str__` of programs, functions and blocks
  while a pass pipeline runs: passes format whole programs into debug messages, logged or not.

One patch does change the program, on purpose, and every conversion (the benchmark's plain one
too) runs inside it:

- `small_constants_deduplicated` replaces `const_deduplication.should_be_deduplicated`: the
  small constants (axes, shapes, scalars: SMALL_CONSTANT_ELEMENTS elements or fewer) are merged
  as the large ones are, the same values, stored once.

`flat_prefix` and `all_close` are the row-reading hash prefix and comparison that the
deduplication uses here and that export/merge.py shares.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def placeholders_written_compactly(module: torch.nn.Module) -> Iterator[None]:
    """While converting, a constant that is one of `module`'s placeholders
    (`placeholders.PlaceholderWeights`: a 2-D fp16 row broadcast over the weight, stride 0, its
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
    coremltools (`placeholders.PlaceholderWeights`)."""
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


# Constants of at most this many elements are merged too. The repeated ones are all axes,
# shapes and scalars (in SmolLM2's main_512, 2,432 of its 2,539 immediate constants repeat one
# of 107 values, none longer than 16 elements); a weight is longer, so which weights merge is
# coremltools' rule still (100 elements or more), whether a weight is a placeholder or not.
SMALL_CONSTANT_ELEMENTS = 16


@contextmanager
def small_constants_deduplicated() -> Iterator[None]:
    """coremltools merges repeated constants of 100 elements or more; each function kept about
    2,000 copies of the same few small ones, a third of its program (docs/buckets.md). Inside
    this block a constant of SMALL_CONSTANT_ELEMENTS elements or fewer is merged as well. The
    values are unchanged; SmolLM2's main_512 goes from 5,460 ops (806 KB) to 3,457 (550 KB)."""
    from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
        const_deduplication as dedup,
    )

    original = dedup.should_be_deduplicated

    def small_or_large(val) -> bool:
        if (isinstance(val, np.ndarray | np.generic) and val.dtype.kind in "biuf"
                and 0 < np.size(val) <= SMALL_CONSTANT_ELEMENTS):
            return True
        return original(val)

    dedup.should_be_deduplicated = staticmethod(small_or_large)
    try:
        yield
    finally:
        dedup.should_be_deduplicated = staticmethod(original)


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


@contextmanager
def constexpr_tracking_skipped_without_constexpr() -> Iterator[None]:
    """Each time a block context closes (about 38 times per function and pipeline), coremltools
    walks the whole block and sets every var's `nonreplaceable_vars_upstream`: the constexpr_*
    vars upstream of it, which a pass may not replace away. Until a var has been found to be
    such a constexpr var (`Var._is_nonreplaceable_var`, which every op's type inference asks
    of its inputs), every set is the empty set it already is. Inside this block the walk is
    skipped until then, and runs as coremltools runs it from then on. This exporter writes
    compressed weights as constexpr ops after conversion (export/weights.py), so its
    conversions never hold one. The first form of this shortcut scanned every op for a
    constexpr at each close instead: about 1 s of a SmolLM2 function's 9 s conversion (a
    helper's profile, 2026-12-07); the bundle is the same bytes."""
    from coremltools.converters.mil.mil import Block
    from coremltools.converters.mil.mil.var import Var

    original_is = Var._is_nonreplaceable_var
    original_propagate = Block._propagate_nonreplaceable_vars
    seen = False

    def is_nonreplaceable(var):
        nonlocal seen
        found = original_is(var)
        seen = seen or bool(found)
        return found

    def propagate_once_any_was_seen(self):
        if seen:
            original_propagate(self)

    Var._is_nonreplaceable_var = staticmethod(is_nonreplaceable)
    Block._propagate_nonreplaceable_vars = propagate_once_any_was_seen
    try:
        yield
    finally:
        Var._is_nonreplaceable_var = staticmethod(original_is)
        Block._propagate_nonreplaceable_vars = original_propagate


@contextmanager
def program_text_skipped_in_pipelines() -> Iterator[None]:
    """coremltools formats whole programs into debug messages whether or not debug logging is
    on: `apply_pipeline` the program twice per pipeline, `common::reduce_transposes` (three
    times per function) and `fuse_layernorm_or_instancenorm` the function, and the text re-runs
    type inference on every op. While a pass pipeline runs inside this block, a program, a
    function and a block print as their names alone, unless coremltools' logger shows debug
    messages. No pass reads the text. (The first form patched `Block.__str__` inside
    reduce_transposes only, and missed the function, whose `__str__` is its own.) Side by side
    in one process, with the shortcut above: the tiny fused pair exported in 47.1 s against
    54.9 s, every file the same."""
    import logging

    from coremltools import _logger
    from coremltools.converters.mil.mil import Block, Function
    from coremltools.converters.mil.mil.passes import pass_pipeline
    from coremltools.converters.mil.mil.program import Program

    manager = pass_pipeline.PassPipelineManager
    original_apply = manager.apply_pipeline
    originals = (Program.__str__, Function.__str__, Block.__str__)

    def apply_without_program_text(prog, pipeline):
        if _logger.isEnabledFor(logging.DEBUG):
            return original_apply(prog, pipeline)
        Program.__str__ = lambda program: "program"
        Function.__str__ = lambda function: f"function {function.name}"
        Block.__str__ = lambda block: f"block {block.name}"
        try:
            return original_apply(prog, pipeline)
        finally:
            Program.__str__, Function.__str__, Block.__str__ = originals

    manager.apply_pipeline = staticmethod(apply_without_program_text)
    try:
        yield
    finally:
        manager.apply_pipeline = staticmethod(original_apply)
