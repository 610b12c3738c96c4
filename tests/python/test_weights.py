"""export.weights writes each weight a slice of rows at a time, slices on two threads at once and
each into its place in the blob: the file must be the one that writing every tensor whole, in
order, makes; and a slice that fails must fail the write."""

import pytest
import torch
from safetensors.torch import save_file

from museflash.checkpoint.tensor_files import SafetensorsReader
from museflash.checkpoint.weight_values import WeightValueError
from museflash.compression import Scheme
from museflash.export import weights
from museflash.export.weights import CompressedWeight, write_weights

SCHEMES = {
    "int4": Scheme("linear", 4, block_size=32),
    "int8": Scheme("linear", 8),
    "odd": Scheme("linear", 4),  # 33 columns: slices must still start on a byte
    "lut": Scheme("palettize", 4, group_size=6),
}


@pytest.fixture()
def locations(tmp_path):
    generator = torch.Generator().manual_seed(0)

    def weight(rows, columns, dtype):
        return (torch.randn(rows, columns, generator=generator) * 0.02).to(dtype)

    save_file({"int4": weight(64, 96, torch.bfloat16), "int8": weight(40, 64, torch.float16),
               "odd": weight(31, 33, torch.float16), "lut": weight(30, 34, torch.float16),
               "plain": weight(50, 70, torch.bfloat16)}, tmp_path / "model.safetensors")
    reader = SafetensorsReader(tmp_path)
    return [reader.locate(key) for key in ("int4", "plain", "int8", "odd", "lut")]


def _write(path, locations, rows_bytes, monkeypatch):
    monkeypatch.setattr(weights, "_ROWS_BYTES", rows_bytes)
    written = write_weights(path, locations, SCHEMES)
    return path.read_bytes(), written.placed


def test_slices_written_on_threads_make_the_file_written_whole(locations, tmp_path, monkeypatch):
    whole = _write(tmp_path / "whole.bin", locations, 1 << 30, monkeypatch)
    sliced = _write(tmp_path / "sliced.bin", locations, 512, monkeypatch)  # 2-12 rows a slice
    assert sliced[0] == whole[0]
    assert sliced[1] == whole[1]
    assert sum(isinstance(p, CompressedWeight) for p in sliced[1].values()) == 4


def test_a_slice_that_fails_fails_the_write(locations, tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    bad.mkdir()
    values = torch.ones(64, 96)
    values[50, 7] = float("inf")  # in a late slice, on whichever thread takes it
    save_file({"int4": values}, bad / "model.safetensors")
    location = SafetensorsReader(bad).locate("int4")
    monkeypatch.setattr(weights, "_ROWS_BYTES", 512)
    with pytest.raises(WeightValueError, match="'int4'.*1 inf"):
        write_weights(tmp_path / "bad.bin", [locations[1], location], SCHEMES)
