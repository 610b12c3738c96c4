"""Values an fp16 package can hold.

Every exported weight is fp16 on device (stored so, or rebuilt so by a constexpr op). A NaN or
inf there turns every logit NaN; a bf16 or fp32 value beyond fp16's range becomes inf. The
export refuses both (`unholdable` on each slice it streams).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from museflash.checkpoint.tensor_files import CheckpointError, WeightLocation


class WeightValueError(CheckpointError):
    """A tensor holds values an fp16 package cannot: NaN, inf, or beyond fp16's range."""


FP16_MAX = 65504.0
# The smallest magnitude fp16 rounds to inf (round to nearest even): what it cannot hold. A
# value between FP16_MAX and this rounds to FP16_MAX, an ordinary rounding error.
FP16_OVERFLOW = 65520.0
# Bit patterns from which on a value is refused: read as unsigned integers, those of negative
# values from the lowest refused negative one (-inf and negative NaNs above it); read as signed
# integers, those of positive values from the lowest refused positive one.
_REFUSED_FROM = {np.dtype(np.float16): (np.uint16, 0xFC00, np.int16, 0x7C00),
                 np.dtype(np.float32): (np.uint32, 0xC77FF000, np.int32, 0x477FF000)}


def unholdable(values: np.ndarray) -> bool:
    """Whether `values` (non-empty, contiguous; float16, or float32 read from the checkpoint)
    hold a NaN, an inf or a value fp16 rounds to inf. Two integer maxima over the bit patterns
    (unsigned: the negative values; signed: the positive ones), which vectorize and need no
    temporary array."""
    unsigned, negative, signed, positive = _REFUSED_FROM[values.dtype]
    return bool(values.view(unsigned).max() >= negative or values.view(signed).max() >= positive)


def weight_value_error(path: Path, key: str, slices: Iterable[np.ndarray]) -> WeightValueError:
    """The one-line refusal of tensor `key` of `path`, counted over its values in float32
    (`slices`, read again: only a refused tensor pays for this)."""
    nan = inf = over = 0
    peak = 0.0
    for values in slices:
        values = np.asarray(values, np.float32)
        magnitude = np.abs(values[~np.isnan(values)])
        nan += values.size - magnitude.size
        inf += int(np.isinf(magnitude).sum())
        over += int(((magnitude >= FP16_OVERFLOW) & np.isfinite(magnitude)).sum())
        if magnitude.size:
            peak = max(peak, float(magnitude.max()))
    return WeightValueError(
        f"{path}: tensor {key!r} holds {nan + inf + over} value(s) an fp16 Core ML package "
        f"cannot hold ({nan} NaN, {inf} inf, {over} beyond fp16's {FP16_MAX:.0f}; largest "
        f"magnitude {peak:.6g}), which make the model's outputs inf or NaN on device; repair "
        "or re-download the checkpoint (NaN and inf come from a damaged file or a diverged "
        "fine-tune) or rescale that tensor into fp16's range")


def location_value_error(location: WeightLocation) -> WeightValueError:
    """weight_value_error over a streamed weight, read again a slice of rows at a time."""
    rows = location.shape[0] if location.shape else 1
    row_elements = int(np.prod(location.shape[1:])) if location.shape else 1
    step = max(1, (16 << 20) // (4 * max(1, row_elements)))
    slices = (location.read_rows(start, min(rows, start + step), torch.float32).numpy()
              for start in range(0, rows, step))
    return weight_value_error(location.path, location.key, slices)
