"""Checkpoint tensor files: the safetensors layout, read and written.

A checkpoint directory holds `config.json` and its tensors in `model.safetensors`, or in shards
listed by `model.safetensors.index.json`. `SafetensorsReader` reads a tensor through a memory
map, converted to the compute dtype in one copy; `WeightLocation` says where a tensor's bytes
sit, for readers that stream a large weight a slice of rows at a time instead. Every header is
checked against the file size before anything is mapped, and every problem raises
CheckpointError naming the file, the key and both values. Pickle files are never read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The stored dtypes a checkpoint may use (safetensors spelling).
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message says which file and key, and why."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return DTYPES[dtype]


# --- Reading ---------------------------------------------------------------------------------


def check_safetensors_file(path: Path) -> dict[str, Any]:
    """Validates the header against the file size (before any mmap) and returns the header."""
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file not found")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(
            f"{path}: file is {size} bytes, shorter than the 8-byte safetensors header length"
        )
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: header length field says {header_len} bytes but only {size - 8} bytes "
                "follow it (truncated or not a safetensors file)"
            )
        raw_header = handle.read(header_len)
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: header is not valid JSON ({error})") from error
    data_size = size - 8 - header_len
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        end = entry.get("data_offsets", [0, 0])[1]
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {key!r} ends at data byte {end} but the file holds only "
                f"{data_size} data bytes (truncated)"
            )
    return header


class SafetensorsReader:
    """Key -> tensor access over one file or an index of shards, through memory maps."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_FILE
        single_path = self.directory / SINGLE_FILE
        if index_path.is_file():
            self.description = str(index_path)
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_path}: no valid weight_map ({error})") from error
            files: dict[str, str] = {}
            for key, name in weight_map.items():
                files.setdefault(name, key)
            for name, example_key in files.items():
                if not (self.directory / name).is_file():
                    raise CheckpointError(
                        f"{self.directory / name}: shard listed in {index_path} (e.g. for key "
                        f"{example_key!r}) not found"
                    )
        elif single_path.is_file():
            self.description = str(single_path)
            weight_map = None
        else:
            raise CheckpointError(
                f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found"
            )
        self._headers: dict[str, dict[str, Any]] = {}
        self._handles: dict[str, Any] = {}
        if weight_map is None:
            header = self._header(SINGLE_FILE)
            weight_map = {key: SINGLE_FILE for key in header if key != "__metadata__"}
        else:
            for key, name in weight_map.items():
                if key not in self._header(name):
                    raise CheckpointError(
                        f"{self.directory / name}: key {key!r} listed in {index_path} is "
                        "missing from the shard"
                    )
        self.weight_map: dict[str, str] = dict(weight_map)

    def _header(self, name: str) -> dict[str, Any]:
        if name not in self._headers:
            self._headers[name] = check_safetensors_file(self.directory / name)
        return self._headers[name]

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def file_of(self, key: str) -> Path:
        return self.directory / self.weight_map[key]

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.weight_map:
            raise CheckpointError(f"{self.description}: missing key {key!r}")
        return tuple(self._header(self.weight_map[key])[key]["shape"])

    def read(self, key: str, expected_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = self.shape(key)
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"{self.file_of(key)}: key {key!r} has shape {list(shape)}, expected "
                f"{list(expected_shape)} from the config"
            )
        name = self.weight_map[key]
        file_dtype = self._headers[name][key]["dtype"]
        if file_dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{self.file_of(key)}: key {key!r} has dtype {file_dtype}, expected one of "
                f"{sorted(SAFETENSORS_DTYPES)}"
            )
        if name not in self._handles:
            # One shard mapped at a time: the pages of finished shards leave the process.
            self._handles.clear()
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        mapped = self._handles[name].get_tensor(key)
        # Own memory in the compute dtype, filled by a single converting copy from the map.
        loaded = torch.empty(shape, dtype=dtype)
        loaded.copy_(mapped)
        return loaded

    def locate(self, key: str) -> WeightLocation:
        """Where the key's bytes sit on disk, for readers that stream instead of mapping."""
        name = self.weight_map[key]
        header = self._header(name)
        entry = header[key]
        with (self.directory / name).open("rb") as handle:
            (data_start,) = struct.unpack("<Q", handle.read(8))  # the header's length
        begin, end = entry["data_offsets"]
        return WeightLocation(self.directory / name, 8 + data_start + begin, end - begin,
                              entry["dtype"], tuple(entry["shape"]), key)

    def close(self) -> None:
        self._handles.clear()


@dataclass(frozen=True)
class WeightLocation:
    path: Path
    offset: int  # absolute, in bytes
    nbytes: int
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]
    key: str

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in `dtype`, through one buffer of its file bytes (no memory map: mapped
        pages would stay resident until the whole shard is unmapped)."""
        return self.read_rows(0, self.shape[0] if self.shape else 0, dtype)

    def read_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the tensor (along its first axis) in `dtype`: a large weight
        can be processed a slice at a time."""
        row_bytes = self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes
        first, count = (start * row_bytes, (stop - start) * row_bytes) if self.shape else (
            0, self.nbytes)
        raw = bytearray(count)
        with self.path.open("rb", buffering=0) as handle:
            handle.seek(self.offset + first)
            view = memoryview(raw)
            done = 0
            while done < count:
                read = handle.readinto(view[done:])
                if not read:
                    raise CheckpointError(f"{self.path}: key {self.key!r} is truncated")
                done += read
        shape = (stop - start, *self.shape[1:]) if self.shape else self.shape
        stored = torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[self.dtype]).reshape(shape)
        return stored if stored.dtype == dtype else stored.to(dtype)


def checkpoint_shapes(target_dir: Path, drafter_dir: Path | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of every tensor of both checkpoints (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for directory in (target_dir, drafter_dir):
        if directory is not None:
            reader = SafetensorsReader(directory)
            shapes.update({key: reader.shape(key) for key in reader.keys()})
            reader.close()
    return shapes


# --- Writing (demo checkpoints, tests, tools) ------------------------------------------------


def write_safetensors(
    tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    directory: str | Path,
    config: dict[str, Any],
    *,
    dtype: str | torch.dtype = "bf16",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes config.json and model.safetensors, or shards plus an index when the tensors
    exceed max_shard_bytes. `tensors` may be a lazy iterable of (key, tensor) when sharding."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(dtype)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        items = tensors.items() if isinstance(tensors, dict) else tensors
        converted = {key: t.detach().to(dtype).contiguous() for key, t in items}
        save_file(converted, str(directory / SINGLE_FILE), metadata=metadata)
        return
    # Shards are written as they fill so only one shard is ever held converted in memory.
    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        name = f"shard-{len(written) + 1:05d}.partial"
        save_file(shard, str(directory / name), metadata=metadata)
        written.append((name, list(shard)))
        shard.clear()

    for key, tensor in tensors.items() if isinstance(tensors, dict) else tensors:
        size = tensor.numel() * dtype.itemsize
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[key] = tensor.detach().to(dtype).contiguous()
        shard_bytes += size
        total += size
    if shard:
        flush()
    weight_map = {}
    for number, (partial, keys) in enumerate(written, start=1):
        name = f"model-{number:05d}-of-{len(written):05d}.safetensors"
        (directory / partial).rename(directory / name)
        weight_map.update({key: name for key in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
