"""Tokens per target call of tree verification, by node budget and candidate source (issue 64).

A greedy tree step accepts the longest path of the tree that the target's greedy tokens follow,
and adds the target's own token after it. The tokens a step gains therefore depend only on the
tree and on the target's greedy continuation, not on how the target computes the tree's rows:
this tool decodes each held-out chat prompt with the target alone (eager, fp32), then replays
the decode step by step, building each step's tree from that step's draft call (the drafter's
ring fed the target's features at the accepted positions, as the engine feeds it) and walking
it against the known continuation. The figure does not depend on the machine.

The recycled table (tree.RecycledTable) learns, here, only from the rows of the accepted path:
a tree call also returns its rejected nodes' rows, which the engine can add. So the recycled
figures are a floor. The table starts empty for each prompt.

Prints, per budget, tokens per target call for each source and all together, and the width-1
chain of the drafter's argmax (today's loop, with the same draft rows) beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from museflash.runtime.speculative import (
    LOOKUP_MAX_MATCH,
    LOOKUP_WINDOW,
    EagerDrafter,
    eager_greedy_generate,
    inject_starts,
    lookup_proposal,
)
from museflash.runtime.tree import RecycledTable, TokenTree, accept_greedy, build_tree

SOURCES = ("chain", "drafter", "recycled", "lookup", "all")
DEFAULT_BUDGETS = (1, 4, 8, 16, 32)
LOOKUP_MIN_MATCH = 2


@dataclass
class Replay:
    """One prompt's target-alone decode: the ids, and the target's features and logits at
    every position (row p: after the id at p)."""
    prompt_length: int
    decoded: int  # the tokens a replay decodes; the continuation holds a block more
    ids: list[int]  # prompt + greedy continuation
    features: np.ndarray  # [len(ids), width]
    logits: np.ndarray  # [len(ids), vocab]


@dataclass
class Tally:
    tokens: int = 0
    calls: int = 0
    accepted: list[int] = field(default_factory=list)

    @property
    def per_call(self) -> float:
        return self.tokens / self.calls if self.calls else 0.0


def replay(target: torch.nn.Module, prompt: list[int], new_tokens: int, block: int,
           chunk: int) -> Replay:
    """The target's greedy continuation of `prompt` (new_tokens and a block more, so that
    every tree of the last step has known choices), then one pass over it for every
    position's features and logits (in chunks of `chunk` positions, the model's longest
    query)."""
    continuation = eager_greedy_generate(target, prompt, new_tokens + block)
    ids = list(prompt) + continuation
    target.reset_caches()
    features, logits = [], []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            out_logits, out_features = target(
                torch.tensor([part], dtype=torch.int32),
                torch.arange(start, start + len(part), dtype=torch.int32))
            logits.append(out_logits[0].float().numpy())
            features.append(out_features[0].float().numpy())
    return Replay(len(prompt), new_tokens, ids, np.concatenate(features),
                  np.concatenate(logits))


def simulate(run: Replay, drafter, block: int, mask_token_id: int, budget: int, source: str,
             tally: Tally) -> None:
    """Replays the decode of `run` with trees of `budget` nodes from `source` (SOURCES)."""
    ids, start = run.ids, run.prompt_length
    drafter = EagerDrafter(drafter, block)
    drafter.reset()

    def inject(positions: np.ndarray) -> None:
        drafter.inject(run.features[positions], positions)

    for first in inject_starts(start, block):
        inject(np.arange(first, first + block))
    table = RecycledTable()
    anchor = start  # the anchor's position: its id is the prefill's choice
    end = start + run.decoded
    while anchor < end:
        rows = None
        if source != "recycled" and source != "lookup":
            rows = drafter.draft(np.array([ids[anchor]] + [mask_token_id] * (block - 1)),
                                 np.arange(anchor, anchor + block)).logits[1:]
        copied = None
        if source in ("lookup", "all"):
            copied = lookup_proposal(ids[max(0, anchor + 1 - LOOKUP_WINDOW - LOOKUP_MAX_MATCH):
                                         anchor + 1], block - 1, LOOKUP_MIN_MATCH)
        if source == "chain":
            tree = TokenTree.chain(ids[anchor],
                                   np.argmax(rows[:budget - 1], axis=-1).tolist())
        else:
            tree = build_tree(ids[anchor], budget,
                              draft_logits=rows if source in ("drafter", "all") else None,
                              recycled=table if source in ("recycled", "all") else None,
                              lookup=copied, max_depth=block - 1)
        # The target's choice after each node on the path its greedy tokens take is the next
        # of those tokens; the walk never reaches a node off that path.
        path, _ = accept_greedy(tree, [ids[anchor + 1 + d] for d in tree.depths()])
        accepted = len(path)
        tally.calls += 1
        tally.tokens += accepted + 1
        tally.accepted.append(accepted)
        last = anchor + accepted
        table.update(ids[anchor:last + 1], run.logits[anchor:last + 1])
        first = max(0, last - block + 1)
        inject(np.arange(first, first + block))
        anchor = last + 1


class TreeFiguresError(ValueError):
    """A pair or a setting the figures cannot be measured with."""


def measure(builtin: str, prompts: int, new_tokens: int, budgets: Sequence[int],
            block: int | None, log: Callable[[str], None] = print) -> dict:
    """The figures of a built-in pair with a chat template, on its first `prompts` held-out
    chat prompts (training/chat_prompts.py EVAL_PROMPTS, which no drafter trained on)."""
    from museflash.builtin.demo_checkpoint import builtin_checkpoints
    from museflash.training.chat_prompts import EVAL_PROMPTS
    from museflash.training.train_smollm2_drafter import chat_ids

    with builtin_checkpoints(builtin) as (target_dir, drafter_dir):
        try:
            ids = chat_ids(target_dir, list(EVAL_PROMPTS[:prompts]))
        except ValueError as error:
            raise TreeFiguresError(f"--builtin {builtin}: {error}") from error
        return figures(target_dir, drafter_dir, ids, new_tokens, budgets, block, log)


def figures(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], new_tokens: int,
            budgets: Sequence[int], block: int | None,
            log: Callable[[str], None] = print) -> dict:
    """`block`: the draft call's length (the deepest node is block - 1 below the root), by
    default the drafter's own block."""
    from museflash.training.distil_corpus import load_pair

    chunk = 128
    longest = max(len(p) for p in prompts) + new_tokens
    target, drafter = load_pair(target_dir, drafter_dir,
                                max_context=-(-(longest + chunk) // 32) * 32, max_query=chunk)
    mask = drafter.config.mask_token_id
    block = block or drafter.config.block_size
    if not 2 <= block <= min(drafter.config.block_size, chunk):
        raise TreeFiguresError(f"--block {block} is not in 2..{drafter.config.block_size}, "
                               "the drafter's block")
    tallies = {(b, s): Tally() for b in budgets for s in SOURCES}
    began = time.perf_counter()
    for index, prompt in enumerate(prompts):
        run = replay(target, prompt, new_tokens, block, chunk)
        for budget in budgets:
            for source in SOURCES:
                simulate(run, drafter, block, mask, budget, source, tallies[budget, source])
        log(f"prompt {index + 1}/{len(prompts)} ({len(prompt)} ids) done, "
            f"{time.perf_counter() - began:.0f} s")
    return {"budgets": list(budgets), "sources": list(SOURCES), "block": block,
            "prompts": len(prompts), "new_tokens": new_tokens,
            "tokens_per_call": {f"{b}": {s: round(tallies[b, s].per_call, 3) for s in SOURCES}
                                for b in budgets}}


def table(report: dict) -> str:
    lines = ["| budget | " + " | ".join(report["sources"]) + " |",
             "| --- | " + " | ".join("---" for _ in report["sources"]) + " |"]
    for budget in report["budgets"]:
        row = report["tokens_per_call"][f"{budget}"]
        lines.append(f"| {budget} | " + " | ".join(f"{row[s]:.2f}" for s in report["sources"])
                     + " |")
    return "\n".join(lines)
