"""The benchmark's real-geometry Qwen3 and Llama pairs (tools/family_geometry.py), at a reduced
width: the target is laid out exactly as transformers' own save_pretrained lays it out, the pair
loads through museflash's checks, and the state count equals the states the loaders build."""

import json

import pytest
import torch
from command_line import run_main
from safetensors import safe_open

from museflash.checkpoint.load import load_drafter, load_target
from museflash.cli import benchmark_main
from museflash.tools import family_geometry
from museflash.tools.family_geometry import FAMILY_GEOMETRIES, state_bytes, write_family_checkpoints

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def _keys(directory):
    keys = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            keys.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return keys


@pytest.fixture(scope="module", params=list(FAMILY_GEOMETRIES))
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root, write_family_checkpoints(request.param, root / "pair", **SMALL)


def test_the_target_is_what_transformers_save_pretrained_writes(pair):
    import transformers

    name, root, (target_dir, _) = pair
    config, _ = family_geometry.family_configs(name, **SMALL)
    model_class = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))
    reference = root / "transformers"
    torch.manual_seed(0)
    model_class(config).save_pretrained(reference, safe_serialization=True)
    assert _keys(target_dir) == _keys(reference)
    written = json.loads((target_dir / "config.json").read_text())
    expected = json.loads((reference / "config.json").read_text())
    assert (written.pop("dtype"), expected.pop("dtype")) == ("bfloat16", "float32")
    assert written == expected
    # Qwen3-4B ties its embedding, so no lm_head is stored; the 8B sizes do store one.
    assert ("lm_head.weight" in _keys(target_dir)) == (not config.tie_word_embeddings)


def test_the_pair_loads_and_states_count_what_the_loaders_build(pair):
    _, _, (target_dir, drafter_dir) = pair
    drafter_config = json.loads((drafter_dir / "config.json").read_text())
    assert drafter_config["num_hidden_layers"] == family_geometry.DRAFTER_LAYERS
    for context in (64, 128):
        target = load_target(target_dir, drafter_dir, max_context=context, max_query_len=16)
        drafter = load_drafter(drafter_dir, target, target_dir=target_dir, max_context=context,
                               max_query_len=16)
        built = {f"{role}.{n}": 2 * b.numel() for role, m in (("target", target),
                                                               ("drafter", drafter))
                 for n, b in m.named_buffers(recurse=False) if n.endswith("Cache")}
        assert state_bytes(target_dir, drafter_dir, context) == built
        # Global layers only, and a full-attention drafter whose ring spans the context.
        assert sorted(built) == ["drafter.drafterKeyCache", "drafter.drafterValueCache",
                                 "target.globalKeyCache", "target.globalValueCache"]
        assert drafter.caches[0].shape[2] == context


def test_a_family_geometry_refuses_sizes(capsys, tmp_path):
    code = run_main(benchmark_main.main, "--geometry=qwen3-4b", "--sizes=1",
                    f"--output-dir={tmp_path / 'out'}")
    assert code == 2
    assert "--sizes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
