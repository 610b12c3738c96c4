"""Weight compression of the export: which weights are compressed how (presets and user rules),
and the maths that compresses them (symmetric linear quantization and k-means palettization)
in the layouts of the iOS18 constexpr ops that rebuild them on device.

Presets (`--compression`):
- `none`: every weight fp16.
- `8bit`: every large weight int8, symmetric, one fp16 scale per output channel (scale [O, 1]).
- `4bit`: large weights affine uint4, one fp16 scale and one fp16 offset per block of 32 along
  the input axis (scale and offset [O, I/32]), each block spanning its own minimum to maximum.
  Those are the blocks of llama.cpp's Q4_1 (d * q + m, q in 0..15, per 32 inputs), so a Q4_1
  GGUF file's weights pass through unchanged but for the fp16 rounding of the offset -m/d.
  The embedding and the lm_head (`*embed_tokens.weight`, `lm_head.weight`, any prefix) are
  int8 per output channel. A weight whose input dimension is not a multiple of 32 falls back
  to int8 per output channel.
- `palettize4`: large weights palettized: 4-bit indices into a 16-entry fp16 look-up table
  shared by each group of 32 consecutive output channels (lut [O/32, 1, 16, 1]), fitted by a
  1-D k-means. Embedding and lm_head int8 per output channel as in `4bit`; a weight whose
  output dimension is not a multiple of 32 falls back to int8 per output channel.

User rules (`--compression-config FILE`): a JSON list of rules, or {"rules": [...]}, each
  {"match": "<glob over checkpoint tensor names>",
   "mode": "linear" | "affine" | "palettize" | "none",
   "bits": 4 | 8, "block_size": N, "group_size": N}
`linear` is symmetric (int data times a scale, the clipping chosen to minimise each block's
squared error); `affine` is unsigned data minus an fp16 offset, times a scale, over each
block's minimum to maximum. `block_size` (linear and affine; absent or null: per output
channel) counts input elements per scale; `group_size` (palettize only; default 32) counts
output channels per look-up table. The first rule whose glob matches a name decides; a
weight no rule matches stays fp16. Unlike a preset's, a user rule is checked strictly: a rule
that decides no weight, or a block or group size that does not divide the weight, is an error
rather than a fallback.

Always, whatever the rules: a tensor that is not 2-D or has fewer than 2^16 elements (norms,
biases, RoPE tables, small projections) stays fp16.

Ranges follow coremltools' `linear_symmetric` (coremltools.optimize._utils.get_quant_range):
int8 data in [-127, 127], int4 in [-7, 7], dequantized as data * scale. Affine data is uint8 in
[0, 255] or uint4 in [0, 15], dequantized as (data - offset) * scale (constexpr_blockwise_shift_
scale with an fp16 offset, which its iOS18 definition allows beside integer data).

This module imports nothing from the rest of museflash but its compiled loops
(`compression_kernels`, numba), and no torch or coremltools.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class CompressionError(ValueError):
    """A bad preset, rule, config file or weight for compression; the message is one line."""


PRESETS: tuple[str, ...] = ("none", "8bit", "4bit", "palettize4")
MIN_ELEMENTS = 1 << 16
MODES = ("linear", "affine", "palettize", "none")
BITS = (4, 8)
DEFAULT_BLOCK_SIZE = 32  # the `4bit` preset's block along the input axis
DEFAULT_GROUP_SIZE = 32  # output channels per look-up table when a rule names none
# The mse clipping search over ratios r of a block's absolute maximum: 1 and the coarse ratios,
# then the best so far +- each refining step in turn: 10 evaluations reaching the ratios k/64 of
# [0.5, 1]. Its total squared error is within 0.1% of trying all 33 of them (normal, Laplace
# and student-t data), and below absmax's by 12% (int4 blocks of 32, normal data) and 2.5%
# (int8 rows of 4096).
CLIP_COARSE = (0.875, 0.75, 0.625)
CLIP_REFINE = (1 / 16, 1 / 32, 1 / 64)
KMEANS_ITERATIONS = 50
KMEANS_INIT_BINS = 256
_RULE_KEYS = ("match", "mode", "bits", "block_size", "group_size")
# Elements quantized per kernel call: its float32 copy is 4 MB.
_CHUNK_ELEMENTS = 1 << 20
# Values of the groups palettized together (their histograms take 2 MB per group).
_PALETTIZE_BATCH_VALUES = 1 << 21
_FP16_TINY = np.float32(2.0**-24)  # the smallest positive fp16 (subnormal)
# An affine block's offset stays within +-AFFINE_OFFSET_LIMIT (its scale is at least the
# block's largest |value| / this): fp16 holds the offset there to within 1/4, an error of at
# most |value| / 4096, below the fp16 rounding of the value itself.
AFFINE_OFFSET_LIMIT = 1024


@dataclass(frozen=True)
class Rule:
    """One user or preset rule: checkpoint tensors whose name matches `match` (an fnmatch glob,
    case-sensitive) are compressed with `mode`, unless an earlier rule matched them."""
    match: str
    mode: str  # "linear", "affine", "palettize" or "none" (stays fp16)
    bits: int | None = None  # 4 or 8; None for mode none
    block_size: int | None = None  # linear: input elements per scale; None: per output channel
    group_size: int | None = None  # palettize: output channels per look-up table

    def to_json(self) -> dict[str, Any]:
        return {"match": self.match, "mode": self.mode, "bits": self.bits,
                "block_size": self.block_size, "group_size": self.group_size}

    def scheme(self) -> Scheme | None:
        if self.mode == "none":
            return None
        group = (self.group_size or DEFAULT_GROUP_SIZE) if self.mode == "palettize" else None
        return Scheme(self.mode, self.bits, self.block_size, group)


@dataclass(frozen=True)
class Scheme:
    """What one tensor gets."""
    mode: str  # "linear", "affine" or "palettize"
    bits: int  # 4 or 8
    block_size: int | None = None  # linear, affine: block along the input axis; None: whole row
    group_size: int | None = None  # palettize: output channels per LUT

    def __post_init__(self):
        if self.mode not in ("linear", "affine", "palettize"):
            raise CompressionError(f"scheme mode {self.mode!r} is not linear, affine or "
                                   "palettize")
        if self.bits not in BITS:
            raise CompressionError(f"scheme bits {self.bits!r} is not 4 or 8")
        if self.mode == "palettize" and not self.group_size:
            raise CompressionError("a palettize scheme needs a group_size")

    @property
    def blocked(self) -> bool:
        """Scales per block of inputs (linear and affine), not look-up tables per group."""
        return self.mode != "palettize"

    @property
    def sides(self) -> int:
        """fp16 blobs beside the data: the scale (linear), the scale and the offset (affine),
        the look-up table (palettize); each of `scale_shape`."""
        return 2 if self.mode == "affine" else 1

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """linear, affine: the scale's (and offset's) shape [O, I/block] ([O, 1] per channel);
        palettize: the look-up table's [O/group, 1, 2^bits, 1]."""
        rows, columns = _matrix_shape(shape)
        if self.blocked:
            block = columns if self.block_size is None else self.block_size
            _check_divides(block, columns, "block_size", "input", shape)
            return (rows, columns // block)
        _check_divides(self.group_size, rows, "group_size", "output", shape)
        return (rows // self.group_size, 1, 1 << self.bits, 1)

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes in the weight file: the packed data or indices plus the fp16 scales (and
        offsets) or LUT."""
        rows, columns = _matrix_shape(shape)
        return (-(-self.bits * rows * columns // 8)
                + 2 * self.sides * int(np.prod(self.scale_shape(shape))))

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "bits": self.bits, "block_size": self.block_size,
                "group_size": self.group_size}


_EMBEDDING_AND_HEAD = ("*embed_tokens.weight", "lm_head.weight", "*.lm_head.weight")


def preset_rules(preset: str) -> list[Rule]:
    """The rules of a preset (see the module docstring)."""
    if preset not in PRESETS:
        raise CompressionError(f"unknown compression preset {preset!r}: --compression takes one "
                               f"of {', '.join(PRESETS)} (or give rules with "
                               f"--compression-config FILE)")
    if preset == "none":
        return []
    if preset == "8bit":
        return [Rule("*", "linear", 8)]
    head = [Rule(glob, "linear", 8) for glob in _EMBEDDING_AND_HEAD]
    if preset == "4bit":
        return head + [Rule("*", "affine", 4, block_size=DEFAULT_BLOCK_SIZE)]
    return head + [Rule("*", "palettize", 4, group_size=DEFAULT_GROUP_SIZE)]


def read_rules(path: str | Path) -> list[Rule]:
    """The rules of a --compression-config JSON file: a list of rules or {"rules": [...]}."""
    where = f"--compression-config {str(path)!r}"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise CompressionError(f"{where}: cannot read the file ({error}); give the path of a "
                               f"readable JSON file of rules") from error
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        raise CompressionError(f"{where} is not valid JSON ({error}); write a list of rules "
                               f"such as [{{\"match\": \"*\", \"mode\": \"linear\", "
                               f"\"bits\": 8}}]") from error
    if isinstance(loaded, dict) and set(loaded) == {"rules"}:
        loaded = loaded["rules"]
    if not isinstance(loaded, list):
        raise CompressionError(f"{where}: expected a JSON list of rules or {{\"rules\": [...]}}, "
                               f"got {type(loaded).__name__}; wrap the rules in a list")
    return [parse_rule(item, index, where) for index, item in enumerate(loaded)]


def parse_rule(item: Any, index: int, where: str = "compression rules") -> Rule:
    """One rule from its JSON object; `index` and `where` name it in errors."""
    def fail(problem: str, fix: str) -> CompressionError:
        return CompressionError(f"{where}: rule {index} {problem}; {fix}")

    if not isinstance(item, dict):
        raise fail(f"is a {type(item).__name__}, not an object",
                   'write {"match": GLOB, "mode": "linear"|"affine"|"palettize"|"none", ...}')
    unknown = sorted(set(item) - set(_RULE_KEYS))
    if unknown:
        raise fail(f"has unknown key(s) {unknown}", f"use only {list(_RULE_KEYS)}")
    match = item.get("match")
    if not isinstance(match, str) or not match:
        raise fail(f"has match {match!r}", 'give "match" a glob over tensor names, e.g. '
                   '"*.mlp.*.weight"')
    index_glob = f"({match!r})"
    mode = item.get("mode")
    if mode not in MODES:
        raise fail(f"{index_glob} has mode {mode!r}", f"use one of {list(MODES)}")
    bits, block, group = item.get("bits"), item.get("block_size"), item.get("group_size")
    if mode == "none":
        given = [key for key in ("bits", "block_size", "group_size") if item.get(key) is not None]
        if given:
            raise fail(f"{index_glob} has mode none (fp16) but sets {given}",
                       "remove them or choose mode linear, affine or palettize")
        return Rule(match, mode)
    if not _is_int(bits) or bits not in BITS:
        raise fail(f"{index_glob} has bits {bits!r}", f'mode {mode} needs "bits": 4 or 8')
    if mode in ("linear", "affine"):
        if group is not None:
            raise fail(f"{index_glob} sets group_size, which only palettize uses",
                       f'remove it ({mode} takes "block_size")')
        if block is not None and (not _is_int(block) or block < 1):
            raise fail(f"{index_glob} has block_size {block!r}", "give a positive integer "
                       "(e.g. 32), or null for one scale per output channel")
        return Rule(match, mode, bits, block_size=block)
    if block is not None:
        raise fail(f"{index_glob} sets block_size, which only linear and affine use",
                   'remove it (palettize takes "group_size")')
    if group is None:
        group = DEFAULT_GROUP_SIZE
    if not _is_int(group) or group < 1:
        raise fail(f"{index_glob} has group_size {group!r}",
                   "give a positive integer number of output channels per look-up table, e.g. 32")
    return Rule(match, mode, bits, group_size=group)


def compressible(shape: tuple[int, ...]) -> bool:
    """Only 2-D tensors of at least MIN_ELEMENTS elements are ever compressed."""
    return len(shape) == 2 and shape[0] * shape[1] >= MIN_ELEMENTS


def first_matching_rule(rules: list[Rule], name: str) -> int | None:
    """Index of the rule that decides tensor `name` (the first whose glob matches), if any."""
    return next((i for i, rule in enumerate(rules) if fnmatch.fnmatchcase(name, rule.match)),
                None)


def plan_compression(rules: list[Rule], shapes: dict[str, tuple[int, ...]], *,
                     strict: bool) -> dict[str, Scheme | None]:
    """Checkpoint name -> its scheme (None: stays fp16), for every name of `shapes`.

    strict (user rules): every rule must decide at least one compressible tensor, and block and
    group sizes must divide the tensors they decide. Not strict (presets): a tensor whose
    dimension does not divide falls back to int8 per output channel."""
    eligible = [name for name, shape in shapes.items() if compressible(tuple(shape))]
    plan: dict[str, Scheme | None] = {name: None for name in shapes}
    matched = [False] * len(rules)
    decided = [False] * len(rules)
    for name in eligible:
        shape = tuple(shapes[name])
        for index, rule in enumerate(rules):
            if fnmatch.fnmatchcase(name, rule.match):
                matched[index] = True
        first = first_matching_rule(rules, name)
        if first is None:
            continue
        decided[first] = True
        plan[name] = _scheme_for(rules[first], first, name, shape, strict)
    if strict:
        for index, rule in enumerate(rules):
            if not matched[index]:
                close = difflib.get_close_matches(rule.match.replace("*", ""), eligible,
                                                  n=3, cutoff=0) or eligible[:3]
                raise CompressionError(
                    f"compression rule {index} ({rule.match!r}) matches no compressible tensor "
                    f"(2-D, at least {MIN_ELEMENTS} elements) of the exported checkpoints; fix "
                    f"its glob (tensors are named like {', '.join(close)}) or remove the rule")
            if not decided[index]:
                earlier = [i for i, r in enumerate(rules[:index])
                           if any(fnmatch.fnmatchcase(n, r.match) and
                                  fnmatch.fnmatchcase(n, rule.match) for n in eligible)]
                raise CompressionError(
                    f"compression rule {index} ({rule.match!r}) decides no tensor: every tensor "
                    f"it matches is taken by earlier rule(s) {earlier} (first match wins); move "
                    f"it before them or remove it")
    return plan


def _scheme_for(rule: Rule, index: int, name: str, shape: tuple[int, int],
                strict: bool) -> Scheme | None:
    scheme = rule.scheme()
    if scheme is None:
        return None
    rows, columns = shape
    if scheme.blocked and scheme.block_size is not None:
        size, dim, axis, key = scheme.block_size, columns, "input", "block_size"
    elif scheme.mode == "palettize":
        size, dim, axis, key = scheme.group_size, rows, "output", "group_size"
    else:
        return scheme
    if dim % size == 0:
        return scheme
    if not strict:
        return Scheme("linear", 8)
    raise CompressionError(
        f"compression rule {index} ({rule.match!r}): {key} {size} does not divide the {axis} "
        f"dimension {dim} of tensor {name!r} (shape {list(shape)}); use a {key} that divides "
        f"it, e.g. {_near_divisors(dim, size)}, or a narrower glob")


def _near_divisors(dim: int, wanted: int, count: int = 5) -> list[int]:
    divisors = [d for d in range(2, dim + 1) if dim % d == 0] or [1]
    return sorted(sorted(divisors, key=lambda d: (abs(d - wanted), d))[:count])


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise CompressionError(f"only 2-D weights are compressed, got shape {list(shape)}")
    return int(shape[0]), int(shape[1])


def _check_divides(size: int, dim: int, key: str, axis: str, shape: tuple[int, ...]) -> None:
    if not _is_int(size) or size < 1 or dim % size:
        raise CompressionError(f"{key} {size!r} does not divide the {axis} dimension {dim} of "
                               f"a weight of shape {list(shape)}; use one of "
                               f"{_near_divisors(dim, size if _is_int(size) else 32)}")


def _as_matrix(weight: np.ndarray, what: str) -> np.ndarray:
    weight = np.asarray(weight)
    if weight.ndim != 2 or not np.issubdtype(weight.dtype, np.floating):
        raise CompressionError(f"{what} takes a 2-D float weight, got {weight.dtype} "
                               f"{list(weight.shape)}")
    return weight


def _check_finite(values: np.ndarray, what: str) -> None:
    if not np.isfinite(values).all():
        raise _non_finite(what)


def _non_finite(what: str) -> CompressionError:
    return CompressionError(f"{what}: the weight holds inf or NaN, which cannot be compressed; "
                            f"fix the checkpoint or keep the tensor fp16")


# Linear quantization -----------------------------------------------------------------------

def quant_max(bits: int) -> int:
    """coremltools' linear_symmetric range is [-quant_max, quant_max]: 127 (int8), 7 (int4)."""
    return (1 << (bits - 1)) - 1


def quantize_linear(weight: np.ndarray, bits: int, block_size: int | None,
                    clip: str = "mse") -> tuple[np.ndarray, np.ndarray]:
    """Symmetric linear quantization of a float [O, I] weight, one fp16 scale per block of
    `block_size` input elements (None: per output channel): (data int8 [O, I] in
    [-quant_max, quant_max], scale float16 [O, I/block]); weight ~= data * scale.

    clip "absmax": scale = absmax / quant_max, as coremltools' linear_symmetric. "mse": each
    block's scale is absmax * r / quant_max for the clipping ratio r in [0.5, 1] whose
    reconstruction, with the fp16-rounded scale, has the least squared error among those the
    search tries (CLIP_COARSE, CLIP_REFINE; never worse than r = 1, ties keep the larger r).
    data = clip(round_half_even(weight / scale)). An all-zero block gets scale 1 and data 0.
    The search runs compiled (`compression_kernels`), on chunks of about _CHUNK_ELEMENTS
    elements: memory beyond the outputs stays small, and the GIL is released while it runs."""
    weight = _as_matrix(weight, "quantize_linear")
    if bits not in BITS:
        raise CompressionError(f"quantize_linear: bits {bits!r} is not 4 or 8")
    if clip not in ("mse", "absmax"):
        raise CompressionError(f"quantize_linear: clip {clip!r} is not 'mse' or 'absmax'")
    # numba: compiled when first imported
    from museflash.compression_kernels import block_absmax, quantize_blocks

    rows, columns = weight.shape
    block = columns if block_size is None else block_size
    _check_divides(block, columns, "block_size", "input", weight.shape)
    blocks = columns // block
    qmax = np.float32(quant_max(bits))
    data = np.empty((rows, columns), np.int8)
    scale = np.empty((rows, blocks), np.float16)
    step = max(1, _CHUNK_ELEMENTS // columns)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        x = np.ascontiguousarray(weight[start:stop], dtype=np.float32).reshape(-1)
        absmax = np.empty((stop - start) * blocks, np.float32)
        block_absmax(x, block, absmax)
        _check_finite(absmax, "quantize_linear")
        base = absmax / qmax
        chosen = np.empty_like(base)
        quantize_blocks(x, block, qmax, base, _fp16_scale(base), clip == "mse",
                        data[start:stop].reshape(-1), chosen)
        scale[start:stop] = chosen.reshape(stop - start, blocks)
    return data, scale


def _fp16_scale(values: np.ndarray) -> np.ndarray:
    """Rounded to fp16 (as float32), at least the smallest fp16; 1 for all-zero blocks."""
    scale = values.astype(np.float16).astype(np.float32)
    if np.isinf(scale).any():
        raise CompressionError("quantize_linear: a block's scale overflows fp16 (|weight| above "
                               "65504 * quant_max); such a weight cannot be quantized, keep it "
                               "fp16")
    scale[values == 0] = 1
    np.maximum(scale, _FP16_TINY, out=scale)
    return scale


def dequantize_linear(data: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 data * scale, each scale covering a block of (data dim / scale dim) elements
    along every axis (the iOS18 constexpr_blockwise_shift_scale without offset)."""
    data, scale = np.asarray(data), np.asarray(scale)
    if data.ndim != scale.ndim or any(s < 1 or d % s for d, s in zip(data.shape, scale.shape,
                                                                       strict=True)):
        raise CompressionError(f"dequantize_linear: scale shape {list(scale.shape)} does not "
                               f"tile data shape {list(data.shape)}")
    blocked, scales = [], []
    for d, s in zip(data.shape, scale.shape, strict=True):
        blocked += [s, d // s]
        scales += [s, 1]
    out = data.astype(np.float32).reshape(blocked) * scale.astype(np.float32).reshape(scales)
    return out.reshape(data.shape)


# Affine quantization -----------------------------------------------------------------------

def quantize_affine(weight: np.ndarray, bits: int,
                    block_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine quantization of a float [O, I] weight, one fp16 scale and one fp16 offset per
    block of `block_size` input elements (None: per output channel): (data uint8 [O, I] in
    [0, 2^bits - 1], scale float16 [O, I/block], offset float16 [O, I/block]); weight ~=
    (data - offset) * scale.

    Each block spans its minimum lo to its maximum hi: scale = (hi - lo) / (2^bits - 1) rounded
    to fp16 (at least max(|lo|, |hi|) / AFFINE_OFFSET_LIMIT, and fp16's smallest), offset =
    -lo / scale rounded to fp16, data = clip(rint(weight / scale + offset)). A block that is
    already such a grid, as every block of llama.cpp's Q4_1 (d * q + m, q in 0..15, 15 and 0
    both taken) is with bits 4 and blocks of 32, comes back exactly but for the rounding of
    -m / d to fp16 and of q + m / d to fp16 when the op rebuilds it (dequantize_affine): at most
    d / 128 at offsets below 16. Rows are independent, so a weight may be quantized a slice of
    rows at a time."""
    weight = _as_matrix(weight, "quantize_affine")
    if bits not in BITS:
        raise CompressionError(f"quantize_affine: bits {bits!r} is not 4 or 8")
    rows, columns = weight.shape
    block = columns if block_size is None else block_size
    _check_divides(block, columns, "block_size", "input", weight.shape)
    blocks = columns // block
    levels = np.float32((1 << bits) - 1)
    data = np.empty((rows, columns), np.uint8)
    scale = np.empty((rows, blocks), np.float16)
    offset = np.empty((rows, blocks), np.float16)
    step = max(1, _CHUNK_ELEMENTS // columns)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        x = np.asarray(weight[start:stop], dtype=np.float32).reshape(stop - start, blocks, block)
        low, high = x.min(axis=2), x.max(axis=2)
        _check_finite(low, "quantize_affine")
        _check_finite(high, "quantize_affine")
        floor = np.maximum(np.abs(low), np.abs(high)) / np.float32(AFFINE_OFFSET_LIMIT)
        wanted = np.maximum(np.maximum((high - low) / levels, floor), _FP16_TINY)
        s = wanted.astype(np.float16)
        if np.isinf(s).any():
            raise CompressionError("quantize_affine: a block's scale overflows fp16 (its range "
                                   "above 65504 * (2^bits - 1)); keep such a weight fp16")
        s32 = s.astype(np.float32)
        z = (-low / s32).astype(np.float16)
        levels_of = np.rint(x / s32[..., None] + z.astype(np.float32)[..., None])
        data[start:stop] = np.clip(levels_of, 0, levels).astype(np.uint8).reshape(stop - start,
                                                                                   columns)
        scale[start:stop], offset[start:stop] = s, z
    return data, scale, offset


def dequantize_affine(data: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """float32 (data - offset) * scale, each scale and offset covering a block of (data dim /
    scale dim) elements along every axis (the iOS18 constexpr_blockwise_shift_scale with an
    offset). As coremltools' own decompression of the op computes it: data in the scale's
    dtype, so with fp16 scales and offsets data - offset is rounded to fp16 before the product
    (an integer minus an offset below 1 can need more than fp16's 11 bits)."""
    data, scale, offset = np.asarray(data), np.asarray(scale), np.asarray(offset)
    if offset.shape != scale.shape or offset.ndim != data.ndim or any(
            o < 1 or d % o for d, o in zip(data.shape, offset.shape, strict=True)):
        raise CompressionError(f"dequantize_affine: offset shape {list(offset.shape)} is not "
                               f"the scale's {list(scale.shape)} or does not tile data shape "
                               f"{list(data.shape)}")
    whole = offset.astype(np.float32)
    for axis, (d, o) in enumerate(zip(data.shape, offset.shape, strict=True)):
        whole = np.repeat(whole, d // o, axis=axis)
    shifted = data.astype(np.float32) - whole  # exact: integers minus fp16 values
    if np.result_type(scale.dtype, offset.dtype) == np.float16:
        shifted = shifted.astype(np.float16).astype(np.float32)
    return dequantize_linear(shifted, scale)


# Palettization -----------------------------------------------------------------------------

def palettize(weight: np.ndarray, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """k-means palettization of a float [O, I] weight: (indices uint8 [O, I] below 2^bits,
    lut float16 [O/group_size, 1, 2^bits, 1]); weight[o, i] ~= lut[o // group_size, 0,
    indices[o, i], 0].

    Each group of `group_size` consecutive output rows gets its own table, the centroids of a
    1-D k-means of the group's values (see _kmeans_1d) rounded to fp16. Each value takes the
    index of the nearest entry of that fp16 table (ties: the lower entry). Deterministic.

    Values that are all fp16 or bfloat16 numbers (an fp16 weight, or a float32 one read from
    an fp16 or bf16 checkpoint) are counted in a histogram of their 16-bit codes instead of
    being sorted, and several groups are fitted at once; the result is the same."""
    weight = _as_matrix(weight, "palettize")
    if bits not in BITS:
        raise CompressionError(f"palettize: bits {bits!r} is not 4 or 8")
    rows, columns = weight.shape
    _check_divides(group_size, rows, "group_size", "output", weight.shape)
    entries = 1 << bits
    indices = np.empty((rows, columns), np.uint8)
    lut = np.empty((rows // group_size, 1, entries, 1), np.float16)
    per_batch = max(1, _PALETTIZE_BATCH_VALUES // max(1 << 16, group_size * columns))
    for first in range(0, rows // group_size, per_batch):
        last = min(rows // group_size, first + per_batch)
        block = slice(first * group_size, last * group_size)
        values = weight[block].reshape(last - first, group_size * columns)
        coded = _sixteen_bit_codes(values)
        if coded is not None:
            found, lut[first:last, 0, :, 0] = _palettize_codes(*coded, entries)
            indices[block] = found.reshape(-1, columns)
            continue
        for group in range(first, last):
            own = values[group - first].astype(np.float32)
            xs = np.sort(own)
            _check_finite(xs[[0, -1]], "palettize")
            table = _lut(_kmeans_1d(xs, None, entries))
            lut[group, 0, :, 0] = table[0]
            rows_of = slice(group * group_size, (group + 1) * group_size)
            indices[rows_of] = _nearest(own, _edges(table)[0]).reshape(group_size, columns)
    return indices, lut


def _lut(centroids: np.ndarray) -> np.ndarray:
    return np.sort(centroids.astype(np.float16), axis=1)


def _edges(lut: np.ndarray) -> np.ndarray:
    """The midpoints between consecutive fp16 entries (exact in float32)."""
    wide = lut.astype(np.float32)
    return (wide[:, :-1] + wide[:, 1:]) / 2


def _palettize_codes(codes: np.ndarray, table: _CodeTable,
                     entries: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices [G * group rows...] (flattened like `codes`, [G, n]) and tables [G, entries] of
    G groups given by 16-bit codes."""
    groups = codes.shape[0]
    finite = table.finite
    keyed = codes.astype(np.int64) + (np.arange(groups, dtype=np.int64)[:, None] << 16)
    counts = np.bincount(keyed.reshape(-1), minlength=groups << 16).reshape(groups, 1 << 16)
    counts = counts[:, table.order]
    if counts[:, finite:].any():
        raise _non_finite("palettize")
    # The values present in any of the groups, ascending.
    present = np.flatnonzero(counts[:, :finite].any(axis=0))
    xs = table.sorted_values[present]
    lut = _lut(_kmeans_1d(xs, counts[:, present], entries))
    # The index of each code from where the edges fall among the sorted codes: a code's index
    # is how many edges lie strictly below its value.
    cuts = np.searchsorted(xs, _edges(lut), side="right")
    marks = np.zeros((groups, xs.size + 1), np.uint8)
    np.add.at(marks, (np.arange(groups)[:, None], cuts), 1)
    lookup = np.zeros((groups, 1 << 16), np.uint8)
    lookup[:, table.order[present]] = np.cumsum(marks[:, :-1], axis=1, dtype=np.uint8)
    return lookup.reshape(-1)[keyed], lut


def _nearest(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Index of the table entry nearest each value: how many edges lie strictly below it."""
    index = np.zeros(values.shape, np.uint8)
    for edge in edges:
        index += values > edge
    return index


@dataclass(frozen=True)
class _CodeTable:
    """The 65536 values of a 16-bit float format in ascending order (inf and NaN last)."""
    order: np.ndarray  # code of each position
    sorted_values: np.ndarray  # float32 value of each position
    finite: int  # positions before the first non-finite code


_CODE_TABLES: dict[str, _CodeTable] = {}


def _code_table(kind: str) -> _CodeTable:
    if kind not in _CODE_TABLES:
        codes = np.arange(1 << 16, dtype=np.uint32)
        values = (codes.astype(np.uint16).view(np.float16).astype(np.float32) if kind == "f16"
                  else (codes << 16).view(np.float32))
        finite = np.isfinite(values)
        order = np.concatenate([np.flatnonzero(finite)[np.argsort(values[finite],
                                                                   kind="stable")],
                                np.flatnonzero(~finite)])
        _CODE_TABLES[kind] = _CodeTable(order, values[order], int(finite.sum()))
    return _CODE_TABLES[kind]


def _sixteen_bit_codes(values: np.ndarray) -> tuple[np.ndarray, _CodeTable] | None:
    """The values' 16-bit codes when they are all fp16 or bfloat16 numbers (then a histogram
    of codes replaces sorting), else None."""
    if values.dtype == np.float16:
        return values.view(np.uint16), _code_table("f16")
    if values.dtype != np.float32:
        return None
    words = np.ascontiguousarray(values).view(np.uint32)
    if not (words & 0xFFFF).any():
        return (words >> 16).astype(np.uint16), _code_table("bf16")
    half = values.astype(np.float16)
    if np.array_equal(half.astype(np.float32), values):
        return half.view(np.uint16), _code_table("f16")
    return None


def _kmeans_1d(xs: np.ndarray, counts: np.ndarray | None, k: int) -> np.ndarray:
    """Centroids [G, k] (float64, ascending) of weighted 1-D k-means of the sorted values `xs`
    taken counts[g] times each in group g (counts [G, n]; None: one group, each value once).

    In 1-D each cluster of the nearest-centroid assignment is a run of the sorted values cut at
    the midpoints between centroids, so a Lloyd iteration is k binary searches and differences
    of cumulative counts and sums (no n x k distances); it stops when no group's runs change
    or after KMEANS_ITERATIONS (a converged group does not change: the result does not depend
    on which groups are fitted together). Start: the k quantiles of the density^(1/3) (the
    asymptotically optimal density of quantization levels, Panter & Dite): from the plain
    quantiles of the values Lloyd needs hundreds of iterations to spread levels into the tails,
    and 256 levels end several times worse; from this start 50 iterations come within 1% of
    the best of long runs from either start (normal, Laplace, student-t 2 and 3 data). If the
    start has coinciding centroids (values with large multiplicities), k evenly spaced distinct
    values instead; with at most k distinct values, the centroids are those values (the last
    repeated) and stay so. An empty cluster keeps its centroid."""
    n = xs.size
    if counts is None:
        cumulative_count = np.arange(n + 1, dtype=np.float64)[None]
        cumulative_sum = np.concatenate([[0.0], np.cumsum(xs, dtype=np.float64)])[None]
    else:
        cumulative_count = np.zeros((counts.shape[0], n + 1))
        np.cumsum(counts, axis=1, out=cumulative_count[:, 1:])
        cumulative_sum = np.zeros((counts.shape[0], n + 1))
        np.cumsum(counts * xs.astype(np.float64), axis=1, out=cumulative_sum[:, 1:])
    groups = cumulative_count.shape[0]
    starts = [_kmeans_start(xs, cumulative_count[g], None if counts is None else counts[g], k)
              for g in range(groups)]
    centroids = np.stack([centroid for centroid, _ in starts])
    fixed = np.array([final for _, final in starts])[:, None]
    cuts = np.empty((groups, k + 1), np.intp)
    cuts[:, 0], cuts[:, -1] = 0, n
    rows = np.arange(groups)[:, None]
    previous = None
    for _ in range(KMEANS_ITERATIONS):
        inner = np.searchsorted(xs, ((centroids[:, :-1] + centroids[:, 1:]) / 2).astype(xs.dtype),
                                side="right")
        if previous is not None and np.array_equal(inner, previous):
            break
        previous = cuts[:, 1:-1] = inner
        size = np.diff(cumulative_count[rows, cuts], axis=1)
        total = np.diff(cumulative_sum[rows, cuts], axis=1)
        means = np.sort(np.where(size > 0, total / np.maximum(size, 1), centroids), axis=1)
        centroids = np.where(fixed, centroids, means)
    return centroids


def _kmeans_start(xs: np.ndarray, cumulative_count: np.ndarray, counts: np.ndarray | None,
                  k: int) -> tuple[np.ndarray, bool]:
    """One group's starting centroids, and whether they are final (at most k distinct values)."""
    present = xs if counts is None else xs[counts > 0]
    if np.count_nonzero(present[1:] != present[:-1]) < k:
        distinct = np.unique(present).astype(np.float64)
        return np.concatenate([distinct, np.repeat(distinct[-1:], k - distinct.size)]), True
    centroids = _density_cube_root_quantiles(xs, cumulative_count, k)
    if np.unique(centroids).size == k:
        return centroids, False
    distinct = np.unique(present).astype(np.float64)
    return distinct[np.round(np.linspace(0, distinct.size - 1, k)).astype(int)], False


def _density_cube_root_quantiles(xs: np.ndarray, cumulative_count: np.ndarray,
                                 k: int) -> np.ndarray:
    """k levels at the (j + 1/2)/k quantiles of density^(1/3), for the sorted values `xs`
    whose density is taken constant between KMEANS_INIT_BINS + 1 count-quantiles spaced like
    Chebyshev nodes (fine at both ends, so that sparse tails are not smeared over wide bins)."""
    total = cumulative_count[-1]
    fractions = (1 - np.cos(np.pi * np.arange(KMEANS_INIT_BINS + 1) / KMEANS_INIT_BINS)) / 2
    # The value holding the count-quantile (at least the first value present).
    positions = np.searchsorted(cumulative_count[1:], np.maximum(fractions * total, 1),
                                side="left").clip(0, xs.size - 1)
    edges = xs[positions]
    # The count of values up to each edge (the same whether xs repeats values or weighs them).
    mass = np.diff(cumulative_count[np.searchsorted(xs, edges, side="right")])
    edges = edges.astype(np.float64)
    width = np.diff(edges)
    level_mass = np.cbrt(mass) * np.cbrt(width) ** 2  # (mass / width)^(1/3) * width
    cdf = np.concatenate([[0.0], np.cumsum(level_mass)])
    if cdf[-1] <= 0:
        return np.full(k, edges[0])
    return np.interp((np.arange(k) + 0.5) / k, cdf / cdf[-1], edges)


def depalettize(indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """float32 weight from indices and scalar look-up tables (iOS18 constexpr_lut_to_dense with
    vector size 1): lut has shape [groups along each axis of indices..., 2^bits, 1] and each
    index is read in the table of its group."""
    indices, lut = np.asarray(indices), np.asarray(lut)
    if (lut.ndim != indices.ndim + 2 or lut.shape[-1] != 1 or
            any(g < 1 or d % g for d, g in zip(indices.shape, lut.shape[:-2], strict=True))):
        raise CompressionError(f"depalettize: look-up table shape {list(lut.shape)} does not "
                               f"fit indices shape {list(indices.shape)}")
    if indices.size and int(indices.max()) >= lut.shape[-2]:
        raise CompressionError(f"depalettize: index {int(indices.max())} is past the "
                               f"{lut.shape[-2]}-entry look-up table")
    groups = np.ix_(*[np.arange(d) // (d // g) for d, g in zip(indices.shape, lut.shape[:-2],
                                                                 strict=True)])
    return lut[(*groups, indices.astype(np.intp), 0)].astype(np.float32)


def compress(weight: np.ndarray, scheme: Scheme, clip: str = "mse") -> tuple[np.ndarray, ...]:
    """The blobs the scheme's constexpr op reads: (data, scale) of a linear scheme
    (quantize_linear), (data, scale, offset) of an affine one (quantize_affine), (indices, lut)
    of a palettize one (palettize). Rows are independent (linear, affine) or independent per
    group of `group_size` rows (palettize), so a weight may be compressed a slice of rows at a
    time. `clip` applies to linear schemes."""
    if scheme.mode == "linear":
        return quantize_linear(weight, scheme.bits, scheme.block_size, clip=clip)
    if scheme.mode == "affine":
        return quantize_affine(weight, scheme.bits, scheme.block_size)
    return palettize(weight, scheme.bits, scheme.group_size)


def expand(blobs: tuple[np.ndarray, ...], scheme: Scheme) -> np.ndarray:
    """The float32 weight `compress`'s blobs stand for."""
    if scheme.mode == "linear":
        return dequantize_linear(*blobs)
    if scheme.mode == "affine":
        return dequantize_affine(*blobs)
    return depalettize(*blobs)
