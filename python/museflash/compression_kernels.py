"""The hot loops of `compression.quantize_linear`, compiled with numba.

The error-minimising clipping search evaluates ten candidate scales per block. As numpy
expressions that is some fifty passes over each weight (about 110 MB/s of fp16 weights on one
core); fused into loops that keep a group of blocks in cache it is about five times faster, and
the compiled functions release the GIL, so a thread can quantize while the export converts.

Layout: the blocks of a group are transposed into a scratch array [block, group] so the inner
loop runs across blocks (one block per SIMD lane) and each block's error is summed in element
order, the order numpy's reduction over the same layout uses; results are bit-identical to the
numpy formulation (tests/python/reference_quantize.py keeps it as the reference).

All arithmetic is float32. Compiled for their one signature when this module is imported
(about 2 s per process; Python's import lock makes threads wait for it rather than compile
twice), not cached on disk: nothing is written beside the sources.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# The search (see compression.CLIP_COARSE / CLIP_REFINE, which these mirror).
_COARSE = np.array([0.875, 0.75, 0.625], np.float32)
_REFINE = np.array([1 / 16, 1 / 32, 1 / 64], np.float32)
_VELTKAMP = np.float32(8193)  # 2^(24 - 11) + 1: splits a float32 at fp16's 11 significant bits
_MIN_NORMAL = np.float32(2.0**-14)
_FP16_MAX = np.float32(65504)
_HALF = np.float32(0.5)
_ONE = np.float32(1)
_MAGNITUDE = np.uint32(0x7FFFFFFF)  # all bits of a float32 but its sign
# float32 elements of a group's transposed blocks (64 KB): the blocks searched together are
# enough to fill the SIMD lanes (at least 8) and few enough to stay in cache.
_SCRATCH_ELEMENTS = 16384


@njit("void(float32[::1], int64, float32[::1])", nogil=True, boundscheck=False)
def block_absmax(x, block, out):
    """out[b] = max |x[b * block:(b + 1) * block]|, or inf or NaN when the block holds one.
    x: 1-D float32.

    Computed on the bit patterns: with the sign bit cleared, the order of float32 bit patterns
    as integers is the order of the values, and inf and NaN patterns lie above every finite
    one. An integer maximum is exact and vectorizes; a float one with NaN checks does not."""
    bits = x.view(np.uint32)
    peaks = out.view(np.uint32)
    for b in range(out.shape[0]):
        peak = np.uint32(0)
        for i in range(b * block, b * block + block):
            peak = max(peak, bits[i] & _MAGNITUDE)
        peaks[b] = peak


@njit(nogil=True, boundscheck=False, inline="always")
def _candidates(base, ratio, count, out):
    """fp16-representable scales near base * ratio: rounded to 11 significant bits and kept in
    fp16's normal range (compression._fp16_candidate's arithmetic)."""
    for j in range(count):
        value = base[j] * ratio[j]
        split = value * _VELTKAMP
        rounded = split - (split - value)
        out[j] = min(max(rounded, _MIN_NORMAL), _FP16_MAX)


@njit(nogil=True, boundscheck=False, inline="always")
def _errors(a, block, stride, count, scales, inverse, qmax, out):
    """Each block's squared error sum((min(rint(a / s), qmax) * s - a)^2) for two candidate
    scales s at once (scales[0], scales[1]; one pass over the blocks for both), a = |x|
    transposed: a[i * stride + j] is element i of block j."""
    for j in range(count):
        inverse[0, j] = _ONE / scales[0, j]
        inverse[1, j] = _ONE / scales[1, j]
        out[0, j] = 0
        out[1, j] = 0
    for i in range(block):
        row = a[i * stride:i * stride + count]
        for j in range(count):
            value = row[j]
            first = value * inverse[0, j]
            second = value * inverse[1, j]
            difference = np.rint(min(first, qmax)) - first
            out[0, j] += difference * difference
            difference = np.rint(min(second, qmax)) - second
            out[1, j] += difference * difference
    for j in range(count):
        out[0, j] *= scales[0, j] * scales[0, j]
        out[1, j] *= scales[1, j] * scales[1, j]


@njit(nogil=True, boundscheck=False, inline="always")
def _keep_better(error, ratio, count, best_error, best_ratio):
    for j in range(count):
        if error[j] < best_error[j]:
            best_ratio[j] = ratio[j]
            best_error[j] = error[j]


@njit(nogil=True, boundscheck=False, inline="always")
def _evaluate(a, block, stride, count, base, ratios, candidates, inverse, qmax, errors,
              best_error, best_ratio):
    """The errors of the two ratios' candidates; each kept if better, the first first."""
    _candidates(base, ratios[0], count, candidates[0])
    _candidates(base, ratios[1], count, candidates[1])
    _errors(a, block, stride, count, candidates, inverse, qmax, errors)
    _keep_better(errors[0], ratios[0], count, best_error, best_ratio)
    _keep_better(errors[1], ratios[1], count, best_error, best_ratio)


@njit(nogil=True, boundscheck=False, inline="always")
def _quantize(x, scale, qmax, out):
    """out = clip(rint(x / scale), -qmax, qmax) as int8; x finite. Written with selects and a
    counted loop over slices so that it vectorizes (about five times faster than Python's
    min/max over indices into the whole arrays)."""
    for i in range(x.shape[0]):
        level = np.rint(x[i] / scale)
        level = level if level > -qmax else -qmax
        level = level if level < qmax else qmax
        out[i] = np.int8(np.int32(level))


@njit("void(float32[::1], int64, float32, float32[::1], float32[::1], boolean, int8[::1], "
      "float32[::1])", nogil=True, boundscheck=False)
def quantize_blocks(x, block, qmax, base, plain, search, data, scale):
    """Quantizes x (1-D float32, blocks of `block` consecutive elements) into data (int8, same
    size) and scale (float32, one per block; fp16-representable).

    base[b] = absmax / qmax, plain[b] = its fp16 scale (the r = 1 candidate). Without `search`
    each block takes `plain`; with it, the candidate of least squared error among r = 1, the
    coarse ratios, then the best so far +- each refining step (ties keep the earlier)."""
    blocks = base.shape[0]
    stride = max(8, min(256, _SCRATCH_ELEMENTS // block))
    a = np.empty(block * stride, np.float32)
    best_error = np.empty(stride, np.float32)
    best_ratio = np.empty(stride, np.float32)
    ratios = np.empty((2, stride), np.float32)
    candidates = np.empty((2, stride), np.float32)
    errors = np.empty((2, stride), np.float32)
    inverse = np.empty((2, stride), np.float32)
    for first in range(0, blocks, stride):
        count = min(stride, blocks - first)
        group_base = base[first:first + count]
        group_plain = plain[first:first + count]
        for j in range(count):
            best_ratio[j] = _ONE
        if search:
            for j in range(count):
                start = (first + j) * block
                for i in range(block):
                    a[i * stride + j] = abs(x[start + i])
            # Candidates two at a time, kept in the order of the search: r = 1 (evaluated
            # clipped as well: with a normal fp16 scale nothing exceeds qmax + 1/2, where
            # clipping changes no error) with the first coarse ratio, then the other two.
            for j in range(count):
                candidates[0, j] = group_plain[j]
                ratios[1, j] = _COARSE[0]
            _candidates(group_base, ratios[1], count, candidates[1])
            _errors(a, block, stride, count, candidates, inverse, qmax, errors)
            for j in range(count):
                best_error[j] = errors[0, j]
            _keep_better(errors[1], ratios[1], count, best_error, best_ratio)
            for j in range(count):
                ratios[0, j] = _COARSE[1]
                ratios[1, j] = _COARSE[2]
            _evaluate(a, block, stride, count, group_base, ratios, candidates, inverse, qmax,
                      errors, best_error, best_ratio)
            for k in range(_REFINE.shape[0]):
                step = _REFINE[k]
                for j in range(count):
                    ratios[0, j] = min(max(best_ratio[j] - step, _HALF), _ONE)
                    ratios[1, j] = min(max(best_ratio[j] + step, _HALF), _ONE)
                _evaluate(a, block, stride, count, group_base, ratios, candidates, inverse,
                          qmax, errors, best_error, best_ratio)
            _candidates(group_base, best_ratio, count, candidates[0])
        for j in range(count):
            chosen = group_plain[j] if best_ratio[j] == _ONE else candidates[0, j]
            scale[first + j] = chosen
            start = (first + j) * block
            _quantize(x[start:start + block], chosen, qmax, data[start:start + block])
