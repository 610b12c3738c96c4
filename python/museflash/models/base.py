"""Building blocks shared by the target and drafter models.

Everything here is written so that `torch.export` followed by coremltools 9.0 produces a
stateful ML program: positions arrive as int tensors, cache slots and masks are derived from
them with tensor ops, and cache writes use a one-hot blend (see docs/positions.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from museflash.bundle import KVWrite, NormForm

# Finite so that fp16 execution never produces inf - inf; far below any real attention score.
MASK_VALUE = -30000.0
RING_ALIGNMENT = 32


def ring_capacity(sliding_window: int, max_query_len: int) -> int:
    """Slots needed so a chunk of queries never overwrites a key an earlier query still needs."""
    needed = sliding_window + max_query_len
    return -(-needed // RING_ALIGNMENT) * RING_ALIGNMENT


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and, exported, finite in fp16 for any finite input.

    The default form (bundle.NormForm.MAX_ABS) divides the row by m = max(max|x|, 1) before
    squaring it and eps by m^2, so every intermediate of the fp16 graph stays below
    max(1, dim); the row's factor rsqrt(mean((x/m)^2) + eps/m^2) / m then multiplies x
    itself, so small channels beside a massive one keep fp16's full precision. The result
    equals x * rsqrt(mean(x^2) + eps) in exact arithmetic
    (coremltools#2821 is what goes wrong when eps is not rescaled with the data). PLAIN is
    that plain form, whose x^2 overflows fp16 above |x| = 256: kept for the figures and the
    tests that show the old graph failing (docs/fp16.md).

    `fold` (set per norm by the fp16 range audit: `fold_norm_weights`) writes the product as
    x * (f * w) instead of (x * f) * w: beside a massive channel x * f of a small channel is an
    fp16 subnormal of a few bits, which a large weight then multiplies, while f * w is normal.
    It can overflow where the row's rms is tiny and w large, so the audit folds only a norm whose
    recorded rms and weights bound it (export/fp16_range.py, docs/fp16.md).

    `unit_offset=True` is the (1 + w) kind whose checkpoint weights are stored around zero;
    `with_weight=False` is a parameter-free normalisation (identity weight). `gain`, a
    non-persistent scalar multiplier of the output (1 unless a residual stream is rescaled:
    `scale_output`), is folded into the weight when there is one.
    """

    def __init__(self, dim: int, eps: float, *, unit_offset: bool, with_weight: bool = True):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.form = NormForm.MAX_ABS
        self.fold = False
        self.gain = 1.0
        if with_weight:
            initial = torch.zeros(dim) if unit_offset else torch.ones(dim)
            self.weight = nn.Parameter(initial, requires_grad=False)
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.form == NormForm.PLAIN:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        else:
            # maximum with a constant, not clamp(min=): coremltools gives clamp an upper bound
            # of fp32's largest value, which its fp16 pass turns into an inf constant.
            peak = torch.maximum(x32.abs().amax(dim=-1, keepdim=True), torch.tensor(1.0))
            scaled = x32 / peak
            # eps / peak^2 as (sqrt(eps) / peak)^2: peak^2 itself would overflow fp16.
            root = math.sqrt(self.eps) / peak
            floor = root * root
            # The row's factor, 1 / rms(x), is applied to x itself, not to `scaled`: beside a
            # massive channel the small channels of x / peak fall into fp16's subnormals,
            # where they keep a few bits, and a large norm weight multiplies that loss.
            # |x| * factor <= sqrt(dim) (or 1 / sqrt(eps)), so the product stays bounded.
            factor = torch.rsqrt(scaled.pow(2).mean(dim=-1, keepdim=True) + floor) / peak
            if self.fold and self.weight is not None:
                return (x32 * (factor * self.full_weight())).to(x.dtype)
            normed = x32 * factor
        if self.weight is not None:
            normed = normed * self.full_weight()
        elif self.gain != 1.0:
            normed = normed * self.gain
        return normed.to(x.dtype)

    def full_weight(self) -> torch.Tensor:
        """The weight the output is multiplied by, fp32: 1 + w for the unit-offset kind."""
        scale = self.weight.float()
        return 1.0 + scale if self.unit_offset else scale

    def scale_input(self, factor: float) -> None:
        """The norm reads a stream now multiplied by `factor`: eps follows it (factor^2), so the
        output is unchanged in exact arithmetic (RMSNorm is scale-invariant but for eps)."""
        self.eps *= factor * factor

    def scale_output(self, factor: float) -> None:
        """Multiplies the output by `factor` (a power of two: exact), through the weight when
        there is one: a (1 + w) weight becomes a plain one, factor * (1 + w)."""
        if self.weight is None:
            self.gain *= factor
            return
        with torch.no_grad():
            full = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
            self.weight.copy_((full * factor).to(self.weight.dtype))
        self.unit_offset = False


def set_norm_form(module: nn.Module, form: NormForm) -> None:
    """Every RMSNorm inside `module` is written in `form`."""
    for child in module.modules():
        if isinstance(child, RMSNorm):
            child.form = NormForm(form)


def fold_norm_weights(module: nn.Module, names: tuple[str, ...] | list[str]) -> None:
    """The RMSNorms of `module` named in `names` (paths below it, as named_modules gives them)
    are written with their weight folded into the row's factor (RMSNorm.fold)."""
    for name in names:
        norm = module.get_submodule(name)
        if not isinstance(norm, RMSNorm) or norm.weight is None:
            raise ValueError(f"{name} is not a weighted RMSNorm of {type(module).__name__}")
        norm.fold = True


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryTables(nn.Module):
    """RoPE cos/sin of every position below `max_position`, one table pair per distinct theta.

    Positions are looked up rather than multiplied by the frequencies: a program converted with
    fp16 compute precision would form `position * inv_freq` and its cos/sin in fp16, where
    positions above 2048 are not even representable and angles are off by ~1e-3 * position
    radians. A gather with the int32 positions is exact; only the table entries are rounded.
    The tables are non-persistent buffers that no entry point writes, so coremltools bakes them
    in as constants (not states) and checkpoints never contain them. Tables hold the first
    half of the rotate-half layout (the second half repeats it), halving their size.
    Positions at or beyond `max_position` are unsupported; they are clamped to the last entry
    only so the gather stays in range (docs/positions.md).
    `scale_inv_freq`, when given, maps each theta's inverse frequencies theta^(-2i/head_dim)
    (float64, [head_dim / 2]) to the ones the model uses (Llama 3's rope scaling:
    models/llama.py); it runs on every `build`, so a model built on `meta` gets it too.
    """

    def __init__(self, head_dim: int, thetas: list[float], max_position: int,
                 dtype: torch.dtype | None = None, *,
                 scale_inv_freq: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        if max_position < 1:
            raise ValueError(f"max_position must be at least 1, got {max_position}")
        self.head_dim = head_dim
        self.max_position = max_position
        # theta 0 marks NoPE layers: they get no table.
        self.thetas = tuple(sorted({float(t) for t in thetas if t > 0}))
        self.scale_inv_freq = scale_inv_freq
        self.build(dtype or torch.get_default_dtype())

    def build(self, dtype: torch.dtype) -> None:
        """(Re)computes the tables on the CPU in `dtype`; also used after building on `meta`
        and after loading weights in another dtype (rounding once from float64)."""
        positions = torch.arange(self.max_position, dtype=torch.float64, device="cpu")
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device="cpu")
        for k, theta in enumerate(self.thetas):
            inv_freq = 1.0 / torch.pow(theta, exponents / self.head_dim)
            if self.scale_inv_freq is not None:
                inv_freq = self.scale_inv_freq(inv_freq).to(torch.float64)
            angles = positions.unsqueeze(-1) * inv_freq.unsqueeze(0)
            self.register_buffer(f"cos_{k}", angles.cos().to(dtype), persistent=False)
            self.register_buffer(f"sin_{k}", angles.sin().to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, theta: float, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] for int positions [T], Hugging Face rotate-half convention."""
        k = self.thetas.index(float(theta))
        index = torch.clamp(positions, 0, self.max_position - 1)
        cos = getattr(self, f"cos_{k}")[index].to(dtype)
        sin = getattr(self, f"sin_{k}")[index].to(dtype)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def write_cache_slots(
    cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor,
    span: int | None = None,
) -> None:
    """cache[layer][:, slots[t]] = values[:, t], in place.

    cache: [layers, kv_heads, capacity, head_dim]; slots: [T] int, pairwise distinct;
    values: [kv_heads, T, head_dim]. A one-hot blend rather than index_put/scatter because it
    is the form coremltools 9.0 converts for an fp16 state (docs/positions.md). With `span`
    (a context bucket: docs/buckets.md) the blend covers slots [0, span) only, a constant
    slice of the state, so a call costs what its bucket holds; the slots must lie below it.
    """
    capacity = cache.shape[2] if span is None else span
    slot_ids = torch.arange(capacity, dtype=slots.dtype)
    hits = slots.reshape(-1, 1) == slot_ids.reshape(1, -1)  # [T, capacity]
    written = hits.any(dim=0).reshape(1, capacity, 1)
    scattered = torch.matmul(hits.to(values.dtype).transpose(0, 1), values)
    if span is None:
        cache[layer] = torch.where(written, scattered.to(cache.dtype), cache[layer])
    else:
        # One slice_update of the state at a constant offset (write_cache_rows from slot 0),
        # rather than a copy of the whole layer with the bucket's slots replaced.
        blended = torch.where(written, scattered.to(cache.dtype),
                              read_cache_rows(cache, layer, span))
        first = torch.zeros(1, dtype=torch.int32)
        cache.copy_(write_cache_rows(cache, layer, first, blended))


@torch.library.custom_op("museflash::write_cache_rows", mutates_args=())
def write_cache_rows(cache: torch.Tensor, layer: int, start: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` with cache[layer][:, start : start + T] = values: T consecutive slots
    from the runtime position `start` ([1] int). values: [kv_heads, T, head_dim].

    A custom op so that the exporter converts it to exactly one `slice_update` whose begin is
    computed from `start` at run time (export/kv_ops.py; KVWrite.SLICE, docs/kv-write.md),
    which torch.export cannot express without reading the position as a Python int. `start`
    is clamped to [0, capacity - T] so the write stays inside the state, here as in the
    converted op; positions past the cache are unsupported in every strategy (the runtimes
    never pass them)."""
    length = values.shape[1]
    first = min(max(int(start.reshape(-1)[0]), 0), cache.shape[2] - length)
    out = cache.clone()
    out[layer, :, first:first + length] = values.to(cache.dtype)
    return out


@write_cache_rows.register_fake
def _write_cache_rows_shape(cache, layer, start, values):
    return torch.empty_like(cache)


@torch.library.custom_op("museflash::read_cache_rows", mutates_args=())
def read_cache_rows(cache: torch.Tensor, layer: int, length: int) -> torch.Tensor:
    """cache[layer][:, :length], a copy: a context bucket's slots of one layer.

    A custom op so that the exporter converts it to ONE `slice_by_index` of the state
    (export/kv_ops.py). Indexing gives two, the layer and then its first slots, and a reader
    that copies each slice would copy the whole layer, O(capacity), on every call."""
    return cache[layer, :, :length].clone()


@read_cache_rows.register_fake
def _read_cache_rows_shape(cache, layer, length):
    return cache.new_empty((cache.shape[1], length, cache.shape[3]))


def write_cache(cache: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor,
                strategy: KVWrite = KVWrite.BLEND, span: int | None = None) -> None:
    """cache[layer][:, slots[t]] = values[:, t], in place, written as `strategy` says: the
    one-hot blend (any pairwise distinct slots; within [0, span) with a span), or one
    slice_update at slots[0] (KVWrite.SLICE: the slots must be consecutive and ascending, as
    the global cache's positions are; it writes O(T) rows whatever the span)."""
    if strategy == KVWrite.SLICE:
        cache.copy_(write_cache_rows(cache, layer, slots[:1], values))
    else:
        write_cache_slots(cache, layer, slots, values, span)


def read_cache(cache: torch.Tensor, layer: int, dtype: torch.dtype,
               span: int | None = None) -> torch.Tensor:
    """One layer of a cache buffer, as `dtype`, with the cast kept in the exported graph.

    coremltools' torch frontend reads an fp16 state as fp32 (its fp16 pass narrows it again
    later), and torch.export drops a `.to()` whose dtype already matches. Without an explicit
    cast, the attention output reaches o_proj as fp32 and the converter promotes that layer's
    weight to a materialised fp32 copy: 2x its bytes per layer, held through half the pass
    pipeline. The fp16 -> fp32 -> fp16 round trip is exact, and the converter folds it away."""
    layer_values = cache[layer] if span is None else read_cache_rows(cache, layer, span)
    if layer_values.dtype == dtype:
        return layer_values.to(torch.float32).to(dtype)
    return layer_values.to(dtype)


class LayerCache:
    """One layer's view of a stateful key/value cache pair, passed to its attention as an object
    (as mlx-lm passes a cache): the two buffers [layers, kv_heads, capacity, head_dim], the
    layer's index in them, the slots this call writes, and how it writes them (`kv_write`).
    The models make a ring's (the drafter's, Muse Glimmer's sliding layers') with the blend
    whatever the target's strategy: it costs O(window) there. `span`, for a global cache,
    is the context bucket the call runs in: it reads and blends slots [0, span) only."""

    __slots__ = ("keys", "values", "layer", "slots", "kv_write", "span")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, layer: int, slots: torch.Tensor,
                 kv_write: KVWrite = KVWrite.BLEND, span: int | None = None):
        self.keys, self.values, self.layer = keys, values, layer
        self.slots, self.kv_write = slots, KVWrite(kv_write)
        self.span = None if span is None or span == keys.shape[2] else span

    def write_keys(self, k: torch.Tensor) -> None:
        """Writes k [kv_heads, T, head_dim] at the slots (write_cache)."""
        write_cache(self.keys, self.layer, self.slots, k, self.kv_write, self.span)

    def write_values(self, v: torch.Tensor) -> None:
        """Writes v [kv_heads, T, head_dim] at the slots (write_cache)."""
        write_cache(self.values, self.layer, self.slots, v, self.kv_write, self.span)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values, as `dtype` (read_cache), within the span."""
        return (read_cache(self.keys, self.layer, dtype, self.span),
                read_cache(self.values, self.layer, dtype, self.span))

    def update(self, k: torch.Tensor, v: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes k, then v ([kv_heads, T, head_dim]), then reads both: the keys and values
        ([kv_heads, span or capacity, head_dim]) this call's queries attend to."""
        self.write_keys(k)
        self.write_values(v)
        return self.read(dtype)


def ring_slot_positions(last_position: torch.Tensor, capacity: int) -> torch.Tensor:
    """Absolute position held by each ring slot, given the newest written position.

    Slot s holds P - ((P - s) mod capacity); negative means never written.
    """
    slot_ids = torch.arange(capacity, dtype=last_position.dtype)
    return last_position - torch.remainder(last_position - slot_ids, capacity)


def sliding_causal_mask(
    positions: torch.Tensor, capacity: int, sliding_window: int
) -> torch.Tensor:
    """[T, capacity] bool: query i sees slot s iff 0 <= p_i - pos(s) < window."""
    slot_positions = ring_slot_positions(positions.amax(), capacity)
    distance = positions.reshape(-1, 1) - slot_positions.reshape(1, -1)
    # logical_and, not `&`: coremltools 9.0 has no converter for aten.__and__.
    written = (slot_positions >= 0).reshape(1, -1)
    return torch.logical_and(written, torch.logical_and(distance >= 0, distance < sliding_window))


def global_causal_mask(positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """[T, capacity] bool for a cache indexed by absolute position."""
    slot_positions = torch.arange(capacity, dtype=positions.dtype)
    return positions.reshape(-1, 1) >= slot_positions.reshape(1, -1)


def tree_write_positions(positions: torch.Tensor) -> torch.Tensor:
    """Where the nodes of a tree call are written (docs/trees.md): node i at position
    positions[0] + i, consecutive from the root's whatever the nodes' depths, so that siblings
    of one depth never share a slot. A chain's nodes are written at their own positions."""
    return positions[:1] + torch.arange(positions.shape[0], dtype=positions.dtype)


def _tree_part(written: torch.Tensor, slot_positions: torch.Tensor,
               tree_mask: torch.Tensor) -> torch.Tensor:
    """[T, S] bool: node i sees the slot holding node j's write position where tree_mask[i, j]
    (tree_mask [T, T], 1 where node i sees node j)."""
    hits = (written.reshape(-1, 1) == slot_positions.reshape(1, -1)).to(torch.float32)
    return torch.matmul(tree_mask.to(torch.float32), hits) > 0.5


def tree_global_mask(positions: torch.Tensor, tree_mask: torch.Tensor,
                     capacity: int) -> torch.Tensor:
    """[T, capacity] bool of a tree call over a cache indexed by absolute position: node i
    sees every slot before the root's position (the context) and the slots of the nodes
    tree_mask[i] names (itself and its ancestors). With a chain's mask (lower triangular) this
    is global_causal_mask."""
    slot_positions = torch.arange(capacity, dtype=positions.dtype)
    context = (slot_positions < positions[:1]).reshape(1, -1)
    return torch.logical_or(
        context, _tree_part(tree_write_positions(positions), slot_positions, tree_mask))


def tree_sliding_mask(positions: torch.Tensor, tree_mask: torch.Tensor, capacity: int,
                      sliding_window: int) -> torch.Tensor:
    """[T, capacity] bool of a tree call over a ring: node i sees a slot holding a position
    before the root's within its window (from its own position), and the slots of the nodes
    tree_mask[i] names. With a chain's mask this is sliding_causal_mask."""
    written = tree_write_positions(positions)
    slot_positions = ring_slot_positions(written.amax(), capacity)
    distance = positions.reshape(-1, 1) - slot_positions.reshape(1, -1)
    context = torch.logical_and(
        torch.logical_and(slot_positions >= 0, slot_positions < positions[:1]).reshape(1, -1),
        distance < sliding_window)
    return torch.logical_or(context, _tree_part(written, slot_positions, tree_mask))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q: [n_q, T, D]; k, v: [n_kv, S, D]; mask: [T, S] bool. Query head h uses KV head
    h // (n_q // n_kv). Returns [n_q, T, D].
    """
    n_q, length, head_dim = q.shape
    n_kv = k.shape[0]
    groups = n_q // n_kv
    grouped = q.reshape(n_kv, groups * length, head_dim)
    scores = torch.matmul(grouped, k.transpose(1, 2)).float() * scale
    scores = scores.reshape(n_kv, groups, length, -1)
    scores = torch.where(mask, scores, torch.full_like(scores, MASK_VALUE))
    weights = scores.softmax(dim=-1).to(v.dtype).reshape(n_kv, groups * length, -1)
    return torch.matmul(weights, v).reshape(n_q, length, head_dim)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
