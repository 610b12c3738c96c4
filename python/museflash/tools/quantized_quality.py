"""What a compression preset costs a built-in target on held-out text, as the export stores it.

    ./bazelw run //:quantized_quality -- --builtin smollm2 [--presets 8bit,4bit] [--documents 24]

For each variant (the checkpoint's own weights, then each preset), the eager target carries its
weights as that preset's export stores them (compression.py, expanded to fp32; verify proves an
export computes the same within fp16 tolerance), and is scored on the held-out files of
train_demo's split of the Python standard library, which no museflash drafter trains on:
- perplexity per token (each file `<bos>`-led, cut to --max-tokens, windows of the context);
- top-1 agreement of its next-token prediction with the uncompressed model's;
- each preset's loss per token against the uncompressed model's, paired file by file, with its
  standard error (whether the difference is more than the text's noise).

compression_figures measures the trained demo pair the same way, with its drafter; this tool
takes any built-in target with a tokenizer (docs/smollm2.md has the real pair's run).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.checkpoint.configs import read_config
from museflash.checkpoint.load import load_target, target_checkpoint_tensors
from museflash.checkpoint.tensor_files import checkpoint_shapes
from museflash.tools.compression_figures import (
    document_losses,
    held_out_positions,
    paired_difference,
    schemes_for,
    store_as,
)

CONTEXT = 256


class QualityError(ValueError):
    """The request cannot be measured; one line saying what to pick instead."""


def held_out_documents(tokenizer, bos_id: int, documents: int,
                       max_tokens: int) -> tuple[list[list[int]], int]:
    """The first `documents` held-out files, each `<bos>` + at most `max_tokens` - 1 of its
    tokens, and the UTF-8 bytes those tokens cover."""
    from museflash.training.train_demo import load_corpus

    files = load_corpus().held_out[:documents]
    chosen, nbytes = [], 0
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    for f, encoding in zip(files, encodings, strict=True):
        ids = encoding.ids[:max_tokens - 1]
        chosen.append([bos_id, *ids])
        end = encoding.offsets[len(ids) - 1][1] if ids else 0  # characters of f.text
        nbytes += len(f.text[:end].encode("utf-8"))
    return chosen, nbytes


def quality(builtin: str, presets: list[str], documents: int = 24, max_tokens: int = 1024,
            log=print) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from museflash.training.train_demo import evaluation_windows

    results: dict[str, Any] = {"builtin": builtin, "context": CONTEXT}
    with builtin_checkpoints(builtin) as (target_dir, _drafter_dir):
        if not (target_dir / "tokenizer.json").is_file():
            raise QualityError(f"--builtin {builtin} has no tokenizer.json, so no text to score; "
                               "pick a built-in pair with one (smollm2, demo, tiny, ...)")
        config = read_config(target_dir)
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        # config.json's <bos>, else its <eos> (a file boundary either way).
        bos = config.get("bos_token_id", config.get("eos_token_id"))
        if isinstance(bos, list):
            bos = bos[0]
        texts, nbytes = held_out_documents(tokenizer, int(bos), documents, max_tokens)
        inputs, targets = evaluation_windows(texts, CONTEXT)
        target = load_target(target_dir, None, dtype=torch.float32, cache_dtype=torch.float32,
                             max_context=CONTEXT, max_query_len=32)
        params = target_checkpoint_tensors(target)
        original = {key: p.detach().clone() for key, p in params.items()}
        shapes = checkpoint_shapes(target_dir, None)
        losses, reference = {}, None
        for name in ["none", *presets]:
            began = time.perf_counter()
            schemes = {} if name == "none" else schemes_for(name, shapes)
            store_as(params, original, schemes)
            losses[name], counts = document_losses(target, texts, CONTEXT)
            nats, tokens = float(losses[name].sum()), int(counts.sum())
            predictions = held_out_positions(target, inputs, targets)
            reference = predictions if reference is None else reference
            results[name] = {
                "perplexity": math.exp(nats / tokens),
                "bits_per_byte": nats / math.log(2) / nbytes,
                "top1_agreement_with_uncompressed": float(
                    (predictions == reference).float().mean()),
                "compressed_tensors": len(schemes),
                "seconds": round(time.perf_counter() - began, 1),
            }
            log(f"[quality] {name}: perplexity {results[name]['perplexity']:.4f} over {tokens} "
                f"tokens of {len(texts)} files, top-1 agreement "
                f"{100 * results[name]['top1_agreement_with_uncompressed']:.2f}% "
                f"({results[name]['seconds']:.0f} s)")
        results["scored_tokens"] = tokens
        results["paired_loss_per_token"] = {
            f"{name} - none": paired_difference(losses[name], losses["none"], counts)
            for name in presets}
        for pair, figures in results["paired_loss_per_token"].items():
            log(f"[quality] {pair}: {figures['loss_per_token']:+.5f} nats/token "
                f"(+- {2 * figures['standard_error']:.5f}, two standard errors over "
                f"{len(counts)} files), perplexity x{math.exp(figures['loss_per_token']):.4f}")
    return results


def markdown(report: dict[str, Any], presets: list[str]) -> str:
    lines = ["| variant | perplexity | x uncompressed | bits/byte | top-1 vs uncompressed |",
             "| --- | --- | --- | --- | --- |"]
    base = report["none"]["perplexity"]
    for name in ["none", *presets]:
        figures = report[name]
        lines.append(f"| {name} | {figures['perplexity']:.4f} | "
                     f"{figures['perplexity'] / base:.4f} | {figures['bits_per_byte']:.4f} | "
                     f"{100 * figures['top1_agreement_with_uncompressed']:.2f}% |")
    return "\n".join(lines)
