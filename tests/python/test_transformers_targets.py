"""The Qwen3 and Llama 3.1 targets against transformers' own Qwen3ForCausalLM and
LlamaForCausalLM, in fp32, on random-initialised models from realistic configs at reduced
width written by transformers' save_pretrained; and their config reading (refusals included).
"""

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from museflash.models import llama, qwen3
from museflash.models.dflash import DFlashConfig
from museflash.models.hf_config import UnsupportedConfigError

# Max abs logit difference allowed between museflash and transformers, fp32 throughout (the
# logits are O(1-10) here; measured on Linux x86_64: 3.7e-5 for Llama, 5e-6 for Qwen3). What
# differs is summation order, and RoPE tables built in float64 rather than transformers' fp32
# angles (hence Llama's larger figure: larger weights, and angles at positions up to 95).
LOGIT_ATOL = 1e-4
FEATURE_ATOL = 2e-5
# With fp16 caches (the exported form): K/V rounded to fp16, everything else fp32 (measured:
# 1.2e-2 for Llama, whose larger weights give logits up to 7; 2.6e-3 for Qwen3).
FP16_CACHE_ATOL = 2e-2
MAX_CONTEXT = 128
MAX_QUERY_LEN = 16
SEQUENCE = 96  # crosses Llama's original_max_position_embeddings (64) below

# Reduced width, realistic everything else: 4 query heads sharing 2 KV heads of head_dim 64.
SHARED = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=MAX_CONTEXT, attn_implementation="eager")
QWEN3 = dict(SHARED, rms_norm_eps=1e-6, initializer_range=0.05,
             rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
# Llama 3.1's rope_scaling with the original context cut from 8192 to 64, so the scaling
# changes frequencies whose rotation matters at the tested positions.
LLAMA = dict(SHARED, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64})
FAMILIES = {
    "qwen3-tied": (qwen3, transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(QWEN3, tie_word_embeddings=True)),
    "qwen3-untied": (qwen3, transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                     dict(QWEN3, tie_word_embeddings=False)),
    "llama3.1": (llama, transformers.LlamaConfig, transformers.LlamaForCausalLM, LLAMA),
}


def _museflash_classes(module):
    if module is qwen3:
        return qwen3.Qwen3Config, qwen3.Qwen3ForCausalLM, qwen3.Qwen3WithDrafterFeatures
    return llama.LlamaConfig, llama.LlamaForCausalLM, llama.LlamaWithDrafterFeatures


def _save_reference(tmp_path, family, seed=0):
    """transformers' model, seeded, with random norm weights (the initialiser sets them to 1,
    which would hide a q_norm / k_norm mix-up), saved by save_pretrained."""
    _, config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    reference = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.copy_(1.0 + 0.3 * torch.randn_like(parameter))
    reference.save_pretrained(tmp_path)
    return reference


def _load_museflash(module, directory, cls=None, drafter_config=None):
    """The museflash model from a save_pretrained directory, through its key mapping; every
    checkpoint tensor must be used."""
    config_cls, target_cls, _ = _museflash_classes(module)
    config = config_cls.from_dict(json.loads((directory / "config.json").read_text()))
    cls = cls or target_cls
    extra = () if drafter_config is None else (drafter_config,)
    model = cls(config, *extra, max_context=MAX_CONTEXT, max_query_len=MAX_QUERY_LEN,
                cache_dtype=torch.float32).eval()
    state = load_file(directory / "model.safetensors")
    used = set()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("encoder."):
                continue
            key = module.target_checkpoint_key(name)
            parameter.copy_(state[key])
            used.add(key)
    assert used == set(state), sorted(set(state) ^ used)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    reference = _save_reference(directory, family)
    module = FAMILIES[family][0]
    tokens = torch.randint(0, 512, (2, SEQUENCE), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
    return family, module, directory, reference, tokens, expected


def test_a_wrong_weight_would_show(pair):
    """The tolerance is far below what one perturbed norm weight changes."""
    _, module, directory, _, tokens, expected = pair
    model = _load_museflash(module, directory)
    with torch.no_grad():
        model.layers[1].post_attention_layernorm.weight.mul_(1.05)
        got = model.batch_logits(tokens)
    assert (got - expected).abs().max() > 100 * LOGIT_ATOL


def test_batch_logits_equal_transformers(pair):
    _, module, directory, _, tokens, expected = pair
    model = _load_museflash(module, directory)
    with torch.no_grad():
        got = model.batch_logits(tokens)
    diff = (got - expected).abs().max().item()
    assert diff <= LOGIT_ATOL, f"max abs diff {diff:.3g}"
    assert expected.abs().max() > 1.0  # logits of a real size, not all near zero


def _cached_steps():
    """(entry point, first position, length): two prefill chunks, then verify-style forward
    blocks and single tokens, across the prefill chunk boundary and position 64."""
    steps = [("prefill", 0, 14), ("prefill", 14, 16), ("forward", 30, 1), ("forward", 31, 5)]
    position = 36
    while position < SEQUENCE:
        length = min(3 if position % 2 else 16, SEQUENCE - position)
        steps.append(("forward", position, length))
        position += length
    return steps


def test_cached_prefill_and_forward_equal_transformers(pair):
    _, module, directory, _, tokens, expected = pair
    model = _load_museflash(module, directory)
    row, worst = tokens[1], 0.0
    with torch.no_grad():
        for entry, start, length in _cached_steps():
            ids = row[start:start + length].reshape(1, -1)
            positions = torch.arange(start, start + length, dtype=torch.int32)
            if entry == "forward" and start == 40:
                # A rejected draft first: the same positions written with other tokens, then
                # rewritten with the accepted ones (the verify loop's overwrite).
                model.with_entry_point("forward")((ids + 7) % 512, positions)
            got = model.with_entry_point(entry)(ids, positions)[0]
            want = expected[1, start + length - 1:start + length] if entry == "prefill" \
                else expected[1, start:start + length]
            worst = max(worst, (got - want).abs().max().item())
    assert worst <= LOGIT_ATOL, f"max abs diff {worst:.3g}"


def test_only_the_global_caches_exist(pair):
    _, module, directory, *_ = pair
    model = _load_museflash(module, directory)
    buffers = {name: b for name, b in model.named_buffers() if name.endswith("Cache")}
    assert sorted(buffers) == ["globalKeyCache", "globalValueCache"]
    shape = (4, 2, MAX_CONTEXT, 64)
    assert all(b.shape == shape for b in buffers.values()), {n: b.shape for n, b in
                                                             buffers.items()}
    default = type(model)(model.config)
    assert default.globalKeyCache.dtype == torch.float16


def test_drafter_features_are_the_named_layers_outputs(pair):
    _, module, directory, reference, tokens, _ = pair
    drafter = DFlashConfig(hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, intermediate_size=256,
                           block_size=16, mask_token_id=511, target_layer_ids=[0, 2],
                           sliding_window=64, rope_theta=1e6)
    model = _load_museflash(module, directory, _museflash_classes(module)[2], drafter)
    torch.manual_seed(2)
    with torch.no_grad():
        model.encoder.fc.weight.normal_(0, 0.05)
        model.encoder.output_norm_enc.weight.uniform_(0.5, 1.5)
        hf = reference(tokens[:1, :20], output_hidden_states=True)
        # hidden_states[0] is the embedding output, [i + 1] the output of layer i.
        want = model.encoder([hf.hidden_states[i + 1] for i in drafter.target_layer_ids])
        logits, features = model(tokens[:1, :12], torch.arange(12))
        last_logits, more = model.with_entry_point("prefill")(tokens[:1, 12:20],
                                                              torch.arange(12, 20))
    assert features.shape == (1, 12, 128) and more.shape == (1, 8, 128)
    diff = (torch.cat([features, more], dim=1) - want).abs().max().item()
    assert diff <= FEATURE_ATOL, f"max abs diff {diff:.3g}"
    assert (logits[0] - hf.logits[0, :12]).abs().max() <= LOGIT_ATOL
    assert (last_logits[0, -1] - hf.logits[0, 19]).abs().max() <= LOGIT_ATOL


def test_llama3_scaling_is_what_the_test_exercises(tmp_path):
    """Without the llama3 scaling, the same weights are far off: the parity above checks it."""
    reference = _save_reference(tmp_path, "llama3.1")
    model = _load_museflash(llama, tmp_path)
    tokens = torch.randint(0, 512, (1, SEQUENCE), generator=torch.Generator().manual_seed(3))
    model.config.rope_scaling = None
    model.rotary.scale_inv_freq = None
    model.rotary.build(torch.float32)
    with torch.no_grad():
        diff = (model.batch_logits(tokens) - reference(tokens).logits).abs().max()
    assert diff > 100 * LOGIT_ATOL


# --- Config reading ---------------------------------------------------------------------------

# Published geometries (Qwen3-4B, Llama-3.1-8B-Instruct) in the older spelling their hub
# config.json files use: top-level rope_theta and a rope_scaling dict or null.
QWEN3_4B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                hidden_act="silu", attention_bias=False, rms_norm_eps=1e-6,
                rope_theta=1_000_000, rope_scaling=None, tie_word_embeddings=True,
                max_position_embeddings=40960, use_sliding_window=False, sliding_window=None,
                max_window_layers=36, torch_dtype="bfloat16", bos_token_id=151643,
                eos_token_id=151645)
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192,
                              "rope_type": "llama3"},
                max_position_embeddings=131072, tie_word_embeddings=False, pretraining_tp=1,
                torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=[128001, 128008,
                                                                             128009])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_written_configs_parse(tmp_path, family):
    module, config_cls, _, kwargs = FAMILIES[family]
    config_cls(**kwargs).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    parsed = _museflash_classes(module)[0].from_dict(written)
    assert (parsed.hidden_size, parsed.num_key_value_heads, parsed.head_dim) == (256, 2, 64)
    assert parsed.rope_theta == kwargs["rope_parameters"]["rope_theta"]
    assert parsed.rms_norm_eps == kwargs["rms_norm_eps"]
    assert parsed.tie_word_embeddings == kwargs.get("tie_word_embeddings", False)
    if module is llama:
        assert parsed.rope_scaling == llama.Llama3RopeScaling(8.0, 1.0, 4.0, 64)


@pytest.mark.parametrize(("module", "published", "config_cls"), [
    (qwen3, QWEN3_4B, transformers.Qwen3Config), (llama, LLAMA_8B, transformers.LlamaConfig)])
def test_published_spelling_and_its_resave_parse_alike(tmp_path, module, published, config_cls):
    """The hub's older spelling, and what transformers 5 writes after reading it, give the
    same config."""
    parse = _museflash_classes(module)[0].from_dict
    config_cls.from_dict(published).save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in resaved
    assert parse(published) == parse(resaved)


def test_llama3_inverse_frequencies_equal_transformers_at_the_real_geometry():
    config = transformers.LlamaConfig.from_dict(LLAMA_8B)
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = llama.LlamaConfig.from_dict(LLAMA_8B)
    exponents = torch.arange(0, ours.head_dim, 2, dtype=torch.float64) / ours.head_dim
    got = ours.rope_scaling(1.0 / torch.pow(ours.rope_theta, exponents))
    assert attention_factor == 1.0
    # transformers computes in fp32: equal to its rounding.
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)
    # All three bands are present at this geometry.
    wavelength = 2 * math.pi / got
    assert (wavelength < 8192 / 4).any() and (wavelength > 8192).any()


def _refusal(parse, config, field_name, value):
    with pytest.raises(UnsupportedConfigError) as raised:
        parse(config)
    message = str(raised.value)
    assert "\n" not in message
    assert field_name in message and repr(value) in message, message


@pytest.mark.parametrize(("module", "base", "field_name", "value"), [
    (qwen3, QWEN3_4B, "architectures", ["Qwen2ForCausalLM"]),
    (qwen3, QWEN3_4B, "model_type", "qwen3_moe"),
    (llama, LLAMA_8B, "architectures", ["MistralForCausalLM"]),
    (llama, LLAMA_8B, "model_type", "mistral"),
])
def test_other_architectures_are_refused(module, base, field_name, value):
    _refusal(_museflash_classes(module)[0].from_dict, dict(base, **{field_name: value}),
             field_name, value)


@pytest.mark.parametrize(("module", "base", "rope_type"), [
    (llama, LLAMA_8B, "yarn"), (llama, LLAMA_8B, "dynamic"), (qwen3, QWEN3_4B, "yarn"),
    (qwen3, QWEN3_4B, "llama3")])
def test_unknown_rope_types_are_refused(module, base, rope_type):
    config = dict(base, rope_scaling={"rope_type": rope_type, "factor": 4.0,
                                      "original_max_position_embeddings": 32768})
    _refusal(_museflash_classes(module)[0].from_dict, config, "rope_scaling.rope_type",
             rope_type)


def test_the_older_type_key_is_read_and_refused_too():
    config = dict(LLAMA_8B, rope_scaling={"type": "dynamic", "factor": 2.0})
    _refusal(llama.LlamaConfig.from_dict, config, "rope_type", "dynamic")
    legacy = dict(LLAMA_8B, rope_scaling={**LLAMA_8B["rope_scaling"], "type": "llama3"})
    del legacy["rope_scaling"]["rope_type"]
    assert llama.LlamaConfig.from_dict(legacy) == llama.LlamaConfig.from_dict(LLAMA_8B)


def test_a_v5_rope_parameters_type_is_refused_too():
    config = dict(LLAMA_8B, rope_scaling=None, rope_parameters={"rope_type": "longrope",
                                                                "rope_theta": 1e4})
    _refusal(llama.LlamaConfig.from_dict, config, "rope_parameters.rope_type", "longrope")


@pytest.mark.parametrize(("field_name", "value"), [
    ("use_sliding_window", True),
    ("layer_types", ["sliding_attention"]),
])
def test_qwen3_sliding_windows_that_are_on_are_refused(field_name, value):
    config = dict(QWEN3_4B)
    config[field_name] = (["full_attention"] * 35 + value) if field_name == "layer_types" \
        else value
    _refusal(qwen3.Qwen3Config.from_dict, config, field_name, value)


def test_qwen3_sliding_window_size_alone_is_not_a_window():
    """transformers ignores `sliding_window` unless use_sliding_window is on; so does this."""
    assert qwen3.Qwen3Config.from_dict(dict(QWEN3_4B, sliding_window=4096)).num_hidden_layers


@pytest.mark.parametrize(("module", "base", "field_name", "value"), [
    (qwen3, QWEN3_4B, "attention_bias", True),
    (qwen3, QWEN3_4B, "hidden_act", "gelu"),
    (llama, LLAMA_8B, "attention_bias", True),
    (llama, LLAMA_8B, "mlp_bias", True),
    (llama, LLAMA_8B, "hidden_act", "relu"),
    (llama, LLAMA_8B, "quantization_config", {"quant_method": "gptq", "bits": 4}),
    (llama, LLAMA_8B, "partial_rotary_factor", 0.5),
])
def test_unhonoured_values_are_refused(module, base, field_name, value):
    _refusal(_museflash_classes(module)[0].from_dict, dict(base, **{field_name: value}),
             field_name, value)


def test_llama3_scaling_without_its_parameters_is_refused():
    config = dict(LLAMA_8B, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        llama.LlamaConfig.from_dict(config)


def test_scale_residual_leaves_logits_and_features_alone(pair):
    """The fp16 range audit's rescaling (a power of two) changes nothing but rounding."""
    _, module, directory, _, tokens, expected = pair
    drafter = DFlashConfig(hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, intermediate_size=256,
                           block_size=16, mask_token_id=511, target_layer_ids=[1, 2],
                           sliding_window=64, rope_theta=1e6)
    model = _load_museflash(module, directory, _museflash_classes(module)[2], drafter)
    positions = torch.arange(16)
    with torch.no_grad():
        before_logits, before_features = model(tokens[:1, :16], positions)
        model.reset_caches()
        model.scale_residual(1 / 64)
        after_logits, after_features = model(tokens[:1, :16], positions)
        batch = model.batch_logits(tokens)
    assert model.residual_scale == 1 / 64
    assert (after_logits - before_logits).abs().max() <= LOGIT_ATOL
    assert (after_features - before_features).abs().max() <= FEATURE_ATOL
    assert (batch - expected).abs().max() <= LOGIT_ATOL


def test_fp16_caches_stay_close(pair):
    """The exported caches are fp16: the cached path with them against transformers' fp32."""
    _, module, directory, _, tokens, expected = pair
    target_cls = _museflash_classes(module)[1]
    model = _load_museflash(module, directory)
    fp16 = target_cls(model.config, max_context=MAX_CONTEXT, max_query_len=MAX_QUERY_LEN)
    fp16.load_state_dict(model.state_dict())
    assert fp16.globalKeyCache.dtype == torch.float16
    worst = 0.0
    with torch.no_grad():
        for start in range(0, SEQUENCE, MAX_QUERY_LEN):
            ids = tokens[0, start:start + MAX_QUERY_LEN].reshape(1, -1)
            got = fp16(ids, torch.arange(start, start + ids.shape[1]))[0]
            worst = max(worst, (got - expected[0, start:start + ids.shape[1]]).abs().max().item())
    assert worst <= FP16_CACHE_ATOL, f"max abs diff {worst:.3g}"


def test_null_settings_are_transformers_defaults():
    """A null attention_bias / mlp_bias / use_sliding_window is the default (no bias, no
    window), as transformers reads it."""
    assert qwen3.Qwen3Config.from_dict(dict(QWEN3_4B, attention_bias=None,
                                            use_sliding_window=None)).num_hidden_layers == 36
    assert llama.LlamaConfig.from_dict(dict(LLAMA_8B, mlp_bias=None)).num_hidden_layers == 32


@pytest.mark.parametrize("entry", ["forward", "prefill"])
def test_entry_points_trace_writing_only_the_global_caches(pair, entry):
    """torch.export takes each entry point as the exporter does (export/convert.py `trace`):
    no data-dependent scalar reads, and the global pair the only states written."""
    from museflash.export.convert import check_no_data_dependent_scalars, trace

    _, module, directory, *_ = pair
    model = _load_museflash(module, directory)
    program = trace(model.with_entry_point(entry),
                    (torch.zeros(1, 4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)))
    check_no_data_dependent_scalars(program)
    written = set(program.graph_signature.buffers_to_mutate.values())
    assert written == {"globalKeyCache", "globalValueCache"}
