"""The bundle contract (museflash.bundle): its schema, its decoder and the golden examples that
the Swift reader is tested against too."""

import json
import os
from pathlib import Path

import pytest

from museflash import bundle
from museflash.bundle import (
    AssetRole,
    BundleError,
    CompressionMode,
    DrafterKind,
    FunctionName,
    KVWrite,
    LayerType,
    Metadata,
    OutputName,
    StateKind,
    StateName,
    schema_errors,
    schema_text,
)

CHECKED_IN_SCHEMA = Path(os.environ.get("MUSEFLASH_METADATA_SCHEMA", "docs/metadata.schema.json"))
EXAMPLES = Path(os.environ.get("MUSEFLASH_METADATA_EXAMPLES", "python/metadata_examples.json"))


@pytest.fixture(scope="module")
def examples():
    return json.loads(EXAMPLES.read_text())


def test_the_checked_in_schema_is_the_generated_one():
    assert CHECKED_IN_SCHEMA.read_text() == schema_text(), (
        "docs/metadata.schema.json is stale: run ./bazelw run //:metadata_schema")


def test_the_schema_states_the_compatibility_rules():
    schema = bundle.json_schema()
    assert schema["properties"]["schema_version"]["enum"] == list(
        bundle.SUPPORTED_SCHEMA_VERSIONS)
    objects = [schema] + [d for d in schema["$defs"].values() if d.get("type") == "object"]
    assert all(o["additionalProperties"] is True for o in objects)
    assert schema["$defs"]["SpeculativeDecoding"]["properties"]["drafter_kind"]["enum"] == [
        k.value for k in DrafterKind]


def test_every_valid_example_conforms_decodes_and_round_trips(examples):
    assert {e["name"] for e in examples["valid"]} == {
        "dflash", "dflash_with_tokenizer", "dflash2", "ring", "fused_target_only",
        "target_only", "target_only_4bit", "dflash_mixed_rules", "dflash_kv_slice",
        "dflash_global_only_target"}
    for example in examples["valid"]:
        raw = example["metadata"]
        assert schema_errors(raw) == [], example["name"]
        assert Metadata.from_json(raw).to_json() == raw, example["name"]


def test_the_examples_are_what_the_exporter_writes_for_each_kind(examples):
    by_name = {e["name"]: Metadata.from_json(e["metadata"]) for e in examples["valid"]}
    dflash = by_name["dflash"]
    assert set(dflash.assets) == {AssetRole.TARGET, AssetRole.DFLASH_DRAFTER}
    assert dflash.asset(AssetRole.DFLASH_DRAFTER).path == dflash.asset(AssetRole.TARGET).path
    assert [s.name for s in dflash.asset(AssetRole.DFLASH_DRAFTER).states] == list(
        bundle.DRAFTER_STATES)
    assert by_name["ring"].package_owners() == {"target.mlpackage": AssetRole.TARGET,
                                                "ring_drafter.mlpackage": AssetRole.RING_DRAFTER}
    assert set(dflash.asset(AssetRole.DFLASH_DRAFTER).functions) == {FunctionName.INJECT_KV,
                                                                     FunctionName.DRAFT}
    assert dflash.speculative_decoding.drafter_kind == DrafterKind.DFLASH
    assert dflash.speculative_decoding.dflash2 is None
    assert dflash.kv_write == KVWrite.BLEND
    assert by_name["dflash_kv_slice"].kv_write == KVWrite.SLICE
    dflash2 = by_name["dflash2"]
    assert dflash2.speculative_decoding.drafter_kind == DrafterKind.DFLASH2
    assert dflash2.drafter_role == AssetRole.DFLASH_DRAFTER
    assert dflash2.asset(AssetRole.DFLASH_DRAFTER).function(FunctionName.DRAFT).outputs == [
        OutputName.LOGITS, OutputName.DRAFT_TOKENS]
    assert dflash.asset(AssetRole.DFLASH_DRAFTER).function(FunctionName.DRAFT).outputs == [
        OutputName.LOGITS]
    settings = dflash2.speculative_decoding.dflash2
    assert settings.selector_top_k <= dflash2.vocab_size
    assert dflash2.speculative_decoding.drafter_hidden_size % settings.conv_group_size == 0
    assert by_name["ring"].drafter_role == AssetRole.RING_DRAFTER
    assert by_name["target_only"].speculative_decoding is None
    assert by_name["target_only"].source.drafter_checkpoint is None
    states = dflash.asset(AssetRole.TARGET).states
    assert [s.name for s in states] == list(bundle.TARGET_STATES)
    assert {s.name: s.kind for s in states}[StateName.SLIDING_KEY_CACHE] == StateKind.SLIDING_KV
    assert dflash.tokenizer is None and by_name["dflash_with_tokenizer"].tokenizer
    tokenizer = by_name["dflash_with_tokenizer"].tokenizer
    assert tokenizer.files[0] == bundle.TOKENIZER_FILE
    assert tokenizer.vocab_size == dflash.vocab_size
    assert dflash.speculative_decoding.mask_token_id in tokenizer.special_tokens.values()


def test_compressed_examples_describe_what_the_rules_gave_each_package(examples):
    by_name = {e["name"]: Metadata.from_json(e["metadata"]) for e in examples["valid"]}
    assert all(by_name[n].compression is None for n in ("dflash", "ring", "target_only"))
    preset = by_name["target_only_4bit"].compression
    assert preset.preset == "4bit" and preset.rules[-1].bits == 4
    mixed = by_name["dflash_mixed_rules"].compression
    assert mixed.preset is None
    assert {g.mode for g in mixed.groups} == {CompressionMode.LINEAR, CompressionMode.PALETTIZE}
    for compression in (preset, mixed):
        for group in compression.groups:
            rule = compression.rules[group.rule]
            assert (group.mode, group.bits) == (rule.mode, rule.bits)
            assert group.bytes_after < group.bytes_before
            # A weight both packages store (the borrowed embedding and lm_head) is counted
            # once in the group's totals and once in each package.
            assert max(s.tensors for s in group.packages.values()) <= group.tensors <= sum(
                s.tensors for s in group.packages.values())
    # One package holds the target and the DFlash drafter: its groups count each weight once.
    assert by_name["dflash_mixed_rules"].package_owners() == {"target.mlpackage":
                                                             AssetRole.TARGET}
    assert all(set(g.packages) == {AssetRole.TARGET} and g.packages[AssetRole.TARGET].tensors
               == g.tensors for g in mixed.groups)
    # The rule keeping layer 0's MLP fp16 comes after the palettize rule for down_proj.
    assert mixed.fp16_tensors > 0


def test_unknown_keys_and_absent_optional_values_are_accepted(examples):
    bases = {e["name"]: e["metadata"] for e in examples["valid"]}
    assert len(examples["forward_compatible"]) == len(bases) + 1
    for example in examples["forward_compatible"]:
        assert schema_errors(example["metadata"]) == [], example["name"]
        assert Metadata.from_json(example["metadata"]) == Metadata.from_json(
            bases[example["base"]])


def test_every_invalid_example_is_refused_by_the_schema_and_the_decoder(examples):
    assert len(examples["invalid"]) >= 8
    for example in examples["invalid"]:
        assert schema_errors(example["metadata"]), example["name"]
        with pytest.raises(BundleError):
            Metadata.from_json(example["metadata"])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r.update(schema_version=99), r"schema_version 99 is not supported"),
    (lambda r: r["assets"]["target"]["functions"]["main"].pop("inputs"),
     r"metadata\.assets\.target\.functions\.main: missing key 'inputs'"),
    (lambda r: r["assets"]["target"]["states"][1].update(layers="2"),
     r"metadata\.assets\.target\.states\[1\]\.layers: expected an integer, got string"),
    (lambda r: r["speculative_decoding"].update(shared_embeddings=1),
     r"shared_embeddings: expected a boolean, got integer"),
    (lambda r: r["assets"]["target"].update(kind="turbo"),
     r"metadata\.assets\.target\.kind: 'turbo' is not one of"),
])
def test_decoding_errors_name_the_place(examples, edit, message):
    raw = json.loads(json.dumps(examples["valid"][0]["metadata"]))
    edit(raw)
    with pytest.raises(BundleError, match=message):
        Metadata.from_json(raw)


def test_read_names_the_file_when_the_metadata_is_missing_or_broken(tmp_path, examples):
    with pytest.raises(BundleError, match="metadata.json not found"):
        Metadata.read(tmp_path)
    (tmp_path / bundle.METADATA_FILE).write_text("{")
    with pytest.raises(BundleError, match="is not valid JSON"):
        Metadata.read(tmp_path)
    raw = examples["valid"][0]["metadata"]
    (tmp_path / bundle.METADATA_FILE).write_text(json.dumps(raw))
    assert Metadata.read(tmp_path).to_json() == raw


def test_asset_and_function_lookups_say_what_exists(examples):
    metadata = Metadata.from_json(next(e["metadata"] for e in examples["valid"]
                                       if e["name"] == "target_only"))
    with pytest.raises(BundleError, match=r"no dflash_drafter asset \(assets: \['target'\]\)"):
        metadata.asset(AssetRole.DFLASH_DRAFTER)
    with pytest.raises(BundleError, match="no function draft"):
        metadata.asset(AssetRole.TARGET).function(FunctionName.DRAFT)


def test_each_state_name_says_how_its_cache_is_addressed(examples):
    """The kind and role written for a state follow from its name: in every valid example a
    global cache holds the whole context, a sliding one is a ring shorter than it (but the
    ring of a full-attention drafter, whose window is the whole context: exactly as long), and
    every key cache has a value cache of the same shape beside it."""
    for example in examples["valid"]:
        metadata = Metadata.from_json(example["metadata"])
        for role, asset in metadata.assets.items():
            shapes = {(state.kind, state.role): state.shape for state in asset.states}
            assert len(shapes) == len(asset.states), (example["name"], role)
            for state in asset.states:
                where = (example["name"], role, str(state.name))
                assert (state.kind, state.role) == (state.name.kind, state.name.role), where
                if state.kind == StateKind.GLOBAL_KV:
                    assert state.capacity == metadata.context_length, where
                elif metadata.speculative_decoding and role == metadata.drafter_role and (
                        metadata.speculative_decoding.drafter.sliding_window
                        == metadata.context_length):
                    assert state.capacity == metadata.context_length, where
                else:
                    assert state.capacity < metadata.context_length, where
                other = (bundle.StateRole.VALUE if state.role == bundle.StateRole.KEY
                         else bundle.StateRole.KEY)
                assert shapes[(state.kind, other)] == state.shape, where


def test_target_states_are_the_pair_of_each_layer_kind_present():
    full, sliding = LayerType.FULL_ATTENTION, LayerType.SLIDING_ATTENTION
    assert bundle.target_states([full, full, full]) == (StateName.GLOBAL_KEY_CACHE,
                                                        StateName.GLOBAL_VALUE_CACHE)
    assert bundle.target_states([sliding, full, sliding]) == bundle.TARGET_STATES
    assert bundle.target_states(["sliding_attention"]) == (StateName.SLIDING_KEY_CACHE,
                                                           StateName.SLIDING_VALUE_CACHE)
    with pytest.raises(ValueError):
        bundle.target_states(["chunked_attention"])


def test_the_global_only_example_has_only_the_global_state_pair(examples):
    by_name = {e["name"]: Metadata.from_json(e["metadata"]) for e in examples["valid"]}
    example = by_name["dflash_global_only_target"]
    assert set(example.target.layer_types) == {LayerType.FULL_ATTENTION}
    assert example.target.sliding_window == bundle.NO_SLIDING_WINDOW
    assert [s.name for s in example.asset(AssetRole.TARGET).states] == [
        StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE]
    for metadata in by_name.values():  # every example follows the rule
        assert tuple(s.name for s in metadata.asset(AssetRole.TARGET).states) == \
            bundle.target_states(metadata.target.layer_types)
