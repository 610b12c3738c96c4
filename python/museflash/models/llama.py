"""Llama 3.1 text decoder (transformers' `LlamaForCausalLM` layout), and the fused target that
also emits DFlash drafter features.

Layout: pre-norm decoder layers, every one full (global) attention with RoPE of one theta,
the inverse frequencies rescaled by `rope_scaling` of type "llama3" when it is set
(`Llama3RopeScaling`); grouped-query attention without q/k norms or biases; SwiGLU MLP without
biases; plain (w) RMSNorm weights; no embedding scale; an untied lm_head (tied when
`tie_word_embeddings`, as Llama 3.2's small sizes are). Caches: every layer is global, so only
the global pair exists, globalKeyCache / globalValueCache [layers, kv_heads, max_context,
head_dim], indexed by absolute position (docs/positions.md). There is no sliding ring. The
embedding, head, caches and entry points are the shared wrapper's (models/causal_lm.py).
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

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
ROPE_TYPES = ("default", "llama3")
FULL = LayerType.FULL_ATTENTION.value


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3's RoPE scaling of the inverse frequencies (rope_type "llama3"), with L the
    original context length: a frequency whose wavelength 2 pi / f exceeds
    L / low_freq_factor is divided by `factor`; one whose wavelength is below
    L / high_freq_factor is kept; in between, f is blended as (1 - s) f / factor + s f with
    s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    Called by RotaryTables on the float64 inverse frequencies."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"llama3 rope scaling needs a positive factor and original context, got "
                f"{self.factor} and {self.original_max_position_embeddings}"
            )

    @classmethod
    def from_dict(cls, where: str, rope: dict[str, Any],
                  config: dict[str, Any]) -> Llama3RopeScaling:
        """From the RoPE dict (`where` names it in messages); the original context falls back,
        as in transformers, to a top-level original_max_position_embeddings and then to
        max_position_embeddings."""
        original = rope.get("original_max_position_embeddings",
                            config.get("original_max_position_embeddings",
                                       config.get("max_position_embeddings")))
        values = {"factor": rope.get("factor"), "low_freq_factor": rope.get("low_freq_factor"),
                  "high_freq_factor": rope.get("high_freq_factor"),
                  "original_max_position_embeddings": original}
        missing = sorted(name for name, value in values.items() if value is None)
        if missing:
            raise ValueError(f"{where} of rope_type 'llama3' is missing {missing}")
        return cls(factor=float(values["factor"]),
                   low_freq_factor=float(values["low_freq_factor"]),
                   high_freq_factor=float(values["high_freq_factor"]),
                   original_max_position_embeddings=int(original))

    def __call__(self, inv_freq: torch.Tensor) -> torch.Tensor:
        context = self.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        long_waves = wavelength > context / self.low_freq_factor
        short_waves = wavelength < context / self.high_freq_factor
        blend = ((context / wavelength - self.low_freq_factor)
                 / (self.high_freq_factor - self.low_freq_factor))
        blended = (1 - blend) * inv_freq / self.factor + blend * inv_freq
        scaled = torch.where(long_waves, inv_freq / self.factor, blended)
        return torch.where(short_waves, inv_freq, scaled)


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Read by the DFlash drafter (DFlashDrafter.for_target): Llama has no logit softcap.
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
    def from_dict(cls, config: dict[str, Any]) -> LlamaConfig:
        """A config.json as transformers' LlamaConfig writes it (rope settings in either
        spelling: models/hf_config.py). Refuses, by field name, every value this model does not
        implement: another architecture, a RoPE type other than the plain one and "llama3",
        biased projections, another activation, a quantized checkpoint."""
        check_identity(config, model_type=MODEL_TYPE, architecture=ARCHITECTURE)
        require_fields(config, ("vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads"), "Llama")
        check_values(config, {"hidden_act": "silu", "attention_bias": False,
                              "mlp_bias": False})
        check_full_attention(config)
        check_absent(config, ("quantization_config", "sliding_window"))
        where, rope = rope_parameters(config)
        if rope["rope_type"] not in ROPE_TYPES:
            raise refuse(f"{where}.rope_type", rope["rope_type"],
                         " and ".join(map(repr, ROPE_TYPES)))
        scaling = None
        if rope["rope_type"] == "llama3":
            scaling = Llama3RopeScaling.from_dict(where, rope, config)
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
            head_dim=int(config["hidden_size"]) // heads if head_dim is None else int(head_dim),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=scaling,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            raw=dict(config),
        )


# --- Checkpoint keys (transformers' LlamaForCausalLM layout) --------------------------------
# The decoder's parameters sit under TARGET_PREFIX with the same names as here
# (model.layers.N.self_attn.q_proj.weight, ...), lm_head at the top level; a tied checkpoint
# has no lm_head.weight (and this model then has no lm_head).
TARGET_PREFIX = "model."
TARGET_UNPREFIXED = ("lm_head.",)


def target_checkpoint_key(param_name: str) -> str:
    """The checkpoint key of the target's parameter `param_name`."""
    if param_name.startswith(TARGET_UNPREFIXED):
        return param_name
    return TARGET_PREFIX + param_name


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
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

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """[..., T, count * head_dim] -> [..., count, T, head_dim]."""
        return x.reshape(*x.shape[:-1], count, self.head_dim).transpose(-3, -2)

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        q = apply_rope(self._heads(self.q_proj(x), self.n_q), *rope)
        k = apply_rope(self._heads(self.k_proj(x), self.n_kv), *rope)
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


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config)
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


class LlamaForCausalLM(GlobalCausalLM):
    """Llama's target decoder (models/causal_lm.py: the caches and entry points), its RoPE
    frequencies rescaled by the config's llama3 `rope_scaling` when it has one."""

    decoder_layer = LlamaDecoderLayer

    def rope_scaling(self) -> Llama3RopeScaling | None:
        return self.config.rope_scaling


class LlamaWithDrafterFeatures(WithDrafterFeatures, LlamaForCausalLM):
    """LlamaForCausalLM that also returns DFlash drafter features (WithDrafterFeatures)."""
