"""The stateful entry points export with torch.export and convert with coremltools (iOS18)."""

import numpy as np
import pytest
import torch

from museflash.builtin.demo_checkpoint import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET_CONFIG,
    build_tiny_models,
)
from museflash.bundle import StateName

ct = pytest.importorskip("coremltools")


def _states(module, names):
    return [
        ct.StateType(
            wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16),
            name=n,
        )
        for n in names
    ]


def _convert(module, example_args, input_specs, state_names, tmp_path, name):
    before = {n: getattr(module, n).clone() for n in state_names}
    exported = torch.export.export(module, example_args).run_decompositions({})
    mutated = set(exported.graph_signature.buffers_to_mutate.values())
    assert mutated == set(state_names), "every cache must be written by this entry point"
    for n in state_names:  # exporting must not have run the model on the real caches
        assert torch.equal(getattr(module, n), before[n])
    model = ct.convert(
        exported,
        inputs=input_specs,
        states=_states(module, state_names),
        minimum_deployment_target=ct.target.iOS18,
        skip_model_load=True,
    )
    model.save(str(tmp_path / f"{name}.mlpackage"))
    spec_states = {s.name for s in model.get_spec().description.state}
    assert spec_states == set(state_names)


@pytest.fixture(scope="module")
def models():
    # A shallower model than the demo keeps conversion quick; one [S, S, S, G] period covers
    # both cache kinds.
    text = dict(TINY_TARGET_CONFIG["text_config"], num_hidden_layers=4,
                layer_types=TINY_TARGET_CONFIG["text_config"]["layer_types"][:4],
                layer_rope_theta=TINY_TARGET_CONFIG["text_config"]["layer_rope_theta"][:4])
    drafter = dict(TINY_DRAFTER_CONFIG, num_hidden_layers=1, target_layer_ids=[1, 3])
    return build_tiny_models(seed=0, target_config={"text_config": text},
                             drafter_config=drafter, max_context=64, max_query_len=4)


TARGET_STATES = [StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE,
                 StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE]
DRAFTER_STATES = [StateName.DRAFTER_KEY_CACHE, StateName.DRAFTER_VALUE_CACHE]


def _int_inputs(length, first="input_ids", shape=None):
    return [
        ct.TensorType(name=first, shape=shape or (1, length), dtype=np.int32),
        ct.TensorType(name="position_ids", shape=(length,), dtype=np.int32),
    ]


def test_fused_target_converts(models, tmp_path):
    # prefill differs from forward only by slicing the last hidden state; converting it as
    # well would double this file's runtime.
    target, _ = models
    args = (torch.zeros(1, 4, dtype=torch.int32), torch.arange(4, dtype=torch.int32))
    _convert(target, args, _int_inputs(4), TARGET_STATES, tmp_path, "forward")


@pytest.mark.parametrize("entry_point", ["draft", "inject_kv"])
def test_drafter_converts(models, tmp_path, entry_point):
    _, drafter = models
    module = drafter.with_entry_point(entry_point)
    if entry_point == "draft":
        args = (torch.zeros(1, 4, dtype=torch.int32), torch.arange(4, dtype=torch.int32))
        inputs = _int_inputs(4)
    else:
        args = (torch.zeros(1, 4, 64), torch.arange(4, dtype=torch.int32))
        inputs = [
            ct.TensorType(name="features", shape=(1, 4, 64), dtype=np.float32),
            ct.TensorType(name="position_ids", shape=(4,), dtype=np.int32),
        ]
    _convert(module, args, inputs, DRAFTER_STATES, tmp_path, entry_point)


def test_constants_deduplicate_as_coremltools_groups_them_with_placeholders_read_by_row():
    """export.coreml_patches._find_constants against coremltools' own find_constants on consts that
    are broadcast rows (as placeholders are): equal rows, a slightly moved row, another row,
    and a materialised copy of the first."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
        const_deduplication,
    )

    from museflash.export.coreml_patches import _broadcast_row, _find_constants

    row = np.linspace(-1, 1, 64).astype(np.float16)
    values = [np.broadcast_to(row, (32, 64)), np.broadcast_to(row.copy(), (32, 64)),
              np.broadcast_to(row + np.float16(1e-4), (32, 64)),
              np.broadcast_to(row + np.float16(0.5), (32, 64)),
              np.ascontiguousarray(np.broadcast_to(row, (32, 64)))]

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64), dtype=types.fp16)],
                opset_version=ct.target.iOS18)
    def program(x):
        return mb.concat(values=[mb.matmul(x=x, y=mb.const(val=v), transpose_y=True)
                                 for v in values], axis=-1)

    blocks = [program.functions["main"]]
    consts = [op.outputs[0] for op in blocks[0].operations if op.op_type == "const"]
    assert sum(_broadcast_row(var.val) for var in consts) == 4  # the rows reach the pass as such

    def named(groups):
        return {key.name: [var.name for var in found] for key, found in groups.items()}

    ours = named(_find_constants(blocks))
    assert ours == named(const_deduplication.find_constants(blocks))
    # The equal rows and the materialised copy are one constant; a row moved by 1e-4 hashes
    # apart (the key is its first values) before tolerance is consulted.
    assert sorted(len(found) for found in ours.values()) == [0, 0, 2]


def _upstream_constexprs_after_a_rewrite(replace: bool) -> list[set[str]]:
    """x + w with w from a constexpr op, as coremltools marks the sum's constexpr ancestors:
    built, then after a pass-like rewrite in the block's context (w replaced by a const and
    its op removed, when `replace`; nothing changed otherwise)."""
    from coremltools.converters.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec(shape=(4,))], opset_version=ct.target.iOS18)
    def program(x):
        w = mb.constexpr_blockwise_shift_scale(data=np.full(4, 2, np.int8),
                                               scale=np.ones(4, np.float32))
        return mb.add(x=x, y=w)

    block = program.functions["main"]
    (constexpr,) = block.find_ops(op_type="constexpr_blockwise_shift_scale")
    (add,) = block.find_ops(op_type="add")

    def marked():
        return {var.op.op_type for var in add.outputs[0].nonreplaceable_vars_upstream}

    built = marked()
    with block:
        if replace:
            const = mb.const(val=np.full(4, 2.0, np.float32), before_op=constexpr)
            block.replace_uses_of_var_after_op(anchor_op=constexpr, old_var=constexpr.outputs[0],
                                               new_var=const, force_replace=True)
            block.remove_ops([constexpr])
    return [built, marked()]


@pytest.mark.parametrize("replace", [True, False], ids=["constexpr-replaced", "constexpr-kept"])
def test_constexpr_tracking_is_skipped_only_where_it_changes_nothing(replace):
    """coreml_patches.constexpr_tracking_skipped_without_constexpr: coremltools marks what lies
    downstream of a constexpr op as not replaceable by a var that does not, and re-marks the
    block when its context closes. With the shortcut the marks must be coremltools' own: a sum
    whose constexpr input a rewrite removed is re-marked free (no constexpr op is left, but a
    stale mark is), and one whose input stays keeps its mark."""
    from museflash.export.coreml_patches import constexpr_tracking_skipped_without_constexpr

    expected = _upstream_constexprs_after_a_rewrite(replace)
    with constexpr_tracking_skipped_without_constexpr():
        assert _upstream_constexprs_after_a_rewrite(replace) == expected
    kept = {"constexpr_blockwise_shift_scale"}
    assert expected == [kept, set() if replace else kept]
