"""Token trees for speculative verification (docs/trees.md).

A tree holds the anchor (the token the last target call chose) at its root, node 0, and the
candidate continuations below it; one target call can verify every node at once, each seeing
the cache and its own ancestors. Greedy decoding then keeps the longest path whose every token
is the target's argmax after its parent, and the target's choice after that path's last node.

Candidates come from three sources, merged into one tree:
- the drafter: a DFlash block gives a distribution at every depth in one call, so a node at
  depth d may take any of row d's likeliest tokens, whatever its parent;
- the recycled table: the target's own likeliest next tokens after a token, remembered from
  the rows of earlier target calls (Token Recycling, arXiv 2408.08696);
- lookup: the tokens that followed the context's ending where it occurred before
  (`speculative.lookup_proposal`).

`build_tree` grows the tree best first within a node budget. A node's score is the product,
along its path, of each edge's probability: the largest any source gives that edge (the
drafter's row probability, the table's remembered target probability times RECYCLED_WEIGHT,
or LOOKUP_PROBABILITY on the lookup chain). Every edge probability is at most 1, so a child
never outscores its parent and the nodes come out parents first. Equal scores are broken by
the smaller parent index, then the smaller token id, so that the Swift engine's builder
(TokenTree.swift) gives the same tree node for node.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from museflash.runtime.sampling import sample

DRAFT_TOP_K = 8  # a drafter row's likeliest tokens a node may take
RECYCLED_TOP_K = 8  # the target's likeliest next tokens the table keeps per token
LOOKUP_PROBABILITY = 0.5  # the probability given to each edge of the lookup chain
# The table's probabilities are the target's after a token in some earlier context, not this
# one: taken at face value they displace better drafter candidates. Measured on the real pair's
# held-out chat prompts, all sources at 32 nodes (docs/trees.md): weight 1 gives 2.40 tokens a
# call, 0.3 gives 2.50, 0.1 2.50, 0.03 2.48.
RECYCLED_WEIGHT = 0.3


class TreeError(ValueError):
    """A tree or a mask that a tree call cannot take."""


class Source(IntEnum):
    """What proposed a node: its largest edge probability's source (ROOT for node 0)."""
    ROOT = 0
    DRAFTER = 1
    RECYCLED = 2
    LOOKUP = 3


@dataclass(frozen=True)
class TokenTree:
    tokens: np.ndarray  # [N] int32; node 0 is the anchor
    parents: np.ndarray  # [N] int32; -1 for node 0, else a node before this one
    sources: np.ndarray  # [N] int8: Source

    def __post_init__(self) -> None:
        count = len(self.tokens)
        if count < 1 or len(self.parents) != count or len(self.sources) != count:
            raise TreeError(f"a tree needs one parent and one source per token, got "
                            f"{count} tokens, {len(self.parents)} parents and "
                            f"{len(self.sources)} sources")
        if int(self.parents[0]) != -1:
            raise TreeError("node 0 must be the root (parent -1)")
        for node in range(1, count):
            parent = int(self.parents[node])
            if not 0 <= parent < node:
                raise TreeError(f"node {node}'s parent {parent} is not an earlier node")

    @classmethod
    def chain(cls, anchor: int, tokens: Sequence[int]) -> TokenTree:
        """The width-1 tree: the anchor, then each token below the one before."""
        count = len(tokens) + 1
        return cls(np.array([anchor, *tokens], np.int32),
                   np.arange(-1, count - 1, dtype=np.int32),
                   np.array([Source.ROOT] + [Source.DRAFTER] * len(tokens), np.int8))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> np.ndarray:
        """[N] int32: 0 for the root, one more than its parent's for each node."""
        depths = np.zeros(len(self), np.int32)
        for node in range(1, len(self)):
            depths[node] = depths[self.parents[node]] + 1
        return depths

    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: row i is True at i and at each of its ancestors, the nodes it sees."""
        mask = np.eye(len(self), dtype=bool)
        for node in range(1, len(self)):
            mask[node] |= mask[self.parents[node]]
        return mask

    def children(self) -> list[list[int]]:
        """Each node's children, in node order."""
        children: list[list[int]] = [[] for _ in range(len(self))]
        for node in range(1, len(self)):
            children[int(self.parents[node])].append(node)
        return children

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        nodes = []
        while node > 0:
            nodes.append(node)
            node = int(self.parents[node])
        return nodes[::-1]


def check_ancestor_mask(mask: np.ndarray) -> None:
    """Refuses a mask that is not some tree's ancestor mask, in one line: every node must see
    itself and the root, no later node, and exactly its parent's nodes besides itself, where
    its parent is the latest earlier node it sees."""
    mask = np.asarray(mask, bool)
    if mask.ndim != 2 or mask.shape[0] != mask.shape[1] or not len(mask):
        raise TreeError(f"a tree mask is square and not empty, got shape {mask.shape}")
    for node in range(len(mask)):
        row = mask[node]
        if not row[node] or not row[0]:
            raise TreeError(f"tree mask row {node} does not see itself and the root (node 0)")
        later = np.flatnonzero(row[node + 1:])
        if len(later):
            raise TreeError(f"tree mask row {node} sees a later node, {node + 1 + later[0]}; "
                            "nodes must come after their ancestors")
        if node:
            seen = np.flatnonzero(row[:node])
            parent = int(seen[-1])
            expected = mask[parent].copy()
            expected[node] = True
            if not np.array_equal(row, expected):
                raise TreeError(f"tree mask row {node} sees nodes its parent, {parent}, does "
                                "not: a node sees only its ancestors")


def mask_parents(mask: np.ndarray) -> np.ndarray:
    """The parents of the tree whose ancestor mask this is (check_ancestor_mask first)."""
    mask = np.asarray(mask, bool)
    parents = np.full(len(mask), -1, np.int32)
    for node in range(1, len(mask)):
        parents[node] = int(np.flatnonzero(mask[node, :node])[-1])
    return parents


class RecycledTable:
    """The target's likeliest next tokens after each token it has been called on: every row
    of a target call gives the token at that row and the target's distribution after it."""

    def __init__(self, top_k: int = RECYCLED_TOP_K):
        self.top_k = top_k
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # token -> (ids, log-probs)

    def update(self, tokens: Sequence[int], logits: np.ndarray) -> None:
        """Remembers, for each token, the top_k of the target's logits on its row (a newer row
        replaces an older one)."""
        logits = np.asarray(logits, np.float64)
        for token, row in zip(tokens, logits, strict=True):
            ids, logp = top_log_probabilities(row, self.top_k)
            self.rows[int(token)] = (ids, logp)

    def successors(self, token: int) -> tuple[np.ndarray, np.ndarray]:
        return self.rows.get(int(token), _NONE)


_NONE = (np.zeros(0, np.int32), np.zeros(0, np.float64))


def top_log_probabilities(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k likeliest ids of a logits row and their log-probabilities (float64), likeliest
    first, equal ones by smaller id."""
    row = np.asarray(logits, np.float64)
    top = row.max()
    log_total = top + math.log(float(np.exp(row - top).sum()))
    k = min(k, len(row))
    # Every id at least as likely as the k-th: ties at the k-th value go to the smaller ids
    # (argpartition alone picks among them arbitrarily; fp16 logits tie often).
    kth = np.partition(row, len(row) - k)[len(row) - k]
    candidates = np.flatnonzero(row >= kth)
    order = sorted(candidates.tolist(), key=lambda i: (-row[i], i))[:k]
    ids = np.array(order, np.int32)
    return ids, row[ids] - log_total


def build_tree(anchor: int, budget: int, *, draft_logits: np.ndarray | None = None,
               recycled: RecycledTable | None = None, lookup: Sequence[int] | None = None,
               max_depth: int | None = None, draft_top_k: int = DRAFT_TOP_K,
               lookup_probability: float = LOOKUP_PROBABILITY,
               recycled_weight: float = RECYCLED_WEIGHT) -> TokenTree:
    """The tree of at most `budget` nodes (the root included) with the best scores (the
    module's docstring says how nodes are scored and ordered).

    `draft_logits`: [D, vocab], row d - 1 the drafter's logits at depth d (a DFlash block's
    rows after its anchor). `lookup`: the lookup proposal, a chain below the root. No node is
    deeper than `max_depth` (the drafter's rows, by default; None with no drafter: unbounded)."""
    if budget < 1:
        raise TreeError(f"a tree budget is at least 1 node (the root), got {budget}")
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    if draft_logits is not None:
        rows = [top_log_probabilities(row, draft_top_k) for row in np.asarray(draft_logits)]
        if max_depth is None:
            max_depth = len(rows)
    lookup = [int(t) for t in lookup] if lookup is not None else []
    lookup_logp = math.log(lookup_probability)
    recycled_logw = math.log(recycled_weight)

    tokens, parents, sources = [int(anchor)], [-1], [int(Source.ROOT)]
    depths, scores, on_lookup = [0], [0.0], [True]
    children: set[tuple[int, int]] = set()
    heap: list[tuple[float, int, int, int]] = []  # (-score, parent, token, source)

    def push_children(node: int) -> None:
        depth = depths[node] + 1
        if max_depth is not None and depth > max_depth:
            return
        score = scores[node]
        if depth <= len(rows):
            for token, logp in zip(*rows[depth - 1], strict=True):
                heapq.heappush(heap, (-(score + logp), node, int(token), int(Source.DRAFTER)))
        if recycled is not None:
            for token, logp in zip(*recycled.successors(tokens[node]), strict=True):
                heapq.heappush(heap, (-(score + logp + recycled_logw), node, int(token),
                                      int(Source.RECYCLED)))
        if on_lookup[node] and depth <= len(lookup):
            heapq.heappush(heap, (-(score + lookup_logp), node, lookup[depth - 1],
                                  int(Source.LOOKUP)))

    push_children(0)
    while heap and len(tokens) < budget:
        negative, parent, token, source = heapq.heappop(heap)
        if (parent, token) in children:
            continue  # a likelier source already put this edge in the tree
        children.add((parent, token))
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        sources.append(source)
        depths.append(depths[parent] + 1)
        scores.append(-negative)
        depth = depths[node]
        on_lookup.append(on_lookup[parent] and depth <= len(lookup)
                         and lookup[depth - 1] == token)
        push_children(node)
    return TokenTree(np.array(tokens, np.int32), np.array(parents, np.int32),
                     np.array(sources, np.int8))


def accept_greedy(tree: TokenTree, choices: Sequence[int]) -> tuple[list[int], int]:
    """(the accepted nodes, root's child first; the token after them) when `choices[i]` is
    the target's argmax after node i's path: the walk from the root down the child whose token
    is its parent's choice, as far as such a child exists."""
    if len(choices) != len(tree):
        raise TreeError(f"{len(choices)} choices for a tree of {len(tree)} nodes")
    child = {(int(p), int(t)): node for node, (p, t)
             in enumerate(zip(tree.parents, tree.tokens, strict=True)) if node}
    path, node = [], 0
    while (next_node := child.get((node, int(choices[node])))) is not None:
        path.append(next_node)
        node = next_node
    return path, int(choices[node])


def fill_by_sampling(shape: TokenTree, q: np.ndarray, rng: np.random.Generator) -> TokenTree:
    """A sampled generation's tree (docs/trees.md, "Sampling"): `shape` with each node's token
    drawn from q[depth - 1], the drafter's sampling distribution at its depth, without its elder
    siblings' tokens, in node order. A node whose depth's distribution its elder siblings have
    exhausted (top-p) is dropped with its subtree. The shape depends on the drafter alone, so
    each node's children are the sequential draws `accept_sampled` judges."""
    depths = shape.depths()
    tokens, parents = [int(shape.tokens[0])], [-1]
    new_index: dict[int, int] = {0: 0}
    drawn: dict[int, list[int]] = {}
    for node in range(1, len(shape)):
        parent = new_index.get(int(shape.parents[node]))
        if parent is None or depths[node] > len(q):
            continue
        row = np.array(q[depths[node] - 1], np.float64)
        row[drawn.get(parent, [])] = 0.0
        if not row.sum() > 0:
            continue
        token = int(sample(row, rng))
        drawn.setdefault(parent, []).append(token)
        new_index[node] = len(tokens)
        tokens.append(token)
        parents.append(parent)
    return TokenTree(np.array(tokens, np.int32), np.array(parents, np.int32),
                     np.array([Source.ROOT] + [Source.DRAFTER] * (len(tokens) - 1), np.int8))


def accept_sampled(tree: TokenTree, p: Callable[[int], np.ndarray], q: np.ndarray,
                   rng: np.random.Generator) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over `tree` (SpecInfer's recursive rejection, the
    candidates drawn without replacement): (the accepted nodes, root's child first; the token
    after them). From the root, a node's children are judged in order: child i, drawn from q_i
    (its depth's q without its elder siblings' tokens, renormalised), is accepted when
    u * q_i(x_i) < p_i(x_i), p_1 = p(node), the target's distribution after the node's path; on
    rejection p_{i+1} = max(0, p_i - q_i), normalised. An accepted child becomes the node; when
    every child is rejected, or there is none, the token is drawn from the last p_i. Each test
    is the rejection rule's lemma, so the output is distributed as the target's own sampling.
    One uniform per child judged, then one for the token (Swift's acceptTree, the same rule)."""
    children = tree.children()
    depths = tree.depths()
    path, node = [], 0
    while True:
        target = np.asarray(p(node), np.float64)
        drawn: list[int] = []
        accepted = None
        for child in children[node]:
            proposal = np.array(q[depths[child] - 1], np.float64)
            proposal[drawn] = 0.0
            proposal /= proposal.sum()
            x = int(tree.tokens[child])
            if rng.random() * proposal[x] < target[x]:
                accepted = child
                break
            drawn.append(x)
            residual = np.maximum(target - proposal, 0.0)
            if residual.sum() > 0:  # else target == proposal up to rounding: keep it
                target = residual / residual.sum()
        if accepted is None:
            return path, int(sample(target, rng))
        path.append(accepted)
        node = accepted


def compact_tree_rows(states: Sequence[np.ndarray], base: int, path: Sequence[int]) -> None:
    """After a tree call whose node i was written at position base + i (models' forward with
    a tree_mask), moves the accepted path's cache rows to their own positions: node path[j - 1]
    to base + j, for j = 1..len(path), in place, in each of `states` (the target's KV caches,
    [..., capacity, head_dim]: position p in slot p % capacity, for a global cache and a ring
    alike). Path nodes come in ascending order, each at or after its depth, so a row is read
    before any move overwrites it. A chain's path needs no move."""
    for array in states:
        capacity = array.shape[-2]
        for depth, node in enumerate(path, start=1):
            if node != depth:
                array[..., (base + depth) % capacity, :] = array[..., (base + node) % capacity, :]
