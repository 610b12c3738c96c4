"""Distil the demo DFlash drafter from the trained demo target (self-distillation), on CPU.

    ./bazelw run //:train_demo_drafter -- --output-dir DIR [--target-dir demo/target]
        [--train-steps 4000 | --train-seconds S] [--layers 3] [--window 32]
        [--sequences 8192] [--line-prompts N] [--corpus-cache FILE]

Target: a Muse Glimmer checkpoint with its tokenizer (default: the trained demo target
committed under demo/target, made by //:train_demo from the Python standard library's sources).
The drafter is built for it: the target's hidden size and head geometry, `mask_token_id` the
tokenizer's `<mask>`, `target_layer_ids` spread over the target's depth, block_size 16 (the
weights do not depend on the block size: training mixes K = 4, 8 and 16, and the same weights
are measured at each K with the config's block_size set to it). Its layers and the encoder
start from a seeded random initialisation; the embedding and lm_head are borrowed from the
target and stay frozen.

Data: prompts from the TRAINING files of the target's corpus (train_demo's split by file;
`<bos>` + text + `<eos>` per file, as the target saw them) of two kinds: windows at random
places (`document_prompts`), and `<bos>` + a function or class header line (`line_prompts`:
the shape of a prompt a user types, `def fibonacci(n):`, whose continuation starts a sequence).
Each is continued greedily by the target itself to one length (eager torch, fp32, rows of every
prompt length batched together with `generate_corpus_ragged`; the batched path is checked
token-for-token against the one-sequence-at-a-time `generate_corpus` at every run);
`--corpus-cache` keeps the result for later runs with the same settings (and for
//:train_demo_dflash2). For an anchor position a of
a continuation the drafter sees what it sees at run time: the target features injected for the
context positions inside its window (fewer near the prompt's start), and the block
[token_a, MASK x (K-1)]; it learns to predict the target's next K-1 tokens.

Everything runs through the models' own code (museflash.models): the target's `hidden_states` /
`logits` and the drafter's `inject_kv` / `draft`, batched with torch.func.vmap (each sequence or
block with its own caches), so there is no second copy of the maths here. The batched drafting
is checked against the drafter's inject_kv + draft on single blocks before training.

Writes DIR/drafter (config.json, model.safetensors in bf16: the real checkpoint layout, block
size 16) and DIR/train_demo_drafter.json, and reports acceptance for K = 4, 8, 16 before and
after training on prompts from the HELD-OUT files (never trained on, by the target or the
drafter), two ways:
  loop            the speculative loop (runtime/speculative.py) over EAGER torch modules loaded
                  from the written bf16 checkpoint with block_size K (not an export), greedy and
                  sampled at temperature 0.7 (rejection sampling; a seeded numpy Generator) on
                  windows, and greedy on `<bos>` + definition-line prompts;
  teacher-forced  the batched inject_kv + draft at anchors of held-out greedy continuations:
                  what the greedy loop would accept from each anchor, all anchors alike.
  acceptance      = mean over steps (anchors) of (drafted tokens accepted) / (K - 1)
  accepted length = mean drafted tokens accepted per step (the target's own token not counted)

The functions also serve the tiny random demo pair (tests/python/test_speculative.py fits a
drafter to it with `load_pair`, `generate_corpus`, `train` and `write_drafter`) and the DFlash2
distillation (training/train_demo_dflash2.py).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from museflash.checkpoint.configs import check_configs, read_config
from museflash.checkpoint.load import drafter_checkpoint_tensors
from museflash.checkpoint.tensor_files import write_safetensors
from museflash.models.dflash import DFlashConfig, DFlashDrafter, DFlashEncoder
from museflash.runtime.sampling import Sampling
from museflash.runtime.speculative import (
    Drafted,
    EagerDrafter,
    EagerTarget,
    speculative_generate,
)
from museflash.training.distil_corpus import (
    CORPUS_CAPTURE_DTYPE,
    MAX_CONTEXT,
    Corpus,
    cached_corpus,
    check_batched_generation,
    document_prompts,
    draft_blocks,
    file_sha256,
    generate_corpus_batched,
    generate_corpus_ragged,
    line_prompts,
    load_pair,
)

UPSTREAM_ACCEPTANCE = {4: 0.64, 8: 0.30, 16: 0.17}
EVAL_BLOCKS = (4, 8, 16)
BLOCK_SIZE = 16  # the written drafter's block: the largest evaluated K
PROMPT_LENGTH = 16  # random prompts for the tiny random pair (tests)
SAMPLED_TEMPERATURE = 0.7


def default_target_dir() -> Path:
    from museflash.builtin.demo_checkpoint import TRAINED_DEMO_DIR

    return TRAINED_DEMO_DIR / "target"


def check_batched_drafting(target, drafter, corpus: Corpus, block: int = 4,
                           rows: int = 3) -> float:
    """Max difference, relative to the logits' scale, between `draft_blocks` on a batch of
    blocks and the drafter's own inject_kv + draft on each block alone; raises when they
    disagree (a batching mistake: caches shared between rows, rows mixed up, or context at
    negative positions that is not hidden: alone, a block gets only its real positions, as at
    run time; the first rows' anchors are the first generated positions)."""
    picked = torch.arange(min(rows, corpus.tokens.shape[0]))
    low, high = _anchor_range(corpus, picked, block)
    anchors = torch.minimum(low + picked, high - 1)  # a different position in every row
    worst = 0.0
    with torch.no_grad():
        (features, ctx_pos, ids, block_pos), _ = _blocks(target, drafter, corpus, picked,
                                                         anchors, block)
        batched = draft_blocks(drafter, features, ctx_pos, ids, block_pos)
        for i in range(len(picked)):
            drafter.reset_caches()
            real = ctx_pos[i] >= 0
            if real.any():
                drafter.inject_kv(features[i:i + 1, real], ctx_pos[i, real].to(torch.int32))
            alone = drafter.draft(ids[i:i + 1].to(torch.int32), block_pos[i].to(torch.int32))[0]
            worst = max(worst, float((batched[i] - alone).abs().max() / alone.abs().max()))
        drafter.reset_caches()
    if worst > 1e-4:
        raise RuntimeError(f"batched drafting disagrees with inject_kv + draft ({worst:.2e})")
    return worst


def context_length(config, block: int, sequence_length: int | None = None) -> int:
    """Injected positions a block of K sees before its anchor: the window - K before it when
    the window is the block's (DFlash v1, none when K fills it), the window - 1 its first
    query reaches with z-lab's window per query (|q - k| < window; DFlash2), and every earlier
    position of a `sequence_length` row for a full-attention drafter (no window)."""
    if config.sliding_window is None:
        if sequence_length is None:
            raise ValueError("a full-attention drafter sees every earlier position: give the "
                             "sequence length")
        return sequence_length - block
    if config.window_per_query:
        return config.sliding_window - 1
    return max(0, config.sliding_window - block)


def _blocks(target, drafter, corpus: Corpus, rows: torch.Tensor, anchors: torch.Tensor,
            block: int):
    """`draft_blocks` inputs and labels [B, K-1] for blocks at `anchors` of `rows`, with the
    context run time gives them: the injected positions inside the drafter's window
    (`context_length`). Near the start of a sequence some of them are negative: the ring mask
    hides those slots (a slot written with position p < 0 reads back as p, not >= 0), so such
    a block sees only the real positions, as at run time, and their (placeholder) features get
    no gradient."""
    ctx = context_length(drafter.config, block, corpus.tokens.shape[1])
    ctx_pos = anchors[:, None] + torch.arange(-ctx, 0)
    block_pos = anchors[:, None] + torch.arange(block)
    # The encoder is per position: run it once per distinct row, up to the last position any
    # of its blocks reads, and gather each block's context from that.
    distinct, which = torch.unique(rows, return_inverse=True)
    encoded = target.encoder([corpus.captured[distinct, :max(1, int(anchors.max()))]
                              .to(torch.float32)])
    features = encoded[which[:, None], ctx_pos.clamp(min=0)]
    ids = torch.full((len(rows), block), drafter.config.mask_token_id)
    ids[:, 0] = corpus.tokens[rows, anchors]
    labels = corpus.tokens[rows[:, None], block_pos[:, 1:]]
    return (features, ctx_pos, ids, block_pos), labels


def _anchor_range(corpus: Corpus, rows: torch.Tensor, block: int):
    """[low, high) of anchors: generated positions (the first one is the anchor of the first
    draft after the prompt) whose whole block lies inside the row."""
    low = corpus.starts[rows]
    return low, torch.full_like(low, corpus.tokens.shape[1] - block + 1)


def strided_anchors(corpus: Corpus, block: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, anchors): every `stride`-th anchor of every row of `corpus` whose block lies
    inside the row (each row's offset its index mod `stride`), for the held-out figures."""
    rows, anchors = [], []
    for row in range(corpus.tokens.shape[0]):
        low, high = _anchor_range(corpus, torch.tensor([row]), block)
        anchors.append(torch.arange(int(low) + row % stride, int(high), stride))
        rows.append(torch.full_like(anchors[-1], row))
    return torch.cat(rows), torch.cat(anchors)


def loss_decay(block: int) -> float:
    """Acceptance stops at the first miss, so early block positions matter most: position i
    (1-based) weighs exp(-(i - 1) / gamma), gamma growing with the block (DFlash's 7 for 16)."""
    return 7.0 if block >= 16 else 5.0 if block >= 8 else 4.0


def _decayed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                           block: int) -> torch.Tensor:
    """Cross-entropy of logits [B, K-1, V] against labels [B, K-1], position i (1-based)
    weighted exp(-(i - 1) / gamma) (`loss_decay`), averaged over the blocks."""
    decay = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / loss_decay(block))
    losses = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                         labels.reshape(-1), reduction="none")
    return (losses.reshape(len(labels), -1) * decay).sum() / (decay.sum() * len(labels))


def block_loss(target, drafter, corpus: Corpus, rows: torch.Tensor, anchors: torch.Tensor,
               block: int) -> torch.Tensor:
    """The drafted positions' cross-entropy against the target's tokens, position i (1-based)
    weighted exp(-(i - 1) / gamma) (`loss_decay`), averaged over the blocks."""
    inputs, labels = _blocks(target, drafter, corpus, rows, anchors, block)
    return _decayed_cross_entropy(draft_blocks(drafter, *inputs)[:, 1:], labels, block)


def vocabulary_block_loss(vocabulary: torch.Tensor):
    """`block_loss` with the softmax over `vocabulary` (token ids, every label among them)
    instead of the whole vocabulary: the tokens a corpus holds are a few thousand of a large
    model's tens of thousands, and the frozen lm_head over all of them is most of a step's
    cost. Tokens outside it get no push down: measure the result with the full lm_head (the
    acceptance figures do)."""
    vocabulary = torch.as_tensor(vocabulary).unique()
    index = torch.full((int(vocabulary.max()) + 1,), -1, dtype=torch.long)
    index[vocabulary] = torch.arange(len(vocabulary))

    def loss(target, drafter, corpus: Corpus, rows: torch.Tensor, anchors: torch.Tensor,
             block: int) -> torch.Tensor:
        inputs, labels = _blocks(target, drafter, corpus, rows, anchors, block)
        if int(labels.max()) >= len(index) or bool((index[labels] < 0).any()):
            raise ValueError("a label lies outside the loss's vocabulary: build it from the "
                             "corpus's tokens")
        hidden = draft_blocks(drafter, *inputs, method="_draft_hidden")[:, 1:]
        return _decayed_cross_entropy(drafter._logits(hidden, vocabulary), index[labels], block)

    return loss


def trained_parameters(target, drafter) -> list[nn.Parameter]:
    """The encoder (stored with the drafter, run inside the fused target) and every parameter
    of the drafter but the borrowed embedding and lm_head."""
    own = [p for name, p in drafter.named_parameters()
           if not name.startswith(("embed_tokens.", "lm_head."))]
    return list(target.encoder.parameters()) + own


def saved_tensor_copies(drafter):
    """What autograd needs around the drafter's entry points. Each drafter layer writes its
    ring cache in place after the previous layer read its own: with fp32 caches that read is a
    view of the same buffer, which autograd refuses unless the tensors it saved are copied when
    mutated (allow_mutation_on_saved_tensors, a dispatch mode that costs time on every op).
    With fp16 caches, the device's state dtype, a read is an fp32 copy and nothing is needed:
    autograd's version counters would still catch a saved tensor changed in place."""
    if drafter.caches[0].dtype == torch.float32:
        return torch.autograd.graph.allow_mutation_on_saved_tensors()
    return contextlib.nullcontext()


def train(target, drafter, corpus: Corpus, *, steps: int | None, seconds: float | None,
          batch: int = 64, lr: float = 3e-3, seed: int = 0, blocks: tuple[int, ...] = EVAL_BLOCKS,
          loss_fn=block_loss, anchors_per_row: int = 1, log=print) -> int:
    """Trains `trained_parameters` in place (the borrowed embedding and lm_head stay frozen)
    on `loss_fn` (`block_loss`) of batches of blocks. Stops after `steps` or `seconds`,
    whichever comes first; the learning rate warms up over the first 5% of that budget and
    decays linearly to 0 (by the elapsed fraction of it). Steps cycle through `blocks` (K),
    anchors uniform over the generated positions, `anchors_per_row` of them in each sampled
    row (the blocks of one row share its encoder pass: a cheaper step, less varied)."""
    generator = torch.Generator().manual_seed(seed)
    params = trained_parameters(target, drafter)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sequences = corpus.tokens.shape[0]
    began, step = time.monotonic(), 0
    total_planned = steps or 10**9
    window_losses: list[float] = []

    def progress() -> float:
        done = step / total_planned
        if seconds is not None:
            done = max(done, (time.monotonic() - began) / seconds)
        return done

    while progress() < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, 20 * progress()) * (1.0 - progress())
        block = blocks[step % len(blocks)]
        rows = torch.randint(0, sequences, (batch // anchors_per_row,),
                             generator=generator).repeat_interleave(anchors_per_row)
        low, high = _anchor_range(corpus, rows, block)
        anchors = low + (torch.rand(batch, generator=generator) * (high - low)).long()
        # Rows too short for this block keep their last whole block (prompt labels included).
        anchors = anchors.clamp(max=corpus.tokens.shape[1] - block)
        with saved_tensor_copies(drafter):
            loss = loss_fn(target, drafter, corpus, rows, anchors, block)
            optimizer.zero_grad()
            loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        window_losses.append(loss.item())
        if step % 100 == 0:
            log(f"[train] step {step}: loss {np.mean(window_losses):.3f} "
                f"({time.monotonic() - began:.0f} s)")
            window_losses.clear()
    for p in params:
        p.requires_grad_(False)
    return step


def teacher_forced_acceptance(target, drafter, corpus: Corpus, block: int, chunk: int = 256,
                              stride: int = 1) -> float:
    """Mean accepted/(K-1) over every `stride`-th anchor of `corpus` (`draft_blocks`, fp32
    weights): what the greedy speculative loop would accept from each anchor, all anchors
    weighted alike."""
    rows_all, anchors_all = [], []
    for row in range(corpus.tokens.shape[0]):
        low, high = _anchor_range(corpus, torch.tensor([row]), block)
        anchors_all.append(torch.arange(int(low) + row % stride, int(high), stride))
        rows_all.append(torch.full_like(anchors_all[-1], row))
    rows_all, anchors_all = torch.cat(rows_all), torch.cat(anchors_all)
    accepted = []
    with torch.no_grad():
        for first in range(0, len(rows_all), chunk):
            inputs, labels = _blocks(target, drafter, corpus, rows_all[first:first + chunk],
                                     anchors_all[first:first + chunk], block)
            hits = draft_blocks(drafter, *inputs)[:, 1:].argmax(dim=-1) == labels
            accepted.append(hits.long().cumprod(dim=1).sum(dim=1))
    return float(torch.cat(accepted).float().mean()) / (block - 1)


def write_drafter(target, drafter, source_dir: Path, out_dir: Path, block_size: int) -> Path:
    """The drafter checkpoint (bf16, the real layout) with `source_dir`'s config at
    `block_size`; the encoder weights come from the fused target."""
    config = read_config(source_dir)
    config["block_size"] = block_size
    write_safetensors(drafter_checkpoint_tensors(drafter, target.encoder), out_dir, config,
                      dtype="bf16")
    return out_dir


# --- A drafter for a trained target ----------------------------------------------------------


def spread_layer_ids(depth: int, count: int = 3) -> list[int]:
    """`count` target layers evenly spread from the second to the last (DFlash taps shallow to
    deep layers; the last one's output carries the target's next-token prediction)."""
    if depth < 2:
        return [0]
    return sorted({int(round(x)) for x in np.linspace(1, depth - 1, min(count, depth - 1))})


def drafter_config(target_dir: Path, *, layers: int, window: int,
                   target_layer_ids: list[int] | None = None,
                   block_size: int = BLOCK_SIZE,
                   mask_token_id: int | None = None) -> dict[str, Any]:
    """A flat DFlash config.json (like demo_checkpoint.TINY_DRAFTER_CONFIG) for the target in
    `target_dir`: its hidden size, heads and MLP width, `mask_token_id` or else the tokenizer's
    `<mask>` as mask token (the last vocabulary id when the checkpoint has no tokenizer, as in
    the random demo)."""
    checked = check_configs(target_dir)
    target = checked.target
    if mask_token_id is not None:
        mask = mask_token_id
    elif checked.tokenizer is not None:
        if "<mask>" not in checked.tokenizer.special_tokens:
            raise ValueError(f"{target_dir}: the tokenizer has no <mask> special token "
                             f"({sorted(checked.tokenizer.special_tokens)})")
        mask = checked.tokenizer.special_tokens["<mask>"]
    else:
        mask = target.vocab_size - 1
    thetas = [theta for theta in target.layer_rope_theta if theta] or [10000.0]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "dflash",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "rms_norm_eps": target.rms_norm_eps,
        "block_size": block_size,
        "mask_token_id": mask,
        "target_layer_ids": list(target_layer_ids or spread_layer_ids(target.num_hidden_layers)),
        "sliding_window": window,
        "rope_parameters": {"rope_theta": thetas[0], "rope_type": "default"},
    }


def init_parameter(name: str, param: nn.Parameter, generator: torch.Generator,
                   residual_scale: float) -> None:
    """A linear weight ~ N(0, 1/fan_in), scaled by `residual_scale` for the residual branches'
    output projections; a norm weight (any other parameter) 1. In place, under no_grad."""
    if param.dim() == 2:
        std = param.shape[1] ** -0.5
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std *= residual_scale
        param.copy_(torch.randn(param.shape, generator=generator) * std)
    else:
        param.fill_(1.0)


def write_initial_drafter(target_dir: Path, config: dict[str, Any], out_dir: Path,
                          seed: int) -> Path:
    """A seeded random drafter checkpoint (encoder and layers; fp32) for `config`: linear
    weights ~ N(0, 1/fan_in), the residual branches' output projections scaled by
    1/sqrt(2 * layers), norm weights 1."""
    cfg = DFlashConfig.from_dict(config)
    target_hidden = check_configs(target_dir).target.hidden_size
    encoder = DFlashEncoder(cfg, target_hidden)
    drafter = DFlashDrafter(cfg, nn.Embedding(1, cfg.hidden_size), None, max_context=32)
    generator = torch.Generator().manual_seed(seed)
    residual_scale = (2 * cfg.num_hidden_layers) ** -0.5
    with torch.no_grad():
        for module in (encoder, drafter.layers, drafter.norm):
            for name, param in module.named_parameters():
                init_parameter(name, param, generator, residual_scale)
    write_safetensors(drafter_checkpoint_tensors(drafter, encoder), out_dir, config,
                      dtype="fp32")
    return out_dir


@dataclass
class Split:
    """The target's corpus as train_demo split it: each file `<bos>` + text + `<eos>` in the
    target's tokenizer, the files' texts, and the corpus figures."""
    train: list[list[int]]
    held_out: list[list[int]]
    train_texts: list[str]
    held_out_texts: list[str]
    tokenizer: Any
    stats: dict[str, Any]


def corpus_split(target_dir: Path, corpus_root: Path | None = None) -> Split:
    """train_demo's split by file of the target's corpus. When the target's run report
    (train_demo.json beside the target directory) is there, its corpus settings are used and
    `same_corpus_as_target` says whether the training files' digest matches it."""
    from museflash.training import train_demo

    run_report = Path(target_dir).parent / "train_demo.json"
    recorded = json.loads(run_report.read_text()) if run_report.is_file() else {}
    include_tests = bool(recorded.get("settings", {}).get("include_tests", False))
    corpus = train_demo.load_corpus(corpus_root, include_tests=include_tests)
    tokenizer = train_demo.load_tokenizer(target_dir)
    train_files = {f.path for f in corpus.train}
    if any(f.path in train_files for f in corpus.held_out):
        raise RuntimeError("a held-out file is also a training file")
    stats = corpus.stats()
    digest = recorded.get("corpus", {}).get("train_sha256")
    stats["same_corpus_as_target"] = None if digest is None else digest == stats["train_sha256"]
    return Split(train_demo.encode_files(tokenizer, corpus.train),
                 train_demo.encode_files(tokenizer, corpus.held_out),
                 [f.text for f in corpus.train], [f.text for f in corpus.held_out], tokenizer,
                 stats)


class ArgmaxDrafter(EagerDrafter):
    """An eager drafter whose proposals are each drafted row's argmax: a DFlash2 drafter with
    its candidate selector bypassed (the same as EagerDrafter for DFlash v1)."""

    def draft(self, ids, positions) -> Drafted:
        return Drafted(super().draft(ids, positions).logits)


def measure_acceptance(target_dir: Path, drafter_dir: Path, block: int, prompts: list[list[int]],
                       new_tokens: int, sampling: Sampling | None = None,
                       seed: int = 0, selector: bool = True) -> tuple[float, float, float]:
    """(acceptance, mean accepted length, tokens per main call) of the eager speculative loop,
    with the checkpoint as written (bf16 weights, like an export would read them); greedy, or
    sampled with `sampling` (numpy Generator seeded with `seed`). A DFlash2 drafter proposes
    its selector's `draft_tokens`, or with `selector` False each row's argmax. Prompts may differ in
    length: the prefill chunk is the longest one's, shorter ones are padded (as an export pads
    a prompt shorter than its prefill chunk)."""
    longest = max(len(p) for p in prompts)
    context = -(-(longest + new_tokens + block) // 32) * 32
    target, drafter = load_pair(target_dir, drafter_dir, max_context=max(MAX_CONTEXT, context))
    mask = drafter.config.mask_token_id
    # A prompt shorter than a block is padded to one, as an export's prefill chunk pads it.
    eager_target = EagerTarget(target, prefill_length=max(longest, block), verify_length=block)
    eager_drafter = (EagerDrafter if selector else ArgmaxDrafter)(drafter)
    rng = np.random.default_rng(seed) if sampling is not None else None
    accepted, per_call = [], []
    with torch.no_grad():
        for prompt in prompts:
            result = speculative_generate(eager_target, eager_drafter, prompt, new_tokens,
                                          mask_token_id=mask, sampling=sampling, rng=rng,
                                          lookup_min_match=0)
            accepted.extend(result.accepted)
            per_call.append(result.tokens_per_verify_call)
    mean = float(np.mean(accepted))
    return mean / (block - 1), mean, float(np.mean(per_call))


def with_block_sizes(target, drafter, source_dir: Path, out_root: Path, name: str,
                     final: Path | None = None, writer=write_drafter) -> dict[int, Path]:
    """Checkpoint dirs for every evaluated block size (same weights, written by `writer`);
    `final`, when given, is the BLOCK_SIZE one (the drafter this tool delivers)."""
    dirs = {}
    for block in EVAL_BLOCKS:
        out = final if final is not None and block == BLOCK_SIZE else out_root / f"{name}-k{block}"
        dirs[block] = writer(target, drafter, source_dir, out, block)
    return dirs


def loop_acceptance(target_dir: Path, dirs: dict[int, Path], prompts: list[list[int]],
                    new_tokens: int, sampling: Sampling | None, seed: int,
                    selector: bool = True) -> dict[int, tuple]:
    return {k: measure_acceptance(target_dir, d, k, prompts, new_tokens, sampling, seed + k,
                                  selector)
            for k, d in dirs.items()}


def _roundup32(n: int) -> int:
    return -(-n // 32) * 32


@dataclass
class Data:
    """What a distillation run trains and is measured on."""
    corpus: Corpus  # the target's greedy continuations of prompts from the training files
    heldout: Corpus  # ... of held-out windows: the teacher-forced figures
    prompts: list[list[int]]  # held-out windows: the loop figures
    line_prompts: list[list[int]]  # held-out `<bos>` + definition line: the loop figures
    report: dict[str, Any]


def distillation_data(target, target_dir: Path, split: Split, *, sequences: int,
                      line_prompts_count: int, prompt_length: int, continuation: int, seed: int,
                      eval_prompts_count: int, heldout_sequences: int,
                      corpus_cache: Path | None = None, log=print) -> Data:
    """The training corpus: `sequences` windows of `prompt_length` tokens at random places of
    the training files and `line_prompts_count` prompts `<bos>` + a definition line of a
    training file (at most `prompt_length` tokens), every row continued greedily by `target`
    to prompt_length + continuation tokens in all (rows of every prompt length batched;
    `corpus_cache` keeps it between runs). And the held-out prompts of both kinds."""
    from museflash.training.train_demo import BOS_ID

    length = prompt_length + continuation
    train_prompts = (document_prompts(split.train, sequences, prompt_length, seed)
                     if sequences else [])
    train_prompts += (line_prompts(split.tokenizer, split.train_texts, line_prompts_count,
                                   prompt_length, BOS_ID, seed) if line_prompts_count else [])
    if not train_prompts:
        raise ValueError("no training prompts: give sequences or line prompts")
    first = [p for p in train_prompts if len(p) == len(train_prompts[0])][:3]
    log(f"[train] batched generation vs generate_corpus: identical tokens, encoder inputs "
        f"rel error {check_batched_generation(target, first, length):.1e}")
    key = {"target_weights_sha256": file_sha256(Path(target_dir) / "model.safetensors"),
           "capture_dtype": str(CORPUS_CAPTURE_DTYPE),
           "train_sha256": split.stats["train_sha256"], "sequences": sequences,
           "line_prompts": line_prompts_count, "prompt_length": prompt_length,
           "length": length, "seed": seed, "target_layer_ids": list(target.target_layer_ids)}
    corpus, seconds = cached_corpus(
        corpus_cache, key,
        lambda: generate_corpus_ragged(target, train_prompts, length,
                                       capture_dtype=CORPUS_CAPTURE_DTYPE), log)
    generated = int((length - corpus.starts).sum())
    report = {"sequences": sequences, "line_prompts": line_prompts_count,
              "prompt_length": prompt_length, "continuation": continuation,
              "generated_tokens": generated, "generation_seconds": seconds}
    log(f"[train] data: {sequences} windows + {line_prompts_count} <bos>-led definition lines "
        f"from the training files, continued to {length} tokens: {generated} generated tokens "
        f"in {seconds:.0f} s")
    # Held-out: prompts from the held-out files, which trained neither model.
    heldout = generate_corpus_batched(
        target, document_prompts(split.held_out, heldout_sequences, prompt_length, seed + 2),
        length)
    return Data(corpus, heldout,
                document_prompts(split.held_out, eval_prompts_count, prompt_length, seed + 1),
                line_prompts(split.tokenizer, split.held_out_texts, eval_prompts_count,
                             prompt_length, BOS_ID, seed + 3), report)


def run(output_dir: Path, *, target_dir: Path | None = None, corpus_root: Path | None = None,
        train_seconds: float | None, train_steps: int | None, sequences: int,
        line_prompts_count: int = 0, prompt_length: int = 32, continuation: int = 96,
        layers: int = 3, window: int = 32, target_layer_ids: list[int] | None = None,
        seed: int = 0, eval_prompts_count: int = 16, new_tokens: int = 64,
        heldout_sequences: int = 96, tf_stride: int = 3, batch: int = 64, lr: float = 2e-3,
        temperature: float | None = SAMPLED_TEMPERATURE, corpus_cache: Path | None = None,
        log=print) -> dict:
    output_dir = Path(output_dir)
    target_dir = resolve_target_dir(target_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    wall = time.monotonic()
    report = new_report(target_dir)
    split = load_split(target_dir, corpus_root, report, log)
    config = drafter_config(target_dir, layers=layers, window=window,
                            target_layer_ids=target_layer_ids)
    report["drafter_config"] = config
    log(f"[train] drafter: {layers} layers, hidden {config['hidden_size']}, window {window}, "
        f"target_layer_ids {config['target_layer_ids']}, mask {config['mask_token_id']}")
    length = prompt_length + continuation
    with tempfile.TemporaryDirectory(prefix="museflash-train-") as scratch:
        initial = write_initial_drafter(target_dir, config, Path(scratch) / "initial", seed)
        # Caches no larger than the corpus needs: every call writes and reads all of them.
        # The drafter's ring in fp16, the device's state dtype: training then needs no copies
        # of saved tensors (`saved_tensor_copies`), which roughly halves a step's time.
        target, drafter = load_pair(target_dir, initial, max_context=_roundup32(length),
                                    max_query=max(prompt_length, window, *EVAL_BLOCKS),
                                    drafter_cache_dtype=torch.float16)
        report["drafter_parameters"] = sum(p.numel() for m in (target.encoder, drafter.layers,
                                                               drafter.norm)
                                           for p in m.parameters())
        data = distillation_data(target, target_dir, split, sequences=sequences,
                                 line_prompts_count=line_prompts_count,
                                 prompt_length=prompt_length, continuation=continuation,
                                 seed=seed, eval_prompts_count=eval_prompts_count,
                                 heldout_sequences=heldout_sequences, corpus_cache=corpus_cache,
                                 log=log)
        report["data"] = data.report
        log(f"[train] batched vs one-block inject_kv+draft: rel error "
            f"{check_batched_drafting(target, drafter, data.corpus):.1e}")
        untrained = with_block_sizes(target, drafter, initial, Path(scratch), "untrained")
        report["untrained"] = loop_acceptance(target_dir, untrained, data.prompts, new_tokens,
                                              None, seed)
        report["untrained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, data.heldout, k, stride=tf_stride)
            for k in EVAL_BLOCKS}
        log("[train] untrained: " + ", ".join(
            f"K={k} {100 * report['untrained'][k][0]:.1f}%" for k in EVAL_BLOCKS))
        began = time.monotonic()
        steps = train(target, drafter, data.corpus, steps=train_steps, seconds=train_seconds,
                      batch=batch, lr=lr, seed=seed, log=log)
        report["train_steps"], report["train_seconds"] = steps, time.monotonic() - began
        report["batch"], report["lr"] = batch, lr
        report["training_ring_cache_dtype"] = "float16"
        report["trained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, data.heldout, k, stride=tf_stride)
            for k in EVAL_BLOCKS}
        final = output_dir / "drafter"
        trained = with_block_sizes(target, drafter, initial, Path(scratch), "trained", final)
        measure_trained(report, target_dir, trained, data, new_tokens, temperature, seed)
    report["eval"] = eval_settings(eval_prompts_count, prompt_length, new_tokens,
                                   heldout_sequences, tf_stride, temperature)
    report["drafter_dir"] = str(final)
    report["wall_seconds"] = time.monotonic() - wall
    (output_dir / "train_demo_drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def resolve_target_dir(target_dir: Path | None) -> Path:
    target_dir = Path(target_dir) if target_dir is not None else default_target_dir()
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"no target checkpoint in {target_dir} (make one with "
                                "//:train_demo, or pass --target-dir)")
    return target_dir


def new_report(target_dir: Path) -> dict[str, Any]:
    return {"acceptance_definition": "mean over decode steps of accepted/(K-1); "
            "accepted length = drafted tokens accepted per step", "measured_with":
            "eager torch (fp32 compute, bf16 checkpoint weights), not an export",
            "target_dir": str(target_dir)}


def load_split(target_dir: Path, corpus_root: Path | None, report: dict, log=print) -> Split:
    split = corpus_split(target_dir, corpus_root)
    report["corpus"] = {key: split.stats[key] for key in (
        "root", "train_files", "held_out_files", "train_sha256", "held_out_sha256",
        "same_corpus_as_target")}
    if split.stats["same_corpus_as_target"] is False:
        log("[train] warning: these training files differ from the ones train_demo.json "
            "records for the target (another Python version?); the split rule is the same")
    return split


def measure_trained(report: dict, target_dir: Path, trained: dict[int, Path], data: Data,
                    new_tokens: int, temperature: float | None, seed: int) -> None:
    """The loop figures of the written checkpoints: greedy and sampled on held-out windows,
    greedy on held-out `<bos>` + definition-line prompts."""
    report["trained"] = loop_acceptance(target_dir, trained, data.prompts, new_tokens, None,
                                        seed)
    if temperature:
        report["trained_sampled"] = loop_acceptance(target_dir, trained, data.prompts,
                                                    new_tokens, Sampling(temperature), seed)
    report["trained_line_prompts"] = loop_acceptance(target_dir, trained, data.line_prompts,
                                                     new_tokens, None, seed)


def eval_settings(eval_prompts_count: int, prompt_length: int, new_tokens: int,
                  heldout_sequences: int, tf_stride: int,
                  temperature: float | None) -> dict[str, Any]:
    return {"loop_prompts": eval_prompts_count, "prompt_length": prompt_length,
            "line_prompts": "<bos> + a definition line of a held-out file, at most "
            f"{prompt_length} tokens", "new_tokens": new_tokens,
            "teacher_forced_sequences": heldout_sequences, "teacher_forced_stride": tf_stride,
            "temperature": temperature}


def format_report(report: dict) -> str:
    data, evaluation = report["data"], report["eval"]
    sampled = report.get("trained_sampled")
    lined = report.get("trained_line_prompts")
    temperature = evaluation.get("temperature")
    lines = [f"acceptance ({report['acceptance_definition']}; {report['measured_with']}), "
             f"held-out prompts; trained {report['train_steps']} steps / "
             f"{report['train_seconds']:.0f} s on {data['sequences']} windows + "
             f"{data.get('line_prompts', 0)} <bos>-led definition lines continued to "
             f"{data['prompt_length'] + data['continuation']} tokens "
             f"({data['generated_tokens']} generated in {data['generation_seconds']:.0f} s)",
             f"  loop: {evaluation['loop_prompts']} prompts of {evaluation['prompt_length']} "
             f"tokens x {evaluation['new_tokens']} new tokens; teacher-forced: anchors at "
             f"stride {evaluation['teacher_forced_stride']} in "
             f"{evaluation['teacher_forced_sequences']} greedy continuations"
             + ("; <bos>+def: as many held-out <bos> + definition-line prompts, greedy"
                if lined else ""),
             "  K   upstream | untrained: accept  t-forced | trained: accept  len   tok/main  "
             "t-forced" + (f" | T={temperature:g}: accept  len" if sampled else "")
             + (" | <bos>+def: accept  len" if lined else "")]
    for k in EVAL_BLOCKS:
        ua = report["untrained"][k][0]
        ta, tl, tt = report["trained"][k]
        uf, tf = report["untrained_teacher_forced"][k], report["trained_teacher_forced"][k]
        line = (f"  {k:<3} {100 * UPSTREAM_ACCEPTANCE[k]:6.0f}%  |  {100 * ua:14.1f}% "
                f"{100 * uf:8.1f}% | {100 * ta:12.1f}% {tl:5.2f} {tt:8.2f} {100 * tf:8.1f}%")
        if sampled:
            sa, sl, _ = sampled[k]
            line += f" | {100 * sa:13.1f}% {sl:5.2f}"
        if lined:
            la, ll, _ = lined[k]
            line += f" | {100 * la:17.1f}% {ll:5.2f}"
        lines.append(line)
    return "\n".join(lines)
