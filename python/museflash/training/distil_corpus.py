"""The distillation corpus of the demo drafters: prompts from the target's training files, the
target's own greedy continuations with the layer outputs its drafter reads, generated batched
through the models' own entry points (torch.func.vmap) and checked against the
one-sequence-at-a-time path, and cached between runs. train_demo_drafter (DFlash) and
train_demo_dflash2 (DFlash2) train on it; train_demo_drafter's docstring says how.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from museflash.bundle import StateName
from museflash.checkpoint.load import load_drafter, load_target
from museflash.models.dflash import DFlashDrafter

MAX_CONTEXT = 256
MAX_QUERY = 128
# The training corpus keeps the target's layer outputs (the encoder's inputs) in fp16, the
# precision the device computes them in: half the memory of fp32 (3.2 GB for 32768 rows).
CORPUS_CAPTURE_DTYPE = torch.float16


@dataclass
class Corpus:
    tokens: torch.Tensor  # [N, L] int64: prompt followed by the target's greedy continuation
    captured: torch.Tensor  # [N, L, layers * hidden]: target layer outputs feeding the encoder
    starts: torch.Tensor  # [N]: first generated position of each row (its prompt length)


def load_pair(target_dir: Path, drafter_dir: Path, *, max_context: int = MAX_CONTEXT,
              max_query: int = MAX_QUERY, drafter_cache_dtype: torch.dtype = torch.float32):
    """fp32 fused target and drafter with fp32 caches (eager reference numerics; training
    gives the drafter fp16 ring caches, see `train`). The caches hold `max_context` positions
    and take queries of up to `max_query` tokens."""
    target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=max_context,
                         max_query_len=max_query, cache_dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=torch.float32,
                           max_query_len=max_query, cache_dtype=drafter_cache_dtype)
    return target, drafter


def random_prompts(count: int, length: int, vocab: int, mask_token_id: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, (count, length))
    prompts[prompts == mask_token_id] = 0
    return prompts.tolist()


def document_prompts(documents: list[list[int]], count: int, length: int,
                     seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens of `documents`, at uniformly random token positions
    over all of them (a window may start at a document's `<bos>`)."""
    usable = [doc for doc in documents if len(doc) >= length]
    if not usable:
        raise ValueError(f"no document has {length} tokens")
    starts = np.array([len(doc) - length + 1 for doc in usable], dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(usable), size=count, p=starts / starts.sum())
    return [usable[i][start:start + length]
            for i, start in zip(picks, (rng.integers(0, starts[i]) for i in picks),
                                strict=True)]


# A line a user might start a program with (`def fibonacci(n):`): a function or class header.
DEFINITION_LINE = re.compile(r"(?:async\s+)?(?:def|class)\s+\w")


def definition_lines(texts: list[str]) -> list[str]:
    """Every line of `texts` that starts a function or class definition, without its
    indentation, in order (repeats kept: common headers weigh as often as they occur)."""
    return [line.strip() for text in texts for line in text.splitlines()
            if DEFINITION_LINE.match(line.lstrip())]


def line_prompts(tokenizer, texts: list[str], count: int, max_length: int, bos: int,
                 seed: int) -> list[list[int]]:
    """`count` prompts `<bos>` + a definition line of `texts` (seeded picks), cut to
    `max_length` tokens: the shape of a prompt typed by a user, which starts a sequence."""
    lines = definition_lines(texts)
    if not lines:
        raise ValueError("no definition line (def/class) in the texts")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(lines), size=count, replace=count > len(lines))
    encoded = tokenizer.encode_batch([lines[i] for i in picks], add_special_tokens=False)
    return [[bos, *e.ids[:max_length - 1]] for e in encoded]


def generate_corpus(target, prompts: list[list[int]], length: int) -> Corpus:
    """Each prompt continued greedily by the target up to `length` tokens in all, one sequence
    at a time: the prompt in one `hidden_states` call, then one token per call, each call's
    `target_layer_ids` outputs kept as the encoder inputs of the positions it fed (the last
    token is fed too, for its encoder input)."""
    rows, captures = [], []
    with torch.no_grad():
        for prompt in prompts:
            target.reset_caches()
            tokens, start, fed = list(prompt), 0, []
            ids = torch.tensor([tokens], dtype=torch.int32)
            while True:
                positions = torch.arange(start, start + ids.shape[1], dtype=torch.int32)
                hidden, captured = target.hidden_states(ids, positions, target.target_layer_ids)
                fed.append(torch.cat(captured, dim=-1)[0])
                start += ids.shape[1]
                if start >= length:
                    break
                tokens.append(int(torch.argmax(target.logits(hidden[:, -1:])[0, -1])))
                ids = torch.tensor([tokens[-1:]], dtype=torch.int32)
            rows.append(tokens)
            captures.append(torch.cat(fed))
    return Corpus(torch.tensor(rows), torch.stack(captures),
                  torch.tensor([len(p) for p in prompts]))


# --- The models' own entry points, batched --------------------------------------------------
# The models run one sequence at a time and write their caches in place (the form Core ML
# converts). Training and corpus generation run them unchanged for many sequences at once:
# torch.func.vmap over the real entry points, each sequence with its own caches (passed in
# through functional_call). There is no second copy of the maths here.

TARGET_CACHES = tuple(name.value for name in (
    StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE,
    StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE))
DRAFTER_CACHES = DFlashDrafter.cache_names


class _Method(nn.Module):
    """Calls one method of `module`; `module` is a submodule so that functional_call can hand
    it other caches (buffers named `module.<cache>`)."""

    def __init__(self, module: nn.Module, method: str):
        super().__init__()
        self.module = module
        self.method = method

    def forward(self, *args):
        return getattr(self.module, self.method)(*args)


def fresh_caches(module: nn.Module, names: tuple[str, ...], batch: int) -> dict[str, torch.Tensor]:
    """Zeroed caches for `batch` sequences, keyed for functional_call on a `_Method`: those of
    `names` the module has (a target without sliding layers has no sliding ring)."""
    buffers = dict(module.named_buffers())
    return {f"module.{name}": torch.zeros((batch, *buffers[name].shape),
                                          dtype=buffers[name].dtype)
            for name in names if name in buffers}


def batched_hidden_states(target, caches: dict[str, torch.Tensor], ids: torch.Tensor,
                          start: int | torch.Tensor, capture: tuple[int, ...] = ()):
    """`target.hidden_states` of every row of ids [B, T] at positions start..start+T-1, each row
    with its own caches (`fresh_caches`, written in place); `start` is one int for all rows or
    a tensor [B], each row's own. Returns the final hidden state [B, T, H] and the outputs of
    the `capture` layers, [B, T, H] each."""
    first = torch.as_tensor(start, dtype=torch.int32).reshape(-1, 1)
    positions = (first + torch.arange(ids.shape[1], dtype=torch.int32)).expand(ids.shape[0], -1)
    method = _Method(target, "hidden_states")

    def one(row_caches, row_ids, row_positions):
        hidden, captured = functional_call(method, row_caches,
                                           (row_ids[None], row_positions, capture))
        return hidden[0], [c[0] for c in captured]

    return vmap(one)(caches, ids, positions)


def draft_blocks(drafter, features: torch.Tensor, ctx_positions: torch.Tensor,
                 block_ids: torch.Tensor, block_positions: torch.Tensor,
                 method: str = "draft") -> torch.Tensor:
    """What the app does for one block, for B blocks at once: on fresh caches, the drafter's
    `inject_kv` of the context features [B, C, H] at ctx_positions [B, C] (C may be 0), then its
    `draft` of block_ids [B, K] at block_positions [B, K]. Returns logits [B, K, vocab] (or
    what `method` returns instead of `draft`, e.g. DFlash2's `_draft_hidden`); differentiable
    in the drafter's weights and in the features."""
    inject, draft = _Method(drafter, "inject_kv"), _Method(drafter, method)
    with_context = features.shape[1] > 0

    def one(row_caches, row_features, row_ctx, row_ids, row_positions):
        if with_context:
            functional_call(inject, row_caches, (row_features[None], row_ctx))
        return functional_call(draft, row_caches, (row_ids[None], row_positions))[0]

    caches = fresh_caches(drafter, DRAFTER_CACHES, block_ids.shape[0])
    return vmap(one)(caches, features, ctx_positions.to(torch.int32), block_ids.to(torch.int32),
                     block_positions.to(torch.int32))


def generate_corpus_batched(target, prompts: list[list[int]], length: int,
                            chunk: int = 512,
                            capture_dtype: torch.dtype = torch.float32) -> Corpus:
    """`generate_corpus` for many prompts of one length at once: the same calls of the target's
    own `hidden_states` and `logits`, each row with its own caches; the encoder inputs kept as
    `capture_dtype`. `check_batched_generation` compares the two."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("batched generation needs prompts of one length")
    rows, captures = [], []
    with torch.no_grad():
        for first in range(0, len(prompts), chunk):
            tokens = torch.tensor(prompts[first:first + chunk])
            caches = fresh_caches(target, TARGET_CACHES, tokens.shape[0])
            step_ids, start, fed = tokens, 0, []
            while True:
                hidden, captured = batched_hidden_states(target, caches, step_ids, start,
                                                         target.target_layer_ids)
                fed.append(torch.cat(captured, dim=-1))
                start += step_ids.shape[1]
                if start >= length:
                    break
                step_ids = target.logits(hidden[:, -1:]).argmax(dim=-1)
                tokens = torch.cat([tokens, step_ids], dim=1)
            rows.append(tokens)
            captures.append(torch.cat(fed, dim=1).to(capture_dtype))
    return Corpus(torch.cat(rows), torch.cat(captures),
                  torch.full((len(prompts),), len(prompts[0])))


def generate_corpus_ragged(target, prompts: list[list[int]], length: int, chunk: int = 256,
                           capture_dtype: torch.dtype = torch.float32) -> Corpus:
    """`generate_corpus_batched` for prompts of several lengths, rows ordered by prompt length
    (then as given), each row's `starts` its own prompt length: rows of several prompt lengths
    decode together, each at its own positions. Chunks of `chunk` rows in that order; in a
    chunk, each prompt length's rows take their prompt in one call, then every row takes one
    token per call. A row that has reached `length` is fed again at its last position until the
    chunk's shortest prompt has too; what that call computes is thrown away (its cache is not
    read again). The encoder inputs go straight into one [N, length, width] tensor."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    starts = torch.tensor([len(prompts[i]) for i in order], dtype=torch.int64)
    if len(prompts) and (int(starts[0]) < 1 or int(starts[-1]) >= length):
        raise ValueError(f"prompts must hold 1 to {length - 1} tokens to be continued to {length}")
    layers = target.target_layer_ids
    width = len(layers) * target.config.hidden_size
    tokens = torch.zeros((len(prompts), length), dtype=torch.int64)
    captured = torch.empty((len(prompts), length, width), dtype=capture_dtype)
    with torch.no_grad():
        for first in range(0, len(prompts), chunk):
            rows = order[first:first + chunk]
            lengths = starts[first:first + len(rows)]
            caches = fresh_caches(target, TARGET_CACHES, len(rows))
            last = torch.empty((len(rows), 1, target.config.hidden_size))
            for n in lengths.unique().tolist():  # the rows of one length are consecutive
                a = int(torch.searchsorted(lengths, n))
                b = int(torch.searchsorted(lengths, n, right=True))
                ids = torch.tensor([prompts[i] for i in rows[a:b]])
                part = {name: cache[a:b] for name, cache in caches.items()}
                hidden, fed = batched_hidden_states(target, part, ids, 0, layers)
                tokens[first + a:first + b, :n] = ids
                captured[first + a:first + b, :n] = torch.cat(fed, dim=-1).to(capture_dtype)
                last[a:b] = hidden[:, -1:]
            step_ids = target.logits(last).argmax(dim=-1)
            positions = lengths.clone()
            while bool((positions < length).any()):
                live = (positions < length).nonzero().flatten()
                tokens[first + live, positions[live]] = step_ids[live, 0]
                hidden, fed = batched_hidden_states(target, caches, step_ids,
                                                    positions.clamp(max=length - 1), layers)
                captured[first + live, positions[live]] = (
                    torch.cat(fed, dim=-1)[live, 0].to(capture_dtype))
                step_ids = target.logits(hidden).argmax(dim=-1)
                positions += 1
    return Corpus(tokens, captured, starts)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_corpus(path: Path | None, key: dict[str, Any], make, log=print) -> tuple[Corpus, float]:
    """(corpus, seconds its generation took): read from `path` when it holds a corpus made
    with the same `key` (the target's weights and every setting the generation depends on),
    else made by `make()` and, with a `path`, saved there for the next run."""
    text = json.dumps(key, sort_keys=True)
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("key") == text:
            log(f"[train] corpus read from {path} (generated in "
                f"{saved['generation_seconds']:.0f} s by an earlier run)")
            return (Corpus(saved["tokens"], saved["captured"], saved["starts"]),
                    float(saved["generation_seconds"]))
        log(f"[train] {path} holds a corpus made with other settings; generating anew")
    began = time.monotonic()
    corpus = make()
    seconds = time.monotonic() - began
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"key": text, "generation_seconds": seconds, "tokens": corpus.tokens,
                    "captured": corpus.captured, "starts": corpus.starts}, path)
    return corpus, seconds


def check_batched_generation(target, prompts: list[list[int]], length: int) -> float:
    """Runs both generators on `prompts`; raises unless the tokens are identical and the encoder
    inputs agree. Returns the encoder inputs' max relative difference."""
    single = generate_corpus(target, prompts, length)
    batched = generate_corpus_batched(target, prompts, length)
    if not torch.equal(single.tokens, batched.tokens):
        rows = (single.tokens != batched.tokens).any(dim=1).nonzero().flatten().tolist()
        raise RuntimeError(f"batched generation differs from generate_corpus on rows {rows}")
    error = float((single.captured - batched.captured).abs().max()
                  / single.captured.abs().max())
    if error > 1e-4:
        raise RuntimeError(f"batched encoder inputs differ from generate_corpus ({error:.2e})")
    return error
