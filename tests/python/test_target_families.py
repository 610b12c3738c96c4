"""Qwen3 and Llama 3.1 targets wired into the loader and the export: the family a config.json
names, the built-in tiny pairs transformers writes, z-lab's drafter config shape on them, and
the bad input refused before anything is converted or written."""

import json
import shutil

import numpy as np
import pytest
import torch

from museflash.builtin.hf_tiny_pairs import HF_TINY_PAIRS, write_hf_tiny_pair, zlab_target_layer_ids
from museflash.bundle import KVWrite
from museflash.checkpoint.configs import check_configs, read_target_config
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.tensor_files import CheckpointError
from museflash.export.options import ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress
from museflash.models.families import LLAMA, MUSE_GLIMMER, QWEN3, target_family
from museflash.models.llama import LlamaWithDrafterFeatures
from museflash.models.qwen3 import Qwen3WithDrafterFeatures

FUSED = {"tiny-qwen3": Qwen3WithDrafterFeatures, "tiny-llama": LlamaWithDrafterFeatures}
# fp32 eager, museflash against transformers on the same files: only summation order differs.
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", params=HF_TINY_PAIRS)
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, *write_hf_tiny_pair(request.param, root)


def _edited_copy(source, destination, edit):
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    edit(config)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_every_familys_config_has_what_the_exporter_reads_of_a_target(pair, tmp_path):
    """export/plan.py, export/describe.py and checkpoint/configs.py read a target's config as
    families.TargetConfig: each family's parsed config has every member it names, and the
    layer kinds it lists are one per layer."""
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
    from museflash.models.families import TargetConfig

    members = set(TargetConfig.__annotations__) | {
        name for name, value in vars(TargetConfig).items() if isinstance(value, property)}
    assert {"vocab_size", "layer_types", "global_layer_ids", "final_logit_softcapping"} <= members
    muse, _ = write_tiny_checkpoints(tmp_path / "muse")
    for directory in (pair[1], muse):
        config = read_target_config(directory)
        missing = sorted(name for name in members if not hasattr(config, name))
        assert not missing, (type(config).__name__, missing)
        assert len(config.layer_types) == config.num_hidden_layers


def test_a_config_names_its_family_by_model_type_or_architectures():
    assert target_family({"model_type": "qwen3"}) is QWEN3
    assert target_family({"architectures": ["LlamaForCausalLM"]}) is LLAMA
    assert target_family({"model_type": "muse_glimmer"}) is MUSE_GLIMMER
    assert target_family({"text_config": {"vocab_size": 8}}) is MUSE_GLIMMER


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 8}))
    with pytest.raises(CheckpointError) as error:
        read_target_config(tmp_path)
    message = str(error.value)
    assert "gemma3" in message and "\n" not in message
    for family in (MUSE_GLIMMER, QWEN3, LLAMA):
        assert family.model_type in message and family.architecture in message


def test_zlab_spacing_of_the_tapped_layers_gives_the_published_ids():
    # z-lab/Qwen3-4B-DFlash-b16: 36 target layers, 5 drafter layers.
    assert zlab_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_the_tiny_pairs_are_written_by_transformers_and_are_deterministic(pair, tmp_path):
    name, target, drafter = pair
    config = json.loads((target / "config.json").read_text())
    assert config["transformers_version"] and config["model_type"] in (QWEN3.model_type,
                                                                       LLAMA.model_type)
    again_target, again_drafter = write_hf_tiny_pair(name, tmp_path)
    for first, second in ((target, again_target), (drafter, again_drafter)):
        for path in sorted(first.iterdir()):
            assert (second / path.name).read_bytes() == path.read_bytes(), path.name


def test_the_zlab_shaped_drafter_loads_as_full_attention(pair):
    name, target, drafter = pair
    checked = check_configs(target, drafter)
    assert type(checked.target).__name__ in ("Qwen3Config", "LlamaConfig")
    assert checked.drafter.sliding_window is None and checked.drafter.block_size == 16
    assert checked.drafter.mask_token_id in checked.tokenizer.special_tokens.values()
    model = load_target(target, drafter, max_context=64, max_query_len=16)
    assert isinstance(model, FUSED[name])
    block_drafter = load_drafter(drafter, model, target_dir=target, max_query_len=16)
    # Full attention: the ring is the whole context, so no position falls out of a window.
    assert block_drafter.window == block_drafter.ring_capacity == 64


@pytest.mark.parametrize("use_sliding_window, full", [(False, True), (True, False), (None, False)])
def test_a_window_without_layer_types_slides_only_if_use_sliding_window_allows(
        pair, tmp_path, use_sliding_window, full):
    """transformers' Qwen3 config (z-lab's drafter is one) derives its layer types from
    use_sliding_window and ignores a stated window it does not use; absent, the window slides
    (the Meta assistant layout)."""
    _, target, drafter = pair

    def edit(config):
        del config["layer_types"]
        config["sliding_window"] = 32
        config["is_causal"] = False  # what z-lab's layout needs to slide at all
        config.pop("use_sliding_window")
        if use_sliding_window is not None:
            config["use_sliding_window"] = use_sliding_window

    edited = _edited_copy(drafter, tmp_path / "drafter", edit)
    assert check_configs(target, edited).drafter.sliding_window == (None if full else 32)


def test_a_full_attention_drafter_reads_the_first_injected_position(pair):
    """Changing what was injected at position 0 changes a block drafted at positions 40..55:
    a sliding window shorter than 40 would hide it."""
    _, target, drafter = pair
    model = load_target(target, drafter, max_context=64, max_query_len=16)
    block_drafter = load_drafter(drafter, model, target_dir=target, max_query_len=16)
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(1, 40, block_drafter.config.hidden_size, generator=generator)
    block = torch.full((1, 16), block_drafter.config.mask_token_id)
    drafted = []
    for scale in (1.0, 5.0):
        changed = features.clone()
        changed[0, 0] *= scale
        block_drafter.reset_caches()
        for start in range(0, 40, 8):
            block_drafter.inject_kv(changed[:, start:start + 8], torch.arange(start, start + 8))
        with torch.no_grad():
            drafted.append(block_drafter.draft(block, torch.arange(40, 56)))
    assert (drafted[0] - drafted[1]).abs().max() > 1e-3


def test_museflash_reads_the_checkpoint_as_transformers_does(pair):
    """The target museflash loads from transformers' files computes transformers' logits."""
    from transformers import AutoModelForCausalLM

    _, target, drafter = pair
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model = load_target(target, max_context=64, max_query_len=24, cache_dtype=torch.float32)
    tokens = torch.tensor([[5, 17, 3, 99, 250, 7, 42, 1, 300, 11, 64, 128, 2, 9, 81, 33, 77, 6,
                            400, 12]])
    with torch.no_grad():
        expected = reference(tokens).logits
        logits = model(tokens, torch.arange(tokens.shape[1]))
    assert np.abs((logits - expected).numpy()).max() < LOGIT_ATOL


# --- Bad input: refused before any conversion, nothing written ----------------------------


def _export(tmp_path, target, drafter, **flags):
    out = tmp_path / "bundle"
    options = dict(output_dir=out, checkpoint=target, drafter_checkpoint=drafter,
                   fused_target=True, dflash_drafter=True, max_context_length=64,
                   prefill_length=8, conversion_processes=1)
    options.update(flags)
    export_bundle(ExportOptions(**options), Progress(echo=lambda _line: None))
    return out


@pytest.mark.parametrize("key, value, named", [
    ("hidden_size", 96, ("hidden_size", "96", "256")),
    ("target_layer_ids", [1, 9], ("target_layer_ids", "[1, 9]", "num_hidden_layers 6")),
])
def test_a_drafter_that_does_not_fit_the_target_is_refused_naming_both_values(
        pair, tmp_path, key, value, named):
    _, target, drafter = pair

    def edit(config):
        (config["dflash_config"] if key == "target_layer_ids" else config)[key] = value

    broken = _edited_copy(drafter, tmp_path / "drafter", edit)
    with pytest.raises(CheckpointError) as error:
        _export(tmp_path, target, broken)
    assert all(part in str(error.value) for part in named), str(error.value)
    assert not (tmp_path / "bundle").exists()


def test_a_llama_config_with_an_unknown_rope_scaling_type_is_refused_by_name(tmp_path):
    target, drafter = write_hf_tiny_pair("tiny-llama", tmp_path / "pair")

    def edit(config):
        config.pop("rope_parameters")
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}

    broken = _edited_copy(target, tmp_path / "target", edit)
    with pytest.raises(CheckpointError) as error:
        _export(tmp_path, broken, drafter)
    assert "rope_scaling.rope_type" in str(error.value) and "longrope" in str(error.value)
    assert "llama3" in str(error.value)  # what is supported
    assert not (tmp_path / "bundle").exists()


def test_either_kv_write_decodes_identically_on_both_families(pair):
    """--kv-write slice on a global-only target: chunks that roll back (a verify block rewritten
    from an earlier position, as after a rejection) give the blend's logits, drafter features
    and caches, bit for bit."""
    name, target, drafter = pair
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    results = {}
    for strategy in KVWrite:
        model = load_target(target, drafter, max_context=64, max_query_len=16,
                            kv_write=strategy)
        assert model.kv_write == strategy
        outputs = []
        with torch.no_grad():
            for start in (0, 8, 16, 12, 20, 19):
                positions = torch.arange(start, start + 8, dtype=torch.int32)
                outputs += list(model(ids[:, start:start + 8], positions))
        results[strategy] = outputs + [model.globalKeyCache.clone(),
                                       model.globalValueCache.clone()]
    assert results[KVWrite.BLEND][-1].any()  # the caches were written
    for blend, sliced in zip(results[KVWrite.BLEND], results[KVWrite.SLICE], strict=True):
        assert torch.equal(blend, sliced), name
