"""A function's context buckets from one conversion: convert it once at a template span, then
write each bucket's package by putting the bucket's span where the template's stood.

A bucket function (docs/buckets.md) differs from its twins only in the span it attends to: the
traced graphs differ in integer arguments equal to the span and nowhere else, and so do the
converted programs, in three places (measured on the tiny pair and SmolLM2, 2026-12-07):

- tensor dimensions equal to the span (the types of the ops' outputs and constants);
- integers of immediate constants equal to the span (slice ends, reshape shapes);
- `arange(span)` constants in the weight file (the slot ids of the blend and the mask).

So the export converts each function once, at a template span `template_span` chose to be
unlike any other integer of the program (a prime that no config dimension equals), and
`SpanSites` finds those places by value. `write_part` writes a bucket's single-function package
from them: the same ops, the same weights, the span replaced, the arange constants rewritten.
The whole-capacity function is written the same way, with the capacity as its span: it reads
the caches through the same one slice, of all their slots.

What the template must not hold, because a value equal to the span would not say it all: an
integer that is a multiple of the span (a dimension merged with it), a float equal to it, a
constant with a span-long dimension that is not `arange(span)`, or an integer constant holding
the span among other values. `SpanSites` refuses such a template (`SpanError`) and the export
converts that function's buckets one by one instead. A converted bucket whose program a pass
folded differently (the span equal to a head dimension, or under coremltools' deduplication
threshold of 100 elements) computes what the written one computes; for buckets above those the
written package is the converted one byte for byte (tests/python/test_spans.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from museflash.bundle import PACKAGE_SPEC, PACKAGE_WEIGHT_FILE
from museflash.export import blobfile
from museflash.export.merge import blob_constants, read_spec

# A template span's floor: coremltools deduplicates constants of 100 elements or more, so a
# template at least this long is converted as the large buckets are.
MIN_TEMPLATE_SPAN = 100

_INT_BLOB_TYPES = {blobfile.INT32: np.int32, blobfile.INT16: np.int16,
                   blobfile.UINT16: np.uint16, blobfile.INT8: np.int8, blobfile.UINT8: np.uint8,
                   blobfile.UINT32: np.uint32}


class SpanError(ValueError):
    """The template's span cannot be told from the rest of its program by value."""


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def integers_of(*objects) -> set[int]:
    """Every integer in the fields of these dataclasses (configs), their lists and nested
    dataclasses: the dimensions a template span must not equal."""
    found: set[int] = set()

    def visit(value) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, int):
            found.add(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name))
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    for each in objects:
        visit(each)
    return found


def template_span(capacity: int, longest_call: int, taken: set[int]) -> int | None:
    """The span to convert a bucketed function's template at: the largest prime at most 3/4 of
    the capacity (away from the capacity and the slots next to it), longer than every call and
    at least MIN_TEMPLATE_SPAN, that is none of the `taken` integers (the configs'
    dimensions); None when there is none (the buckets are then converted one by one)."""
    span = capacity * 3 // 4
    floor = max(longest_call + 1, MIN_TEMPLATE_SPAN)
    while span >= floor:
        if _is_prime(span) and span not in taken:
            return span
        span -= 1
    return None


class SpanSites:
    """The places of a template part's program that hold its span, found by value."""

    def __init__(self, template: Path, span: int):
        self.template = Path(template)
        self.span = span
        self.spec = read_spec(template)
        if len(self.spec.mlProgram.functions) != 1:
            raise SpanError(f"{template.name}: a template part holds one function")
        self.weights = (self.template / PACKAGE_WEIGHT_FILE).read_bytes()
        # (message, field, index or None) of every integer equal to the span
        self.integers: list[tuple] = []
        self.aranges: dict[int, int] = {}  # blob offset -> dtype of an arange(span)
        function = next(iter(self.spec.mlProgram.functions.values()))
        self._blobs = blob_constants(function)
        self._blob_values = 0
        self._visit(self.spec)
        if self._blob_values != sum(len(blob.ops) for blob in self._blobs):
            raise SpanError(f"{template.name}: a weight-file value outside a const op")
        self._check_blobs()
        if not self.integers:
            raise SpanError(f"{template.name}: no integer equals the template span {span}: "
                            "the function does not attend to a context bucket")

    def _visit(self, message) -> None:
        """Every field of `message`, recursively (protobuf reflection, so no field of the
        program is missed)."""
        from google.protobuf.descriptor import FieldDescriptor

        if message.DESCRIPTOR.full_name == "CoreML.Specification.MILSpec.Value":
            self._visit_value(message)
        for field, value in message.ListFields():
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if field.message_type.GetOptions().map_entry:
                    for entry in value.values():
                        if hasattr(entry, "DESCRIPTOR"):
                            self._visit(entry)
                elif _repeated(field):
                    for item in value:
                        self._visit(item)
                else:
                    self._visit(value)
            elif field.name != "offset" or message.DESCRIPTOR.name != "BlobFileValue":
                self._scalar(message, field, value)

    def _scalar(self, message, field, value) -> None:
        from google.protobuf.descriptor import FieldDescriptor

        integer = field.cpp_type in (FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
                                     FieldDescriptor.CPPTYPE_UINT32,
                                     FieldDescriptor.CPPTYPE_UINT64)
        real = field.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE)
        if not (integer or real):
            return
        values = list(value) if _repeated(field) else [value]
        for index, item in enumerate(values):
            if real and item == self.span:
                raise SpanError(f"{self.template.name}: a float equals the template span "
                                f"{self.span} ({field.full_name})")
            if not integer or item == 0:
                continue
            if item == self.span:
                self.integers.append((message, field.name,
                                      index if _repeated(field) else None))
            elif item % self.span == 0:
                raise SpanError(f"{self.template.name}: the integer {item} ({field.full_name}) "
                                f"is a multiple of the template span {self.span}")

    def _visit_value(self, value) -> None:
        """A constant whose type has a span-long dimension must be an arange in the weight
        file, which each bucket's package rewrites."""
        self._blob_values += value.WhichOneof("value") == "blobFileValue"
        tensor = value.type.tensorType
        dims = tuple(d.constant.size for d in tensor.dimensions)
        if self.span not in dims or not value.WhichOneof("value"):
            return
        if value.WhichOneof("value") != "blobFileValue":
            raise SpanError(f"{self.template.name}: an immediate constant of shape {dims} has a "
                            f"dimension of the template span {self.span}")
        offset = value.blobFileValue.offset
        _, dtype, nbytes, start = blobfile.read_record(self.weights, offset)
        numpy = _INT_BLOB_TYPES.get(dtype)
        if numpy is None or dims.count(self.span) != 1 or int(np.prod(dims)) != self.span:
            raise SpanError(f"{self.template.name}: a constant of shape {dims} has a dimension "
                            f"of the template span {self.span} and is not an arange of it")
        values = np.frombuffer(self.weights, numpy, self.span, start)
        if not np.array_equal(values, np.arange(self.span)):
            raise SpanError(f"{self.template.name}: a constant of shape {dims} has a dimension "
                            f"of the template span {self.span} and is not an arange of it")
        self.aranges[offset] = dtype

    def _check_blobs(self) -> None:
        """No other integer constant of the weight file holds the span."""
        for blob in self._blobs:
            if blob.offset in self.aranges:
                continue
            _, dtype, nbytes, start = blobfile.read_record(self.weights, blob.offset)
            numpy = _INT_BLOB_TYPES.get(dtype)
            if numpy is not None and np.any(np.frombuffer(
                    self.weights, numpy, nbytes // np.dtype(numpy).itemsize, start) == self.span):
                raise SpanError(f"{self.template.name}: the integer constant {blob.name} holds "
                                f"the template span {self.span}")

    def write_part(self, span: int, destination: Path) -> None:
        """The single-function package of this function at `span`: the template's program with
        `span` in each of the template span's places, and its weight file with each blob as
        the template has it, but the aranges of `span`, in the same order."""
        if span in (0, self.span):
            raise ValueError(f"span {span}: a bucket's span must be positive and not the "
                             "template's")
        self._set_span(span)
        try:
            self._write(span, Path(destination))
        finally:  # the template as it was, for the next span
            self._set_span(self.span)
            for blob in self._blobs:
                for op in blob.ops:
                    op.attributes["val"].blobFileValue.offset = blob.offset

    def _set_span(self, span: int) -> None:
        for message, name, index in self.integers:
            if index is None:
                setattr(message, name, span)
            else:
                getattr(message, name)[index] = span

    def _write(self, span: int, destination: Path) -> None:
        staging = destination.with_name(destination.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(self.template, staging,
                        ignore=shutil.ignore_patterns("*.bin", "*.mlmodel"))
        writer = blobfile.BlobFileWriter(staging / PACKAGE_WEIGHT_FILE)
        try:
            for blob in self._blobs:
                dtype = self.aranges.get(blob.offset)
                offset = (writer.copy(self.weights, blob.offset) if dtype is None else
                          writer.write(dtype, np.arange(span, dtype=_INT_BLOB_TYPES[dtype])))
                for op in blob.ops:
                    op.attributes["val"].blobFileValue.offset = offset
        finally:
            writer.close()
        (staging / PACKAGE_SPEC).write_bytes(self.spec.SerializeToString())
        shutil.rmtree(destination, ignore_errors=True)
        staging.rename(destination)


def _repeated(field) -> bool:
    from google.protobuf.descriptor import FieldDescriptor

    is_repeated = getattr(field, "is_repeated", None)
    return is_repeated if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED
