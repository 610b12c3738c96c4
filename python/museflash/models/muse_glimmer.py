"""Muse Glimmer text decoder, and the fused target that also emits DFlash drafter features.

Layout: interleaved sliding-window (RoPE) and global (NoPE) layers, gated attention with a
weight-less shared q/k RMSNorm, sandwich norms of the (1 + w) kind, SwiGLU MLP.
Caches: see docs/positions.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from museflash.bundle import KVWrite, LayerType, StateName
from museflash.models.base import (
    LayerCache,
    RMSNorm,
    RotaryTables,
    SwiGLU,
    apply_rope,
    attend,
    global_causal_mask,
    ring_capacity,
    sliding_causal_mask,
    softcap,
    tree_global_mask,
    tree_sliding_mask,
    tree_write_positions,
)
from museflash.models.causal_lm import CausalLM, WithDrafterFeatures

SLIDING = LayerType.SLIDING_ATTENTION.value
FULL = LayerType.FULL_ATTENTION.value


@dataclass
class MuseGlimmerConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: list[str]
    layer_rope_theta: list[float]
    sliding_window: int
    rms_norm_eps: float = 1e-6
    post_norm_eps: float | None = None
    qk_scale_factor: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        layers = self.num_hidden_layers
        if len(self.layer_types) != layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {layers}"
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise ValueError(f"layer_types has unknown values {unknown}; use {SLIDING!r}/{FULL!r}")
        if len(self.layer_rope_theta) != layers:
            raise ValueError(
                f"layer_rope_theta has {len(self.layer_rope_theta)} entries "
                f"but num_hidden_layers is {layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def sliding_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]

    @property
    def global_layer_ids(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> MuseGlimmerConfig:
        """Accepts a full config.json (text settings under `text_config`) or a flat one."""
        text = config.get("text_config") or config
        missing = [
            name
            for name in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "layer_types",
                "layer_rope_theta",
                "sliding_window",
            )
            if name not in text
        ]
        if missing:
            raise ValueError(f"config is missing {missing}")
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(head_dim),
            layer_types=list(text["layer_types"]),
            layer_rope_theta=[float(t) for t in text["layer_rope_theta"]],
            sliding_window=int(text["sliding_window"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            post_norm_eps=text.get("post_norm_eps"),
            qk_scale_factor=float(text.get("qk_scale_factor", 1.0)),
            output_multiplier=float(text.get("output_multiplier", 1.0)),
            final_logit_softcapping=text.get("final_logit_softcapping"),
            tie_word_embeddings=bool(tie),
            raw=dict(config),
        )


# --- Checkpoint keys (the Hugging Face multimodal layout) ------------------------------------
# The text decoder's parameters sit under TARGET_PREFIX, lm_head at the top level; the vision
# tower's and projector's keys belong to no module here and are ignored.
TARGET_PREFIX = "model.language_model."
TARGET_UNPREFIXED = ("lm_head.",)
TARGET_IGNORED_PREFIXES = ("model.vision_", "model.multi_modal_projector.")


def target_checkpoint_key(param_name: str) -> str:
    """The checkpoint key of the target's parameter `param_name`."""
    if param_name.startswith(TARGET_UNPREFIXED):
        return param_name
    return TARGET_PREFIX + param_name


class MuseGlimmerAttention(nn.Module):
    def __init__(self, config: MuseGlimmerConfig, layer_id: int):
        super().__init__()
        self.n_q = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qk_scale_factor = config.qk_scale_factor
        hidden = config.hidden_size
        q_width, kv_width = self.n_q * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, q_width, bias=False)
        self.qk_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False,
                               with_weight=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
        cache: LayerCache,
    ) -> torch.Tensor:
        """rope: (cos, sin) [T, head_dim] for the layer's theta, None for a NoPE layer; mask
        [T, capacity] bool; `cache`: the layer's ring or global cache (base.LayerCache)."""
        length = x.shape[1]
        q = self.q_proj(x[0]).reshape(length, self.n_q, self.head_dim).transpose(0, 1)
        k = self.k_proj(x[0]).reshape(length, self.n_kv, self.head_dim).transpose(0, 1)
        v = self.v_proj(x[0]).reshape(length, self.n_kv, self.head_dim).transpose(0, 1)
        q = self.qk_norm(q) * self.qk_scale_factor
        k = self.qk_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys, values = cache.update(k, v, q.dtype)
        out = attend(q, keys, values, mask, 1.0 / math.sqrt(self.head_dim))
        out = out.transpose(0, 1).reshape(1, length, self.n_q * self.head_dim)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(x)))

    def forward_batch(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Cache-free attention over whole sequences (training, batched evaluation).

        x: [B, T, hidden]; rope: (cos, sin) [T, head_dim] or None; mask: [T, T] bool (query
        i sees key j). The same projections, q/k norm, RoPE, `attend` (vmapped over the batch)
        and gate as `forward`, with the sequence's own keys in place of the caches."""
        batch, length = x.shape[:2]
        q = self.q_proj(x).reshape(batch, length, self.n_q, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(batch, length, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(batch, length, self.n_kv, self.head_dim).transpose(1, 2)
        q = self.qk_norm(q) * self.qk_scale_factor
        k = self.qk_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        scale = 1.0 / math.sqrt(self.head_dim)
        out = torch.vmap(attend, in_dims=(0, 0, 0, None, None))(q, k, v, mask, scale)
        out = out.transpose(1, 2).reshape(batch, length, self.n_q * self.head_dim)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(x)))


class MuseGlimmerDecoderLayer(nn.Module):
    def __init__(self, config: MuseGlimmerConfig, layer_id: int):
        super().__init__()
        eps = config.rms_norm_eps
        post_eps = config.post_norm_eps if config.post_norm_eps is not None else eps
        hidden = config.hidden_size
        self.is_sliding = config.layer_types[layer_id] == SLIDING
        self.rope_theta = config.layer_rope_theta[layer_id]
        self.self_attn = MuseGlimmerAttention(config, layer_id)
        self.mlp = SwiGLU(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, post_eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, post_eps, unit_offset=True)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, mask, cache)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def forward_batch(self, x: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        """`forward` without caches: x [B, T, hidden], mask [T, T] bool."""
        attn = self.self_attn.forward_batch(self.input_layernorm(x), rope, mask)
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class MuseGlimmerForCausalLM(CausalLM):
    """Target decoder with stateful caches, the sliding rings and the global pair; entry
    points, their views and `batch_logits` as CausalLM's (models/causal_lm.py)."""

    def __init__(
        self,
        config: MuseGlimmerConfig,
        *,
        max_context: int = 4096,
        max_query_len: int = 64,
        cache_dtype: torch.dtype = torch.float16,
        kv_write: KVWrite = KVWrite.BLEND,
    ):
        super().__init__()
        self.config = config
        self.max_context = max_context
        self.max_query_len = max_query_len
        self.ring_capacity = ring_capacity(config.sliding_window, max_query_len)
        self.entry_point = "forward"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False,
                                  with_weight=False)
        self.layers = nn.ModuleList(
            MuseGlimmerDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Positions are absolute in every layer, the sliding ring layers included, so the
        # tables must reach the last position the global cache holds.
        self.rotary = RotaryTables(config.head_dim, config.layer_rope_theta, max_context)
        self.cache_dtype = cache_dtype
        self.residual_scale = 1.0  # scale_residual
        # How main and prefill write the global caches (bundle.KVWrite, docs/kv-write.md).
        self.kv_write = KVWrite(kv_write)
        self._cache_layer = {}
        for kind_ids in (config.sliding_layer_ids, config.global_layer_ids):
            self._cache_layer.update({layer: n for n, layer in enumerate(kind_ids)})
        self.reset_caches()

    def reset_caches(self) -> None:
        """(Re)creates zeroed caches on the CPU; also used after building on `meta`."""
        cfg = self.config
        kv, dim = cfg.num_key_value_heads, cfg.head_dim
        global_shape = (len(cfg.global_layer_ids), kv, self.max_context, dim)
        sliding_shape = (len(cfg.sliding_layer_ids), kv, self.ring_capacity, dim)
        shapes = {
            StateName.GLOBAL_KEY_CACHE.value: global_shape,
            StateName.GLOBAL_VALUE_CACHE.value: global_shape,
            StateName.SLIDING_KEY_CACHE.value: sliding_shape,
            StateName.SLIDING_VALUE_CACHE.value: sliding_shape,
        }
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=self.cache_dtype, device="cpu"))

    def scale_residual(self, factor: float) -> None:
        """Multiplies the residual stream by `factor`, a power of two, leaving logits and drafter
        features unchanged but for rounding (docs/fp16.md): the embedding norm and the post
        norms, whose outputs are what the stream adds up, are scaled; every norm that reads the
        stream (and the drafter encoder's, which reads it through `fc`) scales its eps."""
        self.embed_norm.scale_output(factor)
        for layer in self.layers:
            layer.post_attention_layernorm.scale_output(factor)
            layer.post_feedforward_layernorm.scale_output(factor)
            layer.input_layernorm.scale_input(factor)
            layer.pre_feedforward_layernorm.scale_input(factor)
        self.norm.scale_input(factor)
        encoder = getattr(self, "encoder", None)
        if encoder is not None:
            encoder.output_norm_enc.scale_input(factor)
        self.residual_scale *= factor

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        capture_layers: tuple[int, ...] = (),
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Runs the decoder, writing the caches. Returns the final hidden state (before the
        final norm) and the outputs of `capture_layers` in that order. With `tree_mask`, the
        query is a token tree's nodes (causal_lm.CausalLM's forward says how)."""
        length = input_ids.shape[-1]
        if length > self.max_query_len:
            raise ValueError(f"query length {length} exceeds max_query_len {self.max_query_len}")
        positions = position_ids.reshape(-1)
        x = self.embed_norm(self.embed_tokens(input_ids.reshape(1, -1)))
        if tree_mask is None:
            sliding_mask = sliding_causal_mask(positions, self.ring_capacity,
                                               self.config.sliding_window)
            global_mask = global_causal_mask(positions, self.attended_context)
            written = positions
        else:
            sliding_mask = tree_sliding_mask(positions, tree_mask, self.ring_capacity,
                                             self.config.sliding_window)
            global_mask = tree_global_mask(positions, tree_mask, self.attended_context)
            written = tree_write_positions(positions)
        ring_slots = torch.remainder(written, self.ring_capacity)
        # One lookup per distinct theta, shared by its layers.
        ropes = {theta: self.rotary(positions, theta, x.dtype) for theta in self.rotary.thetas}
        captured: dict[int, torch.Tensor] = {}
        for layer_id, layer in enumerate(self.layers):
            # The rings keep the blend whatever kv_write says: it costs O(window) there.
            if layer.is_sliding:
                caches = (self.slidingKeyCache, self.slidingValueCache)
                slots, mask, kv_write, span = ring_slots, sliding_mask, KVWrite.BLEND, None
            else:
                caches = (self.globalKeyCache, self.globalValueCache)
                slots, mask, kv_write, span = written, global_mask, self.kv_write, self.span
            cache = LayerCache(*caches, self._cache_layer[layer_id], slots, kv_write, span)
            x = layer(x, ropes.get(layer.rope_theta), mask, cache)
            if layer_id in capture_layers:
                captured[layer_id] = x
        return x, [captured[i] for i in capture_layers]

    def batch_hidden_states(
        self, input_ids: torch.Tensor, capture_layers: tuple[int, ...] = (),
        around_layer: Callable[[int], AbstractContextManager] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Cache-free `hidden_states` for a batch of whole sequences (training): input_ids
        [B, T] at positions 0..T-1, T <= max_context. Reads and writes no cache; the masks are
        the cached path's (a ring as long as the sequence holds position s in slot s).
        `around_layer(i)`, when given, is entered around layer i's step (the fp16 range audit
        loads each layer's weights only while it runs)."""
        length = input_ids.shape[-1]
        if length > self.max_context:
            raise ValueError(f"sequence length {length} exceeds max_context {self.max_context}")
        positions = torch.arange(length, device=input_ids.device)
        x = self.embed_norm(self.embed_tokens(input_ids))
        sliding_mask = sliding_causal_mask(positions, length, self.config.sliding_window)
        global_mask = global_causal_mask(positions, length)
        ropes = {theta: self.rotary(positions, theta, x.dtype) for theta in self.rotary.thetas}
        captured: dict[int, torch.Tensor] = {}
        for layer_id, layer in enumerate(self.layers):
            mask = sliding_mask if layer.is_sliding else global_mask
            with around_layer(layer_id) if around_layer else nullcontext():
                x = layer.forward_batch(x, ropes.get(layer.rope_theta), mask)
            if layer_id in capture_layers:
                captured[layer_id] = x
        return x, [captured[i] for i in capture_layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The multiplier scales the logits, not lm_head's input: a Python float is an fp32
        # constant to coremltools, and an fp32 input would make it copy the whole lm_head
        # weight to fp32 (the largest tensor of the model).
        logits = nn.functional.linear(self.norm(hidden), self.output_weight())
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        return softcap(logits, self.config.final_logit_softcapping)


class MuseGlimmerWithDrafterFeatures(WithDrafterFeatures, MuseGlimmerForCausalLM):
    """MuseGlimmerForCausalLM that also returns DFlash drafter features (WithDrafterFeatures)."""
