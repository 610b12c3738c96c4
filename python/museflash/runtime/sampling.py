"""Temperature / top-p sampling and the speculative rejection rule.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): the drafter proposes x_i ~ q_i,
the target scores the same positions in one call giving p_i, and drafted token i is accepted
with probability min(1, p_i(x_i) / q_i(x_i)) in order. At the first rejection the token is drawn
from the normalised residual max(0, p_i - q_i); if every proposal is accepted, the bonus token
is drawn from p_K. Each emitted token is then distributed exactly as p given the accepted
context, so the output has the target's own sampled distribution whatever the drafter is.

The rule needs x_i ~ q_i given the context the target conditions on. DFlash drafts every
position in one parallel call from the accepted context only (q_i does not depend on the other
drafted tokens), so x_i is still distributed as q_i given the accepted x_0..x_{i-1}.

All randomness comes from a caller-owned numpy Generator; nothing here touches global state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """Sampling settings. temperature 0 means greedy (argmax); top_p 1 keeps every token."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"temperature {self.temperature:g}, top-p {self.top_p:g}"


def probabilities(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Probability rows (float64, same shape as `logits` [..., vocab]) to sample from.

    Greedy: the one-hot of the argmax (the first maximum on ties, as np.argmax). Otherwise a
    softmax of logits / temperature, then top-p: the smallest set of most probable tokens whose
    mass reaches top_p (a token is kept when the mass strictly before it, in descending order
    with ties by token id, is below top_p), renormalised.
    """
    logits = np.asarray(logits, np.float64)
    if sampling.greedy:
        out = np.zeros_like(logits)
        np.put_along_axis(out, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    scaled = logits / sampling.temperature
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if sampling.top_p == 1:
        return probs
    rows = probs.reshape(-1, probs.shape[-1])
    index = np.arange(len(rows))[:, None]
    order = (-rows).argsort(axis=-1, kind="stable")
    ranked = rows[index, order]
    ranked[ranked.cumsum(axis=-1) - ranked >= sampling.top_p] = 0.0
    kept = np.empty_like(rows)
    kept[index, order] = ranked / ranked.sum(axis=-1, keepdims=True)
    return kept.reshape(probs.shape)


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `probs` [..., vocab] (rows need not be normalised), by inverting
    the cumulative distribution with one uniform per row. Zero-probability tokens are never
    drawn. Returns int64 of shape probs.shape[:-1]."""
    probs = np.asarray(probs, np.float64)
    cdf = probs.cumsum(axis=-1)
    u = rng.random(probs.shape[:-1]) * cdf[..., -1]
    tokens = (cdf <= u[..., None]).sum(axis=-1)
    over = tokens == probs.shape[-1]
    if over.any():
        # u * total rounded up to total; the last token with mass is the right answer.
        last = probs.shape[-1] - 1 - (probs[..., ::-1] > 0).argmax(axis=-1)
        tokens = np.where(over, last, tokens)
    return tokens


def accept_drafts(p: np.ndarray, q: np.ndarray, drafted: np.ndarray,
                  rng: np.random.Generator) -> tuple[int, int]:
    """The speculative rejection step for one verify call.

    p: target probability rows [K + 1, vocab] (row i scores drafted position i; row K is the
    bonus row after all K drafts); q: drafter probability rows [K, vocab]; drafted: the K
    drafted tokens, token i sampled from q[i]. Returns (accepted, token): the number of drafts
    accepted (0..K) and the token emitted after them, drawn from the residual of the first
    rejected position, or from p[K] when all K are accepted.
    """
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    drafted = np.asarray(drafted).reshape(-1)
    k = len(drafted)
    if p.shape[0] != k + 1 or q.shape[0] != k:
        raise ValueError(f"{k} drafted tokens need {k + 1} target rows and {k} drafter rows, "
                         f"got {p.shape[0]} and {q.shape[0]}")
    rows = np.arange(k)
    p_x, q_x = p[rows, drafted], q[rows, drafted]
    if q_x.min() <= 0:
        raise ValueError(f"drafted token at position {int(q_x.argmin())} has drafter "
                         "probability 0; drafted tokens must be sampled from their q row")
    # Accept x_i with probability min(1, p/q): u < p/q for u ~ U[0, 1). One uniform per
    # position, drawn together; the ones after the first rejection are simply unused.
    accept = rng.random(k) * q_x < p_x
    accepted = k if accept.all() else int(accept.argmin())
    if accepted == k:
        return k, int(sample(p[k], rng))
    residual = np.maximum(p[accepted] - q[accepted], 0.0)
    if not residual.sum() > 0:
        # Only possible when p == q up to rounding, where a rejection has probability ~0;
        # p itself is then the residual's limit.
        residual = p[accepted]
    return accepted, int(sample(residual, rng))
