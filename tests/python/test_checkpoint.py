"""Checkpoint loading: round trips, dtypes, shards, and a clear error for each bad input."""

import json
import shutil
import struct

import pytest
import torch
from zlab_layout import to_zlab_layout

from museflash.builtin.demo_checkpoint import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET_CONFIG,
    build_tiny_models,
    write_tiny_checkpoints,
)
from museflash.checkpoint.configs import validate_drafter_against_target
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.tensor_files import CheckpointError
from museflash.models.base import RotaryTables
from museflash.models.dflash import DrafterTargetMismatchError
from museflash.models.muse_glimmer import MuseGlimmerConfig, MuseGlimmerWithDrafterFeatures

SEED = 5
TOKENS = torch.tensor([[3, 14, 159, 26, 53, 58, 97, 93, 238, 46]])
POSITIONS = torch.arange(10, dtype=torch.int32)
BLOCK = torch.tensor([[7, 511, 511, 511]])
BLOCK_POSITIONS = torch.arange(10, 14, dtype=torch.int32)


def _outputs(target, drafter):
    target.reset_caches()
    drafter.reset_caches()
    with torch.no_grad():
        logits, features = target(TOKENS, POSITIONS)
        drafter.inject_kv(features, POSITIONS)
        draft = drafter.draft(BLOCK, BLOCK_POSITIONS)
    return logits, features, draft


def _load(target_dir, drafter_dir, dtype=torch.float32):
    target = load_target(target_dir, drafter_dir, dtype=dtype, max_context=64, max_query_len=10)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=dtype,
                           max_query_len=10)
    return target, drafter


@pytest.fixture(scope="module")
def fp32_dirs(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("fp32"), seed=SEED, dtype="fp32")


@pytest.fixture(scope="module")
def expected():
    target, drafter = build_tiny_models(SEED, max_context=64, max_query_len=10)
    return _outputs(target, drafter)


def test_fp32_round_trip_gives_identical_outputs(fp32_dirs, expected):
    target, drafter = _load(*fp32_dirs)
    assert isinstance(target, MuseGlimmerWithDrafterFeatures)
    assert drafter.embed_tokens is target.embed_tokens
    for got, want in zip(_outputs(target, drafter), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("sharded", [False, True])
def test_bf16_checkpoints_load(tmp_path, expected, sharded):
    dirs = write_tiny_checkpoints(tmp_path, seed=SEED, dtype="bf16",
                                  max_shard_bytes=50_000 if sharded else None)
    if sharded:
        assert (dirs[0] / "model.safetensors.index.json").is_file()
        assert len(list(dirs[0].glob("model-*-of-*.safetensors"))) > 3
    target, drafter = _load(*dirs)
    assert target.layers[0].mlp.up_proj.weight.dtype == torch.float32
    logits, features, draft = _outputs(target, drafter)
    # Weights rounded to bf16: close to, but not equal to, the fp32 model.
    assert torch.allclose(logits, expected[0], atol=0.5)
    assert not torch.equal(logits, expected[0])
    assert draft.shape == expected[2].shape


def test_fp16_checkpoint_loads_into_fp16_compute(tmp_path):
    dirs = write_tiny_checkpoints(tmp_path, seed=SEED, dtype="fp16")
    target = load_target(dirs[0], dtype="fp16")
    assert target.norm.weight.dtype == torch.float16
    assert not isinstance(target, MuseGlimmerWithDrafterFeatures)


def test_flat_target_config_loads(tmp_path, fp32_dirs, expected):
    target_dir = tmp_path / "target"
    shutil.copytree(fp32_dirs[0], target_dir)
    (target_dir / "config.json").write_text(json.dumps(TINY_TARGET_CONFIG["text_config"]))
    target, drafter = _load(target_dir, fp32_dirs[1])
    assert torch.equal(_outputs(target, drafter)[0], expected[0])


@pytest.fixture
def copies(tmp_path, fp32_dirs):
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    shutil.copytree(fp32_dirs[0], target_dir)
    shutil.copytree(fp32_dirs[1], drafter_dir)
    return target_dir, drafter_dir


def _rewrite_tensors(path, change):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_missing_config(copies):
    (copies[0] / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"target/config.json: config file not found"):
        load_target(copies[0])


def test_missing_weights_file(copies):
    (copies[0] / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor "
                                              "model.safetensors.index.json"):
        load_target(copies[0])


def test_missing_shard(tmp_path):
    target_dir, _ = write_tiny_checkpoints(tmp_path, seed=SEED, max_shard_bytes=50_000)
    shard = sorted(target_dir.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as error:
        load_target(target_dir)
    message = str(error.value)
    assert f"{shard}: shard listed in" in message and "not found" in message
    assert "model.language_model." in message


def test_truncated_file(copies):
    path = copies[0] / "model.safetensors"
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.truncate(size - 100)
    with pytest.raises(CheckpointError) as error:
        load_target(copies[0])
    message = str(error.value)
    assert str(path) in message and "truncated" in message
    assert f"holds only {size - 100 - 8 - _header_len(path)} data bytes" in message


def _header_len(path):
    with path.open("rb") as handle:
        return struct.unpack("<Q", handle.read(8))[0]


def test_header_longer_than_file(copies):
    path = copies[0] / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(CheckpointError, match="header length field says 10000 bytes but only 2"):
        load_target(copies[0])


def test_corrupt_header(copies):
    path = copies[0] / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe!!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        load_target(copies[0])


def test_missing_key(copies):
    key = "model.language_model.layers.5.mlp.up_proj.weight"
    _rewrite_tensors(copies[0] / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"model.safetensors: missing key '{key}'"):
        load_target(copies[0])


def test_unexpected_shape(copies):
    key = "model.language_model.layers.2.self_attn.gate_proj.weight"
    _rewrite_tensors(copies[0] / "model.safetensors",
                     lambda t: t.__setitem__(key, torch.zeros(32, 64)))
    with pytest.raises(CheckpointError,
                       match=rf"'{key}' has shape \[32, 64\], expected \[64, 64\]"):
        load_target(copies[0])


def test_extra_layers_are_reported(copies):
    key = "model.language_model.layers.8.mlp.up_proj.weight"
    _rewrite_tensors(copies[0] / "model.safetensors",
                     lambda t: t.__setitem__(key, torch.zeros(128, 64)))
    with pytest.raises(CheckpointError, match="unexpected keys.*layers.8"):
        load_target(copies[0])


def test_drafter_vocab_disagreement(copies):
    config = dict(TINY_DRAFTER_CONFIG, vocab_size=262144)
    (copies[1] / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        load_target(*copies)
    message = str(error.value)
    assert "vocab_size" in message and "262144" in message and "512" in message
    assert "drafter/config.json" in message and "target/config.json" in message


def test_drafter_layer_ids_beyond_target_depth(copies):
    config = dict(TINY_DRAFTER_CONFIG, target_layer_ids=[1, 4, 12])
    (copies[1] / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"target_layer_ids.*12.*num_hidden_layers 8"):
        load_target(*copies)


def test_encoder_width_disagreement(copies):
    config = dict(TINY_DRAFTER_CONFIG, target_layer_ids=[1, 4])
    (copies[1] / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"encoder.fc.weight' input width is 192.* = 128"):
        load_target(*copies)


def test_drafter_missing_key(copies):
    target = load_target(*copies)
    _rewrite_tensors(copies[1] / "model.safetensors",
                     lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match="missing key 'layers.1.self_attn.k_norm.weight'"):
        load_drafter(copies[1], target)


def test_vision_keys_are_present_and_ignored(fp32_dirs):
    from safetensors import safe_open
    with safe_open(str(fp32_dirs[0] / "model.safetensors"), framework="pt") as handle:
        assert any(key.startswith("model.vision_") for key in handle.keys())
    load_target(fp32_dirs[0])


def test_rope_tables_survive_the_meta_build_in_the_compute_dtype(fp32_dirs):
    target_dir, drafter_dir = fp32_dirs
    target = load_target(target_dir, drafter_dir, dtype=torch.float16, max_context=64,
                         max_query_len=10)
    inherited = load_drafter(drafter_dir, target, dtype=torch.float16, max_query_len=10)
    drafter = load_drafter(drafter_dir, target, dtype=torch.float16, max_context=256,
                           max_query_len=10, ring=True)
    assert inherited.rotary.max_position == 64
    assert drafter.rotary.max_position == 256
    for model in (target, inherited, drafter):
        tables = model.rotary
        # Rounded once from float64, not via the fp32 tables built on construction.
        fresh = RotaryTables(tables.head_dim, list(tables.thetas), tables.max_position,
                             dtype=torch.float16)
        buffers = dict(tables.named_buffers())
        assert buffers.keys() == dict(fresh.named_buffers()).keys() and buffers
        for name, table in buffers.items():
            assert table.device.type == "cpu" and table.dtype == torch.float16
            assert torch.equal(table, getattr(fresh, name))


@pytest.mark.parametrize("change, named", [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ({"architectures": ["EagleDraftModel"]}, "EagleDraftModel"),
    ({"dflash_config": {"output_multiplier": 0.2}}, "output_multiplier 0.2"),
    ({"dflash_config": {"input_embedding_scale": 2.0}}, "input_embedding_scale 2.0"),
    ({"final_logit_softcapping": 20.0}, "final_logit_softcapping 20.0"),
    ({"num_target_layers": 52}, "num_target_layers 52"),
])
def test_drafters_this_exporter_would_not_run_exactly_are_refused(copies, change, named):
    """A DFlash2 or unknown architecture, or a v1 drafter stating settings the v1 model does
    not implement, is a one-line error before any weight is read, not a silent export."""
    config = dict(TINY_DRAFTER_CONFIG, **change)
    (copies[1] / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        load_target(*copies)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_both_v1_architecture_names_and_neutral_settings_load(copies):
    """Either v1 architecture name, or none, with settings stated at the values the v1 model
    implements, loads the same fused target and drafter as the config as written."""
    expected_target = load_target(*copies)
    expected_drafter = load_drafter(copies[1], expected_target)
    for architectures in (["MuseGlimmerAssistantModel"], ["DFlashDraftModel"], None):
        config = dict(TINY_DRAFTER_CONFIG, architectures=architectures, num_target_layers=8,
                      dflash_config={"output_multiplier": 1.0})
        (copies[1] / "config.json").write_text(json.dumps(config))
        target = load_target(*copies)
        drafter = load_drafter(copies[1], target)
        assert isinstance(target, MuseGlimmerWithDrafterFeatures), architectures
        assert drafter.config == expected_drafter.config, architectures
        for loaded, expected in ((target, expected_target), (drafter, expected_drafter)):
            got, want = loaded.state_dict(), expected.state_dict()
            assert got.keys() == want.keys(), architectures
            assert all(torch.equal(got[name], want[name]) for name in want), architectures


def test_zlab_layout_loads_the_same_encoder_with_a_per_query_window(copies):
    meta = load_target(*copies)
    meta_drafter = load_drafter(copies[1], meta)
    to_zlab_layout(copies[1])
    zlab = load_target(*copies)
    drafter = load_drafter(copies[1], zlab)
    assert torch.equal(zlab.encoder.fc.weight, meta.encoder.fc.weight)
    assert torch.equal(zlab.encoder.output_norm_enc.weight, meta.encoder.output_norm_enc.weight)
    assert drafter.config.window_per_query and not meta_drafter.config.window_per_query


def test_zlab_layout_that_drafts_causally_is_refused(copies):
    to_zlab_layout(copies[1], is_causal=True)
    with pytest.raises(CheckpointError, match="is_causal: false"):
        load_target(*copies)


def test_validation_names_key_and_both_values():
    target = MuseGlimmerConfig.from_dict(
        {"text_config": dict(TINY_TARGET_CONFIG["text_config"], vocab_size=202048)}
    )
    drafter = dict(TINY_DRAFTER_CONFIG, vocab_size=262144)
    with pytest.raises(DrafterTargetMismatchError, match="vocab_size.*262144.*202048"):
        validate_drafter_against_target(drafter, target)
    with pytest.raises(DrafterTargetMismatchError, match="hidden_size.*96.*64"):
        validate_drafter_against_target(dict(TINY_DRAFTER_CONFIG, hidden_size=96),
                                        TINY_TARGET_CONFIG)
    with pytest.raises(DrafterTargetMismatchError, match=r"target_layer_ids.*\[1, 4, 9\].*8"):
        validate_drafter_against_target(dict(TINY_DRAFTER_CONFIG, target_layer_ids=[1, 4, 9]),
                                        target)
    with pytest.raises(DrafterTargetMismatchError, match="head_dim.*32.*16"):
        validate_drafter_against_target(dict(TINY_DRAFTER_CONFIG, head_dim=32), target)
    with pytest.raises(DrafterTargetMismatchError, match="num_attention_heads.*8.*4"):
        validate_drafter_against_target(dict(TINY_DRAFTER_CONFIG, num_attention_heads=8), target)
    # A value stated on one side only is skipped.
    validate_drafter_against_target({k: v for k, v in TINY_DRAFTER_CONFIG.items()
                                     if k != "head_dim"}, target)
    # A shallower drafter with different KV heads is by design.
    validate_drafter_against_target(dict(TINY_DRAFTER_CONFIG, num_key_value_heads=4,
                                         num_hidden_layers=1), TINY_TARGET_CONFIG)
