"""The data of //:train_drafter (training/trainer.py): prompts in, the target's own replies out.

Prompts come from a file (`read_prompts`: JSONL of chat messages, or plain text, one prompt a
line), from the built-in chat prompts (training/chat_prompts.py) when the target has a chat
template, or, for a target without a tokenizer (the tiny random test pairs), seeded random
token ids. Each conversation is rendered with the target's own chat template; the target
continues it greedily to the row length through the batched entry points
(distil_corpus.generate_corpus_ragged), keeping the layer outputs the drafter's encoder reads.
Optionally the target's top-k next-token probabilities are kept beside every token
(`soft_targets`) for the soft-target loss.

A corpus is cached in one file (`cached_rows`) keyed by everything it depends on; every rank
reads it memory-mapped, so ranks on one machine share its pages.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from museflash.training import distil_corpus as distil

# The features the encoder reads are kept in fp16 (distil_corpus.CORPUS_CAPTURE_DTYPE).
CAPTURE_DTYPE = distil.CORPUS_CAPTURE_DTYPE
MIN_REPLY = 8  # a prompt leaves at least this many tokens of its row to the target's reply


@dataclass
class Rows:
    """A distillation corpus (distil_corpus.Corpus's fields) and, for soft targets, the target's
    top-k next-token distribution at every position: soft_ids/soft_probs [N, L, k], position p
    holding the target's distribution for token p (its prediction after tokens 0..p-1;
    position 0 is unused)."""
    corpus: distil.Corpus
    soft_ids: torch.Tensor | None = None
    soft_probs: torch.Tensor | None = None


def read_prompts(path: Path) -> list[list[dict[str, str]]]:
    """Conversations from a prompts file: `.jsonl`, one JSON value a line, either a list of
    {"role", "content"} messages, an object with such a list under "messages", or an object
    with a "prompt" string; any other file, one plain-text prompt a line. Blank lines are
    skipped. A conversation whose last message is the assistant's loses that message: the
    target writes the reply itself."""
    path = Path(path)
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            conversations.append([{"role": "user", "content": line}])
            continue
        value = json.loads(line)
        if isinstance(value, dict):
            value = value.get("messages", [{"role": "user", "content": value.get("prompt")}])
        if (not isinstance(value, list) or not value
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                           and isinstance(m.get("role"), str) for m in value)):
            raise ValueError(f"{path}:{number}: not a list of {{role, content}} messages, nor "
                             "an object with `messages` or `prompt`")
        if value[-1]["role"] == "assistant":
            value = value[:-1]
        if value:
            conversations.append([{"role": m["role"], "content": m["content"]} for m in value])
    if not conversations:
        raise ValueError(f"{path}: no prompts")
    return conversations


def render(target_dir: Path, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Each conversation in the target's chat template (generation prompt added), in ids."""
    from tokenizers import Tokenizer

    from museflash.checkpoint.chat_template import read_chat_template, render_chat

    found = read_chat_template(target_dir)
    if found is None:
        raise ValueError(f"{target_dir} has no chat template to render the prompts with")
    template, special = found
    tokenizer = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    return [tokenizer.encode(render_chat(template, messages, special_tokens=special),
                             add_special_tokens=False).ids for messages in conversations]


def builtin_conversations(count: int, seed: int, held_out: bool) -> list[list[dict[str, str]]]:
    """The built-in chat prompts (chat_prompts.py): training ones, or the hand-written
    evaluation prompts and the held-out files' function prompts, which never train."""
    from museflash.training import chat_prompts

    if held_out:
        texts = list(chat_prompts.EVAL_PROMPTS) + chat_prompts.held_out_prompts(count, seed)
    else:
        texts = chat_prompts.training_prompts(count, seed)
    return [[{"role": "user", "content": text}] for text in texts[:count]]


def fitting(prompts: list[list[int]], length: int) -> list[list[int]]:
    """The prompts that leave MIN_REPLY tokens of a `length`-token row to the reply."""
    return [p for p in prompts if 1 <= len(p) <= length - MIN_REPLY]


def checkpoint_digest(target_dir: Path) -> str:
    """What identifies a target checkpoint cheaply: its config and the names and sizes of its
    weight files (hashing many GB of weights on every start would cost minutes)."""
    target_dir = Path(target_dir)
    parts = [(target_dir / "config.json").read_text()]
    parts += [f"{p.name}:{p.stat().st_size}" for p in sorted(target_dir.glob("*.safetensors"))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def soft_targets(target, corpus: distil.Corpus, top_k: int,
                 chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next-token probabilities (renormalised over the k) at every position
    of every row, from one batched pass of the target over the whole row (position p holds the
    distribution of token p; position 0 repeats position 1's, unused). ids int32, probs fp16."""
    rows, length = corpus.tokens.shape
    ids = torch.zeros((rows, length, top_k), dtype=torch.int32)
    probs = torch.zeros((rows, length, top_k), dtype=torch.float16)
    with torch.no_grad():
        for first in range(0, rows, chunk):
            tokens = corpus.tokens[first:first + chunk]
            caches = distil.fresh_caches(target, distil.TARGET_CACHES, tokens.shape[0])
            hidden, _ = distil.batched_hidden_states(target, caches, tokens.to(torch.int32), 0)
            top = torch.softmax(target.logits(hidden[:, :-1]).float(), dim=-1).topk(top_k)
            values = top.values / top.values.sum(dim=-1, keepdim=True)
            ids[first:first + chunk, 1:] = top.indices.to(torch.int32)
            probs[first:first + chunk, 1:] = values.to(torch.float16)
    ids[:, 0], probs[:, 0] = ids[:, 1], probs[:, 1]
    return ids, probs


def cached_rows(path: Path, key: dict[str, Any], make, log=print) -> tuple[Rows, float]:
    """(rows, seconds their making took): `path` read (memory-mapped) when it was made with the
    same `key`, else `make()` run and saved there first."""
    text = json.dumps(key, sort_keys=True)
    path = Path(path)
    if path.is_file():
        saved = torch.load(path, weights_only=True, mmap=True)
        if saved.get("key") == text:
            log(f"[data] read {path} (made in {float(saved['seconds']):.0f} s by an earlier run)")
            return (Rows(distil.Corpus(saved["tokens"], saved["captured"], saved["starts"]),
                         saved.get("soft_ids"), saved.get("soft_probs")),
                    float(saved["seconds"]))
        log(f"[data] {path} was made with other settings; making it anew")
    began = time.monotonic()
    rows = make()
    seconds = time.monotonic() - began
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = {"key": text, "seconds": seconds, "tokens": rows.corpus.tokens,
             "captured": rows.corpus.captured, "starts": rows.corpus.starts}
    if rows.soft_ids is not None:
        saved.update(soft_ids=rows.soft_ids, soft_probs=rows.soft_probs)
    partial = path.with_suffix(".partial")
    torch.save(saved, partial)
    partial.replace(path)
    log(f"[data] made {path} in {seconds:.0f} s")
    return cached_rows(path, key, make, lambda _line: None)  # the memory-mapped copy


def make_rows(target, prompts: list[list[int]], length: int, soft_top_k: int | None) -> Rows:
    """The target's greedy continuations of `prompts` to `length` tokens (rows ordered by
    prompt length), with their soft targets when `soft_top_k` is given."""
    corpus = distil.generate_corpus_ragged(target, prompts, length, capture_dtype=CAPTURE_DTYPE)
    if not soft_top_k:
        return Rows(corpus)
    return Rows(corpus, *soft_targets(target, corpus, soft_top_k))
