"""Train the demo DFlash drafter to imitate the demo target (self-distillation), on CPU.

    ./bazelw run //:train_demo_drafter -- --output-dir DIR [--train-seconds 150]

Everything runs through the models' own code (museflash.models): the target's
`hidden_states` / `logits` and the drafter's `inject_kv` / `draft`, batched with torch.func.vmap
(each sequence or block with its own caches), so there is no second copy of the maths here.

Data: random 16-token prompts, continued greedily by the demo target itself (eager torch,
fp32), 2048 of them by default, generated in a batch (`generate_corpus_batched`, checked
token-for-token against the one-sequence-at-a-time `generate_corpus` on a few prompts at every
run). For an anchor position a the drafter sees what it sees at run time: the target features
injected for the context positions inside its window, and the block [token_a, MASK x (K-1)];
it learns to predict the target's next K-1 tokens. The encoder (which runs inside the fused
target but is stored in the drafter checkpoint), the drafter layers and its final norm are
trained; the borrowed embedding and lm_head stay the target's. The batched drafting is checked
against the drafter's inject_kv + draft on single blocks before training.

Writes DIR/drafter (trained, the real checkpoint layout, block_size 4 like the demo) plus
DIR/drafter-k8 and DIR/drafter-k16 (same weights, block_size 8 / 16: the weights do not depend
on the block size), and reports acceptance for K = 4, 8, 16 before and after training, on
HELD-OUT prompts (other seeds than the training prompts; checked disjoint), two ways:
  loop            the speculative loop over EAGER torch modules loaded from the written bf16
                  checkpoints (not an export), on 12 prompts x 40 new tokens;
  teacher-forced  the batched inject_kv + draft at every anchor of 128 held-out continuations:
                  what the loop would accept from each anchor, all anchors weighted alike (fp32
                  weights).
  acceptance      = mean over steps (anchors) of (drafted tokens accepted) / (K - 1)
  accepted length = mean drafted tokens accepted per step (the target's own token not counted)
Chance is about 1/vocab for the first drafted token (accepted length ~0.002). The demo drafter's
window is 16 positions, so at K=16 a block sees no injected context at all (only its anchor
token), at run time and in training alike; K=16 acceptance is bounded by that.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from museflash.checkpoint import (
    drafter_checkpoint_tensors,
    load_drafter,
    load_target,
    read_config,
    write_safetensors,
)
from museflash.paths import resolve_user_path
from museflash.runtime.speculative import EagerDrafter, EagerTarget, speculative_generate

UPSTREAM_ACCEPTANCE = {4: 0.64, 8: 0.30, 16: 0.17}
EVAL_BLOCKS = (4, 8, 16)
MAX_CONTEXT = 256
MAX_QUERY = 128
PROMPT_LENGTH = 16


@dataclass
class Corpus:
    tokens: torch.Tensor  # [N, L] int64: prompt followed by the target's greedy continuation
    captured: torch.Tensor  # [N, L, layers * hidden]: target layer outputs feeding the encoder
    starts: torch.Tensor  # [N]: first generated position of each row (its prompt length)


def load_pair(target_dir: Path, drafter_dir: Path, *, max_context: int = MAX_CONTEXT,
              max_query: int = MAX_QUERY):
    """fp32 fused target and drafter with fp32 caches (eager reference numerics). The caches
    hold `max_context` positions and take queries of up to `max_query` tokens."""
    target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=max_context,
                         max_query_len=max_query, cache_dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=torch.float32,
                           max_query_len=max_query, cache_dtype=torch.float32)
    return target, drafter


def random_prompts(count: int, length: int, vocab: int, mask_token_id: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, (count, length))
    prompts[prompts == mask_token_id] = 0
    return prompts.tolist()


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

TARGET_CACHES = ("globalKeyCache", "globalValueCache", "slidingKeyCache", "slidingValueCache")
DRAFTER_CACHES = ("slidingKeyCache", "slidingValueCache")


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
    """Zeroed caches for `batch` sequences, keyed for functional_call on a `_Method`."""
    return {f"module.{name}": torch.zeros((batch, *getattr(module, name).shape),
                                          dtype=getattr(module, name).dtype)
            for name in names}


def batched_hidden_states(target, caches: dict[str, torch.Tensor], ids: torch.Tensor,
                          start: int, capture: tuple[int, ...] = ()):
    """`target.hidden_states` of every row of ids [B, T] at positions start..start+T-1, each row
    with its own caches (`fresh_caches`, written in place). Returns the final hidden state
    [B, T, H] and the outputs of the `capture` layers, [B, T, H] each."""
    positions = torch.arange(start, start + ids.shape[1], dtype=torch.int32)
    method = _Method(target, "hidden_states")

    def one(row_caches, row_ids):
        hidden, captured = functional_call(method, row_caches, (row_ids[None], positions, capture))
        return hidden[0], [c[0] for c in captured]

    return vmap(one)(caches, ids)


def draft_blocks(drafter, features: torch.Tensor, ctx_positions: torch.Tensor,
                 block_ids: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
    """What the app does for one block, for B blocks at once: on fresh caches, the drafter's
    `inject_kv` of the context features [B, C, H] at ctx_positions [B, C] (C may be 0), then its
    `draft` of block_ids [B, K] at block_positions [B, K]. Returns logits [B, K, vocab];
    differentiable in the drafter's weights and in the features."""
    inject, draft = _Method(drafter, "inject_kv"), _Method(drafter, "draft")
    with_context = features.shape[1] > 0

    def one(row_caches, row_features, row_ctx, row_ids, row_positions):
        if with_context:
            functional_call(inject, row_caches, (row_features[None], row_ctx))
        return functional_call(draft, row_caches, (row_ids[None], row_positions))[0]

    caches = fresh_caches(drafter, DRAFTER_CACHES, block_ids.shape[0])
    return vmap(one)(caches, features, ctx_positions.to(torch.int32), block_ids.to(torch.int32),
                     block_positions.to(torch.int32))


def generate_corpus_batched(target, prompts: list[list[int]], length: int,
                            chunk: int = 512) -> Corpus:
    """`generate_corpus` for many prompts of one length at once: the same calls of the target's
    own `hidden_states` and `logits`, each row with its own caches.
    `check_batched_generation` compares the two."""
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
            captures.append(torch.cat(fed, dim=1))
    return Corpus(torch.cat(rows), torch.cat(captures),
                  torch.full((len(prompts),), len(prompts[0])))


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


def check_batched_drafting(target, drafter, corpus: Corpus, block: int = 4,
                           rows: int = 3) -> float:
    """Max difference, relative to the logits' scale, between `draft_blocks` on a batch of
    blocks and the drafter's own inject_kv + draft on each block alone; raises when they
    disagree (a batching mistake: caches shared between rows, rows mixed up)."""
    window = drafter.config.sliding_window
    picked = torch.arange(min(rows, corpus.tokens.shape[0]))
    low, high = _anchor_range(corpus, picked, block, window)
    anchors = torch.minimum(low + picked, high - 1)  # a different position in every row
    worst = 0.0
    with torch.no_grad():
        (features, ctx_pos, ids, block_pos), _ = _blocks(target, drafter, corpus, picked,
                                                         anchors, block)
        batched = draft_blocks(drafter, features, ctx_pos, ids, block_pos)
        for i in range(len(picked)):
            drafter.reset_caches()
            if features.shape[1]:
                drafter.inject_kv(features[i:i + 1], ctx_pos[i].to(torch.int32))
            alone = drafter.draft(ids[i:i + 1].to(torch.int32), block_pos[i].to(torch.int32))[0]
            worst = max(worst, float((batched[i] - alone).abs().max() / alone.abs().max()))
        drafter.reset_caches()
    if worst > 1e-4:
        raise RuntimeError(f"batched drafting disagrees with inject_kv + draft ({worst:.2e})")
    return worst


def _blocks(target, drafter, corpus: Corpus, rows: torch.Tensor, anchors: torch.Tensor,
            block: int):
    """`draft_blocks` inputs and labels [B, K-1] for blocks at `anchors` of `rows`, with the
    context run time gives them: the injected positions inside the drafter's window, i.e. the
    window - K positions before the anchor (none when K fills the window)."""
    ctx = max(0, drafter.config.sliding_window - block)
    ctx_pos = anchors[:, None] + torch.arange(-ctx, 0)
    block_pos = anchors[:, None] + torch.arange(block)
    features = target.encoder([corpus.captured[rows[:, None], ctx_pos]])
    ids = torch.full((len(rows), block), drafter.config.mask_token_id)
    ids[:, 0] = corpus.tokens[rows, anchors]
    labels = corpus.tokens[rows[:, None], block_pos[:, 1:]]
    return (features, ctx_pos, ids, block_pos), labels


def _anchor_range(corpus: Corpus, rows: torch.Tensor, block: int, window: int):
    """[low, high) of anchors inside the continuation with a full context window behind them."""
    low = corpus.starts[rows].clamp(min=max(0, window - block))
    return low, torch.full_like(low, corpus.tokens.shape[1] - block + 1)


def train(target, drafter, corpus: Corpus, *, steps: int | None, seconds: float | None,
          batch: int = 64, lr: float = 3e-3, seed: int = 0, log=print) -> int:
    """Trains in place; stops after `steps` or `seconds`, whichever comes first. The learning
    rate decays linearly to 0 over that budget (the elapsed fraction of it)."""
    generator = torch.Generator().manual_seed(seed)
    params = (list(target.encoder.parameters()) + list(drafter.layers.parameters())
              + list(drafter.norm.parameters()))
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    window = drafter.config.sliding_window
    sequences = corpus.tokens.shape[0]
    began, step = time.monotonic(), 0
    total_planned = steps or 10**9

    def progress() -> float:
        done = step / total_planned
        if seconds is not None:
            done = max(done, (time.monotonic() - began) / seconds)
        return done

    while progress() < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, 20 * progress()) * (1.0 - progress())
        block = EVAL_BLOCKS[step % len(EVAL_BLOCKS)]
        rows = torch.randint(0, sequences, (batch,), generator=generator)
        low, high = _anchor_range(corpus, rows, block, window)
        anchors = low + (torch.rand(batch, generator=generator) * (high - low)).long()
        # Rows too short for this block keep their last whole block (prompt labels included).
        anchors = anchors.clamp(max=corpus.tokens.shape[1] - block)
        inputs, labels = _blocks(target, drafter, corpus, rows, anchors, block)
        logits = draft_blocks(drafter, *inputs)[:, 1:]
        # Acceptance stops at the first miss, so early block positions matter most.
        decay = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / 4.0)
        losses = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), reduction="none")
        loss = (losses.reshape(batch, -1) * decay).sum() / (decay.sum() * batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 200 == 0:
            log(f"[train] step {step}: loss {loss.item():.3f} "
                f"({time.monotonic() - began:.0f} s)")
    for p in params:
        p.requires_grad_(False)
    return step


def teacher_forced_acceptance(target, drafter, corpus: Corpus, block: int,
                              chunk: int = 512) -> float:
    """Mean accepted/(K-1) over every anchor of `corpus` (`draft_blocks`, fp32 weights): what
    the speculative loop would accept from each anchor, all anchors weighted alike."""
    window = drafter.config.sliding_window
    rows_all, anchors_all = [], []
    for row in range(corpus.tokens.shape[0]):
        low, high = _anchor_range(corpus, torch.tensor([row]), block, window)
        anchors_all.append(torch.arange(int(low), int(high)))
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
    config = read_config(source_dir)
    config["block_size"] = block_size
    write_safetensors(drafter_checkpoint_tensors(drafter, target.encoder), out_dir, config,
                      dtype="bf16")
    return out_dir


def measure_acceptance(target_dir: Path, drafter_dir: Path, block: int, prompts: list[list[int]],
                       new_tokens: int) -> tuple[float, float, float]:
    """(acceptance, mean accepted length, tokens per main call) of the eager speculative loop,
    with the checkpoint as written (bf16 weights, like an export would read them)."""
    target, drafter = load_pair(target_dir, drafter_dir)
    mask = drafter.config.mask_token_id
    eager_target = EagerTarget(target, prefill_length=len(prompts[0]), verify_length=block)
    eager_drafter = EagerDrafter(drafter)
    accepted, per_call = [], []
    for prompt in prompts:
        result = speculative_generate(eager_target, eager_drafter, prompt, new_tokens,
                                      mask_token_id=mask)
        accepted.extend(result.accepted)
        per_call.append(result.tokens_per_verify_call)
    mean = float(np.mean(accepted))
    return mean / (block - 1), mean, float(np.mean(per_call))


def with_block_sizes(target, drafter, source_dir: Path, out_root: Path, name: str):
    """Checkpoint dirs for every evaluated block size (same weights)."""
    dirs = {}
    for block in EVAL_BLOCKS:
        suffix = "" if block == 4 else f"-k{block}"
        dirs[block] = write_drafter(target, drafter, source_dir, out_root / f"{name}{suffix}",
                                    block)
    return dirs


def run(output_dir: Path, *, train_seconds: float | None, train_steps: int | None,
        sequences: int, continuation: int = 80, seed: int = 0, eval_prompts_count: int = 12,
        new_tokens: int = 40, heldout_sequences: int = 128, batch: int = 128,
        lr: float = 4e-3, log=print) -> dict:
    from museflash.demo_checkpoint import write_demo_checkpoints

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"acceptance_definition": "mean over decode steps of accepted/(K-1); "
                    "accepted length = drafted tokens accepted per step", "measured_with":
                    "eager torch (fp32 compute, bf16 checkpoint weights), not an export"}
    with tempfile.TemporaryDirectory(prefix="museflash-train-") as scratch:
        # The default seed and dtype: the pair `//:export` builds for builtin:demo.
        target_dir, base_drafter_dir = write_demo_checkpoints(Path(scratch) / "demo")
        length = PROMPT_LENGTH + continuation
        # Caches no larger than the corpus needs: every call writes and reads all of them.
        target, drafter = load_pair(target_dir, base_drafter_dir,
                                    max_context=-(-length // 32) * 32,
                                    max_query=max(PROMPT_LENGTH, *EVAL_BLOCKS))
        mask, vocab = drafter.config.mask_token_id, target.config.vocab_size
        train_prompts = random_prompts(sequences, PROMPT_LENGTH, vocab, mask, seed)
        log(f"[train] batched generation vs generate_corpus: identical tokens, encoder inputs "
            f"rel error {check_batched_generation(target, train_prompts[:3], length):.1e}")
        began = time.monotonic()
        corpus = generate_corpus_batched(target, train_prompts, length)
        report["corpus"] = {"sequences": sequences, "length": length,
                            "generation_seconds": time.monotonic() - began}
        log(f"[train] corpus: {sequences} sequences x {length} tokens in "
            f"{report['corpus']['generation_seconds']:.0f} s")
        log(f"[train] batched vs one-block inject_kv+draft: rel error "
            f"{check_batched_drafting(target, drafter, corpus):.1e}")
        # Held-out: prompts from other seeds, never trained on.
        prompts = random_prompts(eval_prompts_count, PROMPT_LENGTH, vocab, mask, seed + 1000)
        heldout_prompts = random_prompts(heldout_sequences, PROMPT_LENGTH, vocab, mask,
                                         seed + 2000)
        seen = {tuple(p) for p in train_prompts}
        if any(tuple(p) in seen for p in prompts + heldout_prompts):
            raise RuntimeError("an evaluation prompt is also a training prompt")
        heldout = generate_corpus_batched(target, heldout_prompts, length)
        untrained = with_block_sizes(target, drafter, base_drafter_dir, Path(scratch),
                                     "untrained")
        report["untrained"] = {k: measure_acceptance(target_dir, d, k, prompts, new_tokens)
                               for k, d in untrained.items()}
        report["untrained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, heldout, k) for k in EVAL_BLOCKS}
        began = time.monotonic()
        steps = train(target, drafter, corpus, steps=train_steps, seconds=train_seconds,
                      batch=batch, lr=lr, seed=seed, log=log)
        report["train_steps"], report["train_seconds"] = steps, time.monotonic() - began
        report["trained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, heldout, k) for k in EVAL_BLOCKS}
        trained = with_block_sizes(target, drafter, base_drafter_dir, output_dir, "drafter")
        report["trained"] = {k: measure_acceptance(target_dir, d, k, prompts, new_tokens)
                             for k, d in trained.items()}
    report["eval"] = {"loop_prompts": eval_prompts_count, "new_tokens": new_tokens,
                      "teacher_forced_sequences": heldout_sequences}
    report["drafter_dirs"] = {k: str(d) for k, d in trained.items()}
    return report


def format_report(report: dict) -> str:
    corpus, evaluation = report["corpus"], report["eval"]
    lines = [f"acceptance ({report['acceptance_definition']}; {report['measured_with']}), "
             f"held-out prompts; trained {report['train_steps']} steps / "
             f"{report['train_seconds']:.0f} s on {corpus['sequences']} sequences x "
             f"{corpus['length']} tokens (generated in {corpus['generation_seconds']:.0f} s):",
             f"  loop: {evaluation['loop_prompts']} prompts x {evaluation['new_tokens']} new "
             f"tokens; teacher-forced: every anchor of {evaluation['teacher_forced_sequences']} "
             "continuations",
             "  K   upstream | untrained: accept  len   tok/main  t-forced | trained: accept  "
             "len   tok/main  t-forced"]
    for k in EVAL_BLOCKS:
        ua, ul, ut = report["untrained"][k]
        ta, tl, tt = report["trained"][k]
        uf, tf = report["untrained_teacher_forced"][k], report["trained_teacher_forced"][k]
        lines.append(f"  {k:<3} {100 * UPSTREAM_ACCEPTANCE[k]:6.0f}%  |  {100 * ua:14.1f}% "
                     f"{ul:5.2f} {ut:8.2f} {100 * uf:8.1f}% | {100 * ta:12.1f}% {tl:5.2f} "
                     f"{tt:8.2f} {100 * tf:8.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True, type=resolve_user_path)
    parser.add_argument("--train-seconds", type=float, default=150.0)
    parser.add_argument("--train-steps", type=int, default=None)
    parser.add_argument("--sequences", type=int, default=2048,
                        help="random prompts continued by the target (batched, ~30 ms each)")
    parser.add_argument("--continuation", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (the model is tiny; 1 is usually fastest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args.output_dir, train_seconds=args.train_seconds, train_steps=args.train_steps,
                 sequences=args.sequences, continuation=args.continuation, seed=args.seed)
    print(format_report(report))
    (args.output_dir / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
