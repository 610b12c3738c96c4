"""museflash.compression: the presets and rules, and the quantization and palettization maths
(checked against coremltools' own linear quantizer and look-up-table layout)."""

import json

import numpy as np
import pytest
from reference_quantize import reference_quantize_linear

from museflash import compression
from museflash.compression import (
    MIN_ELEMENTS,
    PRESETS,
    CompressionError,
    Rule,
    Scheme,
    depalettize,
    dequantize_affine,
    dequantize_linear,
    palettize,
    plan_compression,
    preset_rules,
    quantize_affine,
    quantize_linear,
    read_rules,
)


def normal(shape, seed=0, dtype=np.float32, scale=0.02):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def student_t(shape, seed=0, df=3):
    return (np.random.default_rng(seed).standard_t(df, shape) * 0.02).astype(np.float32)


def expand(scale, shape):
    """Each scale repeated over its block: [O, B] -> [O, I]."""
    return np.repeat(scale.astype(np.float64), shape[1] // scale.shape[1], axis=1)


def block_errors(weight, data, scale, block):
    """float64 squared reconstruction error of each block, [O, I / block]."""
    diff = data.astype(np.float64) * expand(scale, weight.shape) - weight.astype(np.float64)
    return (diff**2).reshape(weight.shape[0], -1, block).sum(axis=2)


def one_line_error(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# coremltools' reference ------------------------------------------------------------------

@pytest.fixture(scope="module")
def coreml_reference():
    """A tiny fp16 Linear(128 -> 256) converted for iOS18 and compressed by coremltools:
    {name: (fp16 weight, compressed op)}."""
    ct = pytest.importorskip("coremltools")
    cto = pytest.importorskip("coremltools.optimize.coreml")
    torch = pytest.importorskip("torch")
    weight = normal((256, 128), seed=7, dtype=np.float16, scale=0.05)
    linear = torch.nn.Linear(128, 256, bias=False).half().eval()
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weight))
    example = (torch.zeros(1, 128, dtype=torch.float16),)
    exported = torch.export.export(linear, example).run_decompositions({})
    model = ct.convert(exported, inputs=[ct.TensorType(name="x", shape=(1, 128),
                                                       dtype=np.float16)],
                       minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT16, skip_model_load=True)
    configs = {
        "int4_block32": cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=32,
            weight_threshold=0),
        "int8_channel": cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel",
            weight_threshold=0),
        "lut4_group32": cto.OpPalettizerConfig(
            mode="uniform", nbits=4, granularity="per_grouped_channel", group_size=32,
            weight_threshold=0),
    }
    found = {}
    for name, config in configs.items():
        optimize = (cto.palettize_weights if name.startswith("lut")
                    else cto.linear_quantize_weights)
        compressed = optimize(model, cto.OptimizationConfig(global_config=config))
        ops = [op for op in compressed._mil_program.functions["main"].operations
               if op.op_type in ("constexpr_blockwise_shift_scale", "constexpr_lut_to_dense")]
        assert len(ops) == 1
        found[name] = (weight, ops[0])
    return found


@pytest.mark.parametrize("name, bits, block", [("int4_block32", 4, 32),
                                                ("int8_channel", 8, None)])
def test_absmax_quantization_is_coremltools_linear_symmetric(coreml_reference, name, bits,
                                                             block):
    weight, op = coreml_reference[name]
    their_data, their_scale = np.asarray(op.data.val), np.asarray(op.scale.val)
    assert op.offset is None or op.offset.val is None
    qmax = 2 ** (bits - 1) - 1
    # The symmetric range [-qmax, qmax] (never -qmax - 1), reached at each block's maximum.
    assert their_data.min() == -qmax and their_data.max() == qmax
    data, scale = quantize_linear(weight, bits, block, clip="absmax")
    assert data.dtype == np.int8 and scale.dtype == np.float16
    assert data.shape == their_data.shape and scale.shape == their_scale.shape
    np.testing.assert_array_equal(scale, their_scale)
    # coremltools divides in fp16, so its quotient is rounded to fp16 before rint; that
    # emulation reproduces it exactly...
    emulated = np.clip(np.rint(weight / expand(scale, weight.shape).astype(np.float16)),
                       -qmax, qmax)
    np.testing.assert_array_equal(emulated, their_data)
    # ...and we divide in float32: the elements that differ are near-ties that fp16 rounding
    # pushed across a half, where ours is the nearer level.
    differ = data != their_data
    assert differ.mean() < 0.02, differ.sum()
    assert (np.abs(data.astype(int) - their_data)[differ] == 1).all()
    exact = weight.astype(np.float64)
    step = expand(scale, weight.shape)
    ours = np.abs(data * step - exact)
    theirs = np.abs(their_data * step - exact)
    assert (ours[differ] <= theirs[differ]).all()
    assert (ours <= step / 2 * (1 + 1e-6)).all()
    # Our (exact, float32) dequantization rounded to fp16 is what the op materializes.
    materialized = op.materialized_val_inference()
    assert materialized.dtype == np.float16
    np.testing.assert_array_equal(dequantize_linear(their_data, their_scale).astype(np.float16),
                                  materialized)


def test_palettization_layout_is_coremltools_grouped_channel_lut(coreml_reference):
    weight, op = coreml_reference["lut4_group32"]
    their_indices, their_lut = np.asarray(op.indices.val), np.asarray(op.lut.val)
    scheme = Scheme("palettize", 4, group_size=32)
    assert their_lut.shape == scheme.scale_shape(weight.shape) == (8, 1, 16, 1)
    np.testing.assert_array_equal(depalettize(their_indices, their_lut),
                                  op.materialized_val_inference().astype(np.float32))
    indices, lut = palettize(weight, 4, 32)
    assert (indices.dtype, indices.shape) == (their_indices.dtype, their_indices.shape)
    assert (lut.dtype, lut.shape) == (their_lut.dtype, their_lut.shape)


# Linear quantization ---------------------------------------------------------------------

@pytest.mark.parametrize("bits, block", [(4, 32), (4, 128), (4, 256), (8, None), (8, 64)])
@pytest.mark.parametrize("clip", ["absmax", "mse"])
def test_quantize_linear_shapes_range_and_error_bound(bits, block, clip):
    weight = normal((48, 512), seed=bits)
    data, scale = quantize_linear(weight, bits, block, clip=clip)
    blocks = 1 if block is None else 512 // block
    assert data.shape == (48, 512) and data.dtype == np.int8
    assert scale.shape == (48, blocks) and scale.dtype == np.float16
    qmax = 2 ** (bits - 1) - 1
    assert np.abs(data).max() == qmax if clip == "absmax" else np.abs(data).max() <= qmax
    step = expand(scale, weight.shape)
    error = np.abs(dequantize_linear(data, scale) - weight)
    # Rounding costs at most half a step; clipping at most what lies beyond qmax steps.
    bound = np.maximum(step / 2, np.abs(weight) - qmax * step)
    assert (error <= bound * (1 + 1e-5) + 1e-12).all()
    relative = np.sqrt((error**2).mean() / (weight.astype(np.float64) ** 2).mean())
    assert relative < {4: 0.13, 8: 0.01}[bits]
    if clip == "absmax":
        absmax = np.abs(weight).reshape(48, blocks, -1).max(axis=2)
        np.testing.assert_array_equal(scale, (absmax / qmax).astype(np.float16))


@pytest.mark.parametrize("bits, block", [(4, 32), (8, None), (4, 256)])
@pytest.mark.parametrize("make", [normal, student_t])
def test_mse_clipping_is_never_worse_than_absmax(bits, block, make):
    weight = make((64, 1024), seed=3)
    size = block or 1024
    plain = block_errors(weight, *quantize_linear(weight, bits, block, clip="absmax"), size)
    clipped_data, clipped_scale = quantize_linear(weight, bits, block, clip="mse")
    clipped = block_errors(weight, clipped_data, clipped_scale, size)
    assert (clipped <= plain * (1 + 1e-5)).all()
    # The search only shrinks scales, by at most half.
    _, absmax_scale = quantize_linear(weight, bits, block, clip="absmax")
    ratio = clipped_scale.astype(np.float64) / absmax_scale.astype(np.float64)
    assert (ratio <= 1).all() and (ratio >= 0.5 * (1 - 2**-10)).all()
    # int8 rows gain little (its rounding noise is small next to what clipping costs).
    assert clipped.sum() < (0.99 if bits == 4 else 0.999) * plain.sum()


def test_mse_clipping_helps_heavy_tailed_int4_blocks_substantially():
    weight = student_t((128, 1024), seed=5)
    plain = block_errors(weight, *quantize_linear(weight, 4, 32, clip="absmax"), 32)
    clipped = block_errors(weight, *quantize_linear(weight, 4, 32), 32)
    assert (clipped < plain * (1 - 1e-6)).mean() > 0.5
    assert clipped.sum() < 0.95 * plain.sum()


def test_mse_search_finds_about_the_best_ratio_of_a_fine_grid():
    """Against trying every clipping ratio k/64 in [0.5, 1] with fp16-rounded scales."""
    weight = student_t((32, 2048), seed=11)
    qmax = 7
    blocks = weight.reshape(32, -1, 32).astype(np.float64)
    absmax = np.abs(blocks).max(axis=2, keepdims=True)
    best = None
    for ratio in np.arange(32, 65) / 64:
        scale = (absmax * ratio / qmax).astype(np.float16).astype(np.float64)
        error = ((np.clip(np.rint(blocks / scale), -qmax, qmax) * scale - blocks) ** 2).sum(2)
        best = error if best is None else np.minimum(best, error)
    ours = block_errors(weight, *quantize_linear(weight, 4, 32), 32)
    assert ours.sum() <= best.sum() * 1.003
    assert (ours <= best * 1.0001 + 1e-18).mean() > 0.9


@pytest.mark.parametrize("bits, block", [(4, 32), (4, 128), (8, None), (8, 64)])
@pytest.mark.parametrize("make", [normal, student_t])
def test_compiled_search_matches_the_numpy_reference_bit_for_bit(bits, block, make):
    """The kernel's loops against the same search as whole-array numpy expressions; 97 rows
    leave a partial group of blocks, and the first rows are the edge cases: all zero, scales in
    fp16's subnormal range, a constant row, one outlier."""
    weight = make((97, 1024), seed=7)
    weight[0] = 0
    weight[1] = 3e-7 * np.sign(weight[1])
    weight[2] = -0.25
    weight[3, 5] = 40 * np.abs(weight[3]).max()
    for clip in ("mse", "absmax"):
        ours = quantize_linear(weight, bits, block, clip=clip)
        theirs = reference_quantize_linear(weight, bits, block, clip=clip)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def test_quantize_linear_is_deterministic_and_row_chunk_independent():
    weight = normal((70, 4096), seed=2)  # several row chunks and a partial one
    first = quantize_linear(weight, 4, 32)
    again = quantize_linear(weight.copy(), 4, 32)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    data, scale = quantize_linear(weight[33:41], 4, 32)
    np.testing.assert_array_equal(data, first[0][33:41])
    np.testing.assert_array_equal(scale, first[1][33:41])


def test_quantize_linear_takes_fp16_and_fp32_alike():
    weight = normal((32, 2048), seed=4, dtype=np.float16)
    for bits, block in ((4, 32), (8, None)):
        from16 = quantize_linear(weight, bits, block)
        from32 = quantize_linear(weight.astype(np.float32), bits, block)
        for a, b in zip(from16, from32, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bits, block", [(4, 32), (8, None)])
@pytest.mark.parametrize("clip", ["absmax", "mse"])
def test_zero_constant_and_tiny_blocks(bits, block, clip):
    weight = normal((8, 256), seed=9)
    weight[0] = 0
    weight[1] = 0.3
    weight[2] = -1.7e-3
    weight[3] = 3e-7 * np.sign(weight[3])  # scales in fp16's subnormal range
    data, scale = quantize_linear(weight, bits, block, clip=clip)
    assert np.isfinite(scale.astype(np.float32)).all() and (scale > 0).all()
    np.testing.assert_array_equal(data[0], 0)
    restored = dequantize_linear(data, scale)
    np.testing.assert_array_equal(restored[0], 0)
    for row, value in ((1, 0.3), (2, -1.7e-3)):
        assert (np.sign(data[row]) == np.sign(value)).all()
        np.testing.assert_allclose(restored[row], value, rtol=2e-3)
    qmax = 2 ** (bits - 1) - 1
    assert np.abs(data).max() <= qmax
    assert np.abs(restored[3] - weight[3]).max() <= 2**-24 * qmax


def test_dequantize_linear_broadcasts_each_scale_over_its_block():
    data = np.array([[1, 2, 3, 4], [-1, 0, 7, -7]], np.int8)
    scale = np.array([[0.5, 2.0], [1.0, 0.25]], np.float16)
    expected = [[0.5, 1.0, 6.0, 8.0], [-1.0, 0.0, 1.75, -1.75]]
    np.testing.assert_array_equal(dequantize_linear(data, scale), expected)
    per_channel = dequantize_linear(data, np.array([[2.0], [3.0]], np.float16))
    np.testing.assert_array_equal(per_channel, [[2, 4, 6, 8], [-3, 0, 21, -21]])
    assert per_channel.dtype == np.float32


# Palettization ---------------------------------------------------------------------------

def nearest_on_uniform_grid(values, levels):
    """Reconstruction on `levels` evenly spaced values from min to max of each group."""
    low, high = values.min(axis=1, keepdims=True), values.max(axis=1, keepdims=True)
    grid = low + (high - low) * np.arange(levels) / (levels - 1)
    index = np.abs(values[..., None] - grid[:, None, :]).argmin(axis=2)
    return np.take_along_axis(grid, index, axis=1)


def test_palettize_shapes_and_nearest_entry_assignment():
    weight = normal((64, 96), seed=1)
    indices, lut = palettize(weight, 4, 32)
    assert indices.shape == (64, 96) and indices.dtype == np.uint8 and indices.max() < 16
    assert lut.shape == (2, 1, 16, 1) and lut.dtype == np.float16
    restored = depalettize(indices, lut)
    assert restored.dtype == np.float32 and restored.shape == weight.shape
    for group in range(2):
        rows = weight[32 * group:32 * (group + 1)].astype(np.float64)
        table = lut[group, 0, :, 0].astype(np.float64)
        distance = np.abs(rows[..., None] - table)
        chosen = np.take_along_axis(distance, indices[32 * group:32 * (group + 1), :, None],
                                    axis=2)[..., 0]
        np.testing.assert_array_equal(chosen, distance.min(axis=2))
        np.testing.assert_array_equal(restored[32 * group:32 * (group + 1)],
                                      table[indices[32 * group:32 * (group + 1)]])


def test_kmeans_table_beats_a_uniform_grid_and_is_a_lloyd_fixed_point():
    weight = normal((64, 512), seed=2)
    indices, lut = palettize(weight, 4, 32)
    restored = depalettize(indices, lut)
    grouped = weight.reshape(2, -1).astype(np.float64)
    uniform = nearest_on_uniform_grid(grouped, 16).reshape(weight.shape)
    error = ((restored - weight.astype(np.float64)) ** 2).sum()
    assert error < 0.7 * ((uniform - weight) ** 2).sum()
    # Converged: each entry is (to fp16 rounding) the mean of the values it reconstructs.
    for group in range(2):
        values = grouped[group]
        chosen = indices[32 * group:32 * (group + 1)].reshape(-1)
        for entry in np.unique(chosen):
            mean = values[chosen == entry].mean()
            assert abs(lut[group, 0, entry, 0] - mean) <= 2e-3 * abs(mean) + 1e-6


def reference_kmeans_error(values, k, iterations=100):
    """Plain Lloyd with an n x k distance matrix, from the same quantile start."""
    ordered = np.sort(values)
    centroids = ordered[((np.arange(k) + 0.5) / k * values.size).astype(int)]
    for _ in range(iterations):
        label = np.abs(values[:, None] - centroids).argmin(axis=1)
        centroids = np.array([values[label == j].mean() if (label == j).any() else centroids[j]
                              for j in range(k)])
    return ((centroids[label] - values) ** 2).sum()


def test_kmeans_error_matches_a_plain_lloyd():
    weight = student_t((32, 256), seed=6).astype(np.float64)
    indices, lut = palettize(weight, 4, 32)
    error = ((depalettize(indices, lut) - weight) ** 2).sum()
    assert error <= reference_kmeans_error(weight.reshape(-1), 16) * 1.01


def test_palettize_input_formats_agree(monkeypatch):
    """fp16 codes, bfloat16 codes (fp32 with a zero low half) and sorting give one result."""
    half = normal((64, 256), seed=3, dtype=np.float16)
    from_half = palettize(half, 4, 32)
    from_float = palettize(half.astype(np.float32), 4, 32)
    bf16 = (normal((64, 256), seed=4).view(np.uint32) & 0xFFFF0000).view(np.float32)
    from_bf16 = palettize(bf16, 4, 32)
    monkeypatch.setattr(compression, "_sixteen_bit_codes", lambda values: None)
    for weight, coded in ((half, from_half), (half.astype(np.float32), from_float),
                          (bf16, from_bf16)):
        sorted_result = palettize(weight, 4, 32)
        for a, b in zip(coded, sorted_result, strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(from_half, from_float, strict=True):
        np.testing.assert_array_equal(a, b)


def test_palettize_is_deterministic_and_group_independent():
    weight = normal((96, 300), seed=8)
    first = palettize(weight, 4, 32)
    again = palettize(weight.copy(), 4, 32)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    indices, lut = palettize(weight[32:64], 4, 32)
    np.testing.assert_array_equal(indices, first[0][32:64])
    np.testing.assert_array_equal(lut[0], first[1][1])


def test_palettize_few_distinct_values_zero_and_constant_groups():
    rng = np.random.default_rng(10)
    weight = np.zeros((96, 64), np.float32)
    weight[32:64] = 0.125
    weight[64:] = rng.choice(np.float32([-0.5, 0.25, 0.75]), size=(32, 64))
    for bits in (4, 8):
        indices, lut = palettize(weight, bits, 32)
        assert np.isfinite(lut.astype(np.float32)).all()
        assert lut.shape == (3, 1, 2**bits, 1)
        np.testing.assert_array_equal(depalettize(indices, lut), weight)


def test_palettize_8_bit_uses_256_entries():
    weight = normal((32, 1024), seed=12)
    indices, lut = palettize(weight, 8, 32)
    assert lut.shape == (1, 1, 256, 1)
    assert len(np.unique(indices)) > 200
    error4 = ((depalettize(*palettize(weight, 4, 32)) - weight) ** 2).sum()
    assert ((depalettize(indices, lut) - weight) ** 2).sum() < error4 / 50


def test_depalettize_reads_each_group_table():
    indices = np.array([[0, 1], [1, 0], [1, 1], [0, 0]], np.uint8)
    lut = np.array([[10, 20], [30, 40]], np.float16).reshape(2, 1, 2, 1)
    np.testing.assert_array_equal(depalettize(indices, lut),
                                  [[10, 20], [20, 10], [40, 40], [30, 30]])


# Affine quantization ---------------------------------------------------------------------

def q4_1_blocks(rows, columns, seed=0):
    """Weights as llama.cpp's Q4_1 dequantizes them: per block of 32 inputs, d * q + m with d
    and m fp16, q in 0..15 (0 and 15 both taken: the block's minimum and maximum), in float32;
    and (q, d, m)."""
    rng = np.random.default_rng(seed)
    blocks = columns // 32
    q = rng.integers(0, 16, size=(rows, blocks, 32))
    q[:, :, 0], q[:, :, 1] = 0, 15
    for row in q:  # the two ends anywhere in the block
        for block in row:
            rng.shuffle(block)
    d = (rng.uniform(0.5, 2.0, (rows, blocks)) * 1e-3).astype(np.float16)
    m = (-d.astype(np.float32) * rng.uniform(4, 11, (rows, blocks))).astype(np.float16)
    weight = (d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None])
    return weight.astype(np.float32).reshape(rows, columns), q.reshape(rows, columns), d, m


def test_affine_int4_blocks_of_32_hold_q4_1_weights_exactly_but_for_the_offset_rounding():
    weight, q, d, m = q4_1_blocks(64, 256, seed=3)
    data, scale, offset = quantize_affine(weight, 4, 32)
    np.testing.assert_array_equal(data, q)  # the same levels
    np.testing.assert_array_equal(scale, d)  # the same step
    np.testing.assert_allclose(offset.astype(np.float32), -m.astype(np.float32) / d, rtol=2e-3)
    rebuilt = dequantize_affine(data, scale, offset)
    step = np.repeat(d.astype(np.float32), 32, axis=1)
    # Offsets -m/d in [4, 11]: fp16 rounds them by at most 2^-8 (below 8) or 2^-7 (below 16),
    # and q + m/d (below 16) by at most 2^-8 again when the op rebuilds the weight.
    assert (np.abs(rebuilt - weight) <= step / 128).all()
    # The symmetric int4 of the same blocks loses about a third of a step on average.
    symmetric = dequantize_linear(*quantize_linear(weight, 4, 32))
    assert np.abs(symmetric - weight).mean() > 50 * np.abs(rebuilt - weight).mean()


@pytest.mark.parametrize("bits, block", [(4, 32), (8, None), (4, None)])
def test_quantize_affine_shapes_range_and_error_bound(bits, block):
    weight = student_t((48, 128), seed=bits)
    data, scale, offset = quantize_affine(weight, bits, block)
    blocks = 1 if block is None else 128 // block
    assert data.dtype == np.uint8 and data.shape == weight.shape
    assert scale.dtype == offset.dtype == np.float16 and scale.shape == offset.shape == (48, blocks)
    assert data.max() <= (1 << bits) - 1
    rebuilt = dequantize_affine(data, scale, offset)
    per_element = np.repeat(scale.astype(np.float32), 128 // blocks, axis=1)
    # Half a step from rounding, a little more from the fp16 scale and offset.
    assert (np.abs(rebuilt - weight) <= 0.51 * per_element + 1e-7).all()
    assert np.abs(rebuilt - weight).mean() < np.abs(weight).mean() / (3 if bits == 4 else 50)


def test_affine_offsets_stay_in_fp16_range_for_blocks_far_from_zero():
    weight = normal((8, 64), seed=5, scale=1e-4) + np.float32(30.0)  # [29.9997, 30.0003]
    weight[0] = 0  # and an all-zero row
    data, scale, offset = quantize_affine(weight, 4, 32)
    assert np.isfinite(offset.astype(np.float32)).all()
    assert np.abs(offset.astype(np.float32)).max() <= compression.AFFINE_OFFSET_LIMIT
    rebuilt = dequantize_affine(data, scale, offset)
    assert np.abs(rebuilt - weight).max() <= 30.0 / 2048  # below fp16's rounding of 30
    assert (rebuilt[0] == 0).all()


def test_dequantize_affine_rounds_the_shift_as_coremltools_decompresses():
    """coremltools' constexpr_blockwise_shift_scale.decompress casts data to the scale's dtype,
    so with fp16 inputs data - offset is rounded to fp16 before it is multiplied."""
    iOS18 = pytest.importorskip("coremltools.converters.mil.mil.ops.defs.iOS18.compression")
    rng = np.random.default_rng(4)
    data = rng.integers(0, 16, size=(64, 128)).astype(np.uint8)
    scale = rng.uniform(1e-3, 1e-2, (64, 4)).astype(np.float16)
    offset = rng.uniform(0, 1, (64, 4)).astype(np.float16)  # small: the shift needs > 11 bits
    theirs = iOS18.constexpr_blockwise_shift_scale.decompress(data, scale, offset)
    ours = dequantize_affine(data, scale, offset).astype(np.float16)
    np.testing.assert_array_equal(ours, theirs)
    unrounded = (data - np.repeat(offset.astype(np.float32), 32, axis=1)) * np.repeat(
        scale.astype(np.float32), 32, axis=1)
    assert (unrounded.astype(np.float16) != theirs).any()  # the case the rounding is for


def test_compress_and_expand_name_every_blob_of_each_mode():
    weight = normal((64, 128), seed=9)
    for scheme, count in ((Scheme("linear", 4, 32), 2), (Scheme("affine", 4, 32), 3),
                          (Scheme("palettize", 4, group_size=32), 2)):
        blobs = compression.compress(weight, scheme)
        assert len(blobs) == count == 1 + scheme.sides
        assert all(side.shape == scheme.scale_shape(weight.shape) for side in blobs[1:])
        assert np.abs(compression.expand(blobs, scheme) - weight).max() < 0.02


# Schemes ---------------------------------------------------------------------------------

def test_scheme_scale_shapes_and_stored_bytes():
    shape = (4096, 1024)
    int4 = Scheme("linear", 4, block_size=32)
    assert int4.scale_shape(shape) == (4096, 32)
    assert int4.stored_bytes(shape) == 2_097_152 + 262_144
    int8 = Scheme("linear", 8)
    assert int8.scale_shape(shape) == (4096, 1)
    assert int8.stored_bytes(shape) == 4_194_304 + 8_192
    lut4 = Scheme("palettize", 4, group_size=32)
    assert lut4.scale_shape(shape) == (128, 1, 16, 1)
    assert lut4.stored_bytes(shape) == 2_097_152 + 4_096
    lut8 = Scheme("palettize", 8, group_size=64)
    assert lut8.stored_bytes(shape) == 4_194_304 + 64 * 256 * 2
    affine4 = Scheme("affine", 4, block_size=32)
    assert affine4.scale_shape(shape) == (4096, 32)
    assert affine4.stored_bytes(shape) == 2_097_152 + 2 * 262_144  # scales and offsets


@pytest.mark.parametrize("scheme", [Scheme("linear", 4, 32), Scheme("linear", 8),
                                    Scheme("affine", 4, 32), Scheme("affine", 8),
                                    Scheme("palettize", 4, group_size=32)])
def test_stored_bytes_is_what_the_arrays_take(scheme):
    weight = normal((64, 320), seed=13)
    data, *sides = compression.compress(weight, scheme)
    assert all(side.shape == scheme.scale_shape(weight.shape) for side in sides)
    assert scheme.stored_bytes(weight.shape) == (data.size * scheme.bits // 8
                                                 + sum(side.nbytes for side in sides))


# Presets, rules and plans ----------------------------------------------------------------

SHAPES = {
    "model.language_model.embed_tokens.weight": (1024, 256),
    "model.language_model.layers.0.self_attn.q_proj.weight": (256, 256),  # exactly 2^16
    "model.language_model.layers.0.self_attn.k_proj.weight": (64, 256),  # too small
    "model.language_model.layers.0.mlp.gate_proj.weight": (1000, 256),  # O not / 32
    "model.language_model.layers.0.mlp.down_proj.weight": (256, 1000),  # I not / 32
    "model.language_model.layers.0.input_layernorm.weight": (256,),
    "model.language_model.rotary_emb.cos": (4096, 8),  # 2-D, below 2^16
    "lm_head.weight": (1024, 256),
    "drafter.lm_head.weight": (512, 256),
}
LINEAR8 = Scheme("linear", 8)
LINEAR4 = Scheme("linear", 4, block_size=32)
LUT4 = Scheme("palettize", 4, group_size=32)
AFFINE4 = Scheme("affine", 4, block_size=32)


def expected(embedding, q, gate, down, heads):
    return {
        "model.language_model.embed_tokens.weight": embedding,
        "model.language_model.layers.0.self_attn.q_proj.weight": q,
        "model.language_model.layers.0.self_attn.k_proj.weight": None,
        "model.language_model.layers.0.mlp.gate_proj.weight": gate,
        "model.language_model.layers.0.mlp.down_proj.weight": down,
        "model.language_model.layers.0.input_layernorm.weight": None,
        "model.language_model.rotary_emb.cos": None,
        "lm_head.weight": heads,
        "drafter.lm_head.weight": heads,
    }


@pytest.mark.parametrize("preset, plan", [
    ("none", expected(None, None, None, None, None)),
    ("8bit", expected(LINEAR8, LINEAR8, LINEAR8, LINEAR8, LINEAR8)),
    ("4bit", expected(LINEAR8, AFFINE4, AFFINE4, LINEAR8, LINEAR8)),
    ("palettize4", expected(LINEAR8, LUT4, LINEAR8, LUT4, LINEAR8)),
])
def test_preset_plans(preset, plan):
    assert preset in PRESETS
    assert plan_compression(preset_rules(preset), SHAPES, strict=False) == plan


def test_small_and_non_matrix_tensors_stay_fp16_whatever_the_rules():
    rules = [Rule("*", "linear", 8)]
    shapes = {"a": (256, 255), "b": (256, 256), "c": (16, 64, 64), "d": (1 << 17,)}
    assert 256 * 255 < MIN_ELEMENTS
    assert plan_compression(rules, shapes, strict=True) == {"a": None, "b": LINEAR8,
                                                            "c": None, "d": None}


def write_rules(tmp_path, rules, name="rules.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rules))
    return path


def test_user_rules_first_match_wins(tmp_path):
    path = write_rules(tmp_path, {"rules": [
        {"match": "*embed_tokens.weight", "mode": "none"},
        {"match": "*.mlp.down_proj.weight", "mode": "linear", "bits": 8, "block_size": 200},
        {"match": "*.mlp.*", "mode": "palettize", "bits": 8, "group_size": 8},
        {"match": "*lm_head.weight", "mode": "palettize", "bits": 4},
        {"match": "*", "mode": "linear", "bits": 4, "block_size": None},
    ]})
    rules = read_rules(path)
    assert rules[3] == Rule("*lm_head.weight", "palettize", 4, group_size=32)
    assert plan_compression(rules, SHAPES, strict=True) == expected(
        None, Scheme("linear", 4), Scheme("palettize", 8, group_size=8),
        Scheme("linear", 8, block_size=200), LUT4)


def test_rules_round_trip_through_json(tmp_path):
    rules = [rule for preset in PRESETS for rule in preset_rules(preset)]
    rules.append(Rule("*.mlp.*", "none"))
    path = write_rules(tmp_path, [rule.to_json() for rule in rules])
    assert read_rules(path) == rules


def test_unknown_preset():
    with pytest.raises(CompressionError) as excinfo:
        preset_rules("3bit")
    message = one_line_error(excinfo)
    assert "3bit" in message and "palettize4" in message and "--compression" in message


@pytest.mark.parametrize("rules, named", [
    ([{"match": "*", "mode": "linear", "bits": 8, "blocksize": 32}], ["rule 0", "blocksize"]),
    ([{"match": "*", "mode": "none"}, {"match": "*", "mode": "int4"}], ["rule 1", "int4"]),
    ([{"match": "*", "mode": "linear", "bits": 3}], ["rule 0", "bits", "3"]),
    ([{"match": "*", "mode": "linear"}], ["rule 0", "bits"]),
    ([{"match": "*", "mode": "palettize", "bits": True}], ["rule 0", "bits"]),
    ([{"match": "*", "mode": "linear", "bits": 4, "block_size": 0}], ["rule 0", "block_size"]),
    ([{"match": "*", "mode": "linear", "bits": 4, "block_size": "32"}],
     ["rule 0", "block_size"]),
    ([{"match": "*", "mode": "linear", "bits": 4, "group_size": 32}],
     ["rule 0", "group_size"]),
    ([{"match": "*", "mode": "affine", "bits": 4, "group_size": 32}],
     ["rule 0", "group_size", "affine"]),
    ([{"match": "*", "mode": "affine", "bits": 3}], ["rule 0", "bits", "3"]),
    ([{"match": "*", "mode": "palettize", "bits": 4, "block_size": 32}],
     ["rule 0", "block_size"]),
    ([{"match": "*", "mode": "palettize", "bits": 4, "group_size": -1}],
     ["rule 0", "group_size"]),
    ([{"match": "*", "mode": "none", "bits": 8}], ["rule 0", "bits"]),
    ([{"mode": "none"}], ["rule 0", "match"]),
    (["*"], ["rule 0"]),
    ({"match": "*", "mode": "none"}, ["list"]),
])
def test_bad_rules(tmp_path, rules, named):
    path = write_rules(tmp_path, rules)
    with pytest.raises(CompressionError) as excinfo:
        read_rules(path)
    message = one_line_error(excinfo)
    assert "--compression-config" in message and str(path) in message
    for word in named:
        assert word in message


def test_unreadable_or_invalid_config_file(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(CompressionError) as excinfo:
        read_rules(missing)
    assert str(missing) in one_line_error(excinfo)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"match": "*", "mode": "linear",\n')
    with pytest.raises(CompressionError) as excinfo:
        read_rules(broken)
    assert str(broken) in one_line_error(excinfo)
    assert "JSON" in str(excinfo.value)


def test_palettize_with_8_bits_is_a_valid_rule(tmp_path):
    path = write_rules(tmp_path, [{"match": "*", "mode": "palettize", "bits": 8}])
    assert read_rules(path) == [Rule("*", "palettize", 8, group_size=32)]


def test_a_rule_matching_no_tensor_is_an_error_naming_it_and_suggesting_names():
    rules = [Rule("*q_proj.weight", "linear", 8),
             Rule("*.self_atn.o_proj.weight", "linear", 4, block_size=32)]
    with pytest.raises(CompressionError) as excinfo:
        plan_compression(rules, SHAPES, strict=True)
    message = one_line_error(excinfo)
    assert "rule 1" in message and "*.self_atn.o_proj.weight" in message
    assert any(name in message for name in SHAPES)
    # A rule matching only tensors that always stay fp16 matches no compressible tensor.
    with pytest.raises(CompressionError) as excinfo:
        plan_compression([Rule("*layernorm*", "none")], SHAPES, strict=True)
    assert "rule 0" in one_line_error(excinfo)
    # Presets are not strict: their lm_head rules need not match.
    plan_compression(preset_rules("4bit"), {"x.weight": (256, 256)}, strict=False)


def test_a_rule_shadowed_by_earlier_rules_is_an_error():
    rules = [Rule("*", "linear", 8), Rule("*.mlp.*", "palettize", 4, group_size=8)]
    with pytest.raises(CompressionError) as excinfo:
        plan_compression(rules, SHAPES, strict=True)
    message = one_line_error(excinfo)
    assert "rule 1" in message and "*.mlp.*" in message and "[0]" in message


def test_indivisible_block_size_names_the_tensor_its_shape_and_divisors():
    rules = [Rule("*.mlp.down_proj.weight", "linear", 4, block_size=32)]
    with pytest.raises(CompressionError) as excinfo:
        plan_compression(rules, SHAPES, strict=True)
    message = one_line_error(excinfo)
    assert "model.language_model.layers.0.mlp.down_proj.weight" in message
    assert "[256, 1000]" in message and "rule 0" in message
    assert "40" in message and "25" in message  # divisors of 1000 near 32


def test_indivisible_group_size_names_the_tensor_its_shape_and_divisors():
    rules = [Rule("*.mlp.*", "palettize", 4, group_size=32)]
    with pytest.raises(CompressionError) as excinfo:
        plan_compression(rules, SHAPES, strict=True)
    message = one_line_error(excinfo)
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in message
    assert "[1000, 256]" in message and "40" in message


@pytest.mark.parametrize("call", [
    lambda: quantize_linear(normal((8, 100)), 4, 32),
    lambda: quantize_linear(normal((8, 64)), 2, 32),
    lambda: quantize_linear(normal((8, 64)), 4, 32, clip="max"),
    lambda: quantize_linear(normal((512,)), 8, None),
    lambda: quantize_linear(np.ones((8, 64), np.int32), 8, None),
    lambda: quantize_linear(np.where(np.eye(8, 64) > 0, np.nan, 1.0), 8, None),
    lambda: quantize_linear(np.full((8, 64), np.inf, np.float32), 4, 32),
    lambda: quantize_affine(normal((8, 100)), 4, 32),
    lambda: quantize_affine(normal((8, 64)), 2, 32),
    lambda: quantize_affine(np.where(np.eye(8, 64) > 0, np.nan, 1.0), 8, None),
    lambda: quantize_affine(np.eye(8, 64, dtype=np.float32) * np.float32(1e9), 8, None),
    lambda: dequantize_affine(np.zeros((4, 8), np.uint8), np.ones((4, 2), np.float16),
                              np.ones((4, 1), np.float16)),
    lambda: palettize(normal((40, 64)), 4, 32),
    lambda: palettize(normal((32, 64)), 3, 32),
    lambda: palettize(np.where(np.eye(32, 64) > 0, np.inf, 0.5).astype(np.float32), 4, 32),
    lambda: palettize(np.where(np.eye(32, 64) > 0, np.nan, 0.3).astype(np.float32), 4, 32),
    lambda: palettize(np.where(np.eye(32, 64) > 0, -np.inf, 0.3), 4, 32),
    lambda: dequantize_linear(np.zeros((4, 6), np.int8), np.ones((4, 4), np.float16)),
    lambda: depalettize(np.zeros((4, 6), np.uint8), np.ones((3, 1, 16, 1), np.float16)),
    lambda: depalettize(np.full((4, 6), 16, np.uint8), np.ones((1, 1, 16, 1), np.float16)),
    lambda: Scheme("linear", 4, block_size=48).scale_shape((64, 100)),
    lambda: Scheme("palettize", 4, group_size=32).scale_shape((100, 64)),
    lambda: Scheme("linear", 2),
])
def test_bad_arrays_raise_compression_errors(call):
    with pytest.raises(CompressionError) as excinfo:
        call()
    one_line_error(excinfo)
