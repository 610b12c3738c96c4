"""The causal-LM wrapper around a family's decoder layers, so that the model files hold only
their own math: the config, the checkpoint keys, the attention, MLP and decoder layer.

`CausalLM` is what every target family shares: the entry points and their views, the output
weight, logits over a batch. `WithDrafterFeatures` adds the DFlash drafter's encoder over the
tapped layers; a family's fused target is
`class XWithDrafterFeatures(WithDrafterFeatures, XForCausalLM)`. `GlobalCausalLM` is the rest
of the wrapper for the families whose layers are all global attention with one RoPE theta
(models/qwen3.py, models/llama.py): the embedding, the final norm and lm_head (tied or not),
the RoPE tables, the caches and the residual rescaling. Muse Glimmer, with sliding rings and
an embedding norm, has its own (models/muse_glimmer.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Self

import torch
from torch import nn

from museflash.bundle import KVWrite, StateName
from museflash.models.base import (
    LayerCache,
    RMSNorm,
    RotaryTables,
    global_causal_mask,
    tree_global_mask,
    tree_write_positions,
)
from museflash.models.dflash import DFlashConfig, DFlashEncoder


class CausalLM(nn.Module):
    """A target decoder with stateful caches. A family supplies `hidden_states` (writing the
    caches; the outputs of `capture_layers` too), `batch_hidden_states` (cache-free), `logits`,
    `embed_tokens`, `lm_head` (None when tied to the embedding) and `entry_point` ("forward").

    Entry points (all take input_ids [1, T] int, position_ids [T] int):
      forward -> logits [1, T, vocab]; with tree_mask [T, T] (1 where node i sees node j),
        the verify of a token tree: node i at RoPE position position_ids[i], written at
        position_ids[0] + i, attending to the cache before position_ids[0] and to the nodes
        its row names (docs/trees.md)
      prefill -> logits [1, 1, vocab] of the last position only
    `with_entry_point(name)` returns a view of the same module (shared weights and caches)
    whose forward is that entry point, for torch.export. `batch_logits` (input_ids [B, T], no
    caches) is for training and batched evaluation, not an entry point.
    """

    entry_points = ("forward", "prefill")
    # The context bucket of a view: the global caches' slots [0, span) that its calls attend
    # to and write; None: the whole capacity (docs/buckets.md).
    span: int | None = None

    def with_entry_point(self, name: str, span: int | None = None) -> Self:
        """A view of the same module whose forward is entry point `name`, attending to the
        global caches' first `span` slots only (None: all of them)."""
        if name not in self.entry_points:
            raise ValueError(f"unknown entry point {name!r}; choose from {self.entry_points}")
        if span is not None and not 0 < span <= self.max_context:
            raise ValueError(f"span {span} is outside the global caches' 1..{self.max_context}")
        view = copy.copy(self)  # shares parameter, buffer and submodule dicts
        view.entry_point = name
        view.span = None if span == self.max_context else span
        return view

    @property
    def attended_context(self) -> int:
        """Slots of the global caches this view's calls attend to: its span or the capacity."""
        return self.span or self.max_context

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def batch_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for input_ids [B, T] at positions 0..T-1, without caches: the
        training forward. Equal (within float tolerance) to feeding each row through `forward`
        from empty caches."""
        hidden, _ = self.batch_hidden_states(input_ids)
        return self.logits(hidden)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tree_mask: torch.Tensor | None = None):
        if self.entry_point == "prefill":
            return self.prefill(input_ids, position_ids)
        hidden, _ = self.hidden_states(input_ids, position_ids, tree_mask=tree_mask)
        return self.logits(hidden)

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.hidden_states(input_ids, position_ids)
        return self.logits(hidden[:, -1:])


class GlobalCausalLM(CausalLM):
    """Target decoder with stateful caches (the global pair only), entry points as CausalLM's.

    A family sets `decoder_layer` and, if its RoPE frequencies are rescaled, overrides
    `rope_scaling`. Its config has the geometry of families.TargetConfig and rope_theta,
    rms_norm_eps and tie_word_embeddings. Its layers take (x, rope, mask, base.LayerCache),
    have `forward_batch(x, rope, mask)` without caches, an `output_scale` multiplying what they
    add to the residual stream, and the plain (w) RMSNorms `input_layernorm` and
    `post_attention_layernorm` reading it.
    """

    # The family's decoder layer, built from the config once per layer.
    decoder_layer: ClassVar[Callable[[Any], nn.Module]]

    def __init__(
        self,
        config: Any,
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
        self.entry_point = "forward"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=False)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryTables(config.head_dim, [config.rope_theta], max_context,
                                   scale_inv_freq=self.rope_scaling())
        self.cache_dtype = cache_dtype
        self.residual_scale = 1.0  # scale_residual
        self.kv_write = KVWrite(kv_write)  # how the caches are written (docs/kv-write.md)
        self.reset_caches()

    def rope_scaling(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The map of the RoPE inverse frequencies (RotaryTables' `scale_inv_freq`); None keeps
        them theta^(-2i/head_dim)."""
        return None

    def reset_caches(self) -> None:
        """(Re)creates zeroed caches on the CPU; also used after building on `meta`."""
        cfg = self.config
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, self.max_context, cfg.head_dim)
        for name in (StateName.GLOBAL_KEY_CACHE.value, StateName.GLOBAL_VALUE_CACHE.value):
            self.register_buffer(name, torch.zeros(shape, dtype=self.cache_dtype, device="cpu"))

    def scale_residual(self, factor: float) -> None:
        """Multiplies the residual stream by `factor`, a power of two, leaving logits and drafter
        features unchanged but for rounding (docs/fp16.md): the embedding and what each sublayer
        adds are multiplied in the graph (the embedding may be tied to lm_head, so its weight
        stays), and every norm that reads the stream (the drafter encoder's too, which reads it
        through `fc`) scales its eps."""
        for layer in self.layers:
            layer.output_scale *= factor
            layer.input_layernorm.scale_input(factor)
            layer.post_attention_layernorm.scale_input(factor)
        self.norm.scale_input(factor)
        encoder = getattr(self, "encoder", None)
        if encoder is not None:
            encoder.output_norm_enc.scale_input(factor)
        self.residual_scale *= factor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.residual_scale == 1.0 else x * self.residual_scale

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        capture_layers: tuple[int, ...] = (),
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Runs the decoder, writing the caches. Returns the final hidden state (before the
        final norm) and the outputs of `capture_layers` in that order. With `tree_mask`, the
        query is a token tree's nodes (CausalLM's forward says how)."""
        length = input_ids.shape[-1]
        if length > self.max_query_len:
            raise ValueError(f"query length {length} exceeds max_query_len {self.max_query_len}")
        positions = position_ids.reshape(-1)
        x = self.embed(input_ids.reshape(1, -1))
        if tree_mask is None:
            mask, slots = global_causal_mask(positions, self.attended_context), positions
        else:
            mask = tree_global_mask(positions, tree_mask, self.attended_context)
            slots = tree_write_positions(positions)
        rope = self.rotary(positions, self.config.rope_theta, x.dtype)
        caches = (self.globalKeyCache, self.globalValueCache)
        captured: dict[int, torch.Tensor] = {}
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, rope, mask, LayerCache(*caches, layer_id, slots, self.kv_write,
                                                self.span))
            if layer_id in capture_layers:
                captured[layer_id] = x
        return x, [captured[i] for i in capture_layers]

    def batch_hidden_states(
        self, input_ids: torch.Tensor, capture_layers: tuple[int, ...] = (),
        around_layer: Callable[[int], AbstractContextManager] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Cache-free `hidden_states` for a batch of whole sequences: input_ids [B, T] at
        positions 0..T-1, T <= max_context. Reads and writes no cache. `around_layer(i)`, when
        given, is entered around layer i's step (the fp16 range audit)."""
        length = input_ids.shape[-1]
        if length > self.max_context:
            raise ValueError(f"sequence length {length} exceeds max_context {self.max_context}")
        positions = torch.arange(length, device=input_ids.device)
        x = self.embed(input_ids)
        mask = global_causal_mask(positions, length)
        rope = self.rotary(positions, self.config.rope_theta, x.dtype)
        captured: dict[int, torch.Tensor] = {}
        for layer_id, layer in enumerate(self.layers):
            with around_layer(layer_id) if around_layer else nullcontext():
                x = layer.forward_batch(x, rope, mask)
            if layer_id in capture_layers:
                captured[layer_id] = x
        return x, [captured[i] for i in capture_layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.norm(hidden), self.output_weight())


class WithDrafterFeatures(CausalLM):
    """Target that also returns DFlash drafter features (the encoder runs inside it): the
    encoder reads the outputs of the layers the drafter's `target_layer_ids` name. Listed
    before the family's causal LM among the bases, it builds that model, then the encoder.

      forward(input_ids, position_ids) -> (logits [1, T, vocab], features [1, T, drafter_hidden])
      prefill(input_ids, position_ids) -> (logits [1, 1, vocab], features [1, T, drafter_hidden])
    """

    def __init__(self, config: Any, drafter_config: DFlashConfig, **build_kwargs):
        super().__init__(config, **build_kwargs)
        bad = [i for i in drafter_config.target_layer_ids
               if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {drafter_config.target_layer_ids} include {bad}, outside the "
                f"target's {config.num_hidden_layers} layers"
            )
        self.target_layer_ids = tuple(drafter_config.target_layer_ids)
        self.encoder = DFlashEncoder(drafter_config, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tree_mask: torch.Tensor | None = None):
        if self.entry_point == "prefill":
            return self.prefill(input_ids, position_ids)
        hidden, captured = self.hidden_states(input_ids, position_ids, self.target_layer_ids,
                                              tree_mask=tree_mask)
        return self.logits(hidden), self.encoder(captured)

    def prefill(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        hidden, captured = self.hidden_states(input_ids, position_ids, self.target_layer_ids)
        return self.logits(hidden[:, -1:]), self.encoder(captured)
