"""export.blobfile writes the weight files coremltools' own writer writes, byte for byte."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from museflash.export import blobfile
from museflash.export.blobfile import BlobFileWriter

ct = pytest.importorskip("coremltools")


def blobs():
    rng = np.random.default_rng(0)
    return [
        (blobfile.FLOAT16, "write_fp16_data", rng.integers(0, 2**16, 77, dtype=np.uint16)),
        (blobfile.FLOAT32, "write_float_data", rng.standard_normal(5).astype(np.float32)),
        (blobfile.INT8, "write_int8_data", rng.integers(-128, 128, 130, dtype=np.int8)),
        (blobfile.UINT8, "write_uint8_data", rng.integers(0, 256, 64, dtype=np.uint8)),
        (blobfile.INT4, "write_int4_data", rng.integers(-8, 8, 33, dtype=np.int8)),  # odd
        (blobfile.INT4, "write_int4_data", rng.integers(-8, 8, 64, dtype=np.int8)),
        (blobfile.UINT4, "write_uint4_data", rng.integers(0, 16, 7, dtype=np.uint8)),
        (blobfile.INT16, "write_int16_data", rng.integers(-9, 9, 3, dtype=np.int16)),
        (blobfile.UINT16, "write_uint16_data", rng.integers(0, 9, 3, dtype=np.uint16)),
        (blobfile.INT32, "write_int32_data", rng.integers(-9, 9, 3, dtype=np.int32)),
        (blobfile.UINT32, "write_uint32_data", rng.integers(0, 9, 3, dtype=np.uint32)),
    ]


def test_every_dtype_as_coremltools_writes_it_also_when_appending(tmp_path):
    from coremltools.libmilstoragepython import _BlobStorageWriter

    theirs, ours = tmp_path / "theirs.bin", tmp_path / "ours.bin"
    items = blobs()
    for appending, half in ((False, items[:5]), (True, items[5:])):
        # the second half appends to the file the first half left
        reference = _BlobStorageWriter(str(theirs), truncate_file=not appending)
        expected = [getattr(reference, method)(values) for _, method, values in half]
        del reference
        writer = BlobFileWriter(ours, append=appending)
        try:
            offsets = [writer.write(dtype, values) for dtype, _, values in half]
        finally:
            writer.close()
        assert offsets == expected
    assert ours.read_bytes() == theirs.read_bytes()


def test_what_it_writes_reads_back_through_coremltools(tmp_path):
    from coremltools.libmilstoragepython import _BlobStorageReader

    path = tmp_path / "weights.bin"
    writer = BlobFileWriter(path)
    values = np.arange(-8, 8, dtype=np.int8)
    halves = np.arange(6, dtype=np.float16)
    offsets = (writer.write(blobfile.INT8, values), writer.write(blobfile.FLOAT16, halves))
    writer.close()
    reader = _BlobStorageReader(str(path))
    np.testing.assert_array_equal(reader.read_int8_data(offsets[0]), values)
    np.testing.assert_array_equal(np.asarray(reader.read_fp16_data(offsets[1])).view(np.float16),
                                  halves)


def test_a_wrong_element_size_or_dtype_is_refused(tmp_path):
    writer = BlobFileWriter(tmp_path / "weights.bin")
    try:
        with pytest.raises(ValueError, match="2-byte elements"):
            writer.write(blobfile.FLOAT16, np.zeros(4, np.float32))
        with pytest.raises(ValueError, match="not one this writer handles"):
            writer.write(99, np.zeros(4, np.uint8))
    finally:
        writer.close()


def test_a_blob_written_in_pieces_in_any_order_is_the_blob_written_whole(tmp_path):
    halves = np.arange(1000, dtype=np.uint16)
    nibbles = np.random.default_rng(1).integers(-8, 8, 41, dtype=np.int8)  # odd: padded
    files = {name: BlobFileWriter(tmp_path / f"{name}.bin")
             for name in ("whole", "pieces", "short")}
    try:
        for writer in files.values():
            writer.write(blobfile.INT4, np.array([1, -2, 3], np.int8))  # leaves the end unaligned
        whole, pieces = files["whole"], files["pieces"]
        expected = [whole.write(blobfile.FLOAT16, halves), whole.write(blobfile.INT4, nibbles)]
        blob = pieces.reserve(blobfile.FLOAT16, 1000)
        # from several threads at once, the last piece first
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda first: blob.write(first, halves[first:first + 333]),
                          (999, 666, 333, 0)))
        assert blob.finish() == expected[0]
        blob = pieces.reserve(blobfile.INT4, 41)
        for first, stop in ((30, 41), (0, 10), (10, 30)):
            blob.write(first, nibbles[first:stop])
        assert blob.finish() == expected[1]
        short = files["short"].reserve(blobfile.FLOAT16, 1000)
        short.write(0, halves[:10])
        with pytest.raises(ValueError, match="hold 20 bytes, not the 2000 announced"):
            short.finish()
        with pytest.raises(ValueError, match="runs past"):
            short.write(995, halves[:10])
        odd = files["short"].reserve(blobfile.INT4, 41)
        for first, stop in ((1, 11), (0, 11)):  # an odd start; an odd count not at the end
            with pytest.raises(ValueError, match="even"):
                odd.write(first, nibbles[first:stop])
    finally:
        for writer in files.values():
            writer.close()
    assert (tmp_path / "whole.bin").read_bytes() == (tmp_path / "pieces.bin").read_bytes()


def test_a_copied_blob_keeps_its_dtype_payload_and_padding_bits(tmp_path):
    source, copy = tmp_path / "source.bin", tmp_path / "copy.bin"
    writer = BlobFileWriter(source)
    offsets = [writer.write(blobfile.INT32, np.arange(5, dtype=np.int32)),
               writer.write(blobfile.UINT4, np.arange(7, dtype=np.uint8) % 16)]  # odd: padded
    writer.close()
    data = source.read_bytes()
    writer = BlobFileWriter(copy)
    copied = [writer.copy(data, offset) for offset in reversed(offsets)]
    with pytest.raises(ValueError, match="no blob record"):
        writer.copy(data, offsets[0] + 8)
    writer.close()
    again = copy.read_bytes()
    for old, new in zip(reversed(offsets), copied, strict=True):
        # The record: sentinel, dtype and payload bytes (0-16), padding bits (24-32); only
        # the payload's own offset (16-24) moves.
        assert data[old:old + 16] == again[new:new + 16]
        assert data[old + 24:old + 32] == again[new + 24:new + 32]
        size, start_old = blobfile.read_record(data, old)[2:]
        start_new = blobfile.read_record(again, new)[3]
        assert data[start_old:start_old + size] == again[start_new:start_new + size]
