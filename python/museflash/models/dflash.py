"""DFlash block drafter for Muse Glimmer.

The drafter borrows the target's embedding and lm_head. Target hidden states from
`target_layer_ids` are compressed by the encoder (run inside the fused target) into
"drafter features"; `inject_kv` turns those features into K/V context in every drafter layer's
ring cache, and `draft` denoises a block [anchor, MASK, ...] in one bidirectional pass over
that context. Caches: see docs/positions.md.

Choice: draft logits are lm_head(norm(h)) followed by the target's final logit softcap when it
is set, without the target's output_multiplier (the drafter was trained against raw lm_head
logits; the softcap is monotonic, so greedy drafts are the same either way).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from museflash.bundle import LayerType, StateName
from museflash.models.base import (
    LayerCache,
    RMSNorm,
    RotaryTables,
    SwiGLU,
    apply_rope,
    attend,
    ring_capacity,
    ring_slot_positions,
    sliding_causal_mask,
    softcap,
)


class DrafterTargetMismatchError(ValueError):
    """The drafter cannot run on this target; the message names the setting and both values."""


def first_present(sources: list[dict[str, Any]], names: tuple[str, ...]) -> Any:
    """The first value not None of `names` looked up in each of `sources` in turn."""
    for source in sources:
        for name in names:
            if source.get(name) is not None:
                return source[name]
    return None


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    # None: full attention over everything injected (z-lab's drafters for Qwen3 and Llama,
    # whose layer_types are full_attention): the ring then spans the whole context
    # (DFlashDrafter.window).
    sliding_window: int | None
    rope_theta: float
    rms_norm_eps: float = 1e-6
    # How `draft` applies the sliding window (docs/positions.md): one window per block, ending
    # at its last position (the Meta assistant checkpoint), or one per query, |q - k| < window
    # (z-lab's reference for `is_causal: false`).
    window_per_query: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DFlashConfig:
        """Flat config.json; block_size / mask_token_id / target_layer_ids may instead sit under
        `dflash_config` (z-lab form), and mask_token_id may be spelled draft_mask_token_id."""
        sources = [config, config.get("dflash_config") or {}]
        rope = config.get("rope_parameters") or {}
        values = {
            "block_size": first_present(sources, ("block_size",)),
            "mask_token_id": first_present(sources, ("mask_token_id", "draft_mask_token_id")),
            "target_layer_ids": first_present(sources, ("target_layer_ids",)),
            "rope_theta": rope.get("rope_theta", config.get("rope_theta")),
        }
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
        ):
            values[name] = config.get(name)
        missing = sorted(name for name, value in values.items() if value is None)
        full = full_attention(config)
        window = config.get("sliding_window")
        if window is None and not full:
            missing.append("sliding_window")
        if missing:
            raise ValueError(f"drafter config is missing {sorted(missing)}")
        head_dim = config.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
        return cls(
            hidden_size=int(values["hidden_size"]),
            num_hidden_layers=int(values["num_hidden_layers"]),
            num_attention_heads=int(values["num_attention_heads"]),
            num_key_value_heads=int(values["num_key_value_heads"]),
            head_dim=int(head_dim),
            intermediate_size=int(values["intermediate_size"]),
            block_size=int(values["block_size"]),
            mask_token_id=int(values["mask_token_id"]),
            target_layer_ids=[int(i) for i in values["target_layer_ids"]],
            sliding_window=None if full else int(window),
            rope_theta=float(values["rope_theta"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            window_per_query=config.get("is_causal") is False,
            raw=dict(config),
        )


def full_attention(config: dict[str, Any]) -> bool:
    """Whether a drafter config asks for full attention in every layer: `layer_types` all
    full_attention; or, without layer_types, `use_sliding_window` false or no sliding_window
    (transformers' Qwen3 config, which z-lab's drafter is, derives its layer types so and
    ignores a window it does not use). Otherwise a stated sliding_window means a sliding drafter
    (the Meta assistant layout)."""
    layer_types = config.get("layer_types")
    if layer_types:
        return set(layer_types) == {LayerType.FULL_ATTENTION.value}
    return config.get("use_sliding_window") is False or config.get("sliding_window") is None


# --- Checkpoint keys -------------------------------------------------------------------------
# A drafter checkpoint holds the drafter's own layers under their parameter names, and the
# encoder the fused target runs (its `encoder.` parameters); the embedding and lm_head are the
# target's and are not in the file.
DRAFTER_BORROWED = ("embed_tokens.", "lm_head.")
ENCODER_PREFIX = "encoder."
# z-lab's DFlashDraftModel layout names the encoder `fc` / `hidden_norm` where the Meta
# assistant checkpoint has `encoder.fc` / `encoder.output_norm_enc` (encoder parameter name ->
# z-lab checkpoint key).
ZLAB_ENCODER_KEYS = {"encoder.fc.weight": "fc.weight",
                     "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def drafter_checkpoint_key(param_name: str) -> str | None:
    """The checkpoint key of the drafter's parameter `param_name`; None for the parameters
    borrowed from the target."""
    return None if param_name.startswith(DRAFTER_BORROWED) else param_name


def encoder_key(keys: Container[str], name: str) -> str:
    """The checkpoint key of encoder parameter `name` in the layout of the drafter checkpoint
    whose keys are `keys`."""
    if "encoder.fc.weight" not in keys and "fc.weight" in keys:
        return ZLAB_ENCODER_KEYS.get(name, name)
    return name


class DFlashEncoder(nn.Module):
    """features = output_norm_enc(fc(concat of target layer outputs))."""

    def __init__(self, config: DFlashConfig, target_hidden_size: int):
        super().__init__()
        width = len(config.target_layer_ids) * target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.output_norm_enc = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False)

    def forward(self, target_layer_outputs: list[torch.Tensor]) -> torch.Tensor:
        return self.output_norm_enc(self.fc(torch.cat(target_layer_outputs, dim=-1)))


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.n_q = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.n_q * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_q * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        return x.reshape(x.shape[1], count, self.head_dim).transpose(0, 1)

    def write_kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache
    ) -> None:
        """rope: (cos, sin) [T, head_dim] of the written positions; `cache`: the layer's ring."""
        k = self.k_norm(self._heads(self.k_proj(x), self.n_kv))
        cache.write_keys(apply_rope(k, *rope))
        cache.write_values(self._heads(self.v_proj(x), self.n_kv))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
        cache: LayerCache,
    ) -> torch.Tensor:
        self.write_kv(x, rope, cache)
        q = self.q_norm(self._heads(self.q_proj(x), self.n_q))
        keys, values = cache.read(q.dtype)
        out = attend(apply_rope(q, *rope), keys, values, mask, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(0, 1).reshape(1, x.shape[1], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, unit_offset=False)
        # What the sublayers add to the residual stream is multiplied by this (DFlashDrafter
        # .scale_residual); 1 adds no op to the graph.
        self.output_scale = 1.0

    def scaled(self, update: torch.Tensor) -> torch.Tensor:
        return update if self.output_scale == 1.0 else update * self.output_scale

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        h = x + self.scaled(self.self_attn(self.input_layernorm(x), rope, mask, cache))
        return h + self.scaled(self.mlp(self.post_attention_layernorm(h)))


def block_window_mask(positions: torch.Tensor, capacity: int, window: int) -> torch.Tensor:
    """[T, capacity] bool, the same row for every query of the block: slots holding positions
    in (P - window, P], P the block's last position (context and the whole block)."""
    last = positions.amax()
    slot_positions = ring_slot_positions(last, capacity)
    visible = torch.logical_and(slot_positions >= 0, last - slot_positions < window)
    return visible.reshape(1, -1).expand(positions.shape[0], capacity)


def query_window_mask(positions: torch.Tensor, capacity: int, window: int) -> torch.Tensor:
    """[T, capacity] bool: slot s is visible to query i when |p_i - pos(s)| < window (z-lab's
    non-causal sliding window: earlier queries of a block reach further back)."""
    slot_positions = ring_slot_positions(positions.amax(), capacity).reshape(1, -1)
    distance = positions.reshape(-1, 1) - slot_positions
    return torch.logical_and(slot_positions >= 0,
                             torch.logical_and(distance < window, -distance < window))


class DFlashDrafter(nn.Module):
    """Entry points (positions are int tensors [T]):
      inject_kv(features [1, T, hidden], positions) -> None (writes the ring caches)
      draft(input_ids [1, K] = [anchor, MASK x (K-1)], positions [K]) -> logits [1, K, vocab]
      decode(input_ids [1, T], positions [T]) -> logits [1, T, vocab]  (causal, ring drafter)
    `with_entry_point(name)` returns a view (shared weights and caches) whose forward is that
    entry point, for torch.export. inject_kv returns a tiny tensor so the traced graph has an
    output; ignore it. `max_context` bounds the positions RoPE supports (its tables), like the
    target's; `for_target` copies the target's.
    """

    entry_points = ("draft", "inject_kv", "decode")
    layer_class: type[nn.Module] = DFlashDecoderLayer
    # A view's context bucket (docs/buckets.md): a full-attention drafter's ring holds position
    # p in slot p, so `inject_kv` and `draft` can attend to and write its first `span` slots
    # only, as the target's bucket functions do; None: the whole ring.
    span: int | None = None
    # The ring caches' buffer names, which are the Core ML state names: the block drafter's
    # share a package with the target's caches (docs/metadata.md), so they are named apart.
    cache_names = (StateName.DRAFTER_KEY_CACHE.value, StateName.DRAFTER_VALUE_CACHE.value)

    def __init__(
        self,
        config: DFlashConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear | None,
        *,
        final_logit_softcapping: float | None = None,
        max_context: int = 4096,
        max_query_len: int = 64,
        cache_dtype: torch.dtype = torch.float16,
    ):
        super().__init__()
        if embed_tokens.embedding_dim != config.hidden_size:
            raise DrafterTargetMismatchError(
                f"hidden_size: drafter has {config.hidden_size} but target embedding has "
                f"{embed_tokens.embedding_dim}"
            )
        self.config = config
        self.entry_point = "draft"
        self.final_logit_softcapping = final_logit_softcapping
        self.max_context = max_context
        self.max_query_len = max(max_query_len, config.block_size)
        # A full-attention drafter sees every position the context holds: a ring as long as
        # the context, which never wraps (slot p holds position p for every p < max_context).
        if config.sliding_window is None:
            self.window = self.ring_capacity = max_context
        else:
            self.window = config.sliding_window
            self.ring_capacity = ring_capacity(self.window, self.max_query_len)
        self.cache_dtype = cache_dtype
        # Borrowed from the target: the same module objects, never copies.
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.layers = nn.ModuleList(
            self.layer_class(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False)
        # The ring caches are small but the positions in them are absolute target positions.
        self.rotary = RotaryTables(config.head_dim, [config.rope_theta], max_context)
        self.residual_scale = 1.0  # scale_residual
        self.reset_caches()

    def scale_residual(self, factor: float) -> None:
        """Multiplies the drafter's residual stream by `factor`, a power of two, leaving its
        logits unchanged but for rounding (docs/fp16.md): the embedding it starts from and what
        each sublayer adds are multiplied in the graph (the embedding is the target's, and the
        projections are streamed weights), and the norms reading the stream scale their eps."""
        for layer in self.layers:
            layer.output_scale *= factor
            layer.input_layernorm.scale_input(factor)
            layer.post_attention_layernorm.scale_input(factor)
        self.norm.scale_input(factor)
        self.residual_scale *= factor

    @classmethod
    def for_target(cls, config: DFlashConfig, target: nn.Module, **kwargs) -> DFlashDrafter:
        """max_context defaults to the target's: the drafter runs at the target's positions."""
        kwargs.setdefault("final_logit_softcapping", target.config.final_logit_softcapping)
        kwargs.setdefault("max_context", target.max_context)
        return cls(config, target.embed_tokens, target.lm_head, **kwargs)

    def reset_caches(self) -> None:
        cfg = self.config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, self.ring_capacity, cfg.head_dim)
        for name in self.cache_names:
            self.register_buffer(name, torch.zeros(shape, dtype=self.cache_dtype, device="cpu"))

    @property
    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key cache, value cache) [layers, kv_heads, capacity, head_dim]."""
        return getattr(self, self.cache_names[0]), getattr(self, self.cache_names[1])

    @property
    def full_attention(self) -> bool:
        """The ring is as long as the context and never wraps: it can be bucketed."""
        return self.config.sliding_window is None

    def with_entry_point(self, name: str, span: int | None = None) -> DFlashDrafter:
        """A view whose forward is entry point `name`, attending to (and writing) the ring's
        first `span` slots only (None: all); only a full-attention drafter's ring has a span."""
        if name not in self.entry_points:
            raise ValueError(f"unknown entry point {name!r}; choose from {self.entry_points}")
        if span is not None and span != self.ring_capacity and (
                not self.full_attention or not 0 < span < self.ring_capacity):
            raise ValueError(f"span {span}: only a full-attention drafter's ring of "
                             f"{self.ring_capacity} slots can be bucketed, inside it")
        view = copy.copy(self)
        view.entry_point = name
        view.span = None if span == self.ring_capacity else span
        return view

    @property
    def attended_slots(self) -> int:
        """Slots of the ring this view's calls attend to: its span or the whole ring."""
        return self.span or self.ring_capacity

    def _check_length(self, length: int) -> None:
        if length > self.max_query_len:
            raise ValueError(f"query length {length} exceeds max_query_len {self.max_query_len}")

    def inject_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self._check_length(features.shape[1])
        positions = positions.reshape(-1)
        slots = torch.remainder(positions, self.ring_capacity)
        caches = self.caches
        rope = self.rotary(positions, self.config.rope_theta, features.dtype)
        for layer_id, layer in enumerate(self.layers):
            layer.self_attn.write_kv(features, rope,
                                     LayerCache(*caches, layer_id, slots, span=self.span))
        return positions[-1:]

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """norm(last layer) [1, T, hidden], writing the block's K/V into the ring."""
        slots = torch.remainder(positions, self.ring_capacity)
        caches = self.caches
        x = self.embed_tokens(input_ids.reshape(1, -1))
        if self.residual_scale != 1.0:
            x = x * self.residual_scale
        rope = self.rotary(positions, self.config.rope_theta, x.dtype)
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, rope, mask, LayerCache(*caches, layer_id, slots, span=self.span))
        return self.norm(x)

    def output_weight(self, vocabulary: torch.Tensor | None = None) -> torch.Tensor:
        """The borrowed output weight [vocab, hidden]; with `vocabulary` (token ids), only its
        rows: logits over part of the vocabulary, for training's cheaper softmax."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return weight if vocabulary is None else weight[vocabulary]

    def _logits(self, hidden: torch.Tensor,
                vocabulary: torch.Tensor | None = None) -> torch.Tensor:
        return softcap(nn.functional.linear(hidden, self.output_weight(vocabulary)),
                       self.final_logit_softcapping)

    def _draft_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.reshape(-1)
        self._check_length(positions.shape[0])
        window_mask = query_window_mask if self.config.window_per_query else block_window_mask
        mask = window_mask(positions, self.attended_slots, self.window)
        return self._hidden(input_ids, positions, mask)

    def draft(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._logits(self._draft_hidden(input_ids, positions))

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.reshape(-1)
        self._check_length(positions.shape[0])
        mask = sliding_causal_mask(positions, self.ring_capacity, self.window)
        return self._logits(self._hidden(input_ids, positions, mask))

    def forward(self, first: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.entry_point)(first, positions)


class DFlashRingDrafter(DFlashDrafter):
    """The drafter backbone run autoregressively over its own tokens (older --with-drafter
    export): forward(input_ids [1, T], positions [T]) -> logits, causal sliding-window ring.
    Its package is its own, so its caches keep the names they always had."""

    cache_names = (StateName.SLIDING_KEY_CACHE.value, StateName.SLIDING_VALUE_CACHE.value)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entry_point = "decode"
