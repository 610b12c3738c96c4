"""The mse clipping search of compression.quantize_linear written as numpy expressions over
whole arrays: the reference the compiled kernel (museflash.compression_kernels) must match bit
for bit. Slow (about fifty passes over the weight), clear, and independent of the kernel's loop
structure."""

import numpy as np

from museflash.compression import CLIP_COARSE, CLIP_REFINE, quant_max

FP16_MIN_NORMAL = np.float32(2.0**-14)
FP16_MAX = np.float32(65504)
FP16_TINY = np.float32(2.0**-24)


def fp16_scale(values):
    scale = values.astype(np.float16).astype(np.float32)
    scale[values == 0] = 1
    return np.maximum(scale, FP16_TINY)


def fp16_candidate(values):
    split = values * np.float32(8193)
    rounded = split - (split - values)
    return np.clip(rounded, FP16_MIN_NORMAL, FP16_MAX)


def block_error(a, scale, qmax):
    """a = |x| of blocks laid along axis 0 ([block, blocks]); scale [1, blocks]."""
    work = a * (np.float32(1) / scale)
    rounded = np.rint(np.minimum(work, np.float32(qmax))) - work
    return np.einsum("ij,ij->j", rounded, rounded).reshape(scale.shape) * (scale * scale)


def reference_quantize_linear(weight, bits, block_size, clip="mse"):
    rows, columns = weight.shape
    block = columns if block_size is None else block_size
    qmax = quant_max(bits)
    x = np.ascontiguousarray(weight.astype(np.float32).reshape(-1, block).T)
    a = np.abs(x)
    base = a.max(axis=0, keepdims=True) / np.float32(qmax)
    plain = fp16_scale(base)
    scale = plain
    if clip == "mse":
        best_error = block_error(a, plain, qmax)
        best_ratio = np.ones_like(base)

        def consider(ratio):
            error = block_error(a, fp16_candidate(base * ratio), qmax)
            np.copyto(best_ratio, ratio, where=error < best_error)
            np.minimum(best_error, error, out=best_error)

        for ratio in CLIP_COARSE:
            consider(np.float32(ratio))
        for step in CLIP_REFINE:
            centre = best_ratio.copy()
            for ratio in (centre - np.float32(step), centre + np.float32(step)):
                consider(np.clip(ratio, np.float32(0.5), np.float32(1)))
        scale = np.where(best_ratio == 1, plain, fp16_candidate(base * best_ratio))
    data = np.clip(np.rint(x / scale), -qmax, qmax).astype(np.int8)
    return data.T.reshape(rows, columns), scale.T.reshape(rows, -1).astype(np.float16)
