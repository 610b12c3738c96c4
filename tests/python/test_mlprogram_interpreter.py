"""The numpy ML-program interpreter runs converted packages like eager PyTorch does.

Packages are made the way the exporter makes them (torch.export -> run_decompositions ->
ct.convert with fp16 states, iOS18, the program validated once per pass pipeline; drafter and
target as multifunction packages, merged by export/merge.py) from a shallow demo model, once
per module.
"""

import copy
import os
import shutil

import numpy as np
import pytest
import torch
from package_surgery import negate_fp16_blob, swap_blobs

from museflash.builtin.demo_checkpoint import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET_CONFIG,
    build_tiny_models,
)
from museflash.bundle import StateName
from museflash.export.coreml_patches import validated_once_per_pipeline
from museflash.export.merge import merge_packages
from museflash.models.dflash import DFlashRingDrafter
from museflash.runtime.interpreter import (
    KERNELS,
    SUPPORTED_OP_TYPES,
    Interpreter,
    InterpreterError,
    LazyInterpreters,
    UnsupportedOpError,
    _all_finite,
    list_functions,
    load_interpreters,
    load_program,
)
from museflash.runtime.parity import ParityError, Tolerance, module_states, parity_step, sync_states

ct = pytest.importorskip("coremltools")

TARGET_STATES = [StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE,
                 StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE]
DRAFTER_STATES = [StateName.DRAFTER_KEY_CACHE, StateName.DRAFTER_VALUE_CACHE]
RING_STATES = [StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE]
QUERY_LEN = 8  # target chunk and inject_kv length; also max_query_len, so ring capacity is 32
HIDDEN = 64
# Long enough for positions above 2048, which fp16 cannot even represent; the global cache and
# the RoPE tables grow with it, but stay small at this width.
MAX_CONTEXT = 4096

# Tolerances, as a fraction of each tensor's largest magnitude (see parity.Tolerance).
# The package stores every activation, weight and cache entry in fp16, whose unit roundoff is
# 2^-11 ~ 4.9e-4 (spacing up to ~1e-3 of a value); eager torch computes in fp32 from the same
# weights. Every op adds about one roundoff of its operand's scale and these accumulate through
# residual adds, norms, softmax and the 4 target layers (~40 fp16 roundings between input and
# logits); RoPE cos/sin are gathered from fp16 tables by integer position, so they carry one
# rounding at every position. Observed at positions < 64: outputs <= 6e-3 (target logits),
# caches <= 5.4e-3 (keys of later layers inherit the residual stream's error); the ring drafter
# at positions 500..4095 stays below 2.2e-3. The limits leave ~3x headroom for other seeds and
# inputs, yet a real defect moves things by O(1) of scale (swapped weights: > 0.3; RoPE angles
# formed in fp16 instead: key cache 0.53 of scale at position 3000).
OUTPUT_TOLERANCE = Tolerance(rel_tol=2e-2)
STATE_TOLERANCE = Tolerance(rel_tol=1.5e-2)


def _shallow_configs():
    text = TINY_TARGET_CONFIG["text_config"]
    # One [S, S, S, G] period: both cache kinds, and a stack of sliding layers.
    target = {"text_config": dict(text, num_hidden_layers=4, layer_types=text["layer_types"][:4],
                                  layer_rope_theta=text["layer_rope_theta"][:4])}
    drafter = dict(TINY_DRAFTER_CONFIG, target_layer_ids=[1, 3])
    return target, drafter


def _state_types(module, names):
    return [
        ct.StateType(
            wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16),
            name=n,
        )
        for n in names
    ]


def _int_inputs(length):
    return [
        ct.TensorType(name="input_ids", shape=(1, length), dtype=np.int32),
        ct.TensorType(name="position_ids", shape=(length,), dtype=np.int32),
    ]


def _convert(module, example_args, inputs, state_names, path, output_names=None):
    exported = torch.export.export(module, example_args).run_decompositions({})
    outputs = [ct.TensorType(name=n) for n in output_names] if output_names else None
    with validated_once_per_pipeline():
        model = ct.convert(exported, inputs=inputs, outputs=outputs,
                           states=_state_types(module, state_names),
                           minimum_deployment_target=ct.target.iOS18, skip_model_load=True)
    model.save(str(path))
    return path


def _multifunction(parts, default, path):
    merge_packages(list(parts.items()), path, default)
    return path


def _ids(length):
    return torch.zeros(1, length, dtype=torch.int32), torch.arange(length, dtype=torch.int32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Demo models plus their packages: target (main, prefill), drafter (inject_kv, draft) and
    the ring drafter (single-function decode)."""
    work = tmp_path_factory.mktemp("packages")
    target_config, drafter_config = _shallow_configs()
    target, drafter = build_tiny_models(seed=0, target_config=target_config,
                                        drafter_config=drafter_config,
                                        max_context=MAX_CONTEXT, max_query_len=QUERY_LEN)
    # As the exporter does: every package gets the same max_context, so each RoPE table
    # covers every position the target's global cache can hold.
    ring = DFlashRingDrafter.for_target(drafter.config, target, max_context=MAX_CONTEXT,
                                        max_query_len=QUERY_LEN)
    # Same weights; the caches differ in name only (the ring drafter's package is its own).
    missing, unexpected = ring.load_state_dict(drafter.state_dict(), strict=False)
    assert (sorted(missing), sorted(unexpected)) == (sorted(ring.cache_names),
                                                     sorted(drafter.cache_names))
    fused_outputs = ["logits", "drafter_features"]
    parts = {
        name: _convert(target.with_entry_point(entry), _ids(QUERY_LEN), _int_inputs(QUERY_LEN),
                       TARGET_STATES, work / f"target_{name}.mlpackage", fused_outputs)
        for name, entry in (("main", "forward"), ("prefill", "prefill"))
    }
    target_package = _multifunction(parts, "main", work / "target.mlpackage")
    block = drafter.config.block_size
    features_inputs = [
        ct.TensorType(name="features", shape=(1, QUERY_LEN, HIDDEN), dtype=np.float32),
        ct.TensorType(name="position_ids", shape=(QUERY_LEN,), dtype=np.int32),
    ]
    parts = {
        "inject_kv": _convert(drafter.with_entry_point("inject_kv"),
                              (torch.zeros(1, QUERY_LEN, HIDDEN), _ids(QUERY_LEN)[1]),
                              features_inputs, DRAFTER_STATES, work / "inject_kv.mlpackage"),
        "draft": _convert(drafter.with_entry_point("draft"), _ids(block), _int_inputs(block),
                          DRAFTER_STATES, work / "draft.mlpackage", ["logits"]),
    }
    drafter_package = _multifunction(parts, "draft", work / "drafter.mlpackage")
    ring_package = _convert(ring, _ids(1), _int_inputs(1), RING_STATES,
                            work / "ring_drafter.mlpackage", ["logits"])
    return {
        "target": target, "drafter": drafter, "ring": ring, "work": work,
        "target_package": target_package, "drafter_package": drafter_package,
        "ring_package": ring_package,
    }


def _random_states(module, names, seed):
    """Cache contents both sides start from: nonzero everywhere, so reads of never-written or
    stale slots would show up, not hide behind zeros."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(tuple(getattr(module, n).shape)).astype(np.float16)
            for n in names}


def _check(report, log):
    log.append(str(report))
    report.check(OUTPUT_TOLERANCE, STATE_TOLERANCE)


# --------------------------------------------------------------------------------------------
# Loading and op coverage


def test_every_exported_op_type_is_supported(exported):
    for key in ("target_package", "drafter_package", "ring_package"):
        spec = ct.utils.load_spec(str(exported[key]))
        for function in spec.mlProgram.functions.values():
            block = function.block_specializations[function.opset]
            # The loader turns write_state into coreml_update_state.
            used = {"coreml_update_state" if op.type == "write_state" else op.type
                    for op in block.operations}
            assert used <= SUPPORTED_OP_TYPES, (key, sorted(used - SUPPORTED_OP_TYPES))


def test_load_program_selects_functions(exported):
    names, default = list_functions(exported["drafter_package"])
    assert sorted(names) == ["draft", "inject_kv"] and default == "draft"
    program = load_program(exported["drafter_package"], "inject_kv")
    assert list(program.functions) == ["inject_kv"]
    assert Interpreter(program).function_name == "inject_kv"
    both = load_program(exported["drafter_package"])
    assert sorted(both.functions) == ["draft", "inject_kv"]
    assert Interpreter(both).function_name == "draft"
    single = load_program(exported["ring_package"])
    assert Interpreter(single).function_name == "main"
    with pytest.raises(KeyError, match="inject_kv"):
        load_program(exported["target_package"], "inject_kv")


def _float64_weights(interpreter):
    return {id(step.fixed["weight"]) for step in interpreter._plan if "weight" in step.fixed}


def test_functions_of_one_package_share_their_stored_weights(exported):
    loaded = load_interpreters(exported["target_package"], ["main", "prefill"])
    main, prefill = loaded["main"], loaded["prefill"]
    weights = [name for name, value in main.constants.items()
               if isinstance(value, np.ndarray) and value.size >= 1024]
    assert weights
    for name in weights:
        assert prefill.constants[name] is main.constants[name], name
        assert not main.constants[name].flags.writeable, name
    assert _float64_weights(main) and _float64_weights(main) == _float64_weights(prefill)
    # The same outputs, bit for bit, as an Interpreter that shares nothing.
    alone = copy.copy(load_program(exported["target_package"], "prefill"))  # loaded: shared
    alone.weights_identity = None
    unshared = Interpreter(alone, "prefill")
    assert not _float64_weights(unshared) & _float64_weights(prefill)
    inputs = {"input_ids": np.arange(3, 3 + QUERY_LEN, dtype=np.int32).reshape(1, -1),
              "position_ids": np.arange(QUERY_LEN, dtype=np.int32)}
    outputs = [interpreter.run(inputs, interpreter.zero_states())
               for interpreter in (prefill, unshared)]
    for name in outputs[0]:
        np.testing.assert_array_equal(outputs[0][name], outputs[1][name])


def test_lazy_interpreters_load_a_function_when_first_asked_for_it(exported):
    lazy = LazyInterpreters(exported["target_package"], ["main", "prefill"])
    assert list(lazy) == ["main", "prefill"] and "prefill" in lazy and lazy.loaded == []
    prefill = lazy["prefill"]
    assert lazy.loaded == ["prefill"] and lazy["prefill"] is prefill
    assert prefill.function_name == "prefill"
    with pytest.raises(KeyError, match="no function 'main_64'"):
        LazyInterpreters(exported["target_package"], ["main", "main_64"])


def test_a_slice_update_writes_into_its_x_only_when_nothing_reads_x_later(tmp_path):
    class Overwrite(torch.nn.Module):
        def __init__(self, keep: bool):
            super().__init__()
            self.keep = keep

        def forward(self, x):
            doubled = x * 2
            zeroed = doubled.clone()
            zeroed[:, 1:3] = 0  # a slice_update of `doubled`
            return zeroed + doubled if self.keep else zeroed

    x = torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)
    for keep in (True, False):
        exported_program = torch.export.export(Overwrite(keep), (x,))
        model = ct.convert(exported_program.run_decompositions({}),
                           inputs=[ct.TensorType(name="x", shape=(3, 4))],
                           minimum_deployment_target=ct.target.iOS18, skip_model_load=True)
        model.save(str(tmp_path / f"overwrite_{keep}.mlpackage"))
        interpreter = Interpreter(load_program(tmp_path / f"overwrite_{keep}.mlpackage"))
        ops = [op.op_type for op in interpreter.function.operations]
        assert "slice_update" in ops, ops
        (got,) = interpreter.run({"x": x.numpy()}).values()
        np.testing.assert_allclose(got, Overwrite(keep)(x).numpy(), rtol=1e-3)


def test_a_rewritten_package_is_read_again_not_shared(exported, tmp_path):
    package = tmp_path / "target.mlpackage"
    shutil.copytree(exported["target_package"], package)
    before = load_interpreters(package, ["main"])["main"]
    weight = "layers_1_self_attn_k_proj_weight"
    # The program is unchanged (the same storage keys); only weight.bin's bytes are not.
    negate_fp16_blob(package, weight)
    after = load_interpreters(package, ["main"])["main"]
    names = [name for name in before.constants if weight in name]
    assert names
    for name in names:
        assert after.constants[name] is not before.constants[name]
        assert not np.array_equal(after.constants[name], before.constants[name])


def test_a_package_loaded_again_is_the_same_program_until_its_bytes_change(exported, tmp_path):
    package = tmp_path / "target.mlpackage"
    shutil.copytree(exported["target_package"], package)
    first = load_program(package, "main")
    assert load_program(package, "main") is first
    assert load_program(package, ["main", "prefill"]) is not first
    weight = "layers_1_self_attn_k_proj_weight"
    blob = next((package / "Data" / "com.apple.CoreML" / "weights").iterdir())
    before = os.stat(blob)
    negate_fp16_blob(package, weight)
    # The same size and the same times: only the bytes tell the rewrite.
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(blob).st_size == before.st_size
    again = load_program(package, "main")
    assert again is not first
    name = next(n for n in Interpreter(first, "main").constants if weight in n)
    assert not np.array_equal(Interpreter(again, "main").constants[name],
                              Interpreter(first, "main").constants[name])


def test_fp16_finiteness_is_read_from_the_exponent_bits():
    finite = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, 1.0], np.float16)
    assert _all_finite(finite) and _all_finite(finite[::2]) and _all_finite(finite[:0])
    for bad in (np.inf, -np.inf, np.nan):
        value = np.append(finite, np.float16(bad))
        assert not _all_finite(value) and not _all_finite(value.astype(np.float32))
        assert not _all_finite(value[1::1][::-1])
    assert _all_finite(np.array([2**31 - 1], np.int32))


def test_states_must_be_caller_owned_fp16_arrays(exported):
    interpreter = Interpreter(load_program(exported["ring_package"]))
    states = interpreter.zero_states()
    inputs = {"input_ids": np.array([[3]], np.int32), "position_ids": np.array([0], np.int32)}
    interpreter.run(inputs, states)
    key = StateName.SLIDING_KEY_CACHE
    assert np.any(states[key] != 0), "the state write must land in the caller's array"
    wrong = {**states, key: states[key].astype(np.float32)}
    with pytest.raises(ValueError, match=str(key)):
        interpreter.run(inputs, wrong)
    with pytest.raises(ValueError, match="missing"):
        interpreter.run({"input_ids": inputs["input_ids"]}, states)


# --------------------------------------------------------------------------------------------
# Parity with eager torch


@pytest.mark.parametrize("function_name, entry_point", [("main", "forward"),
                                                        ("prefill", "prefill")])
def test_target_matches_torch_across_ring_wrap(exported, function_name, entry_point):
    target = exported["target"]
    interpreter = Interpreter(load_program(exported["target_package"], function_name))
    assert interpreter.output_names == ["logits", "drafter_features"]
    states = _random_states(target, TARGET_STATES, seed=1)
    sync_states(target, states)
    module = target.with_entry_point(entry_point)
    rng = np.random.default_rng(2)
    log = []
    # Chunks 20..27, 28..35 (the ring of 32 wraps inside it), 36..43, 44..51.
    for start in range(20, 52, QUERY_LEN):
        inputs = {
            "input_ids": rng.integers(0, 512, (1, QUERY_LEN)).astype(np.int32),
            "position_ids": np.arange(start, start + QUERY_LEN, dtype=np.int32),
        }
        _check(parity_step(interpreter, module, inputs, states), log)
    print("\n".join(log))


def test_drafter_inject_then_draft_share_states(exported):
    drafter = exported["drafter"]
    program = load_program(exported["drafter_package"])
    inject, draft = Interpreter(program, "inject_kv"), Interpreter(program, "draft")
    states = _random_states(drafter, DRAFTER_STATES, seed=3)
    sync_states(drafter, states)
    block = drafter.config.block_size
    mask_id = drafter.config.mask_token_id
    rng = np.random.default_rng(4)
    log = []
    # Accepted context a..a+7 then a block at a+8; the next inject overwrites the block.
    for start in (16, 24, 32):
        features = rng.standard_normal((1, QUERY_LEN, HIDDEN)).astype(np.float32)
        positions = np.arange(start, start + QUERY_LEN, dtype=np.int32)
        _check(parity_step(inject, drafter.with_entry_point("inject_kv"),
                           {"features": features, "position_ids": positions}, states), log)
        anchor = int(rng.integers(0, 511))
        tokens = np.array([[anchor] + [mask_id] * (block - 1)], dtype=np.int32)
        block_positions = np.arange(start + QUERY_LEN, start + QUERY_LEN + block, dtype=np.int32)
        _check(parity_step(draft, drafter.with_entry_point("draft"),
                           {"input_ids": tokens, "position_ids": block_positions}, states), log)
    print("\n".join(log))


def test_ring_drafter_decode_matches_torch_across_ring_wrap(exported):
    ring = exported["ring"]
    interpreter = Interpreter(load_program(exported["ring_package"]))
    states = _random_states(ring, RING_STATES, seed=5)
    sync_states(ring, states)
    rng = np.random.default_rng(6)
    log = []
    for position in range(24, 40):  # capacity 32: slots wrap to 0 at position 32
        inputs = {"input_ids": rng.integers(0, 512, (1, 1)).astype(np.int32),
                  "position_ids": np.array([position], dtype=np.int32)}
        _check(parity_step(interpreter, ring, inputs, states), log)
    print("\n".join(log))


# RoPE cos/sin are looked up by integer position, so no angle is ever formed in fp16 (where
# positions above 2048 are not representable and angles drift by ~1e-3 * position rad).
@pytest.mark.parametrize("start", [500, 1000, 3000, MAX_CONTEXT - 4])
def test_ring_drafter_decode_at_long_positions(exported, start):
    ring = exported["ring"]
    interpreter = Interpreter(load_program(exported["ring_package"]))
    states = _random_states(ring, RING_STATES, seed=8)
    sync_states(ring, states)
    log = []
    for position in range(start, start + 4):
        inputs = {"input_ids": np.array([[7]], dtype=np.int32),
                  "position_ids": np.array([position], dtype=np.int32)}
        _check(parity_step(interpreter, ring, inputs, states), log)
    print("\n".join(log))


def test_target_matches_torch_at_long_positions(exported):
    """Sliding (RoPE) and global (NoPE) layers above 2048, the global cache nearly full."""
    target = exported["target"]
    interpreter = Interpreter(load_program(exported["target_package"], "main"))
    states = _random_states(target, TARGET_STATES, seed=9)
    sync_states(target, states)
    module = target.with_entry_point("forward")
    rng = np.random.default_rng(10)
    log = []
    for start in (3000, 3008, MAX_CONTEXT - QUERY_LEN):
        inputs = {
            "input_ids": rng.integers(0, 512, (1, QUERY_LEN)).astype(np.int32),
            "position_ids": np.arange(start, start + QUERY_LEN, dtype=np.int32),
        }
        _check(parity_step(interpreter, module, inputs, states), log)
    print("\n".join(log))


def test_swapped_weights_fail_the_parity_check(exported):
    drafter = exported["drafter"]
    broken = exported["work"] / "broken.mlpackage"
    shutil.copytree(exported["drafter_package"], broken)
    swap_blobs(broken, [("layers_1_self_attn_k_proj_weight_to_fp16",
                         "layers_1_self_attn_v_proj_weight_to_fp16")])
    inject = Interpreter(load_program(broken, "inject_kv"))
    states = module_states(drafter, DRAFTER_STATES)
    sync_states(drafter, states)
    inputs = {"features": np.random.default_rng(7).standard_normal((1, QUERY_LEN, HIDDEN))
              .astype(np.float32),
              "position_ids": np.arange(QUERY_LEN, dtype=np.int32)}
    report = parity_step(inject, drafter.with_entry_point("inject_kv"), inputs, states)
    print(report)
    assert report.states[StateName.DRAFTER_KEY_CACHE].max_rel > 0.3, str(report)
    with pytest.raises(ParityError, match=str(StateName.DRAFTER_KEY_CACHE)):
        report.check(OUTPUT_TOLERANCE, STATE_TOLERANCE)


def test_unsupported_op_is_named(tmp_path):
    class RunningTotal(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=-1)

    exported_program = torch.export.export(RunningTotal(), (torch.ones(2, 3),))
    model = ct.convert(exported_program.run_decompositions({}),
                       inputs=[ct.TensorType(name="x", shape=(2, 3))],
                       minimum_deployment_target=ct.target.iOS18, skip_model_load=True)
    model.save(str(tmp_path / "cumsum.mlpackage"))
    program = load_program(tmp_path / "cumsum.mlpackage")
    op_name = next(op.name for op in program.functions["main"].operations
                   if op.op_type == "cumsum")
    with pytest.raises(UnsupportedOpError, match=rf"cumsum \(op '{op_name}'\)"):
        Interpreter(program)


# --------------------------------------------------------------------------------------------
# Kernels with semantics easy to get subtly wrong


def _kernel(op_type, **args):
    return KERNELS[op_type](args)


def test_slice_by_index_masks_and_strides():
    x = np.arange(24).reshape(2, 3, 4)
    out = _kernel("slice_by_index", x=x, begin=np.array([1, 0, 3]), end=np.array([2, 3, 0]),
                  stride=np.array([1, 2, -1]), begin_mask=np.array([False, True, False]),
                  end_mask=np.array([False, True, True]),
                  squeeze_mask=np.array([True, False, False]))
    np.testing.assert_array_equal(out, x[1, ::2, 3::-1])


def test_slice_update_writes_a_squeezed_slab():
    x = np.zeros((3, 2, 4), np.float16)
    update = np.ones((2, 4), np.float16)
    out = _kernel("slice_update", x=x, update=update, begin=np.array([1, 0, 0]),
                  end=np.array([3, 2, 4]), squeeze_mask=np.array([True, False, False]))
    assert out[1].sum() == 8 and out.sum() == 8 and x.sum() == 0


def test_reshape_zero_copies_dims_from_the_right():
    out = _kernel("reshape", x=np.zeros((2, 50)), shape=np.array([1, 0, -1, 0]))
    assert out.shape == (1, 1, 2, 50)


def test_concat_interleave():
    out = _kernel("concat", values=[np.array([1, 2]), np.array([3, 4])], axis=np.int32(0),
                  interleave=np.bool_(True))
    np.testing.assert_array_equal(out, [1, 3, 2, 4])


def test_gather_negative_and_out_of_range_indices():
    x = np.arange(10) * 10
    np.testing.assert_array_equal(_kernel("gather", x=x, indices=np.array([-1, 2]),
                                          axis=np.int32(0)), [90, 20])
    with pytest.raises(InterpreterError, match="out of range"):
        _kernel("gather", x=x, indices=np.array([10]), axis=np.int32(0))


@pytest.mark.parametrize("mode, expected", [("update", [0, 7, 0]), ("add", [0, 12, 0])])
def test_scatter_nd_modes_with_repeated_indices(mode, expected):
    out = _kernel("scatter_nd", data=np.zeros(3, np.float32), indices=np.array([[1], [1]]),
                  updates=np.array([5.0, 7.0], np.float32), mode=mode)
    np.testing.assert_array_equal(out, expected)


def test_reductions_accept_loaded_numpy_bool_flags():
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    out = _kernel("reduce_mean", x=x, axes=np.array([-1]), keep_dims=np.bool_(True))
    np.testing.assert_allclose(out, [[1.0], [4.0]])
    assert _kernel("reduce_max", x=x, keep_dims=np.bool_(False)).shape == ()


def test_silu_and_sigmoid_are_stable_for_large_inputs():
    x = np.array([-1e4, -1.0, 0.0, 1.0, 1e4], np.float32)
    with np.errstate(over="raise"):
        np.testing.assert_allclose(_kernel("silu", x=x), [0.0, -0.268941, 0.0, 0.731059, 1e4],
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_kernel("sigmoid", x=x), [0.0, 0.268941, 0.5, 0.731059, 1.0],
                                   rtol=1e-5, atol=1e-6)
