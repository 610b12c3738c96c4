"""DFlash2 block drafter for Muse Glimmer (z-lab's `DFlash2DraftModel`).

DFlash2 keeps DFlash v1's contract (models/dflash.py): the fused target emits drafter features,
`inject_kv` writes them as K/V into the drafter's ring, and `draft` denoises the block
[anchor, MASK, ...] in one pass with z-lab's non-causal sliding window (|q - k| < window). It
adds, per layer, two grouped dynamic causal convolutions over the block, and a candidate
selector that turns the draft logits into one token path:

  attention_conv / mlp_conv  around the attention and the MLP of every layer: `prepare` mixes
      the normed input along the block, out[t] = sum_o (base[0][o] + d0[t, o, g]) * x[t - o]
      (zero before the block's first position), and the sublayer's output is mixed the same
      way with base[1] and d1. d = kernel_projection(normed input): one weight per offset and
      per channel group, the same for the group's `conv_group_size` channels.
  candidate_selector  the `selector_top_k` best tokens of every drafted position are scored
      against the token chosen before them: score = logit + (predecessor_codebook[prev] *
      hidden_projection(h)) . successor_codebook[candidate]; greedy takes the best, starting
      from the anchor as the first predecessor. `draft` returns the path as `draft_tokens`.

Draft logits are lm_head(norm(h)) * output_multiplier, soft-capped by the drafter's own
final_logit_softcapping (both from `dflash_config`), as z-lab's reference computes them.
Sampling through the selector is not implemented: sampled decoding draws each drafted token
from its logits row (still lossless under the rejection rule); see docs/dflash2.md.

Checkpoint keys are the parameter names: the codebooks are bare parameters, stored without a
`.weight` suffix as in z-lab's checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from museflash.models.base import LayerCache, softcap
from museflash.models.dflash import (
    DFlashConfig,
    DFlashDecoderLayer,
    DFlashDrafter,
)

# dflash_config keys DFlash2 needs beyond DFlash v1's, and the optional ones with defaults.
REQUIRED_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(kw_only=True)
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in REQUIRED_SETTINGS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"conv_group_size {self.conv_group_size}")
        if not self.output_multiplier > 0:
            raise ValueError(f"output_multiplier must be positive, got {self.output_multiplier}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError("final_logit_softcapping must be positive or absent, got "
                             f"{self.final_logit_softcapping}")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DFlash2Config:
        """z-lab's layout: v1's settings, plus the DFlash2 ones under `dflash_config` (or at
        the top level)."""
        base = DFlashConfig.from_dict(config)
        settings = {**config, **(config.get("dflash_config") or {})}
        missing = [name for name in REQUIRED_SETTINGS if settings.get(name) is None]
        if missing:
            raise ValueError(f"DFlash2 drafter config is missing {missing} (dflash_config)")
        softcap_value = settings.get("final_logit_softcapping")
        values = {name: getattr(base, name) for name in base.__dataclass_fields__}
        values.update({name: int(settings[name]) for name in REQUIRED_SETTINGS})
        return cls(**values,
                   output_multiplier=float(settings.get("output_multiplier", 1.0)),
                   final_logit_softcapping=(None if softcap_value in (None, 0)
                                            else float(softcap_value)))


class GroupedDynamicConv(nn.Module):
    """The causal convolution over the block, its kernel per position the static
    `base_kernel` plus a dynamic part projected from the normed input (one per channel group).
    base_kernel [2, kernel, hidden]: [0] mixes the sublayer's input, [1] its output."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size),
                                        requires_grad=False)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups,
                                           bias=False)

    def _convolve(self, x: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor):
        """x [1, T, hidden]; base [kernel, hidden]; dynamic [1, T, kernel, groups]."""
        length = x.shape[1]
        blocks = x.reshape(1, length, self.groups, self.group_size)
        out = torch.zeros_like(blocks)
        for offset in range(min(self.kernel_size, length)):
            shifted = blocks if offset == 0 else torch.cat(
                [torch.zeros_like(blocks[:, :offset]), blocks[:, :length - offset]], dim=1)
            weight = (base[offset].reshape(1, 1, self.groups, self.group_size).to(x.dtype)
                      + dynamic[:, :, offset].reshape(1, length, self.groups, 1))
            out = out + weight * shifted
        return out.reshape(x.shape)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input mixed with base[0], the dynamic kernel `finish` uses)."""
        length = x.shape[1]
        dynamic = self.kernel_projection(x).reshape(1, length, 2, self.kernel_size, self.groups)
        return (self._convolve(x, self.base_kernel[0], dynamic[:, :, 0]), dynamic[:, :, 1])

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, self.base_kernel[1], dynamic)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        sizes = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*sizes)
        self.mlp_conv = GroupedDynamicConv(*sizes)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        mixed, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.scaled(self.attention_conv.finish(self.self_attn(mixed, rope, mask, cache),
                                                       dynamic))
        mixed, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.scaled(self.mlp_conv.finish(self.mlp(mixed), dynamic))


class CandidateSelector(nn.Module):
    """Scores each drafted position's top-k tokens against the token chosen before it."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        rank, vocab = config.selector_rank, config.raw.get("vocab_size")
        if vocab is None:
            raise ValueError("DFlash2 drafter config is missing vocab_size (the codebooks' rows)")
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(int(vocab), rank),
                                                 requires_grad=False)
        self.successor_codebook = nn.Parameter(torch.zeros(int(vocab), rank),
                                               requires_grad=False)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k logits, their token ids), each [positions, k], best first."""
        return torch.topk(logits, self.top_k, dim=-1)

    def scores(self, projected: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessor: torch.Tensor) -> torch.Tensor:
        """[1, k]: one position's candidate scores after `predecessor` ([1] token id)."""
        query = nn.functional.embedding(predecessor, self.predecessor_codebook) * projected
        successors = nn.functional.embedding(candidates, self.successor_codebook)  # [k, rank]
        return unary + torch.matmul(query, successors.transpose(0, 1))

    def greedy_path(self, hidden: torch.Tensor, logits: torch.Tensor,
                    anchor: torch.Tensor) -> torch.Tensor:
        """hidden [P, hidden], logits [P, vocab], anchor [1] int -> the path [P] int32."""
        unary, candidates = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        predecessor = anchor.reshape(1).to(torch.int32)
        path = []
        for position in range(hidden.shape[0]):
            scores = self.scores(projected[position:position + 1], unary[position:position + 1],
                                 candidates[position], predecessor)
            best = torch.argmax(scores, dim=-1, keepdim=True)
            predecessor = torch.gather(candidates[position:position + 1], 1, best)
            predecessor = predecessor.reshape(1).to(torch.int32)
            path.append(predecessor)
        return torch.cat(path)


class DFlash2Drafter(DFlashDrafter):
    """Entry points as DFlash v1's, except that there is no ring `decode` and that
      draft(input_ids [1, K], positions [K]) -> (logits [1, K, vocab], draft_tokens [1, K-1])
    where draft_tokens is the selector's greedy path (int32)."""

    entry_points = ("draft", "inject_kv")
    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DFlash2Config, *args, **kwargs):
        if not config.window_per_query:
            raise ValueError("DFlash2 drafts with z-lab's non-causal window: its config must "
                             "state `is_causal: false`")
        super().__init__(config, *args, **kwargs)
        self.candidate_selector = CandidateSelector(config)

    def _logits(self, hidden: torch.Tensor,
                vocabulary: torch.Tensor | None = None) -> torch.Tensor:
        logits = (nn.functional.linear(hidden, self.output_weight(vocabulary))
                  * self.config.output_multiplier)
        return softcap(logits, self.config.final_logit_softcapping)

    def draft(self, input_ids: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self._draft_hidden(input_ids, positions)
        logits = self._logits(hidden)
        tokens = self.candidate_selector.greedy_path(hidden[0, 1:], logits[0, 1:],
                                                     input_ids.reshape(-1)[:1])
        return logits, tokens.reshape(1, -1)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("DFlash2 has no ring `decode`: it drafts whole blocks")

    def path_gaps(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  path: torch.Tensor) -> torch.Tensor:
        """For another path [K-1] of the same block: at each position, how far its token's
        selector score (after the path's own predecessor) falls below the best candidate's.
        A token outside the top-k candidates is scored as a candidate would be, and its gap is
        the larger of that and how far its logit falls below the k-th candidate's (fp16
        rounding of two almost equal logits can swap the last candidate). Zeros for the greedy
        path. Re-runs the block, writing the same K/V the last `draft` of it wrote. Parity
        uses it to tell an fp16 near-tie from a wrong selector."""
        hidden = self._draft_hidden(input_ids, positions)
        logits = self._logits(hidden)
        selector = self.candidate_selector
        unary, candidates = selector.candidates(logits[0, 1:])
        projected = selector.hidden_projection(hidden[0, 1:])
        predecessors = torch.cat([input_ids.reshape(-1)[:1], path.reshape(-1)[:-1]])
        gaps = []
        for position, token in enumerate(path.reshape(-1).tolist()):
            predecessor = predecessors[position:position + 1].to(torch.int32)
            scores = selector.scores(projected[position:position + 1],
                                     unary[position:position + 1], candidates[position],
                                     predecessor)[0]
            hit = (candidates[position] == token).nonzero()
            if len(hit):
                gaps.append(float(scores.max() - scores[hit[0, 0]]))
                continue
            own = logits[0, 1 + position, token].reshape(1, 1)
            score = selector.scores(projected[position:position + 1], own,
                                    torch.tensor([token]), predecessor)[0, 0]
            boundary = unary[position, -1] - own[0, 0]
            gaps.append(float(max(scores.max() - score, boundary)))
        return torch.tensor(gaps)
