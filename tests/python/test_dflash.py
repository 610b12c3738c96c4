"""DFlash drafter: cache injection, block drafting and the ring drafter against references."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from reference_drafter import attention_kv, rms
from reference_rope import rotate

from museflash.builtin.demo_checkpoint import TINY_DRAFTER_CONFIG, build_tiny_models
from museflash.models.base import ring_slot_positions
from museflash.models.dflash import (
    DFlashConfig,
    DFlashRingDrafter,
    block_window_mask,
    query_window_mask,
)

ATOL = 2e-4


@pytest.fixture(scope="module")
def models():
    return build_tiny_models(seed=11, cache_dtype=torch.float32, max_context=128)


def _layer_kv(drafter, layer, inputs, positions):
    return attention_kv(drafter.layers[layer].self_attn, drafter.config, inputs, positions)


def reference_drafter(drafter, tokens, positions, context=None, context_positions=None,
                      causal=False, per_query=False):
    """Explicit-mask drafter forward. Context K/V come straight from `context` features; keys
    are visible when inside the window ending at the block's last position (draft), the
    query's own position (causal), or within the window on either side of the query
    (per_query: z-lab's non-causal sliding window, |q - k| < window)."""
    cfg = drafter.config
    positions = torch.as_tensor(positions)
    x = drafter.embed_tokens.weight[torch.tensor(tokens)].detach()
    n = len(tokens)
    for layer in range(cfg.num_hidden_layers):
        block = drafter.layers[layer]
        h = rms(x, block.input_layernorm.weight, cfg.rms_norm_eps)
        k, v = _layer_kv(drafter, layer, h, positions)
        key_positions = positions
        if context is not None:
            ck, cv = _layer_kv(drafter, layer, context, torch.as_tensor(context_positions))
            k, v = torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)
            key_positions = torch.cat([torch.as_tensor(context_positions), positions])
        anchor = positions[:, None] if causal or per_query else positions.max().expand(n, 1)
        distance = anchor - key_positions[None, :]
        allowed = (distance >= 0) & (distance < cfg.sliding_window)
        if per_query:
            allowed = distance.abs() < cfg.sliding_window
        if causal:
            allowed &= key_positions[None, :] <= positions[:, None]
        q = (h @ block.self_attn.q_proj.weight.T).view(n, cfg.num_attention_heads, -1)
        q = rotate(rms(q, block.self_attn.q_norm.weight, cfg.rms_norm_eps).transpose(0, 1),
                    positions, cfg.rope_theta)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=allowed
        ).transpose(0, 1).reshape(n, -1)
        x = x + out @ block.self_attn.o_proj.weight.T
        h = rms(x, block.post_attention_layernorm.weight, cfg.rms_norm_eps)
        x = x + (F.silu(h @ block.mlp.gate_proj.weight.T) * (h @ block.mlp.up_proj.weight.T)) \
            @ block.mlp.down_proj.weight.T
    logits = rms(x, drafter.norm.weight, cfg.rms_norm_eps) @ drafter.lm_head.weight.T
    cap = drafter.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


def _features(n, seed):
    return torch.randn(1, n, 64, generator=torch.Generator().manual_seed(seed))


def _inject(drafter, features, start=0, chunk=8):
    for offset in range(0, features.shape[1], chunk):
        part = features[:, offset:offset + chunk]
        positions = torch.arange(start + offset, start + offset + part.shape[1],
                                 dtype=torch.int32)
        drafter.inject_kv(part, positions)


def _block(drafter, anchor_token):
    k = drafter.config.block_size
    return [anchor_token] + [drafter.config.mask_token_id] * (k - 1)


def test_inject_kv_writes_exactly_the_injected_slots(models):
    _, drafter = models
    drafter.reset_caches()
    _inject(drafter, _features(30, 0))
    before_k = drafter.drafterKeyCache.clone()
    before_v = drafter.drafterValueCache.clone()
    features = _features(3, 1)
    positions = torch.tensor([30, 31, 32], dtype=torch.int32)  # 32 wraps to slot 0
    with torch.no_grad():
        drafter.inject_kv(features, positions)
    slots = [30, 31, 0]
    others = [s for s in range(drafter.ring_capacity) if s not in slots]
    for layer in range(drafter.config.num_hidden_layers):
        k, v = _layer_kv(drafter, layer, features[0], positions)
        assert torch.allclose(drafter.drafterKeyCache[layer][:, slots], k, atol=1e-5)
        assert torch.allclose(drafter.drafterValueCache[layer][:, slots], v, atol=1e-5)
        assert torch.equal(drafter.drafterKeyCache[layer][:, others], before_k[layer][:, others])
        assert torch.equal(drafter.drafterValueCache[layer][:, others],
                           before_v[layer][:, others])


@pytest.mark.parametrize("anchor_position", [9, 45])  # 45: context has wrapped the ring
def test_draft_matches_reference_over_injected_context(models, anchor_position):
    _, drafter = models
    drafter.reset_caches()
    context = _features(anchor_position, 2)
    tokens = _block(drafter, 17)
    positions = torch.arange(anchor_position, anchor_position + len(tokens), dtype=torch.int32)
    with torch.no_grad():
        _inject(drafter, context)
        logits = drafter.draft(torch.tensor([tokens]), positions)
    assert logits.shape == (1, drafter.config.block_size, 512)
    expected = reference_drafter(drafter, tokens, positions.long(), context[0],
                                 torch.arange(anchor_position))
    assert torch.allclose(logits[0], expected, atol=ATOL), (logits[0] - expected).abs().max()


@pytest.mark.parametrize("anchor_position", [9, 45])
def test_per_query_window_draft_matches_the_reference(models, anchor_position):
    """z-lab's convention: earlier queries of the block see further back, so the block's
    rows differ, and the result differs from the one-window-per-block draft."""
    _, drafter = models
    view = copy.copy(drafter)
    view.config = dataclasses.replace(drafter.config, window_per_query=True)
    drafter.reset_caches()
    context = _features(anchor_position, 2)
    tokens = _block(drafter, 17)
    positions = torch.arange(anchor_position, anchor_position + len(tokens), dtype=torch.int32)
    with torch.no_grad():
        _inject(drafter, context)
        logits = view.draft(torch.tensor([tokens]), positions)
        per_block = drafter.draft(torch.tensor([tokens]), positions)
    expected = reference_drafter(drafter, tokens, positions.long(), context[0],
                                 torch.arange(anchor_position), per_query=True)
    assert torch.allclose(logits[0], expected, atol=ATOL), (logits[0] - expected).abs().max()
    if anchor_position + len(tokens) > drafter.config.sliding_window:
        assert not torch.allclose(logits, per_block, atol=1e-3)


def test_per_query_window_mask_reaches_back_from_each_query():
    positions = torch.arange(40, 44, dtype=torch.int32)
    mask = query_window_mask(positions, capacity=64, window=16)
    slot_positions = ring_slot_positions(positions.amax(), 64)
    for row, query in enumerate(positions.tolist()):
        visible = sorted(int(p) for p in slot_positions[mask[row]])
        assert visible == list(range(query - 15, 44))


def test_draft_after_rollback_sees_accepted_context_only(models):
    _, drafter = models
    drafter.reset_caches()
    context = _features(40, 3)
    with torch.no_grad():
        _inject(drafter, context[:, :30])
        drafter.draft(torch.tensor([_block(drafter, 5)]), torch.arange(30, 34, dtype=torch.int32))
        # Target accepted 2 of the block: inject their features, draft from the new anchor.
        _inject(drafter, context[:, 30:32], start=30)
        tokens = _block(drafter, 9)
        positions = torch.arange(32, 36, dtype=torch.int32)
        logits = drafter.draft(torch.tensor([tokens]), positions)
    expected = reference_drafter(drafter, tokens, positions.long(), context[0, :32],
                                 torch.arange(32))
    assert torch.allclose(logits[0], expected, atol=ATOL), (logits[0] - expected).abs().max()


@pytest.mark.parametrize("last_position", [2, 20, 77])
def test_draft_mask_rows_are_identical_and_cover_exactly_the_window(last_position):
    capacity, window, k = 32, 16, 4
    positions = torch.arange(last_position - k + 1, last_position + 1, dtype=torch.int32)
    positions = positions.clamp(min=0) if last_position < k else positions
    mask = block_window_mask(positions, capacity, window)
    assert mask.shape == (k, capacity)
    assert all(torch.equal(mask[0], row) for row in mask)
    expected = {p % capacity for p in range(max(0, last_position - window + 1),
                                            last_position + 1)}
    assert {s for s in range(capacity) if mask[0, s]} == expected


def test_draft_mask_hides_positions_beyond_a_rolled_back_block():
    # A block at 60..63 was drafted; the next block is at 58..61 (positions 62, 63 are stale).
    mask = block_window_mask(torch.arange(58, 62, dtype=torch.int32), 32, 16)[0]
    assert not mask[62 % 32] and not mask[63 % 32]
    assert all(mask[p % 32] for p in range(46, 62))


def test_ring_drafter_decodes_like_a_causal_sliding_reference(models):
    target, drafter = models
    ring = DFlashRingDrafter(drafter.config, target.embed_tokens, target.lm_head,
                             final_logit_softcapping=30.0, max_query_len=8,
                             cache_dtype=torch.float32)
    # Same weights; the caches differ in name only (the ring drafter's package is its own).
    missing, unexpected = ring.load_state_dict(drafter.state_dict(), strict=False)
    assert (sorted(missing), sorted(unexpected)) == (sorted(ring.cache_names),
                                                     sorted(drafter.cache_names))
    tokens = torch.randint(0, 511, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    outputs = []
    with torch.no_grad():
        for start, size in [(0, 8), (8, 1), (9, 7), (16, 8), (24, 8), (32, 8)]:
            positions = torch.arange(start, start + size, dtype=torch.int32)
            outputs.append(ring(torch.tensor([tokens[start:start + size]]), positions)[0])
    got = torch.cat(outputs)
    expected = reference_drafter(ring, tokens, torch.arange(40), causal=True)
    assert torch.allclose(got, expected, atol=ATOL), (got - expected).abs().max()


def test_drafter_rope_tables_default_to_the_target_context(models):
    target, drafter = models
    assert drafter.max_context == target.max_context == drafter.rotary.max_position
    ring = DFlashRingDrafter.for_target(drafter.config, target, max_context=300)
    assert ring.rotary.max_position == 300
    assert ring.rotary.thetas == (drafter.config.rope_theta,)


def test_drafter_borrows_target_modules_without_copying(models):
    target, drafter = models
    assert drafter.embed_tokens is target.embed_tokens
    assert drafter.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()


def test_config_dflash_config_form_and_mask_alias():
    flat = DFlashConfig.from_dict(TINY_DRAFTER_CONFIG)
    zlab = copy.deepcopy(TINY_DRAFTER_CONFIG)
    nested = {name: zlab.pop(name) for name in ("block_size", "target_layer_ids")}
    nested["draft_mask_token_id"] = zlab.pop("mask_token_id")
    zlab["dflash_config"] = nested
    zlab.pop("rope_parameters")
    zlab["rope_theta"] = 10000.0
    parsed = DFlashConfig.from_dict(zlab)
    assert parsed == flat
    assert parsed.mask_token_id == 511 and parsed.target_layer_ids == [1, 4, 6]
    assert parsed.raw["dflash_config"]["draft_mask_token_id"] == 511


def test_config_missing_settings_are_named():
    broken = {k: v for k, v in TINY_DRAFTER_CONFIG.items() if k != "mask_token_id"}
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict(broken)
