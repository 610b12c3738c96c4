"""DFlash2 drafter: the model against an independent reference, z-lab's checkpoint layout, the
refusals, and the exported `draft` (interpreter parity, token-exact speculative loop)."""

import copy
import json

import numpy as np
import pytest
import torch
from prebuilt import DFLASH2_BUNDLE, prebuilt_bundle
from reference_drafter import attention_kv, rms
from reference_rope import rotate

from museflash.builtin.demo_checkpoint import (
    TINY_DFLASH2_CONFIG,
    build_tiny_models,
    write_tiny_checkpoints,
)
from museflash.bundle import DrafterKind, FunctionName, Metadata, OutputName
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.tensor_files import CheckpointError
from museflash.models.dflash2 import DFlash2Config
from museflash.runtime.speculative import (
    Drafted,
    EagerDrafter,
    EagerTarget,
    greedy_generate,
    speculative_generate,
)

ATOL = 2e-4

# The tensor names of z-lab's DFlash2 checkpoint (tests/fixtures/dflash2-safetensors-header.json
# in z-lab/dflash), per layer and for the whole model.
ZLAB_LAYER_KEYS = (
    "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
    "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
    "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight",
    "self_attn.v_proj.weight")
ZLAB_MODEL_KEYS = (
    "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook", "fc.weight", "hidden_norm.weight", "norm.weight")


@pytest.fixture(scope="module")
def models():
    return build_tiny_models(seed=5, drafter_config=TINY_DFLASH2_CONFIG,
                             cache_dtype=torch.float32, max_context=128)


# --- An independent reference, from z-lab's description -------------------------------------


def _convolve(conv, x, part, dynamic):
    """out[t] = sum over offsets o <= t of (base[part][o] + d[t, part, o, g]) * x[t - o], the
    dynamic weight d[t, part, o, g] at row (part * kernel + o) * groups + g of the
    projection, shared by the group's channels."""
    kernel, hidden = conv.base_kernel.shape[1:]
    size = conv.group_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(min(kernel, t + 1)):
            for g in range(hidden // size):
                channels = slice(g * size, (g + 1) * size)
                weight = conv.base_kernel[part, o, channels] + dynamic[
                    t, (part * kernel + o) * (hidden // size) + g]
                out[t, channels] += weight * x[t - o, channels]
    return out


def reference_draft(drafter, tokens, positions, context, context_positions):
    """(logits [K, vocab], greedy selector path [K-1]) of one block, with every key of the
    context and the block visible to a query within the window on either side."""
    cfg = drafter.config
    x = drafter.embed_tokens.weight[torch.tensor(tokens)].detach()
    n = len(tokens)
    keys_at = torch.cat([context_positions, positions])
    visible = (positions[:, None] - keys_at[None, :]).abs() < cfg.sliding_window
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in drafter.layers:
        attn = layer.self_attn
        h = rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        d_attn = h @ layer.attention_conv.kernel_projection.weight.T
        h = _convolve(layer.attention_conv, h, 0, d_attn)
        ck, cv = attention_kv(attn, cfg, context, context_positions)
        bk, bv = attention_kv(attn, cfg, h, positions)
        k, v = torch.cat([ck, bk], dim=1), torch.cat([cv, bv], dim=1)
        q = (h @ attn.q_proj.weight.T).view(n, cfg.num_attention_heads, -1)
        q = rotate(rms(q, attn.q_norm.weight, cfg.rms_norm_eps).transpose(0, 1), positions,
                   cfg.rope_theta)
        scores = q @ k.repeat_interleave(group, 0).transpose(1, 2) / cfg.head_dim ** 0.5
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out = (weights @ v.repeat_interleave(group, 0)).transpose(0, 1).reshape(n, -1)
        out = _convolve(layer.attention_conv, out @ attn.o_proj.weight.T, 1, d_attn)
        x = x + out
        h = rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        d_mlp = h @ layer.mlp_conv.kernel_projection.weight.T
        h = _convolve(layer.mlp_conv, h, 0, d_mlp)
        mlp = layer.mlp
        out = (torch.nn.functional.silu(h @ mlp.gate_proj.weight.T) * (h @ mlp.up_proj.weight.T)
               ) @ mlp.down_proj.weight.T
        x = x + _convolve(layer.mlp_conv, out, 1, d_mlp)
    hidden = rms(x, drafter.norm.weight, cfg.rms_norm_eps)
    logits = hidden @ drafter.lm_head.weight.T * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    logits = torch.tanh(logits / cap) * cap
    selector = drafter.candidate_selector
    projected = hidden @ selector.hidden_projection.weight.T
    previous, path = tokens[0], []
    for row in range(1, n):
        candidates = sorted(range(logits.shape[1]), key=lambda t: -float(logits[row, t]))
        candidates = candidates[:cfg.selector_top_k]
        query = selector.predecessor_codebook[previous] * projected[row]
        best = max(candidates, key=lambda t: float(
            logits[row, t] + query @ selector.successor_codebook[t]))
        path.append(best)
        previous = best
    return logits, path


def _inject(drafter, features):
    for start in range(0, features.shape[1], 4):
        part = features[:, start:start + 4]
        drafter.inject_kv(part, torch.arange(start, start + part.shape[1], dtype=torch.int32))


@pytest.mark.parametrize("anchor_position", [8, 44])  # 44: the ring of 32 has wrapped
def test_draft_matches_the_independent_reference(models, anchor_position):
    _, drafter = models
    drafter.reset_caches()
    context = torch.randn(1, anchor_position, 64, generator=torch.Generator().manual_seed(7))
    tokens = [17] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1)
    positions = torch.arange(anchor_position, anchor_position + len(tokens), dtype=torch.int32)
    with torch.no_grad():
        _inject(drafter, context)
        logits, draft_tokens = drafter.draft(torch.tensor([tokens], dtype=torch.int32),
                                             positions)
        window = torch.arange(max(0, anchor_position - drafter.config.sliding_window),
                              anchor_position)
        expected, path = reference_draft(drafter, tokens, positions.long(), context[0, window],
                                         window)
    assert torch.allclose(logits[0], expected, atol=ATOL), (logits[0] - expected).abs().max()
    assert draft_tokens.dtype == torch.int32 and draft_tokens[0].tolist() == path


def test_the_selector_path_is_not_the_rows_argmax(models):
    """The demo drafter's selector changes a drafted token, so a loop that took each row's
    argmax instead of `draft_tokens` would not be driving DFlash2."""
    _, drafter = models
    differs = 0
    with torch.no_grad():
        for anchor in range(40):
            drafter.reset_caches()
            _inject(drafter, torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(anchor)))
            ids = torch.tensor([[anchor] + [511] * 3], dtype=torch.int32)
            logits, tokens = drafter.draft(ids, torch.arange(8, 12, dtype=torch.int32))
            differs += int(not torch.equal(tokens[0], logits[0, 1:].argmax(-1).int()))
    assert differs > 0


# --- z-lab's checkpoint layout and the refusals -----------------------------------------------


def _pair(tmp_path, **drafter_changes):
    config = copy.deepcopy(TINY_DFLASH2_CONFIG)
    for key, value in drafter_changes.items():
        if value is None:
            config.pop(key, None)
            config["dflash_config"].pop(key, None)
        elif key in config["dflash_config"]:
            config["dflash_config"][key] = value
        else:
            config[key] = value
    return write_tiny_checkpoints(tmp_path / "pair", seed=5, drafter_config=config)


def test_the_written_checkpoint_has_zlab_layout_and_loads_back(tmp_path, models):
    from safetensors import safe_open

    target_dir, drafter_dir = _pair(tmp_path)
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    layers = TINY_DFLASH2_CONFIG["num_hidden_layers"]
    assert keys == {f"layers.{i}.{k}" for i in range(layers) for k in ZLAB_LAYER_KEYS} | set(
        ZLAB_MODEL_KEYS)
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=128,
                         max_query_len=8, cache_dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=torch.float32,
                           max_query_len=8, cache_dtype=torch.float32)
    assert isinstance(drafter.config, DFlash2Config)
    _, built = models
    for name, value in built.named_parameters():
        # The checkpoint is bf16: the loaded drafter carries the rounded values.
        assert torch.equal(drafter.get_parameter(name), value.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("changes, message", [
    ({"is_causal": None}, "is_causal: false"),
    ({"selector_top_k": 513}, "selector_top_k 513 exceeds the target vocabulary 512"),
    ({"conv_group_size": 24}, "not a multiple of conv_group_size 24"),
    ({"selector_rank": None}, "missing ['selector_rank']"),
    ({"architectures": ["DFlash2DraftModel", "DFlashDraftModel"]}, "two drafter families"),
    ({"architectures": ["DFlash3DraftModel"]}, "not a drafter this exporter knows"),
    ({"num_target_layers": 52}, "num_target_layers 52"),
])
def test_bad_dflash2_configs_are_refused_naming_the_setting(tmp_path, changes, message):
    target_dir, drafter_dir = _pair(tmp_path)
    config = json.loads((drafter_dir / "config.json").read_text())
    for key, value in changes.items():
        where = config["dflash_config"] if key in config["dflash_config"] else config
        if value is None:
            where.pop(key)
        else:
            where[key] = value
    (drafter_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json") as error:
        load_target(target_dir, drafter_dir)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_dflash2_drafter_has_no_ring_form(tmp_path):
    target_dir, drafter_dir = _pair(tmp_path)
    target = load_target(target_dir, drafter_dir)
    with pytest.raises(CheckpointError, match="no ring form"):
        load_drafter(drafter_dir, target, ring=True)


# --- The speculative loop takes the selector's path ---------------------------------------------


class _OracleTokens:
    """A drafter whose `draft_tokens` are the target's own greedy continuation and whose logits
    rows all point elsewhere: only a loop driven by `draft_tokens` accepts its drafts."""

    def __init__(self, drafter, continuation, prompt_length):
        self.inner, self.continuation, self.prompt_length = drafter, continuation, prompt_length
        self.block_size = drafter.block_size

    def inject(self, features, positions):
        self.inner.inject(features, positions)

    def draft(self, ids, positions):
        drafted = self.inner.draft(ids, positions)
        start = int(positions[0]) - self.prompt_length + 1
        tokens = np.array(self.continuation[start:start + self.block_size - 1], np.int32)
        logits = np.zeros_like(drafted.logits)
        logits[:, 0] = 1.0  # every row's argmax is token 0
        return Drafted(logits, tokens)

    def reset(self):
        self.inner.reset()


def test_the_greedy_loop_proposes_draft_tokens(models):
    target, drafter = models
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    new_tokens = 12
    expected = greedy_generate(EagerTarget(target, 8, 4), prompt, new_tokens + 4).tokens
    oracle = _OracleTokens(EagerDrafter(drafter), expected, len(prompt))
    result = speculative_generate(EagerTarget(target, 8, 4), oracle, prompt, new_tokens,
                                  mask_token_id=511, lookup_min_match=0)
    assert result.tokens == expected[:new_tokens]
    assert result.accepted[:2] == [3, 3]  # every proposal accepted


# --- The export -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("coremltools")
    # //tests/runtime:dflash2_bundle: --builtin tiny-dflash2, fused, context 256.
    return prebuilt_bundle(tmp_path_factory.mktemp("dflash2"), DFLASH2_BUNDLE)


def test_the_export_declares_dflash2_and_draft_tokens(exported):
    metadata = Metadata.read(exported)
    spec = metadata.speculative_decoding
    assert spec.drafter_kind == DrafterKind.DFLASH2
    assert spec.dflash2.selector_top_k == TINY_DFLASH2_CONFIG["dflash_config"]["selector_top_k"]
    assert spec.dflash2.output_multiplier == 0.5
    draft = metadata.asset(metadata.drafter_role).function(FunctionName.DRAFT)
    assert draft.outputs == [OutputName.LOGITS, OutputName.DRAFT_TOKENS]


def test_the_exported_draft_carries_token_ids_in_32_bits(exported):
    """coremltools' 16-bit integer pass would give topk uint16 indices and gather ids through
    16 bits: ids of Muse Glimmer's 202,048-token vocabulary would wrap."""
    from museflash.runtime.interpreter import load_program

    program = load_program(exported / "target.mlpackage")
    draft = program.functions[str(FunctionName.DRAFT)]
    topk = [op for op in draft.operations if op.op_type == "topk"]
    assert len(topk) == 1 and topk[0].output_indices_dtype.val == "int32"
    narrow = [op.name for op in draft.operations for var in op.outputs
              if str(var.dtype.__name__) in ("int16", "uint16")]
    assert narrow == []


def test_verify_on_a_dflash2_export(exported):
    from museflash.checks.verify import VerifyOptions, run_verify

    lines = []
    status = run_verify(VerifyOptions(export_dir=exported, echo=lines.append, new_tokens=16))
    print("\n".join(lines))
    assert status == 0
    parity = next(line for line in lines if line.startswith("parity dflash_drafter"))
    assert "draft_tokens max abs 0 " in parity and " OK" in parity
    assert any(line.startswith("lossless: speculative == ") for line in lines)


def test_path_gaps_are_zero_on_the_greedy_path_and_positive_off_it(models):
    """What verify uses to tell an fp16 near-tie of two selector scores from a wrong path."""
    _, drafter = models
    drafter.reset_caches()
    with torch.no_grad():
        _inject(drafter, torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(3)))
        ids = torch.tensor([[21, 511, 511, 511]], dtype=torch.int32)
        positions = torch.arange(8, 12, dtype=torch.int32)
        logits, path = drafter.draft(ids, positions)
        assert drafter.path_gaps(ids, positions, path[0]).tolist() == [0.0, 0.0, 0.0]
        runner_up = torch.topk(logits[0, 1], 2).indices[1]
        other = torch.cat([runner_up.reshape(1).int(), path[0, 1:]])
        gaps = drafter.path_gaps(ids, positions, other)
        assert gaps[0] > 0 or int(runner_up) == int(path[0, 0])
        # A token outside the candidates: at least as far as its logit is below the k-th's.
        outside = torch.argsort(logits[0, 1])[0].reshape(1).int()  # the least likely token
        kth = torch.topk(logits[0, 1], drafter.candidate_selector.top_k).values[-1]
        gap = drafter.path_gaps(ids, positions, torch.cat([outside, path[0, 1:]]))[0]
        assert gap >= kth - logits[0, 1, outside[0]] > 0


def test_verify_accepts_a_selector_near_tie_and_refuses_a_wrong_path(models):
    from museflash.checks.verify import OUTPUT_TOLERANCE, _accept_selector_near_tie
    from museflash.runtime.parity import Discrepancy, ParityReport

    _, drafter = models
    drafter.reset_caches()
    ids = np.array([[21, 511, 511, 511]], np.int32)
    positions = np.arange(8, 12, dtype=np.int32)
    with torch.no_grad():
        _inject(drafter, torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(3)))
        logits, path = drafter.draft(torch.from_numpy(ids), torch.from_numpy(positions))

    def report(tokens, scale=None):
        # As if the package's path differed from eager's by one token somewhere.
        scale = float(logits.abs().max()) if scale is None else scale
        return ParityReport("draft", outputs={
            "logits": Discrepancy("logits", 0.0, scale),
            "draft_tokens": Discrepancy("draft_tokens", 1.0, 1.0, exact=True)},
            actual={"draft_tokens": tokens})

    tied = report(path.numpy())  # zero gap: what an fp16 swap of equal scores would give
    assert _accept_selector_near_tie(tied, drafter, ids, positions) == 1
    assert tied.outputs["draft_tokens"].within(OUTPUT_TOLERANCE)
    wrong = path.numpy().copy()
    wrong[0, 0] = int(torch.argsort(logits[0, 1])[0])  # not even a candidate
    refused = report(wrong)
    assert _accept_selector_near_tie(refused, drafter, ids, positions) == 0
    assert not refused.outputs["draft_tokens"].within(OUTPUT_TOLERANCE)
    # The best token just outside the candidates (fp16 can swap it with the last candidate):
    # accepted when its gap is within tolerance of the logits' scale, refused otherwise.
    first_out = torch.topk(logits[0, 1], drafter.candidate_selector.top_k + 1).indices[-1]
    boundary = path.numpy().copy()
    boundary[0, 0] = int(first_out)
    with torch.no_grad():
        gap = float(drafter.path_gaps(torch.from_numpy(ids), torch.from_numpy(positions),
                                      torch.from_numpy(boundary[0])).max())
    assert 0 < gap < float("inf")
    wide = report(boundary, scale=2 * gap / OUTPUT_TOLERANCE.rel_tol)
    assert _accept_selector_near_tie(wide, drafter, ids, positions) == 1
    narrow = report(boundary, scale=0.5 * gap / OUTPUT_TOLERANCE.rel_tol)
    assert _accept_selector_near_tie(narrow, drafter, ids, positions) == 0
