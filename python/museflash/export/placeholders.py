"""The export's stand-ins for the large weights, and which weights it streams.

A model is traced and converted with placeholders where its large weights go; the real values
are written into the packages' weight files separately, read a slice at a time from the
checkpoint (export/weights.py), and the merge points each placeholder const at its weight's
blob (export/merge.py). So peak memory stays near one converting graph whatever the model's
size (docs/export-memory.md). The weights that get placeholders are the ones the export
streams, and the only ones it can store compressed (`compressed_weights`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

from museflash.checkpoint.tensor_files import CheckpointError, WeightLocation
from museflash.compression import Rule, Scheme, plan_compression


class PlaceholderWeights:
    """Stand-ins for the large weights, so a model can be traced and converted without them.

    Each placeholder is one random fp16 row broadcast over the weight's shape (a stride-0 view:
    it costs one row of memory however many rows the weight has). The row is derived from the
    weight's file and key alone, so every process that loads the same checkpoint makes the same
    row for the same weight, whatever order it loads in. Rows differ between weights, so
    constant deduplication still merges exactly the uses of the same weight, and the row
    identifies the weight again in the converted package's weight file, so the merge can point
    its const at the real values (written by `export.weights`; `export.merge`)."""

    MIN_ELEMENTS = 4096  # smaller tensors are loaded for real (inline or cheap either way)
    MIN_COLUMNS = 16  # a row this long is unique among the weights with near certainty

    def __init__(self):
        self.by_row: dict[bytes, WeightLocation] = {}
        self.by_pointer: dict[int, bytes] = {}

    @classmethod
    def wants(cls, shape: tuple[int, ...]) -> bool:
        return (len(shape) == 2 and shape[1] >= cls.MIN_COLUMNS
                and shape[0] * shape[1] >= cls.MIN_ELEMENTS)

    def make(self, location: WeightLocation, dtype: torch.dtype) -> torch.Tensor:
        rows, columns = location.shape
        row = torch.randn(columns, generator=_name_seeded(location)).to(dtype)
        key = row.numpy().tobytes()
        known = self.by_row.get(key)
        if known is not None and (known.path, known.key) != (location.path, location.key):
            raise CheckpointError(f"{location.path}: placeholder rows of {known.key!r} and "
                                  f"{location.key!r} coincide; rename one of the tensors")
        self.by_row[key] = location
        self.by_pointer[row.data_ptr()] = key
        return row.expand(rows, columns)

    def row_of(self, tensor: torch.Tensor) -> bytes | None:
        if tensor.dim() != 2 or tensor.stride(0) != 0:
            return None
        return self.by_pointer.get(tensor.data_ptr())


def _name_seeded(location: WeightLocation) -> torch.Generator:
    name = f"{Path(location.path).resolve()}\0{location.key}".encode()
    seed = int.from_bytes(hashlib.sha256(name).digest()[:8], "little")
    return torch.Generator().manual_seed(seed)


def streamed_weight(shape: tuple[int, ...]) -> bool:
    """Weights the export streams from the checkpoint into the packages (the only ones it
    can compress)."""
    return PlaceholderWeights.wants(tuple(shape))


def compressed_weights(rules: list[Rule], shapes: Mapping[str, tuple[int, ...]], *,
                       strict: bool) -> dict[str, Scheme]:
    """Checkpoint key -> scheme of each weight `rules` compress (compression.plan_compression)
    among those the export streams: what a compressed export stores compressed."""
    planned = plan_compression(rules, dict(shapes), strict=strict)
    return {key: scheme for key, scheme in planned.items()
            if scheme is not None and streamed_weight(shapes[key])}
