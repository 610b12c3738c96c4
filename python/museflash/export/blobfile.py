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
from pathlib import Path

import numpy as np

ALIGNMENT = 64
SENTINEL = 0xDEADBEEF
VERSION = 2
_HEADER = struct.Struct("<II56x")  # count, version
_METADATA = struct.Struct("<IIQQQ32x")  # sentinel, dtype, payload bytes, payload offset, padding

# Blob dtype codes (4-bit values are handed over one per byte, as int8/uint8; other dtypes are
# written as their bytes, so any array of the element size will do, fp16 as float16).
FLOAT16, FLOAT32, UINT8, INT8, INT16, UINT16, INT4, UINT4, INT32, UINT32 = (
    1, 2, 3, 4, 6, 7, 8, 11, 14, 15)
_ELEMENT_BYTES = {FLOAT16: 2, FLOAT32: 4, UINT8: 1, INT8: 1, INT16: 2, UINT16: 2, INT32: 4,
                  UINT32: 4}
_NIBBLES = {INT4, UINT4}


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
        return self._write_blob(dtype, np.size(values), [payload])

    def write_pieces(self, dtype: int, count: int, pieces) -> int:
        """Appends one blob of `count` values that arrive as an iterable of arrays (so a large
        weight need not be in memory whole); returns its offset. For 4-bit dtypes every piece
        but the last holds an even number of values."""
        return self._write_blob(dtype, count, (self._payload(dtype, piece) for piece in pieces))

    def _write_blob(self, dtype: int, count: int, payloads) -> int:
        if dtype in _NIBBLES:
            nbytes, padding = (count + 1) // 2, 4 * (count % 2)
        elif dtype in _ELEMENT_BYTES:
            nbytes, padding = count * _ELEMENT_BYTES[dtype], 0
        else:
            raise ValueError(f"blob dtype {dtype} is not one this writer handles")
        offset = self._record(dtype, nbytes, padding)
        position = start = offset + _METADATA.size
        for payload in payloads:
            position = self._write_at(position, payload)
        if position - start != nbytes:
            raise ValueError(f"blob pieces hold {position - start} bytes, not the {nbytes} "
                             f"announced")
        self.end = position
        return offset

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
        """Writes all of `data` at `position` (the GIL is released while the OS writes);
        returns the position after it."""
        self.file.seek(position)
        view = memoryview(data).cast("B")
        while view.nbytes:
            written = self.file.write(view)
            view = view[written:]
            position += written
        return position
