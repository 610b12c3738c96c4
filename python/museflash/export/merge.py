"""Single-function Core ML packages -> one multifunction package, real weights streamed in.

coremltools' own route (`save_multifunction`) loads every function's program and weights back
into memory, deduplicates constants across functions, and lowers the whole program again. Here
the merge works on what the single-function packages already hold: their specs (the functions'
ML program protos, copied as they are) and their weight files (read one blob at a time). The
result is the package `save_multifunction` writes for the same parts (the same weight file byte
for byte; in the spec, the parts' debug labels of state ops are kept where save_multifunction
renumbers them), with one difference on purpose: a blob that holds a placeholder
(`placeholders.PlaceholderWeights`) is written with the real weight, read from the checkpoint.
The export has those written before the merge, while the parts convert (`weights.WeightsAhead`):
the merge then continues that file, so the real weights come first in it and each placeholder
const is pointed at its weight's blob. The file is written by `blobfile.BlobFileWriter`, which
makes coremltools' bytes without holding the GIL.

Which blobs are shared follows coremltools' cross-function deduplication exactly: constants are
grouped by dtype, shape and a hash of their first elements, and within a group are the same when
`np.allclose` says so with coremltools' tolerances. Blobs are written in the order the lowering
writes them: function by function, each in its own weight file's order. The benchmark compares
the result with `save_multifunction`'s, constant by constant.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from museflash.bundle import PACKAGE_SPEC, PACKAGE_WEIGHT_FILE
from museflash.checkpoint.tensor_files import WeightLocation
from museflash.compression import Scheme
from museflash.export import blobfile
from museflash.export.coreml_patches import all_close, flat_prefix
from museflash.export.placeholders import PlaceholderWeights
from museflash.export.weights import (
    CompressedWeight,
    StoredWeight,
    WrittenWeights,
    write_compressed,
    write_real,
)

IOS18_SPECIFICATION_VERSION = 9

_VERIFY_CHUNK_BYTES = 32 << 20


class MergeError(ValueError):
    """A part cannot be merged as it is; the message names the part and the constant."""


@dataclass(frozen=True)
class _BlobType:
    numpy: type
    blob_dtype: int  # the weight file's dtype code (blobfile)
    atol: float  # coremltools' const_deduplication tolerance for the dtype


def _blob_types() -> dict[int, _BlobType]:
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
        const_deduplication,
    )
    from coremltools.proto import MIL_pb2

    atol = const_deduplication.DTYPE2ATOL
    kinds = MIL_pb2.DataType
    return {
        kinds.FLOAT16: _BlobType(np.float16, blobfile.FLOAT16, atol.get(types.fp16, 1e-12)),
        kinds.FLOAT32: _BlobType(np.float32, blobfile.FLOAT32, atol.get(types.fp32, 1e-12)),
        kinds.INT8: _BlobType(np.int8, blobfile.INT8, 1e-12),
        kinds.UINT8: _BlobType(np.uint8, blobfile.UINT8, 1e-12),
        kinds.INT16: _BlobType(np.int16, blobfile.INT16, 1e-12),
        kinds.UINT16: _BlobType(np.uint16, blobfile.UINT16, 1e-12),
        kinds.INT32: _BlobType(np.int32, blobfile.INT32, 1e-12),
        kinds.UINT32: _BlobType(np.uint32, blobfile.UINT32, 1e-12),
    }


@dataclass
class _Blob:
    """One constant of one part that lives in the part's weight file."""
    function: str
    name: str
    offset: int  # in the part's weight file
    shape: tuple[int, ...]
    data_type: int  # MIL_pb2.DataType
    ops: list  # the const ops whose values point at this blob (rewritten when merged)
    nested: bool  # inside a control-flow block: coremltools never shares these across functions


def read_spec(package: Path):
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.ParseFromString((Path(package) / PACKAGE_SPEC).read_bytes())
    return spec


def blob_constants(function_proto, function: str = "") -> list[_Blob]:
    """The function's constants stored in the weight file, in weight-file order."""
    by_offset: dict[int, _Blob] = {}

    def visit(block, nested: bool) -> None:
        for op in block.operations:
            for inner in op.blocks:
                visit(inner, True)
            if op.type != "const" or "val" not in op.attributes:
                continue
            value = op.attributes["val"]
            if value.WhichOneof("value") != "blobFileValue":
                continue
            tensor = value.type.tensorType
            offset = value.blobFileValue.offset
            if offset not in by_offset:
                by_offset[offset] = _Blob(
                    function, op.outputs[0].name, offset,
                    tuple(d.constant.size for d in tensor.dimensions), tensor.dataType, [],
                    nested)
            by_offset[offset].ops.append(op)

    for block in function_proto.block_specializations.values():
        visit(block, False)
    return [by_offset[offset] for offset in sorted(by_offset)]


class _WeightFile:
    """Reads blobs of one part's weight file: the header, the first row, or all of it."""

    def __init__(self, package: Path):
        self.path = Path(package) / PACKAGE_WEIGHT_FILE
        self.handle = self.path.open("rb", buffering=0)

    def close(self) -> None:
        self.handle.close()

    def header(self, blob: _Blob) -> tuple[int, int]:
        """(data offset, size in bytes) of the blob."""
        self.handle.seek(blob.offset)
        sentinel, _, size, start = blobfile.read_record(
            self.handle.read(blobfile.RECORD_FIELDS_BYTES))
        if sentinel != blobfile.SENTINEL:
            raise MergeError(f"{self.path}: const {blob.name} points at offset {blob.offset}, "
                             "which holds no blob header")
        return start, size

    def read(self, start: int, size: int) -> bytes:
        self.handle.seek(start)
        data = self.handle.read(size)
        if len(data) != size:
            raise MergeError(f"{self.path}: blob at {start} is truncated")
        return data

    def verify_repeated_row(self, start: int, size: int, row: bytes, name: str, key: str):
        rows_per_chunk = max(1, _VERIFY_CHUNK_BYTES // len(row))
        pattern = np.frombuffer(row, dtype=np.uint8)
        done = 0
        while done < size:
            chunk = self.read(start + done, min(size - done, rows_per_chunk * len(row)))
            block = np.frombuffer(chunk, dtype=np.uint8).reshape(-1, len(row))
            if not (block == pattern).all():
                raise MergeError(f"{self.path}: const {name} starts like the placeholder of "
                                 f"{key} but differs further on; conversion changed the weight")
            done += len(chunk)


@dataclass
class _Unique:
    """A blob as written to the merged file, and what deduplication compares it by."""
    placed: int | CompressedWeight  # the merged offset, or the compressed form's blobs
    values: np.ndarray  # a placeholder as its row broadcast over the shape (a view, no copy)


def _hash_key(blob: _Blob, values: np.ndarray, count: int) -> tuple:
    # A placeholder's first values are taken from its row, not from its broadcast copied out
    # whole (at the 30B's layer width that copy was 3.9 s of a 4.0 s merge).
    digest = hashlib.sha1(np.ascontiguousarray(flat_prefix(values, count))).hexdigest()
    return blob.data_type, blob.shape, digest


def merge_packages(
    parts: list[tuple[str, Path]],
    destination: Path,
    default_function: str,
    placeholders: PlaceholderWeights | None = None,
    expected_rows: set[bytes] | None = None,
    compression: Mapping[str, Scheme] | None = None,
    written: WrittenWeights | None = None,
) -> dict[str, StoredWeight]:
    """Writes `destination` (a new .mlpackage) with one function per (name, part package), in
    that order. Placeholder blobs are written with the real weights; every row in
    `expected_rows` must be found. A placeholder whose checkpoint key `compression` names is
    written compressed instead (`compression.py`, a slice of rows at a time) and its const ops
    become the scheme's constexpr op. `written`: a weight file that already holds real weights
    (`weights.WeightsAhead`, written while the parts converted); it becomes the merged file,
    the other constants appended to it, and a placeholder it holds is pointed at its blob
    instead of being written again. Returns the real weights the merged file holds, by
    checkpoint key."""
    from coremltools.models.utils import _create_mlpackage
    from coremltools.proto import Model_pb2

    if default_function not in {name for name, _ in parts}:
        raise MergeError(f"default function {default_function!r} is not among "
                         f"{[name for name, _ in parts]}")
    destination = Path(destination)
    scratch = destination.parent / f".{destination.name}.weights"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        merged = Model_pb2.Model()
        merged.mlProgram.version = 1
        functions = []
        version = IOS18_SPECIFICATION_VERSION
        if written is not None:
            os.replace(written.path, scratch / PACKAGE_WEIGHT_FILE.name)
        weights = _MergedWeights(scratch / PACKAGE_WEIGHT_FILE.name, placeholders,
                                 compression or {}, written)
        for name, package in parts:
            spec = read_spec(package)
            if spec.WhichOneof("Type") != "mlProgram" or list(spec.mlProgram.functions) != ["main"]:
                raise MergeError(f"{package} is not a single-function ML program")
            version = max(version, spec.specificationVersion)
            described = spec.description
            functions.append(Model_pb2.FunctionDescription(
                name=name, input=described.input, output=described.output,
                state=described.state, predictedFeatureName=described.predictedFeatureName,
                predictedProbabilitiesName=described.predictedProbabilitiesName))
            function = merged.mlProgram.functions[name]
            function.CopyFrom(spec.mlProgram.functions["main"])
            source = _WeightFile(package)
            try:
                for blob in blob_constants(function, name):
                    placed = weights.place(blob, source)
                    if isinstance(placed, CompressedWeight):
                        for op in blob.ops:
                            placed.rewrite(op)
                    else:
                        for op in blob.ops:
                            op.attributes["val"].blobFileValue.offset = placed
            finally:
                source.close()
        weights.close()
        missing = (expected_rows or set()) - weights.seen_rows
        if missing:
            keys = sorted(placeholders.by_row[row].key for row in missing)
            raise MergeError(f"{destination.name}: weights {keys[:5]} are not stored as they "
                             "were given (a conversion pass folded or transformed them)")
        merged.specificationVersion = version
        merged.description.CopyFrom(Model_pb2.ModelDescription(
            functions=functions, defaultFunctionName=default_function))
        empty = scratch / "empty"
        empty.mkdir()
        _create_mlpackage(merged, weights_dir=str(empty), package_path=str(destination))
        os.replace(scratch / PACKAGE_WEIGHT_FILE.name, destination / PACKAGE_WEIGHT_FILE)
        return weights.stored
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _MergedWeights:
    """The merged weight file: each blob is written once, or shares the offset of an earlier
    blob that coremltools' cross-function deduplication would merge it with."""

    def __init__(self, path: Path, placeholders: PlaceholderWeights | None,
                 compression: Mapping[str, Scheme], written: WrittenWeights | None = None):
        from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
            const_deduplication,
        )

        self.writer = blobfile.BlobFileWriter(path, append=written is not None)
        self.written = written.placed if written is not None else {}
        self.placeholders = placeholders
        self.blob_types = _blob_types()
        self.hash_length = const_deduplication.LENGTH_OF_HASHKEY
        self.groups: dict[tuple, list[_Unique]] = {}
        self.seen_rows: set[bytes] = set()  # placeholders written with their real weights
        self.compression = compression
        self.stored: dict[str, StoredWeight] = {}

    def close(self) -> None:
        self.writer.close()

    def place(self, blob: _Blob, source: _WeightFile) -> int | CompressedWeight:
        """The merged file's offset for `blob` of `source` (or, for a weight to compress, its
        compressed blobs), writing it if it is new."""
        kind = self.blob_types.get(blob.data_type)
        if kind is None:
            raise MergeError(f"{source.path}: const {blob.name} has a blob dtype "
                             f"({blob.data_type}) this merge does not handle")
        start, size = source.header(blob)
        location, row = _placeholder_location(source, blob, start, size, self.placeholders)
        if location is not None:
            sample = np.broadcast_to(np.frombuffer(row, dtype=np.float16), blob.shape)
        elif compact_placeholder(blob, size):
            raise MergeError(f"{source.path}: const {blob.name} is stored as one row, which no "
                             "placeholder has: the part was damaged or conversion changed the "
                             "weight")
        else:
            if size != np.dtype(kind.numpy).itemsize * int(np.prod(blob.shape)):
                raise MergeError(f"{source.path}: const {blob.name} of shape "
                                 f"{list(blob.shape)} has a {size}-byte blob")
            sample = np.frombuffer(source.read(start, size), dtype=kind.numpy).reshape(blob.shape)
        unique = _Unique(-1, sample)
        key = _hash_key(blob, sample, self.hash_length)
        candidates = [] if blob.nested else self.groups.get(key, [])
        match = next((u for u in candidates if all_close(sample, u.values, kind.atol)), None)
        if match is not None:
            return match.placed
        if location is not None:
            scheme = self.compression.get(location.key)
            unique.placed = self.written.get(location.key)
            if unique.placed is None:
                unique.placed = (write_real(self.writer, location) if scheme is None
                                 else write_compressed(self.writer, location, scheme))
            self.stored[location.key] = StoredWeight.of(location.key, location.shape, scheme)
            self.seen_rows.add(row)
        else:
            unique.placed = self.writer.write(kind.blob_dtype, sample)
        if not blob.nested:
            self.groups.setdefault(key, []).append(unique)
        return unique.placed


def compact_placeholder(blob: _Blob, size: int) -> bool:
    """A 2-D fp16 blob of exactly one row for a larger shape: how a part package stores a
    placeholder, its row alone (`export.coreml_patches.placeholders_written_compactly`)."""
    from coremltools.proto import MIL_pb2

    return (len(blob.shape) == 2 and blob.shape[0] > 1 and size == 2 * blob.shape[1]
            and blob.data_type == MIL_pb2.DataType.FLOAT16)


def _placeholder_location(
    source: _WeightFile, blob: _Blob, start: int, size: int,
    placeholders: PlaceholderWeights | None,
) -> tuple[WeightLocation, bytes] | tuple[None, None]:
    """(the checkpoint tensor whose placeholder this blob holds, the placeholder row), or
    (None, None) for a real constant. A blob that starts with a placeholder's row must be that
    placeholder, whole: written compactly (the row alone, for the shape the op declares) or in
    full (every row checked)."""
    if placeholders is None or len(blob.shape) != 2:
        return None, None
    from coremltools.proto import MIL_pb2

    if blob.data_type != MIL_pb2.DataType.FLOAT16:
        return None, None
    row = source.read(start, blob.shape[1] * 2)
    location = placeholders.by_row.get(row)
    if location is None:
        return None, None
    compact = compact_placeholder(blob, size)
    if blob.shape != location.shape or not (compact
                                            or size == 2 * blob.shape[0] * blob.shape[1]):
        raise MergeError(f"{source.path}: const {blob.name} holds the placeholder of "
                         f"{location.key} {list(location.shape)} with shape {list(blob.shape)}; "
                         "conversion changed the weight")
    if not compact:
        source.verify_repeated_row(start, size, row, blob.name, location.key)
    return location, row
