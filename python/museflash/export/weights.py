"""Each package's real weights, written to its weight file while the functions convert.

The large weights are placeholders during conversion (`placeholders.PlaceholderWeights`); which
ones a package holds is known as soon as the modules are loaded. `WeightsAhead` then starts one
thread that takes them a tensor at a time, package after package: WRITING_THREADS threads (one
per core, 2 to 8) read slices of its rows from the checkpoint, compress them if the plan's
schemes name it (`compression.compress`) and write each slice where it belongs in the tensor's
blob of the package's weight file (`blobfile.BlobFileWriter.reserve`: positioned writes, in any
order). The conversion runs meanwhile: file reads and writes, torch's dtype conversion and the
compiled quantizer all release the GIL. Each slice is checked as it passes (a NaN, an inf or a
value fp16 cannot hold refuses the tensor: `checkpoint.weight_values.unholdable`), so a weight
that would turn the model's outputs inf or NaN on device fails the export before anything is
published. The merge (`merge.merge_packages`) then appends the functions' other constants to the
same file and points each placeholder const at its weight's blob.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from museflash.bundle import COMPRESSION_OPS, CompressionMode
from museflash.checkpoint.tensor_files import WeightLocation
from museflash.checkpoint.weight_values import WeightValueError, location_value_error, unholdable
from museflash.compression import Scheme, compress
from museflash.export import blobfile
from museflash.export.progress import Progress

# Core ML stores sub-byte data packed; the writer takes it one element per byte.
_BLOB_DTYPES = {("linear", 4): ("INT4", blobfile.INT4),
                ("linear", 8): ("INT8", blobfile.INT8),
                ("affine", 4): ("UINT4", blobfile.UINT4),
                ("affine", 8): ("UINT8", blobfile.UINT8),
                ("palettize", 4): ("UINT4", blobfile.UINT4),
                ("palettize", 8): ("UINT8", blobfile.UINT8)}
# The constexpr ops' side inputs, as an error message names them.
_SIDE_WORDS = {"scale": "scales", "offset": "offsets", "lut": "look-up tables"}
_ROWS_BYTES = 4 << 20  # bytes of checkpoint rows read (and compressed) at a time, per thread
# Slices read, compressed and written at once: one per core, from 2 to 8 (each holds about
# 10 MB). This machine has 2 cores; more were not measured here.
WRITING_THREADS = min(8, max(2, os.cpu_count() or 2))


@dataclass(frozen=True)
class StoredWeight:
    """A checkpoint weight as the merged weight file holds it."""
    key: str
    shape: tuple[int, ...]
    scheme: Scheme | None  # None: fp16
    bytes: int  # its blobs' payload bytes (the data, and the scales or look-up table)

    @classmethod
    def of(cls, key: str, shape: tuple[int, ...], scheme: Scheme | None) -> StoredWeight:
        size = 2 * int(np.prod(shape)) if scheme is None else scheme.stored_bytes(shape)
        return cls(key, tuple(shape), scheme, size)


@dataclass(frozen=True)
class CompressedWeight:
    """A weight written compressed: the iOS18 constexpr op that rebuilds it on device, and
    that op's inputs (each a blob of the merged weight file: offset, MIL dtype, shape)."""
    op_type: str
    inputs: tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (input, offset, dtype, shape)

    def rewrite(self, op) -> None:
        """Turns the `const` op that held the placeholder into the constexpr op; its output
        (name, fp16 type and shape) and so every use of it stay as they are."""
        file_name = op.attributes["val"].blobFileValue.fileName
        op.type = self.op_type
        del op.attributes["val"]
        for name, offset, data_type, shape in self.inputs:
            value = op.inputs[name].arguments.add().value
            tensor = value.type.tensorType
            tensor.dataType = data_type
            tensor.rank = len(shape)
            for size in shape:
                tensor.dimensions.add().constant.size = size
            value.blobFileValue.fileName = file_name
            value.blobFileValue.offset = offset


class Stopped(Exception):
    """The export stopped (another stage failed) before these weights were written."""


@dataclass
class WrittenWeights:
    """One package's weight file with its real weights in it, and where each one is."""
    path: Path
    placed: dict[str, int | CompressedWeight] = field(default_factory=dict)  # by checkpoint key


def write_weights(path: Path, locations: list[WeightLocation], schemes: Mapping[str, Scheme],
                  stop: threading.Event | None = None) -> WrittenWeights:
    """Writes a new weight file holding `locations`' tensors, compressed where `schemes` names
    them, fp16 otherwise."""
    written = WrittenWeights(Path(path))
    writer = blobfile.BlobFileWriter(path)
    try:
        with ThreadPoolExecutor(WRITING_THREADS) as pool:
            for location in locations:
                if stop is not None and stop.is_set():
                    raise Stopped()
                scheme = schemes.get(location.key)
                written.placed[location.key] = (
                    write_real(writer, location, pool) if scheme is None
                    else write_compressed(writer, location, scheme, pool))
    finally:
        writer.close()
    return written


def write_real(writer: blobfile.BlobFileWriter, location: WeightLocation,
               pool: ThreadPoolExecutor | None = None) -> int:
    """Appends the weight as fp16, read and written a slice of rows at a time (by the pool's
    threads at once, if one is given); returns its blob's offset."""
    rows, columns = location.shape
    step = max(1, _ROWS_BYTES // (2 * columns))
    blob = writer.reserve(blobfile.FLOAT16, rows * columns)

    def one_slice(start: int) -> None:
        stop = min(rows, start + step)
        values = location.read_rows(start, stop, torch.float16).numpy()
        if unholdable(values):  # NaN, inf, or a bf16/fp32 value fp16 rounds to inf
            raise location_value_error(location)
        blob.write(start * columns, values)

    _each(pool, one_slice, range(0, rows, step))
    return blob.finish()


def write_compressed(writer: blobfile.BlobFileWriter, location: WeightLocation, scheme: Scheme,
                     pool: ThreadPoolExecutor | None = None) -> CompressedWeight:
    """Reads the weight a slice of rows at a time (fp32, from the checkpoint's own dtype),
    compresses each slice and writes its data into the data blob (by the pool's threads at
    once, if one is given), then the scales (and offsets) or look-up table. Memory: a slice per
    thread, and the scales or tables (1/8 of the fp16 weight or less)."""
    from coremltools.proto import MIL_pb2

    rows, columns = location.shape
    # A look-up table serves group_size rows, so palettized slices hold whole groups; 4-bit
    # slices start and end on a byte, two values to it, so they hold an even count.
    unit = scheme.group_size if scheme.mode == "palettize" else 1
    step = max(unit, _ROWS_BYTES // (4 * columns) // unit * unit)
    if columns % 2 and step % 2:
        step += unit
    sides = [np.empty(scheme.scale_shape(location.shape), np.float16)
             for _ in range(scheme.sides)]
    data_type, blob_dtype = _BLOB_DTYPES[(scheme.mode, scheme.bits)]
    blob = writer.reserve(blob_dtype, rows * columns)

    def one_slice(start: int) -> None:
        stop = min(rows, start + step)
        values = location.read_rows(start, stop, torch.float32).numpy()
        if unholdable(values):  # the constexpr op rebuilds it in fp16
            raise location_value_error(location)
        data, *parts = compress(values, scheme)
        for side, part in zip(sides, parts, strict=True):
            side[start // unit:stop // unit] = part
        blob.write(start * columns, data)

    _each(pool, one_slice, range(0, rows, step))
    op_type, data_input, *side_inputs = COMPRESSION_OPS[CompressionMode(scheme.mode)]
    for side, name in zip(sides, side_inputs, strict=True):
        if unholdable(side):
            what = _SIDE_WORDS.get(name, name)
            raise WeightValueError(
                f"{location.path}: tensor {location.key!r}: its {scheme.mode} {scheme.bits}-bit "
                f"{what} overflow fp16 ({int((~np.isfinite(side)).sum())} of {side.size} inf "
                "or NaN), which the device cannot rebuild the weight from; keep this tensor "
                "fp16 (a compression rule with mode \"none\") or rescale it")
    inputs = [(data_input, blob.finish(), getattr(MIL_pb2.DataType, data_type), (rows, columns))]
    for side, name in zip(sides, side_inputs, strict=True):
        inputs.append((name, writer.write(blobfile.FLOAT16, side), MIL_pb2.DataType.FLOAT16,
                       tuple(side.shape)))
    return CompressedWeight(op_type, tuple(inputs))


def _each(pool: ThreadPoolExecutor | None, function, items) -> None:
    """function(item) for each item: on the pool's threads if one is given (each holds one
    item's memory at a time), raising the first failure after cancelling what had not
    started."""
    if pool is None:
        for item in items:
            function(item)
        return
    futures = [pool.submit(function, item) for item in items]
    try:
        for future in futures:
            future.result()
    finally:
        for future in futures:
            future.cancel()
        wait(futures)


class WeightsAhead:
    """Writes each package's weights (`write_weights`) on a background thread, in the order
    given to `start`; `result(package)` waits for that package's file and raises what writing
    it raised. Leaving the context stops the thread after the tensor in hand (the files are
    the caller's to remove). `label` is added to each package's progress line."""

    def __init__(self, schemes: Mapping[str, Scheme], progress: Progress | None = None,
                 label: str = ""):
        self.schemes = schemes
        self.progress = progress
        self.label = label
        self.stop = threading.Event()
        self.done: dict[str, threading.Event] = {}
        self.results: dict[str, WrittenWeights | BaseException] = {}
        self.thread: threading.Thread | None = None
        self.failed: BaseException | None = None  # the first failure, as soon as it happens

    def __enter__(self) -> WeightsAhead:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def start(self, jobs: Mapping[str, tuple[Path, list[WeightLocation]]]) -> None:
        """jobs: package -> (its new weight file, the checkpoint tensors to write into it)."""
        if any(scheme.mode == "linear" for scheme in self.schemes.values()):
            # Compile the quantizer here, before the thread starts: compiled on the thread while
            # this one traced a function, numba once saw `max` as a functools.partial.
            import museflash.compression_kernels  # noqa: F401
        self.done = {package: threading.Event() for package in jobs}
        self.thread = threading.Thread(target=self._run, args=(dict(jobs),),
                                       name="museflash-weights", daemon=True)
        self.thread.start()

    def _run(self, jobs: dict[str, tuple[Path, list[WeightLocation]]]) -> None:
        failed: BaseException | None = None
        for package, (path, locations) in jobs.items():
            try:
                if failed is not None:
                    raise failed
                with self._stage(package) as info:
                    self.results[package] = write_weights(path, locations, self.schemes,
                                                          self.stop)
                    info["bytes"] = path.stat().st_size
            except BaseException as error:  # noqa: BLE001 - handed to the caller by result()
                failed = failed or error
                self.failed = failed
                self.results[package] = error
            finally:
                self.done[package].set()

    def _stage(self, package: str):
        detail = f"{package}, {self.label}" if self.label else package
        return (self.progress.stage("weights", detail) if self.progress is not None
                else nullcontext({}))

    def raise_failure(self) -> None:
        """Raises what writing some package's weights raised, if anything has yet: the export
        need not convert the functions of a model whose weights it refuses."""
        if self.failed is not None:
            raise self.failed

    def result(self, package: str) -> WrittenWeights:
        self.done[package].wait()
        outcome = self.results[package]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
