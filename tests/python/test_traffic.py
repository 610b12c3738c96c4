"""The traffic tool (//:traffic): first-order bytes per call counted from the saved program's
types, checked against hand counts on a small export and on programs built op by op."""

import math

import numpy as np
import pytest
from command_line import run_main
from prebuilt import DFLASH2_BUNDLE, DFLASH2_SLICE_BUNDLE, prebuilt_bundle

from museflash.builtin.demo_checkpoint import TINY_TARGET_CONFIG
from museflash.bundle import KVWrite, Metadata, StateKind
from museflash.cli import traffic_main
from museflash.tools import traffic
from museflash.tools.traffic import (
    REST,
    STATE_SIZED,
    WEIGHTS,
    Summary,
    bundle_traffic,
    extrapolate,
    function_traffic,
    geometry_configs,
)

ct = pytest.importorskip("coremltools")
from coremltools.converters.mil.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import types  # noqa: E402

FP16 = 2  # bytes
CONTEXT, PREFILL = 64, 8


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    # //tests/integration:demo_bundle: the tiny fused pair at CONTEXT, PREFILL.
    return prebuilt_bundle(tmp_path_factory.mktemp("traffic"))


@pytest.fixture(scope="module")
def main_traffic(bundle):
    (counted,) = bundle_traffic(bundle, "main")
    return counted


# --- The tiny export against a hand count ----------------------------------------------------


def _geometry():
    text = TINY_TARGET_CONFIG["text_config"]
    layer_types = text["layer_types"]
    sliding = sum(t == "sliding_attention" for t in layer_types)
    # The sliding ring: window + the longest query (prefill), rounded up to 32 slots.
    ring = -(-(text["sliding_window"] + PREFILL) // 32) * 32
    return text, sliding, len(layer_types) - sliding, ring


def test_one_layers_cache_writes_and_weights_equal_a_hand_count(main_traffic):
    text, sliding, full, ring = _geometry()
    kv, head_dim, hidden = text["num_key_value_heads"], text["head_dim"], text["hidden_size"]
    # Today's write (the blend): each layer writes its whole cache layer, K and V, through
    # one slice_update per cache into the state, in place, so each moves one layer in and out.
    sliding_layer = kv * ring * head_dim * FP16
    global_layer = kv * CONTEXT * head_dim * FP16
    updates = [op for op in main_traffic.ops if op.op_type == "slice_update"]
    assert len(updates) == 2 * (sliding + full)
    assert all(op.in_place for op in updates)
    first_sliding = updates[:2]  # layer 0 is sliding: its K and V writes come first
    assert [(op.bytes_in, op.bytes_out) for op in first_sliding] == [(sliding_layer,) * 2] * 2
    assert {op.part for op in first_sliding} == {STATE_SIZED}
    per_layer_sizes = sorted({op.bytes_in for op in updates})
    assert per_layer_sizes == sorted({sliding_layer, global_layer})
    assert sum(op.total for op in updates) == 2 * 2 * (sliding * sliding_layer
                                                        + full * global_layer)
    # The write-back of an in-place chain moves nothing.
    writes = [op for op in main_traffic.ops if op.op_type == "coreml_update_state"]
    assert len(writes) == 4 and all(op.total == 0 for op in writes)
    # Layer 0's weights: q, k, v, o and the attention's output gate, the MLP's gate, up and
    # down, fp16; its norms are below the weight threshold.
    heads, intermediate = text["num_attention_heads"], text["intermediate_size"]
    weights = FP16 * (3 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
                      + 3 * hidden * intermediate)
    layer0 = [op for op in main_traffic.ops if op.name.startswith("p_layers_0_")]
    assert {op.part for op in layer0} == {WEIGHTS}
    assert sum(op.bytes_in for op in layer0) == weights
    assert all(op.bytes_out == 0 for op in layer0)
    # The floor: every weight once, every state once.
    states = 2 * FP16 * kv * head_dim * (sliding * ring + full * CONTEXT)
    summary = main_traffic.summary()
    assert summary.state_bytes == states
    assert summary.floor == summary.total(WEIGHTS) + states


def test_slice_writes_of_the_global_layers_move_only_their_rows(tmp_path):
    """//tests/runtime:dflash2_slice_bundle against dflash2_bundle, the same export with the
    blend (the tiny target at context 256), both exported once by the build."""
    text, sliding, full, _ = _geometry()
    kv, head_dim = text["num_key_value_heads"], text["head_dim"]
    blend_bundle = prebuilt_bundle(tmp_path / "blend", DFLASH2_BUNDLE)
    slice_bundle = prebuilt_bundle(tmp_path / "slice", DFLASH2_SLICE_BUNDLE)
    metadata = Metadata.read(slice_bundle)
    assert metadata.kv_write_strategy == KVWrite.SLICE
    assert Metadata.read(blend_bundle).kv_write_strategy == KVWrite.BLEND
    target = metadata.assets["target"]
    query, ring = target.functions["main"].query_length, target.capacity(StateKind.SLIDING_KV)
    (counted,) = bundle_traffic(slice_bundle, "main")
    updates = [op for op in counted.ops if op.op_type == "slice_update"]
    assert all(op.in_place for op in updates)
    # --kv-write slice: each global layer writes its T new rows of K and of V, in place.
    rows = kv * query * head_dim * FP16
    assert [op.bytes_in for op in updates].count(rows) == 2 * full
    assert all(op.bytes_out == op.bytes_in for op in updates)
    # The sliding rings keep the blend: a whole ring layer per write, as in the blend bundle.
    assert [op.bytes_in for op in updates].count(kv * ring * head_dim * FP16) == 2 * sliding
    (blend_main,) = bundle_traffic(blend_bundle, "main")
    blend = blend_main.summary()
    assert counted.summary().total(STATE_SIZED) < blend.total(STATE_SIZED)
    assert counted.summary().floor == blend.floor


def test_every_function_is_counted_and_the_parts_add_up(bundle, main_traffic):
    counted = bundle_traffic(bundle)
    assert [(f.package, f.function) for f in counted] == [
        # Every Core ML function of the function table, the one-token decode and the tree
        # verify among them.
        ("target.mlpackage", name) for name in ("main", "prefill", "decode", "tree",
                                                "inject_kv", "draft")]
    summary = main_traffic.summary()
    assert summary.total() == sum(op.total for op in main_traffic.ops)
    assert sum(count for _, _, count in summary.parts.values()) == len(main_traffic.ops)
    assert summary.total(STATE_SIZED) > 0 and summary.total(REST) > 0
    lines = traffic.format_summary(summary)
    assert any(line.split()[:1] == ["state-sized"] for line in lines)


# --- Programs built op by op -----------------------------------------------------------------


STATE_SHAPE = (2, 2, 64, 16)  # layers, KV heads, capacity, head_dim


def _program(write_back: bool):
    rng = np.random.default_rng(0)
    indices = rng.integers(0, 16, size=(64, 64)).astype(types.np_uint4_dtype)
    lut = np.arange(16, dtype=np.float16).reshape(1, 1, 16, 1)
    dense = rng.standard_normal((64, 64)).astype(np.float16)

    @mb.program(input_specs=[mb.StateTensorSpec(STATE_SHAPE, dtype=types.fp16),
                             mb.TensorSpec((2, 4, 16), dtype=types.fp16)],
                opset_version=ct.target.iOS18)
    def program(cache, rows):
        update = mb.expand_dims(x=rows, axes=[0])  # a view: [1, 2, 4, 16]
        written = mb.slice_update(x=mb.read_state(input=cache), update=update,
                                  begin=[1, 0, 8, 0], end=[2, 2, 12, 16])
        if write_back:
            mb.coreml_update_state(state=cache, value=written)
        fresh = mb.fill(shape=list(STATE_SHAPE), value=np.float16(0))
        copied = mb.slice_update(x=fresh, update=update, begin=[0, 0, 0, 0],
                                 end=[1, 2, 4, 16])
        flat = mb.reshape(x=copied, shape=[64, 64])
        palettized = mb.constexpr_lut_to_dense(indices=indices, lut=lut)
        return mb.add(x=mb.matmul(x=flat, y=palettized), y=mb.const(val=dense))

    return program.functions["main"]


def _by_type(counted):
    return {op.op_type: op for op in counted.ops}


def test_in_place_and_fresh_slice_updates_by_hand():
    counted = function_traffic(_program(write_back=True), "p", "main")
    ops = _by_type(counted)
    rows = 2 * 4 * 16 * FP16
    state = math.prod(STATE_SHAPE) * FP16
    updates = [op for op in counted.ops if op.op_type == "slice_update"]
    # Into the state, written back: the update only, read and written.
    assert (updates[0].in_place, updates[0].bytes_in, updates[0].bytes_out) == (True, rows, rows)
    assert updates[0].part == REST  # four rows are not a layer
    # Into a fresh tensor: the whole tensor read and written, and the update read.
    assert (updates[1].in_place, updates[1].bytes_in, updates[1].bytes_out) == (
        False, state + rows, state)
    assert updates[1].part == STATE_SIZED
    assert ops["coreml_update_state"].total == 0
    # Weights at their stored size: 4-bit indices plus the table; the dense const in fp16.
    assert ops["constexpr_lut_to_dense"].bytes_in == 64 * 64 // 2 + 16 * FP16
    assert ops["const"].bytes_in == 64 * 64 * FP16
    # The matmul reads the reshaped view (no constant input counted) and writes its result;
    # the add reads it, not the const.
    assert (ops["matmul"].bytes_in, ops["matmul"].bytes_out) == (state, state)
    assert (ops["add"].bytes_in, ops["add"].bytes_out) == (state, state)
    assert counted.views == 3  # read_state, expand_dims, reshape
    assert counted.state_bytes == state


def test_an_update_that_never_reaches_the_state_moves_its_whole_output():
    counted = function_traffic(_program(write_back=False), "p", "main")
    first = next(op for op in counted.ops if op.op_type == "slice_update")
    state = math.prod(STATE_SHAPE) * FP16
    assert (first.in_place, first.bytes_out) == (False, state)


# --- Geometry and extrapolation --------------------------------------------------------------


def test_the_geometry_is_the_issues_52_layers():
    target, drafter = geometry_configs()
    text = target["text_config"]
    assert (text["num_hidden_layers"], text["num_key_value_heads"], text["head_dim"]) == (
        52, 2, 128)
    assert drafter["block_size"] == 8  # a main of 8: 7 drafted tokens and the anchor
    small, _ = geometry_configs(8)
    assert small["text_config"]["layer_types"] == text["layer_types"][:8]
    with pytest.raises(traffic.TrafficError, match="multiple of 4"):
        geometry_configs(6)


def test_extrapolation_is_linear_per_layer():
    def at(layers):
        return Summary("f", {STATE_SIZED: (10 * layers, 5 * layers, 3 * layers),
                             WEIGHTS: (100 + 7 * layers, 0, 2 + layers), REST: (1, 2, 3)},
                       {"select": (15 * layers, 3 * layers)}, state_bytes=4 * layers, views=9)

    carried = extrapolate(at(4), at(8), 4, 8, 52)
    assert carried.parts == at(52).parts and carried.types == at(52).types
    assert carried.state_bytes == at(52).state_bytes
    assert "52 layers" in carried.note


# --- The command line ------------------------------------------------------------------------


def _refusal(capsys, *args):
    status = run_main(traffic_main.main, *args)
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_refuses_a_missing_export_dir(tmp_path, capsys):
    err = _refusal(capsys, "--export-dir", str(tmp_path / "nope"))
    assert "nope is not a directory" in err and "metadata.json" in err


def test_cli_refuses_a_directory_without_metadata(tmp_path, capsys):
    err = _refusal(capsys, "--export-dir", str(tmp_path))
    assert "metadata.json not found" in err and "//:export" in err


def test_cli_refuses_an_unknown_function(bundle, capsys):
    err = _refusal(capsys, "--export-dir", str(bundle), "--function", "mian")
    assert "'mian'" in err and "'main'" in err and "choose one of" in err


def test_cli_refuses_neither_or_both_modes(bundle, capsys):
    assert "exactly one of" in _refusal(capsys)
    assert "exactly one of" in _refusal(capsys, "--export-dir", str(bundle),
                                        "--geometry-context", "1024")
    assert "--geometry-context" in _refusal(capsys, "--export-dir", str(bundle),
                                            "--layers", "4")
    assert "multiple of 32" in _refusal(capsys, "--geometry-context", "1000", "--layers", "4")
    assert "whole numbers" in _refusal(capsys, "--geometry-context", "1k")
    assert "metadata.json" in _refusal(capsys, "--export-dir", str(bundle), "--kv-write", "slice")
    err = _refusal(capsys, "--geometry-context", "1024", "--layers", "4", "--kv-write", "host")
    assert "'host'" in err and "'slice'" in err


def test_cli_prints_one_table_per_function(bundle, capsys):
    assert run_main(traffic_main.main, "--export-dir", str(bundle), "--function", "draft") == 0
    out = capsys.readouterr().out
    assert "target.mlpackage draft" in out and "x floor" in out
    assert "target.mlpackage main" not in out
