"""The demo checkpoint generator: real layout, deterministic, command line."""

import json
import re

import pytest
from command_line import run_main
from safetensors import safe_open

from museflash.builtin import demo_checkpoint
from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.tensor_files import CheckpointError
from museflash.cli.demo_checkpoint_main import main
from museflash.export.options import ExportError, ExportOptions, check_flag_rules


def _tensor_bytes(directory):
    return (directory / "model.safetensors").read_bytes()


def test_layout_and_determinism(tmp_path):
    first = write_tiny_checkpoints(tmp_path / "a", seed=1)
    second = write_tiny_checkpoints(tmp_path / "b", seed=1)
    other = write_tiny_checkpoints(tmp_path / "c", seed=2)
    for a, b, c in zip(first, second, other, strict=True):
        assert _tensor_bytes(a) == _tensor_bytes(b)
        assert _tensor_bytes(a) != _tensor_bytes(c)
    target_dir, drafter_dir = first
    assert "text_config" in json.loads((target_dir / "config.json").read_text())
    drafter_config = json.loads((drafter_dir / "config.json").read_text())
    assert "vocab_size" not in drafter_config and drafter_config["block_size"] == 4
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        assert handle.get_tensor("lm_head.weight").dtype.__str__() == "torch.bfloat16"
    assert "model.language_model.embed_tokens.weight" in keys
    assert "model.language_model.layers.7.post_feedforward_layernorm.weight" in keys
    assert not any("q_norm" in k or "k_norm" in k for k in keys)
    assert any(k.startswith("model.vision_") for k in keys)
    with safe_open(str(drafter_dir / "model.safetensors"), framework="pt") as handle:
        drafter_keys = set(handle.keys())
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight", "norm.weight",
            "layers.1.self_attn.k_norm.weight"} <= drafter_keys
    assert not any("embed" in k or "lm_head" in k for k in drafter_keys)


def test_command_line_writes_shards(tmp_path, capsys):
    assert run_main(main, "--output-dir", str(tmp_path), "--dtype", "fp16",
                    "--max-shard-bytes", "100000") == 0
    index = json.loads((tmp_path / "target" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert all((tmp_path / "target" / name).is_file() for name in shards)
    assert "wrote" in capsys.readouterr().out


def test_builtin_pairs_and_their_errors(tmp_path, monkeypatch):
    with demo_checkpoint.builtin_checkpoints("tiny") as (target, drafter):
        assert check_configs(target, drafter).target.vocab_size == 512
    assert not target.exists()  # the tiny pair lives only inside the block
    monkeypatch.setattr(demo_checkpoint, "TRAINED_DEMO_DIR", tmp_path / "gone")
    # Each error names what it could not find: the missing directory, the unknown name.
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "gone"))):
        with demo_checkpoint.builtin_checkpoints("demo"):
            pass
    with pytest.raises(ValueError, match="huge"):
        with demo_checkpoint.builtin_checkpoints("huge"):
            pass
    with pytest.raises(ExportError, match="--builtin 'huge'"):
        check_flag_rules(ExportOptions(output_dir=tmp_path / "out", builtin="huge"))
