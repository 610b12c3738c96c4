"""Context buckets (docs/buckets.md): the one function table in bundle.py, the flag's rules, the
models' spans, and a bucketed bundle decoding exactly as its unbucketed twin across every
bucket boundary.

The bundles: //tests/runtime:dflash2_bundle (the tiny target with a DFlash2 drafter at capacity
256, buckets 64 and 128) and dflash2_slice_bundle, the same export with --kv-write slice and no
buckets. Every write strategy computes the same values (docs/kv-write.md), so they must give
the same tokens, accepted drafts and call trace."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from prebuilt import DFLASH2_BUNDLE, DFLASH2_SLICE_BUNDLE

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.bundle import (
    PACKAGE_WEIGHT_FILE,
    Asset,
    AssetKind,
    AssetRole,
    BundleError,
    ContextBucket,
    Function,
    FunctionName,
    FunctionRole,
    InputName,
    OutputName,
    State,
    StateKind,
    StateName,
)
from museflash.checkpoint.load import load_drafter, load_target
from museflash.export.options import (
    ExportError,
    ExportOptions,
    check_context_buckets,
    default_context_buckets,
    parse_context_buckets,
)
from museflash.export.plan import plan_export
from museflash.runtime.speculative import DecodeSession, load_exported_pair
from museflash.tools.runtime_goldens import Recorder

# --- The flag and the default --------------------------------------------------------------


def test_default_buckets_double_from_512_up_to_the_capacity_and_stay_at_five():
    assert default_context_buckets(512, 32) == ()
    assert default_context_buckets(8192, 32) == (512, 1024, 2048, 4096)
    wide = default_context_buckets(131072, 32)
    assert len(wide) == 4 and wide[0] == 512
    assert all(b % 32 == 0 for b in wide) and list(wide) == sorted(wide)


@pytest.mark.parametrize("buckets, problem", [
    ((128, 64), "not strictly ascending"),
    ((64, 64), "not strictly ascending"),
    ((100,), "not a multiple of 32.*use 128"),
    ((512,), "exceeds the capacity 256"),
    ((32,), "below the longest call \\(33 tokens"),
])
def test_bad_buckets_are_refused_naming_the_problem(buckets, problem):
    with pytest.raises(ExportError, match=problem):
        check_context_buckets(buckets, 256, 33)


def test_a_bucket_list_that_is_not_integers_is_refused():
    assert parse_context_buckets("64,128") == (64, 128)
    with pytest.raises(ExportError, match="not a comma-separated list of integers"):
        parse_context_buckets("64,big")


def test_the_plan_gives_each_bucket_a_main_a_prefill_and_a_decode_smallest_first(tmp_path):
    options = ExportOptions(output_dir=tmp_path, builtin="tiny", fused_target=True,
                            dflash_drafter=True, max_context_length=256, prefill_length=8,
                            context_buckets=(64, 128, 256))
    with builtin_checkpoints("tiny") as (target_dir, drafter_dir):
        plan = plan_export(options, target_dir, drafter_dir)
    target = plan.asset(AssetRole.TARGET)
    assert target.buckets == (64, 128)  # the capacity is the whole-capacity functions'
    assert [(f.name, f.bucket) for f in target.functions] == [
        ("main_64", 64), ("prefill_64", 64), ("decode_64", 64), ("tree_64", 64),
        ("main_128", 128), ("prefill_128", 128), ("decode_128", 128), ("tree_128", 128),
        ("main", None), ("prefill", None), ("decode", None), ("tree", None)]
    assert {f.query_length for f in target.functions if f.function == FunctionName.DECODE} == {1}
    assert [f.name for f in plan.asset(AssetRole.DFLASH_DRAFTER).functions] == [
        "inject_kv", "draft"]


@pytest.mark.parametrize("pair, context, buckets", [
    ("tiny-qwen3", 4096, (512, 1024, 2048)),  # its own 4096 positions
    ("tiny-llama", 8192, (512, 1024, 2048, 4096)),  # 131,072 trained: capped at 8192
])
def test_the_default_capacity_is_the_models_own_up_to_8192(tmp_path, pair, context, buckets):
    options = ExportOptions(output_dir=tmp_path, builtin=pair, fused_target=True,
                            dflash_drafter=True)
    with builtin_checkpoints(pair) as (target_dir, drafter_dir):
        plan = plan_export(options, target_dir, drafter_dir)
    assert plan.context_length == context
    assert plan.asset(AssetRole.TARGET).buckets == buckets
    # Their z-lab-shaped drafters attend to the whole context: the same buckets.
    assert plan.asset(AssetRole.DFLASH_DRAFTER).buckets == buckets


# --- The function table ----------------------------------------------------------------------


def _function(role: FunctionRole, length: int) -> Function:
    return Function(role, length, [InputName.INPUT_IDS, InputName.POSITION_IDS],
                    [OutputName.LOGITS])


def _asset(buckets: list[ContextBucket] | None, capacity: int = 256,
           decode: Function | None = None) -> Asset:
    main, prefill = _function(FunctionRole.DECODE, 8), _function(FunctionRole.PREFILL, 32)
    states = [State(name, StateKind.GLOBAL_KV, name.role, [2, 1, capacity, 16], "float16", 2,
                    1, capacity, 16)
              for name in (StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE)]
    return Asset("target.mlpackage", AssetKind.TARGET, FunctionName.MAIN,
                 {FunctionName.MAIN: main, FunctionName.PREFILL: prefill}, states, buckets,
                 decode)


def _bucket(context: int) -> ContextBucket:
    return ContextBucket(context, {FunctionName.MAIN: _function(FunctionRole.DECODE, 8),
                                   FunctionName.PREFILL: _function(FunctionRole.PREFILL, 32)})


def test_each_call_runs_in_the_smallest_bucket_holding_its_last_position():
    asset = _asset([_bucket(64), _bucket(128)])
    assert [row.name for row in asset.function_table()] == [
        "main_64", "prefill_64", "main_128", "prefill_128", "main", "prefill"]
    picks = {last: asset.pick(FunctionName.MAIN, last).name for last in (0, 63, 64, 127, 128, 255)}
    assert picks == {0: "main_64", 63: "main_64", 64: "main_128", 127: "main_128",
                     128: "main", 255: "main"}
    assert asset.pick(FunctionName.PREFILL, 10).context == 64
    with pytest.raises(BundleError, match="position 256 is past the 256 slots"):
        asset.pick(FunctionName.MAIN, 256)
    with pytest.raises(BundleError, match="no function draft"):
        asset.pick(FunctionName.DRAFT, 0)


@pytest.mark.parametrize("buckets, problem", [
    ([_bucket(128), _bucket(64)], "not strictly ascending"),
    ([_bucket(256)], "not inside its context-sized caches' capacity"),
    ([ContextBucket(64, {FunctionName.MAIN: _function(FunctionRole.DECODE, 4)})],
     "function main that differs"),
])
def test_metadata_whose_buckets_break_the_contract_is_refused(buckets, problem):
    with pytest.raises(BundleError, match=problem):
        _asset(buckets)


def test_a_decode_runs_in_every_bucket_listing_it_and_is_kept_out_of_functions():
    decode = _function(FunctionRole.DECODE, 1)
    bucket = ContextBucket(64, {FunctionName.MAIN: _function(FunctionRole.DECODE, 8),
                                FunctionName.DECODE: decode})
    asset = _asset([bucket], decode=decode)
    assert [row.name for row in asset.function_table()] == [
        "main_64", "decode_64", "main", "prefill", "decode"]
    assert [asset.pick(FunctionName.DECODE, last).name for last in (63, 64)] == [
        "decode_64", "decode"]
    # Older readers drive `functions` and refuse names they do not know: decode stays out.
    with pytest.raises(BundleError, match="belongs under the asset's `decode` key"):
        dataclasses.replace(asset, functions=asset.functions | {FunctionName.DECODE: decode})
    with pytest.raises(BundleError, match="not a one-token copy of its main"):
        dataclasses.replace(asset, decode=_function(FunctionRole.DECODE, 2))
    with pytest.raises(BundleError, match="function decode that differs"):
        _asset([bucket])  # a bucket's decode needs the asset's own


def test_a_tree_runs_in_every_bucket_with_one_and_is_kept_out_of_functions():
    tree = Function(FunctionRole.TREE, 8, [InputName.INPUT_IDS, InputName.POSITION_IDS,
                                           InputName.TREE_MASK], [OutputName.LOGITS])
    bucket = dataclasses.replace(_bucket(64), tree=tree)
    asset = dataclasses.replace(_asset(None), buckets=[bucket], tree=tree)
    assert [row.name for row in asset.function_table()] == [
        "main_64", "prefill_64", "tree_64", "main", "prefill", "tree"]
    assert [asset.pick(FunctionName.TREE, last).name for last in (63, 64)] == ["tree_64", "tree"]
    # Older readers refuse function names they do not know: a tree stays out of `functions`,
    # a bucket's too (buckets predate it).
    with pytest.raises(BundleError, match="belongs under the asset's `tree` key"):
        dataclasses.replace(asset, functions=asset.functions | {FunctionName.TREE: tree})
    with pytest.raises(BundleError, match="belongs under the asset's `tree` key"):
        dataclasses.replace(asset, buckets=[ContextBucket(
            64, bucket.functions | {FunctionName.TREE: tree})])
    with pytest.raises(BundleError, match="not main's verify with a tree_mask"):
        dataclasses.replace(asset, tree=dataclasses.replace(tree, inputs=tree.inputs[:2]))
    with pytest.raises(BundleError, match="function tree that differs"):
        dataclasses.replace(asset, tree=None)  # the bucket's tree needs the asset's own


def test_an_asset_without_buckets_has_only_its_own_functions():
    table = _asset(None).function_table()
    assert [(row.name, row.context) for row in table] == [("main", None), ("prefill", None)]
    assert _asset(None).pick(FunctionName.MAIN, 255).name == "main"


# --- The models ------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["tiny", "tiny-qwen3"])
def test_a_span_view_computes_the_same_bits_and_writes_only_inside_its_span(pair):
    with builtin_checkpoints(pair) as (target_dir, drafter_dir):
        whole = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=128,
                            max_query_len=8)
        spanned = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=128,
                              max_query_len=8)
    ids = torch.arange(3, 11, dtype=torch.int32).reshape(1, 8)
    full, bucket = whole.with_entry_point("forward"), spanned.with_entry_point("forward", span=64)
    for start in (0, 8, 40, 56):
        positions = torch.arange(start, start + 8, dtype=torch.int32)
        for a, b in zip(full(ids, positions), bucket(ids, positions), strict=True):
            assert torch.equal(a, b)
    for name in ("globalKeyCache", "globalValueCache"):
        assert torch.equal(getattr(whole, name), getattr(spanned, name))
        assert getattr(spanned, name)[:, :, 56:64].abs().sum() > 0
        assert getattr(spanned, name)[:, :, 64:].abs().sum() == 0


def test_a_full_attention_drafters_span_view_computes_the_same_bits():
    """tiny-qwen3's z-lab-shaped drafter attends to the whole context: its ring can be
    bucketed like the target's global caches; a sliding drafter's (tiny-dflash2's) cannot."""
    with builtin_checkpoints("tiny-qwen3") as (target_dir, drafter_dir):
        target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=128,
                             max_query_len=8)
        drafters = [load_drafter(drafter_dir, target, target_dir=target_dir,
                                 dtype=torch.float32, max_context=128, max_query_len=8)
                    for _ in range(2)]
    whole, spanned = drafters
    width = whole.layers[0].self_attn.k_proj.in_features
    features = torch.linspace(-1, 1, 8 * width).reshape(1, 8, width)
    ids = torch.arange(3, 11, dtype=torch.int32).reshape(1, 8)
    for start in (0, 8, 40, 56):
        positions = torch.arange(start, start + 8, dtype=torch.int32)
        whole.with_entry_point("inject_kv")(features, positions)
        spanned.with_entry_point("inject_kv", span=64)(features, positions)
        a = whole.with_entry_point("draft")(ids, positions)
        b = spanned.with_entry_point("draft", span=64)(ids, positions)
        assert torch.equal(a, b)
    for mine, theirs in zip(whole.caches, spanned.caches, strict=True):
        assert torch.equal(mine, theirs) and theirs[:, :, 64:].abs().sum() == 0
    with builtin_checkpoints("tiny-dflash2") as (target_dir, drafter_dir):
        target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=128,
                             max_query_len=8)
        sliding = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=torch.float32,
                               max_context=128, max_query_len=8)
    with pytest.raises(ValueError, match="only a full-attention drafter"):
        sliding.with_entry_point("draft", span=64)


# --- A bucketed bundle against its unbucketed twin --------------------------------------------


def _bundle(variable: str) -> Path:
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"{variable} is not set: run through Bazel")
    return Path(path)


@pytest.fixture(scope="module")
def twins():
    """(bucketed, unbucketed): each the (target, drafter, metadata) of its bundle."""
    return (load_exported_pair(_bundle(DFLASH2_BUNDLE)),
            load_exported_pair(_bundle(DFLASH2_SLICE_BUNDLE)))


def _bucket_of(name: str) -> int | None:
    match = re.fullmatch(r"[a-z_]+?_(\d+)", name)
    return int(match.group(1)) if match else None


def _decode_turns(pair, turns: list[tuple[int, int]], drafter: bool):
    """Greedy decoding of a chat-like session: per turn (prompt ids added, new tokens), the
    history so far plus the new ids, with both caches kept across turns. Returns the tokens
    and accepted drafts of each turn, and the recorded calls: (function, first position,
    length) per turn."""
    target, draft, metadata = pair
    session = DecodeSession(target, draft if drafter else None,
                            mask_token_id=metadata.speculative_decoding.mask_token_id,
                            context_length=metadata.context_length, lookup_min_match=0)
    session.reset()
    recorder = Recorder([target.package, draft.package])
    calls, results, history = [], [], []
    rng = np.random.default_rng(7)
    try:
        for added, new in turns:
            history += [int(t) for t in rng.integers(3, metadata.vocab_size, added)]
            recorder.start()
            result = session.generate(history, new)
            calls.append(list(recorder.trace))
            results.append((result.tokens, result.accepted, result.reused_tokens))
            history += result.tokens
    finally:
        recorder.close()
    return results, calls


def _ran(pair) -> list[str]:
    target, draft, _ = pair
    return list(target.package.ran)


@pytest.mark.parametrize("drafter", [True, False], ids=["speculative", "target-only"])
def test_bucketed_and_unbucketed_bundles_decode_the_same_across_every_boundary(twins, drafter):
    bucketed, plain = twins
    # 70 ids: the prefill's last chunk (38..69) straddles 64; 110 new tokens run verify blocks
    # across 128, with rejections rolling back below it; the second turn grows the history
    # from about 180 positions, so the session moves up into the whole capacity.
    turns = [(70, 110), (6, 20)]
    for pair in twins:
        pair[0].package.ran.clear()
    got, got_calls = _decode_turns(bucketed, turns, drafter)
    want, want_calls = _decode_turns(plain, turns, drafter)
    assert got == want
    assert got_calls == want_calls  # the same functions at the same positions, in order
    assert got[1][2] > 0, "the second turn kept the first turn's caches"
    # Which bucket each target call ran in: the smallest holding its last position.
    target_functions = (FunctionName.MAIN, FunctionName.PREFILL, FunctionName.DECODE)
    trace = [row for turn in got_calls for row in turn if row["function"] in target_functions]
    ran = _ran(bucketed)
    assert len(ran) == len(trace)
    capacity = bucketed[2].context_length
    for row, name in zip(trace, ran, strict=True):
        last = row["first_position"] + row["length"] - 1
        bucket = _bucket_of(name) or capacity
        smaller = [b for b in (64, 128, capacity) if b < bucket]
        assert last < bucket and all(last >= b for b in smaller), (row, name)
    assert set(_ran(plain)) <= {"main", "prefill", "decode"}

    def straddles(row, boundary):
        return row["first_position"] < boundary <= row["first_position"] + row["length"] - 1

    rows = list(zip(trace, ran, strict=True))
    prefills = [(row, name) for row, name in rows if row["function"] == "prefill"]
    assert any(straddles(row, 64) and name == "prefill_128" for row, name in prefills)
    mains = [(row, name) for row, name in rows if row["function"] == "main"]
    decodes = [(row, name) for row, name in rows if row["function"] == "decode"]
    if drafter:
        assert not decodes
        assert any(straddles(row, 128) and name == "main" for row, name in mains)
        # A rollback across a boundary: a call wrote past 128, the next one starts below it.
        assert any(a["first_position"] + a["length"] > 128 > b["first_position"]
                   for (a, _), (b, _) in zip(mains, mains[1:], strict=False))
    else:
        # The target alone steps one token at a time through decode, up across 128.
        assert not mains and all(row["length"] == 1 for row, _ in decodes)
        assert {"decode_128", "decode"} <= {name for _, name in decodes}
    # The session moved up: the first turn's last call ran in a smaller bucket than the
    # whole capacity the second turn's calls run in.
    first_turn = sum(1 for row in got_calls[0] if row["function"] in target_functions)
    assert _bucket_of(ran[0]) == 64 and _bucket_of(ran[first_turn]) is None


def test_the_bucketed_package_stores_each_weight_once():
    """Within 1% of the unbucketed weight file: each bucket adds only its masks' small
    constants (hundreds of bytes), never a copy of a weight."""
    bucketed, plain = [(_bundle(v) / "target.mlpackage" / PACKAGE_WEIGHT_FILE).stat().st_size
                       for v in (DFLASH2_BUNDLE, DFLASH2_SLICE_BUNDLE)]
    assert plain <= bucketed <= 1.01 * plain


def test_decode_steps_the_target_alone_as_main_does(twins):
    """Target-alone decoding through the one-token decode gives the tokens of decoding
    through main with pad rows, which is what a bundle without decode does."""
    target, _, metadata = twins[0]
    assert target.step_function == FunctionName.DECODE and target.step_length == 1
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, metadata.vocab_size, 70)]
    with_decode = DecodeSession(target, None, context_length=metadata.context_length)
    with_decode.reset()
    got = with_decode.generate(prompt, 70)
    target.step_function, target.step_length = FunctionName.MAIN, target.verify_length
    try:
        with_main = DecodeSession(target, None, context_length=metadata.context_length)
        with_main.reset()
        want = with_main.generate(prompt, 70)
    finally:
        target.step_function, target.step_length = FunctionName.DECODE, 1
    assert got.tokens == want.tokens
    assert (got.decode_calls, got.verify_calls) == (69, 0)
    assert (want.decode_calls, want.verify_calls) == (0, 69)


def test_verify_checks_the_smallest_buckets_functions_against_the_eager_view():
    """//:verify parity-checks main, prefill, decode and tree over the whole capacity and their
    copies in the smallest bucket (the others differ only in the span), each at positions
    below its bucket."""
    from museflash.bundle import Metadata
    from museflash.checks import verify

    bundle = _bundle(DFLASH2_BUNDLE)
    metadata = Metadata.read(bundle)
    checks = verify.target_checks(metadata)
    assert [(str(function), bucket) for function, _, _, bucket in checks] == [
        ("main", None), ("prefill", None), ("decode", None), ("tree", None),
        ("main", 64), ("prefill", 64), ("decode", 64), ("tree", 64)]
    with builtin_checkpoints("tiny-dflash2") as dirs:
        target, _ = verify.load_reference_models(metadata, *dirs)
    for function, entry, seed, bucket in checks[4:]:
        result = verify.check_target(bundle, metadata, target, function, entry, seed,
                                     bucket=bucket)
        assert result.ok and result.name == f"target.{function}_64", result.line()
        last = int(re.search(r"positions \d+\.\.(\d+)", result.note).group(1))
        assert last < 64, result.note
