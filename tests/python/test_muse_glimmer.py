"""The cached Muse Glimmer target against an independent no-cache reference forward."""

import pytest
import torch
import torch.nn.functional as F
from reference_rope import rotate

from museflash.builtin.demo_checkpoint import TINY_TARGET_CONFIG, build_tiny_models
from museflash.bundle import LayerType
from museflash.models.base import RotaryTables, apply_rope, sliding_causal_mask
from museflash.models.muse_glimmer import MuseGlimmerConfig

ATOL = 2e-4


def _rms(x, weight=None, eps=1e-6, unit_offset=True):
    y = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    if weight is None:
        return y
    return y * (1 + weight) if unit_offset else y * weight


def reference_logits(model, tokens):
    """Whole-sequence forward with explicit masks; shares only the weights with the model."""
    cfg = model.config
    p = {name: t.detach().float() for name, t in model.named_parameters()}
    n = len(tokens)
    positions = torch.arange(n)
    x = _rms(p["embed_tokens.weight"][torch.tensor(tokens)], eps=cfg.rms_norm_eps)
    post_eps = cfg.post_norm_eps if cfg.post_norm_eps is not None else cfg.rms_norm_eps
    i, j = torch.meshgrid(positions, positions, indexing="ij")
    hidden_by_layer = []
    for layer in range(cfg.num_hidden_layers):
        w = {k[len(f"layers.{layer}."):]: v for k, v in p.items()
             if k.startswith(f"layers.{layer}.")}
        h = _rms(x, w["input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ w["self_attn.q_proj.weight"].T).view(n, cfg.num_attention_heads, -1)
        k = (h @ w["self_attn.k_proj.weight"].T).view(n, cfg.num_key_value_heads, -1)
        v = (h @ w["self_attn.v_proj.weight"].T).view(n, cfg.num_key_value_heads, -1)
        q = _rms(q, eps=cfg.rms_norm_eps) * cfg.qk_scale_factor
        k = _rms(k, eps=cfg.rms_norm_eps)
        theta = cfg.layer_rope_theta[layer]
        if theta:
            q = rotate(q.transpose(0, 1), positions, theta).transpose(0, 1)
            k = rotate(k.transpose(0, 1), positions, theta).transpose(0, 1)
        allowed = j <= i
        if cfg.layer_types[layer] == LayerType.SLIDING_ATTENTION:
            allowed = allowed & (i - j < cfg.sliding_window)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed
        ).transpose(0, 1).reshape(n, -1)
        gate = torch.sigmoid(h @ w["self_attn.gate_proj.weight"].T)
        attn = (attn * gate) @ w["self_attn.o_proj.weight"].T
        x = x + _rms(attn, w["post_attention_layernorm.weight"], post_eps)
        h = _rms(x, w["pre_feedforward_layernorm.weight"], cfg.rms_norm_eps)
        mlp = (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T))
        mlp = mlp @ w["mlp.down_proj.weight"].T
        x = x + _rms(mlp, w["post_feedforward_layernorm.weight"], post_eps)
        hidden_by_layer.append(x)
    out = _rms(x, p["norm.weight"], cfg.rms_norm_eps) * cfg.output_multiplier
    head = p["embed_tokens.weight"] if model.lm_head is None else p["lm_head.weight"]
    logits = out @ head.T
    if cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits, hidden_by_layer


@pytest.fixture(scope="module")
def models():
    return build_tiny_models(seed=3, cache_dtype=torch.float32, max_context=128)


def _tokens(n, seed=0):
    return torch.randint(0, 511, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_chunks(model, tokens, chunk_sizes, start=0):
    """Feeds tokens in chunks (cycling chunk_sizes) from position `start`; returns logits."""
    outputs, position, sizes = [], start, list(chunk_sizes)
    step = 0
    while position - start < len(tokens):
        size = min(sizes[step % len(sizes)], len(tokens) - (position - start))
        chunk = torch.tensor([tokens[position - start:position - start + size]])
        positions = torch.arange(position, position + size, dtype=torch.int32)
        outputs.append(model(chunk, positions)[0])
        position += size
        step += 1
    return torch.cat(outputs, dim=1)[0]


def test_ring_is_shorter_than_the_test_sequences(models):
    target, _ = models
    assert target.ring_capacity == 32
    assert target.ring_capacity % 32 == 0
    assert target.ring_capacity >= target.config.sliding_window + target.max_query_len


@pytest.mark.parametrize(("chunk_sizes", "length"), [((1,), 40), ((8,), 70), ((3, 5, 1, 8, 2), 70)])
def test_cached_decoding_matches_full_forward_across_ring_wrap(models, chunk_sizes, length):
    target, _ = models
    target.reset_caches()
    tokens = _tokens(length)  # the ring holds 32 slots, so every case wraps
    expected, _ = reference_logits(target, tokens)
    with torch.no_grad():
        got = _run_chunks(target, tokens, chunk_sizes)
    assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()


def test_fp16_cache_stays_close_to_reference(models):
    target, _ = models
    fp16_target, _ = build_tiny_models(seed=3, cache_dtype=torch.float16, max_context=128)
    tokens = _tokens(40, seed=5)
    expected, _ = reference_logits(target, tokens)
    with torch.no_grad():
        got = _run_chunks(fp16_target, tokens, (8,))
    assert fp16_target.slidingKeyCache.dtype == torch.float16
    assert torch.allclose(got, expected, atol=5e-2), (got - expected).abs().max()


def test_prefill_returns_last_logits_and_same_features(models):
    target, _ = models
    tokens = torch.tensor([_tokens(8, seed=1)])
    positions = torch.arange(8, dtype=torch.int32)
    with torch.no_grad():
        target.reset_caches()
        logits, features = target(tokens, positions)
        target.reset_caches()
        prefill = target.with_entry_point("prefill")
        last_logits, prefill_features = prefill(tokens, positions)
    assert prefill.slidingKeyCache is target.slidingKeyCache
    assert last_logits.shape == (1, 1, target.config.vocab_size)
    assert torch.allclose(last_logits[0, 0], logits[0, -1], atol=1e-5)
    assert torch.allclose(prefill_features, features, atol=1e-5)


def test_rolled_back_positions_are_never_visible(models):
    target, _ = models
    target.reset_caches()
    committed, speculative, replacement = _tokens(26, 2), _tokens(6, 3), _tokens(30, 4)
    with torch.no_grad():
        _run_chunks(target, committed, (8,))
        # Verify 6 speculative tokens at 26..31, accept 2, restart at 28 with other tokens.
        _run_chunks(target, speculative, (6,), start=26)
        got = _run_chunks(target, replacement, (1, 3, 8), start=28)
    expected, _ = reference_logits(target, committed + speculative[:2] + replacement)
    assert torch.allclose(got, expected[28:], atol=ATOL), (got - expected[28:]).abs().max()


def test_stale_ring_slots_are_masked_after_rollback():
    capacity, window = 32, 16
    # Positions up to 45 were written; the query restarts at 40.
    mask = sliding_causal_mask(torch.tensor([40], dtype=torch.int32), capacity, window)[0]
    visible = {s for s in range(capacity) if mask[s]}
    assert visible == {p % capacity for p in range(25, 41)}
    assert not any(mask[p % capacity] for p in range(41, 46))


def test_drafter_features_match_encoder_on_hooked_layer_outputs(models):
    target, _ = models
    target.reset_caches()
    captured = {}
    hooks = [
        target.layers[i].register_forward_hook(
            lambda _m, _inp, out, i=i: captured.setdefault(i, []).append(out)
        )
        for i in target.target_layer_ids
    ]
    tokens = _tokens(12, seed=7)
    try:
        with torch.no_grad():
            features = torch.cat([
                target(torch.tensor([tokens[:8]]), torch.arange(8, dtype=torch.int32))[1],
                target(torch.tensor([tokens[8:]]), torch.arange(8, 12, dtype=torch.int32))[1],
            ], dim=1)
    finally:
        for hook in hooks:
            hook.remove()
    stacked = torch.cat(
        [torch.cat(captured[i], dim=1) for i in target.target_layer_ids], dim=-1
    )
    enc = target.encoder
    expected = _rms(stacked @ enc.fc.weight.T, enc.output_norm_enc.weight,
                    enc.output_norm_enc.eps, unit_offset=False)
    assert torch.allclose(features, expected, atol=1e-5)
    # Independent of hooks: the reference forward's hidden states agree too.
    _, hidden = reference_logits(target, tokens)
    ref_stacked = torch.cat([hidden[i] for i in target.target_layer_ids], dim=-1)
    assert torch.allclose(stacked[0], ref_stacked, atol=ATOL)


def test_config_nested_and_flat_are_equivalent():
    nested = MuseGlimmerConfig.from_dict(TINY_TARGET_CONFIG)
    flat = MuseGlimmerConfig.from_dict(dict(TINY_TARGET_CONFIG["text_config"]))
    assert nested == flat
    assert nested.global_layer_ids == [3, 7]
    assert nested.post_norm_eps == 1e-5


def test_config_rejects_inconsistent_layer_lists():
    text = dict(TINY_TARGET_CONFIG["text_config"], layer_rope_theta=[0.0] * 3)
    with pytest.raises(ValueError, match="layer_rope_theta has 3 entries"):
        MuseGlimmerConfig.from_dict(text)



def _direct_cos_sin(positions, head_dim, theta):
    """The rotate-half formula evaluated in float64: the exact values the tables round."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def test_rope_table_lookup_equals_the_direct_formula_up_to_max_context():
    max_context, head_dim = 4096, 16
    tables = RotaryTables(head_dim, [10000.0, 0.0, 1e6, 10000.0], max_context)
    assert tables.thetas == (10000.0, 1e6)  # one table pair per distinct theta, none for NoPE
    positions = torch.arange(max_context, dtype=torch.int32)
    for theta in tables.thetas:
        cos, sin = tables(positions, theta, torch.float32)
        want_cos, want_sin = _direct_cos_sin(positions, head_dim, theta)
        assert cos.dtype == sin.dtype == torch.float32
        assert (cos.double() - want_cos).abs().max() < 1e-6
        assert (sin.double() - want_sin).abs().max() < 1e-6


def test_rope_tables_rotate_pairs_like_the_reference_at_long_positions():
    tables = RotaryTables(16, [10000.0], 4096)
    positions = torch.tensor([0, 1, 7, 100, 2049, 4095], dtype=torch.int32)
    x = torch.randn(2, len(positions), 16, generator=torch.Generator().manual_seed(0))
    got = apply_rope(x, *tables(positions, 10000.0, torch.float32))
    cos, sin = (t[:, :8] for t in _direct_cos_sin(positions, 16, 10000.0))
    first, second = x[..., :8].double(), x[..., 8:].double()
    want = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    assert (got.double() - want).abs().max() < 1e-5


def test_positions_beyond_the_tables_are_clamped_into_range():
    tables = RotaryTables(16, [10000.0], 64)
    cos, sin = tables(torch.tensor([63, 64, 5000], dtype=torch.int32), 10000.0, torch.float32)
    assert torch.equal(cos[1], cos[0]) and torch.equal(sin[2], sin[0])


def test_rope_tables_are_shared_read_only_constants(models):
    target, _ = models
    names = [name for name, _ in target.named_buffers() if name.startswith("rotary.")]
    assert names == ["rotary.cos_0", "rotary.sin_0"]  # sliding layers share theta 1e4
    assert target.rotary.max_position == target.max_context
    assert not any(key.startswith("rotary.") for key in target.state_dict())
    view = target.with_entry_point("prefill")
    assert view.rotary is target.rotary
    before = {name: table.clone() for name, table in target.rotary.named_buffers()}
    target.reset_caches()
    with torch.no_grad():
        view(torch.tensor([_tokens(8)]), torch.arange(8, dtype=torch.int32))
    for name, table in target.rotary.named_buffers():
        assert torch.equal(table, before[name])


# --- The cache-free batched forward used for training ---------------------------------------


def _batch(rows, length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 511, (rows, length), generator=generator)


def test_batched_forward_equals_the_cached_forward_on_the_same_tokens(models):
    target, _ = models  # sliding window 16, ring of 32 slots: 70 tokens wrap it twice
    ids = _batch(3, 70, seed=11)
    with torch.no_grad():
        batched = target.batch_logits(ids)
        for row in range(ids.shape[0]):
            target.reset_caches()
            cached = _run_chunks(target, ids[row].tolist(), (8, 3, 1))
            assert torch.allclose(batched[row], cached, atol=ATOL), \
                (batched[row] - cached).abs().max()
    expected, _ = reference_logits(target, ids[1].tolist())
    assert torch.allclose(batched[1], expected, atol=ATOL)
    assert batched.shape == (3, 70, target.config.vocab_size)


def test_batched_forward_reads_and_writes_no_cache(models):
    target, _ = models
    target.reset_caches()
    caches = {name: buffer.clone() for name, buffer in target.named_buffers()}
    ids = _batch(2, 20, seed=12)
    with torch.no_grad():
        first = target.batch_logits(ids)
        target(torch.tensor([_tokens(8)]), torch.arange(8, dtype=torch.int32))  # fill caches
        second = target.batch_logits(ids)
        target.reset_caches()
    assert torch.equal(first, second)
    with torch.no_grad():
        target.batch_logits(ids)
    for name, buffer in target.named_buffers():
        assert torch.equal(buffer, caches[name]), name


def test_batched_hidden_states_capture_the_layers_the_reference_computes(models):
    target, _ = models
    ids = _batch(2, 40, seed=13)
    with torch.no_grad():
        hidden, captured = target.batch_hidden_states(ids, target.target_layer_ids)
    for row in range(2):
        _, reference_hidden = reference_logits(target, ids[row].tolist())
        assert torch.allclose(hidden[row], reference_hidden[-1], atol=ATOL)
        for layer_id, layer_out in zip(target.target_layer_ids, captured, strict=True):
            assert torch.allclose(layer_out[row], reference_hidden[layer_id], atol=ATOL)


def test_batched_forward_trains_every_decoder_weight_and_refuses_overlong_input():
    target, _ = build_tiny_models(seed=4, max_context=32)
    target.requires_grad_(True)
    ids = _batch(2, 33, seed=14)
    logits = target.batch_logits(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    untouched = [name for name, p in target.named_parameters()
                 if not name.startswith("encoder.") and (p.grad is None or not p.grad.any())]
    assert untouched == []
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_context 32"):
        target.batch_logits(ids)
