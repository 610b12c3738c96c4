"""The loss and the held-out figures of //:train_drafter (training/trainer.py).

Blocks are train_demo_drafter's (`_blocks`: the context the runtime injects, the block
[token_a, MASK x (K-1)], the target's next K-1 tokens as labels) drafted through the models'
own entry points, batched (distil_corpus.draft_blocks). What is new here is the choice of
targets and softmax:
  hard / soft   the target's token, or the target's top-k distribution (trainer_data);
  full          the softmax over the whole vocabulary;
  corpus        over a fixed set of ids (the corpus's tokens and soft ids), as the SmolLM2
                recipe did (train_demo_drafter.vocabulary_block_loss);
  topk          per drafted position over its label, its soft ids and the drafter's own top-k
                at that position right now (computed without gradient from the full logits):
                the tokens the drafter wrongly favours are always pushed down, and every
                position's set is its own, so the loss does not depend on how blocks are
                grouped into micro-batches or ranks.
Each drafted position i (1-based) weighs exp(-(i - 1) / gamma) (DFlash's exponential decay);
a block's loss is its weighted mean. DFlash2 adds its selector's teacher-forced loss
(train_demo_dflash2.make_loss's second term).
"""

from __future__ import annotations

import torch
from torch import nn

from museflash.models.dflash2 import DFlash2Drafter
from museflash.training import distil_corpus as distil
from museflash.training import train_demo_dflash2 as v2
from museflash.training import train_demo_drafter as v1

VOCABULARIES = ("full", "corpus", "topk")
FIGURE_BLOCKS = (4, 8, 16)
TOP1_POSITIONS = 4


def position_weights(block: int, gamma: float | None) -> torch.Tensor:
    """[K-1] weights of the drafted positions: exp(-(i - 1) / gamma); gamma None takes
    train_demo_drafter.loss_decay's per-block gamma (the demo recipes')."""
    gamma = v1.loss_decay(block) if gamma is None else gamma
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def _first_occurrence(candidates: torch.Tensor) -> torch.Tensor:
    """For each column of candidates [..., C], the index of the first column holding the same
    id (itself when it is the first)."""
    same = candidates[..., :, None] == candidates[..., None, :]
    return same.to(torch.uint8).argmax(dim=-1)


class BlockLoss(nn.Module):
    """The summed per-block loss of blocks at `anchors` of `rows`; a module holding the
    trained modules (the target's encoder and the drafter), so that DDP can wrap it. The target
    and the rows are plain attributes: the target's own weights are frozen and not DDP's."""

    def __init__(self, target, drafter, rows, *, gamma: float | None, soft: bool,
                 vocabulary: str, top_k: int, selector_weight: float):
        super().__init__()
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"loss vocabulary {vocabulary!r}: one of {VOCABULARIES}")
        if soft and rows.soft_ids is None:
            raise ValueError("soft targets need the target's top-k kept with the rows")
        self.dflash2 = isinstance(drafter, DFlash2Drafter)
        if self.dflash2 and vocabulary != "full":
            raise ValueError("a DFlash2 drafter's selector reads the whole vocabulary's top-k: "
                             "train it with the full-vocabulary loss")
        self.encoder = target.encoder
        self.drafter = drafter
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_rows", rows)
        self.gamma, self.soft, self.vocabulary = gamma, soft, vocabulary
        self.top_k, self.selector_weight = top_k, selector_weight
        if vocabulary == "corpus":
            held = [rows.corpus.tokens.unique()]
            if soft:
                held.append(rows.soft_ids.unique().long())
            self.corpus_ids = torch.cat(held).unique()
            index = torch.full((int(self.corpus_ids.max()) + 1,), -1, dtype=torch.long)
            index[self.corpus_ids] = torch.arange(len(self.corpus_ids))
            self.corpus_index = index

    def forward(self, rows: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
        target, drafter, corpus = self._target, self.drafter, self._rows.corpus
        inputs, labels = v1._blocks(target, drafter, corpus, rows, anchors, block)
        hidden = distil.draft_blocks(drafter, *inputs, method="_draft_hidden")[:, 1:]
        if self.soft:
            at = anchors[:, None] + torch.arange(1, block)
            soft_ids = self._rows.soft_ids[rows[:, None], at].long()
            soft_probs = self._rows.soft_probs[rows[:, None], at].float()
        weights = position_weights(block, self.gamma)
        logits = None
        if self.vocabulary == "full":
            logits = drafter._logits(hidden)
            logp = torch.log_softmax(logits.float(), dim=-1)
            nll = (-(soft_probs * logp.gather(-1, soft_ids)).sum(-1) if self.soft
                   else -logp.gather(-1, labels[..., None])[..., 0])
        elif self.vocabulary == "corpus":
            index = self.corpus_index
            if int(labels.max()) >= len(index) or bool((index[labels] < 0).any()):
                raise ValueError("a label lies outside the corpus vocabulary")
            logp = torch.log_softmax(drafter._logits(hidden, self.corpus_ids).float(), dim=-1)
            nll = (-(soft_probs * logp.gather(-1, index[soft_ids])).sum(-1) if self.soft
                   else -logp.gather(-1, index[labels][..., None])[..., 0])
        else:
            with torch.no_grad():
                favoured = drafter._logits(hidden.detach()).topk(self.top_k, dim=-1).indices
            columns = [labels[..., None]] + ([soft_ids] if self.soft else []) + [favoured]
            candidates = torch.cat(columns, dim=-1)
            ids, where = candidates.unique(return_inverse=True)
            chosen = drafter._logits(hidden, ids).gather(-1, where).float()
            first = _first_occurrence(candidates)
            repeated = first != torch.arange(candidates.shape[-1])
            logp = torch.log_softmax(chosen.masked_fill(repeated, float("-inf")), dim=-1)
            logp = logp.gather(-1, first)  # a repeated id reads its first column's value
            width = soft_ids.shape[-1] if self.soft else 0
            nll = (-(soft_probs * logp[..., 1:1 + width]).sum(-1) if self.soft
                   else -logp[..., 0])
        loss = ((nll * weights).sum(-1) / weights.sum()).sum()
        if self.dflash2 and self.selector_weight:
            loss = loss + self.selector_weight * self._selector_loss(
                hidden, logits, labels, inputs[2][:, :1], weights)
        return loss

    def _selector_loss(self, hidden, logits, labels, first, weights) -> torch.Tensor:
        """train_demo_dflash2.make_loss's selector term, summed over blocks: cross-entropy of
        the selector's scores after the true predecessors, against the candidate that is the
        target's token (positions without it among the candidates are left out)."""
        predecessors = torch.cat([first, labels[:, :-1]], dim=1)
        scores, candidates = v2.selector_scores(self.drafter, hidden, logits, predecessors)
        match = candidates == labels[..., None]
        picked = nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]),
                                             match.float().argmax(dim=-1).reshape(-1),
                                             reduction="none").reshape(labels.shape)
        return (picked * weights * match.any(dim=-1)).sum() / weights.sum()


def heldout_figures(target, drafter, corpus: distil.Corpus, *, stride: int = 1,
                    chunk: int = 128) -> dict:
    """Teacher-forced figures on held-out rows, at every `stride`-th anchor: the fraction of
    anchors whose drafted positions 1..4 are the target's tokens (K = 16 blocks: "top1"), and
    the acceptance at K = 4, 8, 16: mean accepted / (K - 1), what the greedy loop accepts
    from each anchor (a DFlash2 drafter proposing its selector's choices)."""
    dflash2 = isinstance(drafter, DFlash2Drafter)
    figures: dict = {"acceptance": {}}
    with torch.no_grad():
        for block in FIGURE_BLOCKS:
            rows_all, anchors_all = v1.strided_anchors(corpus, block, stride)
            hits = []
            for first in range(0, len(rows_all), chunk):
                rows, anchors = rows_all[first:first + chunk], anchors_all[first:first + chunk]
                if dflash2:
                    hidden, logits, labels, previous = v2.block_outputs(target, drafter, corpus,
                                                                        rows, anchors, block)
                    scores, candidates = v2.selector_scores(drafter, hidden, logits, previous)
                    proposed = torch.gather(candidates, 2,
                                            scores.argmax(dim=-1, keepdim=True))[..., 0]
                else:
                    inputs, labels = v1._blocks(target, drafter, corpus, rows, anchors, block)
                    proposed = distil.draft_blocks(drafter, *inputs)[:, 1:].argmax(dim=-1)
                hits.append(proposed == labels)
            hits = torch.cat(hits)
            accepted = hits.long().cumprod(dim=1).sum(dim=1).float()
            figures["acceptance"][block] = float(accepted.mean()) / (block - 1)
            if block == max(FIGURE_BLOCKS):
                figures["top1"] = [float(hits[:, i].float().mean())
                                   for i in range(TOP1_POSITIONS)]
                figures["anchors"] = len(rows_all)
    return figures
