"""Qwen3 dense text decoder (transformers' `Qwen3ForCausalLM` layout), and the fused target
that also emits DFlash drafter features.

Layout: pre-norm decoder layers, every one full (global) attention with RoPE of one theta;
grouped-query attention with a weighted RMSNorm on each q and k head before RoPE; SwiGLU MLP;
plain (w, not 1 + w) RMSNorm weights; no embedding scale; lm_head tied to the embedding when
`tie_word_embeddings` (the small sizes). Caches: every layer is global, so only the global
pair exists, globalKeyCache / globalValueCache [layers, kv_heads, max_context, head_dim],
indexed by absolute position (docs/positions.md). There is no sliding ring. The embedding,
head, caches and entry points are the shared wrapper's (models/causal_lm.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from museflash.bundle import LayerType
from museflash.models.base import (
    LayerCache,
    RMSNorm,
    SwiGLU,
    apply_rope,
    attend,
)
from museflash.models.causal_lm import GlobalCausalLM, WithDrafterFeatures
from museflash.models.hf_config import (
    check_absent,
    check_full_attention,
    check_identity,
    check_values,
    refuse,
    require_fields,
    rope_parameters,
)

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
# transformers' Qwen3Config default when a config.json has no head_dim (not hidden / heads).
DEFAULT_HEAD_DIM = 128
FULL = LayerType.FULL_ATTENTION.value


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = DEFAULT_HEAD_DIM
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Read by the DFlash drafter (DFlashDrafter.for_target): Qwen3 has no logit softcap.
    final_logit_softcapping: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def layer_types(self) -> list[str]:
        return [FULL] * self.num_hidden_layers

    @property
    def global_layer_ids(self) -> list[int]:
        return list(range(self.num_hidden_layers))

    @property
    def sliding_layer_ids(self) -> list[int]:
        return []

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen3Config:
        """A config.json as transformers' Qwen3Config writes it (rope settings in either
        spelling: models/hf_config.py). Refuses, by field name, every value this model does not
        implement: another architecture, a RoPE type other than the plain one, a sliding window
        that is on, biased projections, another activation, a quantized checkpoint."""
        check_identity(config, model_type=MODEL_TYPE, architecture=ARCHITECTURE)
        require_fields(config, ("vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads"), "Qwen3")
        check_values(config, {"hidden_act": "silu", "attention_bias": False,
                              "use_sliding_window": False})
        check_full_attention(config)
        check_absent(config, ("quantization_config",))
        where, rope = rope_parameters(config)
        if rope["rope_type"] != "default":
            raise refuse(f"{where}.rope_type", rope["rope_type"], "'default'")
        heads = int(config["num_attention_heads"])
        kv_heads = config.get("num_key_value_heads")
        head_dim = config.get("head_dim")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else int(kv_heads),
            head_dim=DEFAULT_HEAD_DIM if head_dim is None else int(head_dim),
            rope_theta=float(rope["rope_theta"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            raw=dict(config),
        )


# --- Checkpoint keys (transformers' Qwen3ForCausalLM layout) --------------------------------
# The decoder's parameters sit under TARGET_PREFIX with the same names as here
# (model.layers.N.self_attn.q_norm.weight, ...), lm_head at the top level; a tied checkpoint
# has no lm_head.weight (and this model then has no lm_head).
TARGET_PREFIX = "model."
TARGET_UNPREFIXED = ("lm_head.",)


def target_checkpoint_key(param_name: str) -> str:
    """The checkpoint key of the target's parameter `param_name`."""
    if param_name.startswith(TARGET_UNPREFIXED):
        return param_name
    return TARGET_PREFIX + param_name


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.n_q = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_width, kv_width = self.n_q * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """[..., T, count * head_dim] -> [..., count, T, head_dim]."""
        return x.reshape(*x.shape[:-1], count, self.head_dim).transpose(-3, -2)

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_q)), *rope)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), *rope)
        return q, k, self._heads(self.v_proj(x), self.n_kv)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: LayerCache,
    ) -> torch.Tensor:
        """x [1, T, hidden]; rope: (cos, sin) [T, head_dim]; mask [T, capacity] bool; `cache`
        takes the new keys and values at the absolute positions (base.LayerCache)."""
        length = x.shape[1]
        q, k, v = self._qkv(x[0], rope)
        keys, values = cache.update(k, v, q.dtype)
        out = attend(q, keys, values, mask, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(0, 1).reshape(1, length, self.n_q * self.head_dim))

    def forward_batch(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor
    ) -> torch.Tensor:
        """Cache-free attention over whole sequences: x [B, T, hidden], mask [T, T] bool."""
        batch, length = x.shape[:2]
        q, k, v = self._qkv(x, rope)
        scale = 1.0 / math.sqrt(self.head_dim)
        out = torch.vmap(attend, in_dims=(0, 0, 0, None, None))(q, k, v, mask, scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.n_q * self.head_dim))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Qwen3Attention(config)
        self.mlp = SwiGLU(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=False)
        # What the sublayers add to the residual stream is multiplied by this
        # (GlobalCausalLM.scale_residual); 1 adds no op to the graph.
        self.output_scale = 1.0

    def scaled(self, update: torch.Tensor) -> torch.Tensor:
        return update if self.output_scale == 1.0 else update * self.output_scale

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        h = x + self.scaled(self.self_attn(self.input_layernorm(x), rope, mask, cache))
        return h + self.scaled(self.mlp(self.post_attention_layernorm(h)))

    def forward_batch(self, x: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        """`forward` without caches: x [B, T, hidden], mask [T, T] bool."""
        h = x + self.scaled(self.self_attn.forward_batch(self.input_layernorm(x), rope, mask))
        return h + self.scaled(self.mlp(self.post_attention_layernorm(h)))


class Qwen3ForCausalLM(GlobalCausalLM):
    """Qwen3's target decoder (models/causal_lm.py: the caches and entry points)."""

    decoder_layer = Qwen3DecoderLayer


class Qwen3WithDrafterFeatures(WithDrafterFeatures, Qwen3ForCausalLM):
    """Qwen3ForCausalLM that also returns DFlash drafter features (WithDrafterFeatures)."""
