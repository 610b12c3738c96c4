"""What each compression preset costs and saves on the trained demo pair, on held-out text.

    ./bazelw run //:compression_figures [-- --output FILE.json] [--no-exports]

Quality, for each variant (the checkpoint's weights; 8bit; 4bit, affine; symmetric int4 blocks
of 32 with error-minimising clipping, and with plain absmax clipping; palettize4): the eager
target and drafter carry their weights as that variant's export stores them (compression.py,
expanded to fp32; verify proves an export computes the same within fp16 tolerance), then on
the files the pair never saw (train_demo's split of the Python standard library):
- the target's perplexity per token and bits per byte (as train_demo.held_out_figures);
- top-1 agreement of its next-token prediction with the uncompressed model's, at every scored
  position;
- greedy drafter acceptance at K = 4 / 8 / 16 on held-out prompts (the eager speculative loop,
  K - 1 drafted tokens per step from the block-16 drafter, as demo_figures measures an export);
- the weight error: squared error over squared norm of the weights the variant compresses;
- paired differences in loss per token, held-out document by document, with their standard
  error: each variant against the uncompressed model, affine 4-bit against symmetric, and
  clipped symmetric 4-bit against absmax
  (whether a difference in perplexity is more than the held-out text's noise).

Size (unless --no-exports): each preset is exported (fused target + DFlash drafter) and the
weight files' bytes are reported beside what the rules predict: every weight stored once, at
its scheme's bytes (compression.Scheme.stored_bytes) or 2 bytes an element in fp16.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.bundle import PACKAGE_WEIGHT_FILE, Metadata
from museflash.checkpoint.load import (
    compressed_value,
    drafter_checkpoint_tensors,
    load_drafter,
    load_target,
    target_checkpoint_tensors,
)
from museflash.checkpoint.tensor_files import checkpoint_shapes
from museflash.compression import DEFAULT_BLOCK_SIZE, Rule, Scheme, preset_rules
from museflash.export.placeholders import compressed_weights
from museflash.export.weights import StoredWeight

# The 4bit preset before it was affine: symmetric int4 blocks, the embedding and head int8.
SYMMETRIC_4BIT = "4bit-symmetric"
# name -> (preset, or the rules of SYMMETRIC_4BIT; clipping of linear schemes)
VARIANTS = {
    "none": ("none", "mse"),
    "8bit": ("8bit", "mse"),
    "4bit": ("4bit", "mse"),
    SYMMETRIC_4BIT: (SYMMETRIC_4BIT, "mse"),
    "4bit-symmetric-absmax": (SYMMETRIC_4BIT, "absmax"),
    "palettize4": ("palettize4", "mse"),
}
KS = (4, 8, 16)
CONTEXT = 256  # the demo target's training context


def schemes_for(preset: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Scheme]:
    """The schemes of a preset, or of SYMMETRIC_4BIT."""
    if preset == SYMMETRIC_4BIT:
        rules = preset_rules("4bit")[:-1] + [Rule("*", "linear", 4, DEFAULT_BLOCK_SIZE)]
    else:
        rules = preset_rules(preset)
    return compressed_weights(rules, shapes, strict=False)


def store_as(params: dict[str, torch.Tensor], original: dict[str, torch.Tensor],
             schemes: dict[str, Scheme], clip: str = "mse") -> None:
    """Sets each parameter (by checkpoint key) to its `original` value as an export with
    `schemes` stores it, expanded back to fp32; the ones `schemes` leaves alone to `original`."""
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(compressed_value(original[key], schemes[key], clip)
                        if key in schemes else original[key])


def predicted_bytes(shapes: dict[str, tuple[int, ...]], schemes: dict[str, Scheme]) -> int:
    """Every weight stored once, as the export's merge stores it."""
    return sum(StoredWeight.of(key, shape, schemes.get(key)).bytes
               for key, shape in shapes.items())


def held_out_positions(model, inputs: torch.Tensor, targets: torch.Tensor,
                       batch: int = 16) -> torch.Tensor:
    """The model's argmax at every scored position (IGNORE targets dropped)."""
    from museflash.training.train_demo import IGNORE

    chosen = []
    with torch.no_grad():
        for start in range(0, len(inputs), batch):
            logits = model.batch_logits(inputs[start:start + batch])
            chosen.append(logits.argmax(-1)[targets[start:start + batch] != IGNORE])
    return torch.cat(chosen)


def document_losses(model, documents: list[list[int]],
                    context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per held-out document: (its scored targets' cross-entropy summed, in nats; their count),
    over the windows train_demo.evaluation_windows makes of it (summed over the documents,
    held_out_figures' loss). float64."""
    from museflash.training.train_demo import evaluation_windows, summed_loss

    losses = [summed_loss(model, *evaluation_windows([document], context))
              for document in documents]
    return (torch.tensor([nats for nats, _ in losses], dtype=torch.float64),
            torch.tensor([count for _, count in losses], dtype=torch.float64))


def paired_difference(nats: torch.Tensor, reference: torch.Tensor,
                      counts: torch.Tensor) -> dict[str, float]:
    """The difference in mean loss per token between two variants scored on the same documents
    (nats - reference, per document), and its standard error with documents as the sampling
    unit (the linearised standard error of a ratio of sums: a document's tokens are not
    independent of each other, documents are)."""
    if len(counts) < 2:
        raise ValueError("a standard error needs at least two documents")
    difference = nats - reference
    mean = difference.sum() / counts.sum()
    residual = difference - mean * counts
    n = len(counts)
    error = torch.sqrt(n / (n - 1) * (residual ** 2).sum()) / counts.sum()
    return {"loss_per_token": float(mean), "standard_error": float(error)}


def acceptance(target, drafter, prompts: list[list[int]], new_tokens: int,
               context: int) -> dict[str, float]:
    from museflash.runtime.speculative import EagerDrafter, EagerTarget, speculative_generate

    eager_target = EagerTarget(target, prefill_length=32, verify_length=drafter.config.block_size)
    eager_drafter = EagerDrafter(drafter)
    figures = {}
    for k in KS:
        accepted = steps = 0
        for prompt in prompts:
            result = speculative_generate(eager_target, eager_drafter, prompt, new_tokens,
                                          mask_token_id=drafter.config.mask_token_id,
                                          num_draft_tokens=k - 1, context_length=context,
                                          lookup_min_match=0)
            accepted += sum(result.accepted)
            steps += len(result.accepted)
        figures[f"K={k}"] = accepted / (steps * (k - 1))
    return figures


def quality(log=print, prompts: int = 8, prompt_tokens: int = 48,
            new_tokens: int = 48) -> dict[str, Any]:
    from museflash.tools.demo_figures import prompts_from
    from museflash.training.train_demo import (
        evaluation_windows,
        load_corpus,
        load_tokenizer,
        loss_figures,
    )

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with builtin_checkpoints("demo") as (target_dir, drafter_dir):
        tokenizer = load_tokenizer(target_dir)
        corpus = load_corpus()
        from museflash.training.train_demo import encode_files

        documents = encode_files(tokenizer, corpus.held_out)
        nbytes = sum(len(f.text.encode("utf-8")) for f in corpus.held_out)
        inputs, targets = evaluation_windows(documents, CONTEXT)
        chosen = prompts_from(documents, prompts, prompt_tokens)
        context = prompt_tokens + new_tokens + 32
        sizes = dict(dtype=torch.float32, cache_dtype=torch.float32, max_context=CONTEXT,
                     max_query_len=32)
        target = load_target(target_dir, drafter_dir, **sizes)
        drafter = load_drafter(drafter_dir, target, target_dir=target_dir, **sizes)
        params = {**target_checkpoint_tensors(target),
                  **drafter_checkpoint_tensors(drafter, target.encoder)}
        original = {key: p.detach().clone() for key, p in params.items()}
        shapes = checkpoint_shapes(target_dir, drafter_dir)
        reference = None
        losses: dict[str, torch.Tensor] = {}
        for name, (preset, clip) in VARIANTS.items():
            began = time.perf_counter()
            schemes = {} if preset == "none" else schemes_for(preset, shapes)
            store_as(params, original, schemes, clip)
            # The held-out figures from the same per-document losses the paired differences
            # below take (one pass over the held-out text).
            losses[name], counts = document_losses(target, documents, CONTEXT)
            figures = loss_figures(float(losses[name].sum()), int(counts.sum()), nbytes)
            figures["weight_relative_error"] = (
                weight_error(original, params, schemes) if schemes else 0.0)
            predictions = held_out_positions(target, inputs, targets)
            if reference is None:
                reference = predictions
            figures["top1_agreement_with_uncompressed"] = float(
                (predictions == reference).float().mean())
            figures["acceptance_greedy"] = acceptance(target, drafter, chosen, new_tokens,
                                                      context)
            figures["compressed_tensors"] = len(schemes)
            results[name] = figures
            log(f"[figures] {name}: perplexity {figures['held_out_perplexity']:.3f}, "
                f"{figures['held_out_bits_per_byte']:.4f} bits/byte, top-1 agreement "
                f"{100 * figures['top1_agreement_with_uncompressed']:.2f}%, acceptance "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in
                            figures["acceptance_greedy"].items())
                + f", weight error {figures['weight_relative_error']:.2e}"
                + f" ({time.perf_counter() - began:.0f} s)")
        # Each variant's loss against the uncompressed model's; affine 4-bit against symmetric;
        # is error-minimising clipping worse than plain absmax for the model?
        pairs = [(name, "none") for name in VARIANTS if name != "none"] + [
            ("4bit", SYMMETRIC_4BIT), (SYMMETRIC_4BIT, "4bit-symmetric-absmax")]
        results["paired_loss_per_token"] = {
            f"{a} - {b}": paired_difference(losses[a], losses[b], counts) for a, b in pairs}
        for pair, figures in results["paired_loss_per_token"].items():
            log(f"[figures] {pair}: {figures['loss_per_token']:+.5f} nats/token "
                f"(+- {2 * figures['standard_error']:.5f}, two standard errors over "
                f"{len(counts)} documents)")
    return results


def weight_error(original: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                 schemes: dict[str, Scheme]) -> float:
    """Squared error of the compressed weights over their squared norm, summed over every
    weight the variant compresses: what error-minimising clipping minimises, block by block."""
    error = norm = 0.0
    for key in schemes:
        reference = original[key].double()
        error += float(((params[key].double() - reference) ** 2).sum())
        norm += float((reference ** 2).sum())
    return error / norm


def sizes(log=print) -> dict[str, Any]:
    from museflash.export.options import ExportOptions
    from museflash.export.pipeline import export_bundle
    from museflash.export.progress import Progress

    results: dict[str, Any] = {}
    with builtin_checkpoints("demo") as (target_dir, drafter_dir), \
            tempfile.TemporaryDirectory(prefix="museflash-sizes-") as scratch:
        shapes = checkpoint_shapes(target_dir, drafter_dir)
        for preset in ("none", "8bit", "4bit", "palettize4"):
            out = Path(scratch) / preset
            began = time.perf_counter()
            export_bundle(ExportOptions(output_dir=out, builtin="demo", fused_target=True,
                                        dflash_drafter=True, compression=preset),
                          Progress(echo=lambda _line: None))
            metadata = Metadata.read(out)
            stored = {path: (out / path / PACKAGE_WEIGHT_FILE).stat().st_size
                      for path in metadata.package_owners()}
            schemes = {} if preset == "none" else schemes_for(preset, shapes)
            results[preset] = {
                "weight_file_bytes": stored,
                "bundle_weight_bytes": sum(stored.values()),
                "unique_weight_bytes_predicted": predicted_bytes(shapes, schemes),
                "fp16_weight_bytes": predicted_bytes(shapes, {}),
                "export_seconds": round(time.perf_counter() - began, 1),
            }
            predicted = results[preset]["unique_weight_bytes_predicted"]
            log(f"[figures] {preset}: bundle weight files {sum(stored.values())} bytes "
                f"({stored}); unique weights by the rules {predicted}")
    return results


def markdown(report: dict[str, Any]) -> str:
    lines = ["| variant | perplexity | bits/byte | top-1 vs uncompressed | "
             "acceptance K=4 / 8 / 16 | weight error |", "| --- | --- | --- | --- | --- | --- |"]
    quality = {name: figures for name, figures in report["quality"].items()
               if name in VARIANTS}
    for name, figures in quality.items():
        accepted = " / ".join(f"{100 * v:.1f}%" for v in figures["acceptance_greedy"].values())
        lines.append(f"| {name} | {figures['held_out_perplexity']:.3f} | "
                     f"{figures['held_out_bits_per_byte']:.4f} | "
                     f"{100 * figures['top1_agreement_with_uncompressed']:.2f}% | {accepted} | "
                     f"{figures['weight_relative_error']:.2e} |")
    paired = report["quality"].get("paired_loss_per_token", {})
    if paired:
        lines += ["", "| loss per token, difference | nats | two standard errors |",
                  "| --- | --- | --- |"]
        lines += [f"| {pair} | {figures['loss_per_token']:+.5f} | "
                  f"{2 * figures['standard_error']:.5f} |" for pair, figures in paired.items()]
    if report.get("sizes"):
        lines += ["", "| preset | bundle weight bytes | x fp16 bundle | unique weights by the "
                  "rules | x fp16 |", "| --- | --- | --- | --- | --- |"]
        base = report["sizes"]["none"]
        for preset, figures in report["sizes"].items():
            lines.append(
                f"| {preset} | {figures['bundle_weight_bytes']} | "
                f"{figures['bundle_weight_bytes'] / base['bundle_weight_bytes']:.3f} | "
                f"{figures['unique_weight_bytes_predicted']} | "
                f"{figures['unique_weight_bytes_predicted'] / figures['fp16_weight_bytes']:.3f} |")
    return "\n".join(lines)
