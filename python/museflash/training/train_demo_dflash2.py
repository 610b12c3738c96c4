"""Distil the demo DFlash2 drafter from the trained demo target, with its selector in the loop.

    ./bazelw run //:train_demo_dflash2 -- --output-dir DIR [--corpus-cache FILE]
        [--train-steps N | --train-seconds S] [--layers 3] [--window 32] [--selector-rank 64]

The same distillation as //:train_demo_drafter (training/train_demo_drafter.py: the same corpus
split, prompts and seed, so `--corpus-cache` can hand both tools one generated corpus; the same
batched entry points, anchors and K = 4, 8, 16 cycle), for models/dflash2.py instead of DFlash
v1: every layer's grouped dynamic convolutions, z-lab's window per query (the first query of a
block reaches window - 1 injected positions back, so blocks get that much context), and the
candidate selector, which picks each drafted position's token among its row's top-k after the
token chosen before it.

Loss, per block of K at an anchor, every term weighted exp(-(i - 1) / gamma) by drafted
position i as in v1 (acceptance stops at the first miss):
  rows      cross-entropy of the draft logits against the target's tokens (v1's loss);
  selector  cross-entropy of the selector's scores over the row's top-k candidates, with the
            TRUE previous token (the anchor, then the target's tokens) as predecessor, against
            the candidate that is the target's token (positions whose token is no candidate
            are left out: the selector cannot pick it). Greedy acceptance only ever reaches a
            position after accepting every earlier one, i.e. after exactly these predecessors,
            so the teacher-forced path is the one decoding takes up to its first miss.
The scores are the model's own `CandidateSelector.scores`, batched with vmap; the gradient
reaches the codebooks, the hidden projection and, through the scores' logits, the drafter.

Writes DIR/drafter-dflash2 (z-lab's DFlash2DraftModel layout: `dflash_config`, `fc` /
`hidden_norm`, bf16, block_size 16) and DIR/train_demo_dflash2.json, and reports on the
held-out files (never trained on) for K = 4, 8, 16: the eager speculative loop proposing the
selector's `draft_tokens` (greedy), the same loop with the selector bypassed (each row's
argmax), sampled at temperature 0.7 (drafts drawn from each row; the selector is greedy only),
and the teacher-forced acceptance of both proposals.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning (see training/train_demo.py); read when torch is
# first imported, so it only takes effect when a program imports this module before torch
# (cli/train_demo_dflash2_main.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import vmap

from museflash.bundle import LayerType
from museflash.checkpoint.configs import read_config
from museflash.checkpoint.load import drafter_checkpoint_tensors
from museflash.checkpoint.tensor_files import write_safetensors
from museflash.models.dflash import ZLAB_ENCODER_KEYS, DFlashEncoder
from museflash.models.dflash2 import DFlash2Config, DFlash2Drafter
from museflash.training import distil_corpus as distil
from museflash.training import train_demo_drafter as v1

DRAFTER_DIR = "drafter-dflash2"
REPORT_FILE = "train_demo_dflash2.json"


def dflash2_config(target_dir: Path, *, layers: int, window: int, kernel: int, group: int,
                   rank: int, top_k: int, target_layer_ids: list[int] | None = None,
                   block_size: int = v1.BLOCK_SIZE,
                   mask_token_id: int | None = None) -> dict[str, Any]:
    """A DFlash2 config.json in z-lab's layout (the keys of demo_checkpoint.TINY_DFLASH2_CONFIG)
    for the target in `target_dir`: v1's sizes (`train_demo_drafter.drafter_config`), the
    DFlash2 settings under `dflash_config`, the target's soft cap on the draft logits."""
    from museflash.checkpoint.configs import check_configs

    flat = v1.drafter_config(target_dir, layers=layers, window=window,
                             target_layer_ids=target_layer_ids, block_size=block_size,
                             mask_token_id=mask_token_id)
    target = check_configs(target_dir).target
    dflash = {name: flat.pop(name) for name in ("block_size", "mask_token_id",
                                                "target_layer_ids")}
    dflash.update({"conv_kernel_size": kernel, "conv_group_size": group,
                   "selector_rank": rank, "selector_top_k": top_k, "output_multiplier": 1.0,
                   "final_logit_softcapping": target.final_logit_softcapping})
    return {**flat, "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
            "is_causal": False, "dflash_config": dict(sorted(dflash.items())),
            "layer_types": [LayerType.SLIDING_ATTENTION.value] * layers,
            "num_target_layers": target.num_hidden_layers, "tie_word_embeddings": False}


def with_block_size(config: dict[str, Any], block_size: int) -> dict[str, Any]:
    config = copy.deepcopy(config)
    config["dflash_config"]["block_size"] = block_size
    return config


def zlab_tensors(drafter: DFlash2Drafter, encoder: nn.Module) -> dict[str, torch.Tensor]:
    tensors = drafter_checkpoint_tensors(drafter, encoder)
    for name, key in ZLAB_ENCODER_KEYS.items():
        tensors[key] = tensors.pop(name)
    return tensors


def write_initial_dflash2(target_dir: Path, config: dict[str, Any], out_dir: Path,
                          seed: int) -> Path:
    """A seeded random DFlash2 checkpoint (fp32) for `config`: linear weights ~ N(0, 1/fan_in),
    residual output projections scaled by 1/sqrt(2 * layers), norm weights 1 (as v1's
    `write_initial_drafter`); the convolutions start as the identity (base kernel 1 at offset 0,
    no dynamic part) and the selector as the argmax (successor codebook 0, so every score is
    its logit until the codebooks learn)."""
    from museflash.checkpoint.configs import check_configs

    cfg = DFlash2Config.from_dict(config)
    encoder = DFlashEncoder(cfg, check_configs(target_dir).target.hidden_size)
    drafter = DFlash2Drafter(cfg, nn.Embedding(1, cfg.hidden_size), None, max_context=32)
    generator = torch.Generator().manual_seed(seed)
    residual_scale = (2 * cfg.num_hidden_layers) ** -0.5
    with torch.no_grad():
        for module in (encoder, drafter.layers, drafter.norm, drafter.candidate_selector):
            for name, param in module.named_parameters():
                if name.endswith("base_kernel"):
                    param.zero_()
                    param[:, 0] = 1.0
                elif name.endswith(("kernel_projection.weight", "successor_codebook")):
                    param.zero_()
                elif name.endswith("predecessor_codebook"):
                    param.copy_(torch.randn(param.shape, generator=generator))
                else:
                    v1.init_parameter(name, param, generator, residual_scale)
    write_safetensors(zlab_tensors(drafter, encoder), out_dir, config, dtype="fp32")
    return out_dir


def write_dflash2(target, drafter: DFlash2Drafter, source_dir: Path, out_dir: Path,
                  block_size: int) -> Path:
    """The checkpoint (bf16, z-lab's layout) with `source_dir`'s config at `block_size`; the
    encoder weights come from the fused target."""
    write_safetensors(zlab_tensors(drafter, target.encoder), out_dir,
                      with_block_size(read_config(source_dir), block_size), dtype="bf16")
    return out_dir


# --- The selector, batched --------------------------------------------------------------------


def block_outputs(target, drafter: DFlash2Drafter, corpus: distil.Corpus, rows: torch.Tensor,
                  anchors: torch.Tensor, block: int):
    """(hidden [B, K-1, H], logits [B, K-1, vocab], labels [B, K-1], predecessors [B, K-1]) of
    the drafted positions of blocks at `anchors` of `rows`: the drafter's own `_draft_hidden`
    and `_logits` (what `draft` runs before the selector), on v1's batched blocks (with the
    window per query's context). predecessors: the anchor, then the target's tokens."""
    inputs, labels = v1._blocks(target, drafter, corpus, rows, anchors, block)
    hidden = distil.draft_blocks(drafter, *inputs, method="_draft_hidden")[:, 1:]
    predecessors = torch.cat([inputs[2][:, :1], labels[:, :-1]], dim=1)
    return hidden, drafter._logits(hidden), labels, predecessors


def selector_scores(drafter: DFlash2Drafter, hidden: torch.Tensor, logits: torch.Tensor,
                    predecessors: torch.Tensor):
    """(scores [B, P, k], candidates [B, P, k]): every drafted position's top-k candidates
    (`CandidateSelector.candidates`) scored by `CandidateSelector.scores` after the given
    predecessor token, all positions at once (greedy_path does them one by one, after its own
    choices)."""
    selector = drafter.candidate_selector
    unary, candidates = selector.candidates(logits)
    projected = selector.hidden_projection(hidden)

    def one(row_projected, row_unary, row_candidates, predecessor):
        return selector.scores(row_projected[None], row_unary[None], row_candidates,
                               predecessor.reshape(1))[0]

    return vmap(vmap(one))(projected, unary, candidates, predecessors.to(torch.int32)), candidates


def make_loss(selector_weight: float):
    def dflash2_loss(target, drafter, corpus, rows, anchors, block) -> torch.Tensor:
        """v1's weighted cross-entropy of the rows plus `selector_weight` times the selector's
        teacher-forced cross-entropy over each row's candidates."""
        decay = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / v1.loss_decay(block))
        hidden, logits, labels, predecessors = block_outputs(target, drafter, corpus, rows,
                                                             anchors, block)
        rows_loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                labels.reshape(-1), reduction="none")
        loss = (rows_loss.reshape(labels.shape) * decay).sum() / (decay.sum() * len(rows))
        scores, candidates = selector_scores(drafter, hidden, logits, predecessors)
        match = candidates == labels[..., None]
        present = match.any(dim=-1)
        picked = nn.functional.cross_entropy(scores.reshape(-1, scores.shape[-1]),
                                             match.float().argmax(dim=-1).reshape(-1),
                                             reduction="none").reshape(labels.shape)
        weights = decay * present
        return loss + selector_weight * (picked * weights).sum() / (decay.sum() * len(rows))

    return dflash2_loss


def teacher_forced_acceptance(target, drafter: DFlash2Drafter, corpus: distil.Corpus, block: int,
                              chunk: int = 256, stride: int = 1) -> dict[str, float]:
    """Mean accepted/(K-1) over every `stride`-th anchor of `corpus`, proposing the selector's
    choices ("selector": what the greedy loop accepts from each anchor, since up to its first
    miss the selector's predecessors are the target's tokens) or each row's argmax
    ("argmax", the selector bypassed)."""
    rows_all, anchors_all = v1.strided_anchors(corpus, block, stride)
    accepted: dict[str, list[torch.Tensor]] = {"selector": [], "argmax": []}
    with torch.no_grad():
        for first in range(0, len(rows_all), chunk):
            hidden, logits, labels, predecessors = block_outputs(
                target, drafter, corpus, rows_all[first:first + chunk],
                anchors_all[first:first + chunk], block)
            scores, candidates = selector_scores(drafter, hidden, logits, predecessors)
            chosen = torch.gather(candidates, 2, scores.argmax(dim=-1, keepdim=True))[..., 0]
            for name, proposed in (("selector", chosen), ("argmax", logits.argmax(dim=-1))):
                accepted[name].append((proposed == labels).long().cumprod(dim=1).sum(dim=1))
    return {name: float(torch.cat(hits).float().mean()) / (block - 1)
            for name, hits in accepted.items()}


def check_batched_dflash2(target, drafter: DFlash2Drafter, corpus: distil.Corpus, block: int = 4,
                          rows: int = 3) -> float:
    """The batched blocks against the drafter's own inject_kv + draft on each block alone:
    the logits agree (returns their max difference relative to their scale) and the batched
    selector, given the drafter's own path as predecessors, picks that path (`draft_tokens`).
    Raises when either disagrees."""
    picked = torch.arange(min(rows, corpus.tokens.shape[0]))
    low, high = v1._anchor_range(corpus, picked, block)
    anchors = torch.minimum(low + picked, high - 1)
    worst = 0.0
    with torch.no_grad():
        (features, ctx_pos, ids, block_pos), _ = v1._blocks(target, drafter, corpus, picked,
                                                            anchors, block)
        hidden = distil.draft_blocks(drafter, features, ctx_pos, ids, block_pos,
                                 method="_draft_hidden")[:, 1:]
        logits = drafter._logits(hidden)
        for i in range(len(picked)):
            drafter.reset_caches()
            real = ctx_pos[i] >= 0
            if real.any():
                drafter.inject_kv(features[i:i + 1, real], ctx_pos[i, real].to(torch.int32))
            alone, path = drafter.draft(ids[i:i + 1].to(torch.int32),
                                        block_pos[i].to(torch.int32))
            worst = max(worst, float((logits[i] - alone[0, 1:]).abs().max()
                                     / alone.abs().max()))
            own = torch.cat([ids[i, :1], path[0, :-1].long()])[None]
            scores, candidates = selector_scores(drafter, hidden[i:i + 1], logits[i:i + 1], own)
            chosen = torch.gather(candidates, 2, scores.argmax(dim=-1, keepdim=True))[0, :, 0]
            if not torch.equal(chosen, path[0].long()):
                raise RuntimeError(f"the batched selector picks {chosen.tolist()} where the "
                                   f"drafter's draft_tokens are {path[0].tolist()} (row {i})")
    drafter.reset_caches()
    if worst > 1e-4:
        raise RuntimeError(f"batched DFlash2 drafting differs from inject_kv+draft ({worst:.2e})")
    return worst


# --- The run ----------------------------------------------------------------------------------


def run(output_dir: Path, *, target_dir: Path | None = None, corpus_root: Path | None = None,
        train_seconds: float | None, train_steps: int | None, sequences: int,
        line_prompts_count: int = 0, prompt_length: int = 32, continuation: int = 96,
        layers: int = 3, window: int = 32, kernel: int = 4, group: int = 16, rank: int = 64,
        top_k: int = 8, selector_weight: float = 1.0, blocks: tuple[int, ...] = v1.EVAL_BLOCKS,
        target_layer_ids: list[int] | None = None, seed: int = 0, eval_prompts_count: int = 16,
        new_tokens: int = 64, heldout_sequences: int = 96, tf_stride: int = 3,
        batch: int = 64, lr: float = 2e-3,
        temperature: float | None = v1.SAMPLED_TEMPERATURE, corpus_cache: Path | None = None,
        log=print) -> dict:
    output_dir = Path(output_dir)
    target_dir = v1.resolve_target_dir(target_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    wall = time.monotonic()
    report = v1.new_report(target_dir)
    split = v1.load_split(target_dir, corpus_root, report, log)
    config = dflash2_config(target_dir, layers=layers, window=window, kernel=kernel,
                            group=group, rank=rank, top_k=top_k,
                            target_layer_ids=target_layer_ids)
    report["drafter_config"] = config
    log(f"[train] DFlash2 drafter: {layers} layers, hidden {config['hidden_size']}, window "
        f"{window} per query, convolutions {kernel} taps / groups of {group}, selector rank "
        f"{rank} over the top {top_k}, target_layer_ids "
        f"{config['dflash_config']['target_layer_ids']}")
    length = prompt_length + continuation
    with tempfile.TemporaryDirectory(prefix="museflash-train-dflash2-") as scratch:
        initial = write_initial_dflash2(target_dir, config, Path(scratch) / "initial", seed)
        # The drafter's ring in fp16, as in train_demo_drafter.run.
        target, drafter = distil.load_pair(target_dir, initial, max_context=v1._roundup32(length),
                                       max_query=max(prompt_length, window, *v1.EVAL_BLOCKS),
                                       drafter_cache_dtype=torch.float16)
        report["drafter_parameters"] = sum(
            p.numel() for p in v1.trained_parameters(target, drafter))
        data = v1.distillation_data(target, target_dir, split, sequences=sequences,
                                    line_prompts_count=line_prompts_count,
                                    prompt_length=prompt_length, continuation=continuation,
                                    seed=seed, eval_prompts_count=eval_prompts_count,
                                    heldout_sequences=heldout_sequences,
                                    corpus_cache=corpus_cache, log=log)
        report["data"] = data.report
        log(f"[train] batched vs one-block inject_kv+draft: rel error "
            f"{check_batched_dflash2(target, drafter, data.corpus):.1e}, same selector path")
        report["untrained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, data.heldout, k,
                                         stride=tf_stride)["selector"]
            for k in v1.EVAL_BLOCKS}
        began = time.monotonic()
        steps = v1.train(target, drafter, data.corpus, steps=train_steps, seconds=train_seconds,
                         batch=batch, lr=lr, seed=seed, blocks=blocks,
                         loss_fn=make_loss(selector_weight), log=log)
        report["train_steps"], report["train_seconds"] = steps, time.monotonic() - began
        report["batch"], report["lr"], report["selector_weight"] = batch, lr, selector_weight
        report["block_cycle"] = list(blocks)
        report["training_ring_cache_dtype"] = "float16"
        log(f"[train] after training: {check_batched_dflash2(target, drafter, data.corpus):.1e}")
        forced = {k: teacher_forced_acceptance(target, drafter, data.heldout, k,
                                               stride=tf_stride) for k in v1.EVAL_BLOCKS}
        report["trained_teacher_forced"] = {k: f["selector"] for k, f in forced.items()}
        report["trained_teacher_forced_argmax"] = {k: f["argmax"] for k, f in forced.items()}
        final = output_dir / DRAFTER_DIR
        trained = v1.with_block_sizes(target, drafter, initial, Path(scratch), "trained", final,
                                      writer=write_dflash2)
        v1.measure_trained(report, target_dir, trained, data, new_tokens, temperature, seed)
        report["trained_argmax"] = v1.loop_acceptance(target_dir, trained, data.prompts,
                                                      new_tokens, None, seed, selector=False)
    report["eval"] = v1.eval_settings(eval_prompts_count, prompt_length, new_tokens,
                                      heldout_sequences, tf_stride, temperature)
    report["drafter_dir"] = str(final)
    report["wall_seconds"] = time.monotonic() - wall
    (output_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_report(report: dict) -> str:
    data, evaluation = report["data"], report["eval"]
    temperature = evaluation.get("temperature")
    sampled = report.get("trained_sampled")
    lines = [f"DFlash2 acceptance ({report['acceptance_definition']}; "
             f"{report['measured_with']}), held-out prompts; trained {report['train_steps']} "
             f"steps / {report['train_seconds']:.0f} s on {data['sequences']} windows + "
             f"{data.get('line_prompts', 0)} <bos>-led definition lines continued to "
             f"{data['prompt_length'] + data['continuation']} tokens",
             f"  loop: {evaluation['loop_prompts']} prompts of {evaluation['prompt_length']} "
             f"tokens x {evaluation['new_tokens']} new tokens, greedy with the selector's "
             f"draft_tokens, and with each row's argmax instead; teacher-forced: anchors at "
             f"stride {evaluation['teacher_forced_stride']} in "
             f"{evaluation['teacher_forced_sequences']} greedy continuations",
             "  K   upstream | selector: accept  len   tok/main  t-forced | argmax: accept  "
             "len   t-forced" + (f" | T={temperature:g}: accept  len" if sampled else "")
             + " | <bos>+def: accept  len"]
    for k in v1.EVAL_BLOCKS:
        sa, sl, st = report["trained"][k]
        aa, al, _ = report["trained_argmax"][k]
        line = (f"  {k:<3} {100 * v1.UPSTREAM_ACCEPTANCE[k]:6.0f}%  | {100 * sa:13.1f}% "
                f"{sl:5.2f} {st:8.2f} {100 * report['trained_teacher_forced'][k]:8.1f}% | "
                f"{100 * aa:11.1f}% {al:5.2f} "
                f"{100 * report['trained_teacher_forced_argmax'][k]:8.1f}%")
        if sampled:
            ta, tl, _ = sampled[k]
            line += f" | {100 * ta:13.1f}% {tl:5.2f}"
        la, ll, _ = report["trained_line_prompts"][k]
        line += f" | {100 * la:17.1f}% {ll:5.2f}"
        lines.append(line)
    return "\n".join(lines)
