"""A writer of Core ML's weight file format (MIL blob storage, version 2) in plain Python.

coremltools' own writer (`libmilstoragepython._BlobStorageWriter`) holds the GIL for the whole
of each write, so a thread writing gigabytes of weights through it would stop the conversion
running beside it. File writes from Python release the GIL; this writer makes the same bytes
(tests/python/test_blobfile.py compares the two for every dtype the export writes).

The format: a 64-byte header (blob count uint32, version uint32 = 2, zeros), then per blob a
64-byte metadata record at a 64-byte aligned offset (sentinel 0xDEADBEEF uint32, dtype uint32,
payload bytes uint64, payload offset uint64 = the record's offset + 64, padding bits uint64 for
sub-byte dtypes, zeros) followed by the payload; zeros fill up to the next record. A const op
refers to a blob by its metadata record's offset. Sub-byte values are packed two per byte, the
first in the low nibble.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np

ALIGNMENT = 64
SENTINEL = 0xDEADBEEF
VERSION = 2
_HEADER = struct.Struct("<II56x")  # count, version
_METADATA = struct.Struct("<IIQQQ32x")  # sentinel, dtype, payload bytes, payload offset, padding
# What a reader needs, the record's first four fields: sentinel, dtype, payload bytes, offset.
_RECORD_FIELDS = struct.Struct(_METADATA.format[:5])
RECORD_FIELDS_BYTES = _RECORD_FIELDS.size

# Blob dtype codes (4-bit values are handed over one per byte, as int8/uint8; other dtypes are
# written as their bytes, so any array of the element size will do, fp16 as float16).
FLOAT16, FLOAT32, UINT8, INT8, INT16, UINT16, INT4, UINT4, INT32, UINT32 = (
    1, 2, 3, 4, 6, 7, 8, 11, 14, 15)
_ELEMENT_BYTES = {FLOAT16: 2, FLOAT32: 4, UINT8: 1, INT8: 1, INT16: 2, UINT16: 2, INT32: 4,
                  UINT32: 4}
_NIBBLES = {INT4, UINT4}


def read_record(data: bytes, offset: int = 0) -> tuple[int, int, int, int]:
    """(sentinel, dtype, payload bytes, payload offset) of the blob whose metadata record is at
    `offset` of weight-file bytes `data` (the offset a const op's BlobFileValue names)."""
    return _RECORD_FIELDS.unpack_from(data, offset)


class BlobFileWriter:
    """Appends blobs to a weight file; `close` writes the blob count into the header.

    `BlobFileWriter(path)` starts a new file; `BlobFileWriter(path, append=True)` continues an
    existing one (as coremltools' writer does without truncate_file)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        if append:
            self.file = self.path.open("r+b", buffering=0)
            count, version = _HEADER.unpack(self.file.read(_HEADER.size))
            if version != VERSION:
                raise ValueError(f"{self.path}: weight file version {version}, expected {VERSION}")
            self.count = count
            self.end = self.file.seek(0, os.SEEK_END)
        else:
            self.file = self.path.open("w+b", buffering=0)
            self.count = 0
            self.end = self._write_at(0, _HEADER.pack(0, VERSION))

    def write(self, dtype: int, values: np.ndarray) -> int:
        """Appends one blob of `values` and returns its offset, the one a const op's
        BlobFileValue names."""
        payload = self._payload(dtype, values)  # checked before anything is written
        blob = self.reserve(dtype, np.size(values))
        blob.write_payload(0, payload)
        return blob.finish()

    def copy(self, data: bytes, offset: int) -> int:
        """Appends, as it is, the blob whose metadata record is at `offset` of weight-file
        bytes `data` (its dtype, payload and padding bits); returns its offset here."""
        sentinel, dtype, nbytes, start, padding = _METADATA.unpack_from(data, offset)
        if sentinel != SENTINEL:
            raise ValueError(f"no blob record at offset {offset}")
        record = self._record(dtype, nbytes, padding)
        self.end = self._write_at(record + _METADATA.size, memoryview(data)[start:start + nbytes])
        return record

    def reserve(self, dtype: int, count: int) -> Blob:
        """Appends the metadata record of a blob of `count` values and leaves room for its
        payload, which the returned `Blob` then takes in pieces (so a large weight need not be
        in memory whole), in any order and from several threads at once."""
        if dtype in _NIBBLES:
            nbytes, padding = (count + 1) // 2, 4 * (count % 2)
        elif dtype in _ELEMENT_BYTES:
            nbytes, padding = count * _ELEMENT_BYTES[dtype], 0
        else:
            raise ValueError(f"blob dtype {dtype} is not one this writer handles")
        offset = self._record(dtype, nbytes, padding)
        self.end = offset + _METADATA.size + nbytes
        return Blob(self, dtype, count, offset, nbytes)

    @staticmethod
    def _payload(dtype: int, values: np.ndarray) -> memoryview:
        values = np.ascontiguousarray(values).reshape(-1)
        if dtype not in _NIBBLES and dtype not in _ELEMENT_BYTES:
            raise ValueError(f"blob dtype {dtype} is not one this writer handles")
        if dtype in _NIBBLES:
            values = values.view(np.uint8)
            if values.size % 2:
                values = np.append(values, np.uint8(0))
            # Each pair of values read as one little-endian uint16: the first's low nibble
            # stays in bits 0-3, the second's moves from bits 8-11 to 4-7 (three passes over
            # half as many elements as masking and interleaving bytes).
            pairs = values.view("<u2")
            return memoryview(((pairs & 0x000F) | ((pairs >> 4) & 0x00F0)).astype(np.uint8))
        if values.dtype.itemsize != _ELEMENT_BYTES[dtype]:
            raise ValueError(f"blob dtype {dtype} takes {_ELEMENT_BYTES[dtype]}-byte elements, "
                             f"got {values.dtype}")
        return memoryview(values).cast("B")

    def _record(self, dtype: int, nbytes: int, padding: int) -> int:
        """Pads to the next aligned offset and writes a blob's metadata record there."""
        offset = -(-self.end // ALIGNMENT) * ALIGNMENT
        if offset > self.end:
            self._write_at(self.end, bytes(offset - self.end))
        self._write_at(offset, _METADATA.pack(SENTINEL, dtype, nbytes, offset + _METADATA.size,
                                              padding))
        self.count += 1
        return offset

    def close(self) -> None:
        if self.file.closed:
            return
        try:
            self._write_at(0, _HEADER.pack(self.count, VERSION))
        finally:
            self.file.close()

    def _write_at(self, position: int, data) -> int:
        """Writes all of `data` at `position` (positioned writes: the file offset is not shared
        state, so threads may write at once; the GIL is released while the OS writes); returns
        the position after it."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            written = os.pwrite(self.file.fileno(), view, position)
            view = view[written:]
            position += written
        return position


class Blob:
    """Room reserved for one blob's payload (`BlobFileWriter.reserve`)."""

    def __init__(self, writer: BlobFileWriter, dtype: int, count: int, offset: int,
                 nbytes: int):
        self.writer = writer
        self.dtype = dtype
        self.count = count
        self.offset = offset  # of its metadata record: the offset a const op names
        self.nbytes = nbytes
        self.filled = 0
        self.lock = threading.Lock()

    def write(self, first: int, values: np.ndarray) -> None:
        """Writes `values` as the blob's values from index `first` on (for 4-bit dtypes an even
        index, and an even count unless the piece ends the blob)."""
        if self.dtype in _NIBBLES and (first % 2 or (np.size(values) % 2
                                                     and first + np.size(values) != self.count)):
            raise ValueError(f"a piece of a 4-bit blob holds values {first} to "
                             f"{first + np.size(values)}: pieces start at an even value and "
                             "hold an even count unless they end the blob (two to a byte)")
        element = _ELEMENT_BYTES.get(self.dtype)
        self.write_payload(first // 2 if element is None else first * element,
                           self.writer._payload(self.dtype, values))

    def write_payload(self, at: int, payload: memoryview) -> None:
        if at + payload.nbytes > self.nbytes:
            raise ValueError(f"a piece of {payload.nbytes} bytes at byte {at} runs past the "
                             f"blob's {self.nbytes}")
        self.writer._write_at(self.offset + _METADATA.size + at, payload)
        with self.lock:
            self.filled += payload.nbytes

    def finish(self) -> int:
        """Checks that the pieces filled the blob; returns its offset."""
        if self.filled != self.nbytes:
            raise ValueError(f"blob pieces hold {self.filled} bytes, not the {self.nbytes} "
                             "announced")
        return self.offset
