"""Figures of an exported trained pair on held-out text (the demo tables of docs/benchmarks.md).

    ./bazelw run //:demo_figures -- --export-dir exported [--output FILE.json]

Everything but the wall times runs over the EXPORTED packages (the numpy ML-program
interpreter), on the files the demo pair never saw (tools/train_demo.py's split of the Python
standard library):

- the target's perplexity per token and bits per byte, from its `main` function's logits over
  windows of each held-out file (exported_perplexity: every token scored once, as the training
  run scored them);
- drafter acceptance at K = 4 / 8 / 16 (K - 1 drafted tokens per step, one drafter exported with
  block 16), greedy and at temperature 0.7, and tokens per target call, on prompts cut from the
  middle of held-out files;
- wall time per generated token with and without the drafter, for the eager backend (torch),
  since the interpreter's speed says nothing about a device's.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from museflash.bundle import AssetRole, BundleError, FunctionName, Metadata
from museflash.paths import resolve_user_path
from museflash.runtime.package_check import PackageError, check_packages
from museflash.runtime.sampling import Sampling
from museflash.runtime.speculative import (
    ExportedDrafter,
    ExportedTarget,
    speculative_generate,
    target_only_generate,
)

KS = (4, 8, 16)
TEMPERATURES = (0.0, 0.7)


@dataclass
class Figures:
    held_out_files: int
    scored_tokens: int
    scored_bytes: int
    perplexity: float
    bits_per_byte: float
    prompts: int
    prompt_tokens: int
    new_tokens: int
    acceptance: dict[str, dict[str, float]]  # "greedy"/"t0.7" -> "K=4" -> acceptance
    tokens_per_target_call: dict[str, dict[str, float]]
    eager_ms_per_token: dict[str, float]  # "target alone" / "with drafter (K=16)"


def held_out_documents(tokenizer) -> tuple[list[list[int]], int]:
    """The held-out files as token lists (`<bos>` text `<eos>`), and how many there are."""
    from museflash.tools.train_demo import encode_files, load_corpus

    corpus = load_corpus()
    return encode_files(tokenizer, corpus.held_out), len(corpus.held_out)


def exported_perplexity(target: ExportedTarget, documents: list[list[int]], limit: int,
                        max_tokens: int, decode) -> tuple[float, int, int]:
    """(summed NLL in nats, scored tokens, scored UTF-8 bytes) from `main` blocks. Each file is
    read in windows of `limit` positions from empty caches, one starting every limit // 2
    tokens (train_demo.evaluation_windows): every token after `<bos>` is scored once, and after
    the first window with at least limit // 2 tokens of its file before it, as the training run
    scored its held-out text. Stops after the file that reaches `max_tokens`."""
    from museflash.tools.train_demo import IGNORE, evaluation_windows

    block = target.verify_length
    total, count, nbytes = 0.0, 0, 0
    for doc in documents:
        if count >= max_tokens:
            break
        if len(doc) < 2:
            continue
        inputs, targets = evaluation_windows([doc], limit)
        for ids, wanted in zip(inputs.tolist(), targets.tolist(), strict=True):
            scored = [i for i, t in enumerate(wanted) if t != IGNORE]
            target.reset()
            for start in range(0, scored[-1] + 1, block):
                chunk = ids[start:start + block]
                chunk = chunk + [0] * (block - len(chunk))
                logits, _ = target.verify(np.asarray(chunk, np.int32),
                                          np.arange(start, start + block, dtype=np.int32))
                rows = [i for i in range(block) if start + i < len(wanted)
                        and wanted[start + i] != IGNORE]
                if not rows:
                    continue
                labels = [wanted[start + i] for i in rows]
                values = logits[rows].astype(np.float64)
                values -= values.max(axis=-1, keepdims=True)
                log_probs = values - np.log(np.exp(values).sum(axis=-1, keepdims=True))
                total -= float(log_probs[np.arange(len(rows)), labels].sum())
                count += len(rows)
                nbytes += len(decode(labels).encode("utf-8"))
    return total, count, nbytes


def prompts_from(documents: list[list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each from the middle of a different held-out file
    at least twice as long (a file's start is mostly its licence and module docstring)."""
    return [doc[(len(doc) - length) // 2:][:length] for doc in documents
            if len(doc) >= 2 * length][:count]


def measure(export_dir: Path, prompts: int = 8, prompt_tokens: int = 48, new_tokens: int = 48,
            max_scored_tokens: int = 20000, log=print) -> Figures:
    from tokenizers import Tokenizer

    metadata = Metadata.read(export_dir)
    tokenizer = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    special = set(metadata.tokenizer.special_tokens.values()) if metadata.tokenizer else set()

    def decode(ids):
        return tokenizer.decode([i for i in ids if i not in special])

    documents, files = held_out_documents(tokenizer)
    target = ExportedTarget(export_dir, metadata)
    drafter = ExportedDrafter(export_dir, metadata)
    spec = metadata.speculative_decoding
    limit = metadata.context_length - target.verify_length
    began = time.perf_counter()
    nll, count, nbytes = exported_perplexity(target, documents, limit, max_scored_tokens, decode)
    log(f"[figures] perplexity over {count} held-out tokens: {math.exp(nll / count):.3f} "
        f"({time.perf_counter() - began:.0f} s)")
    chosen = prompts_from(documents, prompts, prompt_tokens)
    acceptance: dict[str, dict[str, float]] = {}
    per_call: dict[str, dict[str, float]] = {}
    for temperature in TEMPERATURES:
        label = "greedy" if temperature == 0 else f"t{temperature:g}"
        sampling = Sampling(temperature)
        for k in KS:
            if k > spec.block_size:
                continue
            accepted, steps, tokens, calls = 0, 0, 0, 0
            for number, prompt in enumerate(chosen):
                result = speculative_generate(
                    target, drafter, prompt, new_tokens, mask_token_id=spec.mask_token_id,
                    num_draft_tokens=k - 1, context_length=metadata.context_length,
                    sampling=sampling, rng=np.random.default_rng(1000 + number))
                accepted += sum(result.accepted)
                steps += len(result.accepted)
                tokens += len(result.tokens)
                calls += result.target_calls
            acceptance.setdefault(label, {})[f"K={k}"] = accepted / (steps * (k - 1))
            per_call.setdefault(label, {})[f"K={k}"] = tokens / calls
            log(f"[figures] {label} K={k}: acceptance {100 * accepted / (steps * (k - 1)):.1f}%,"
                f" {tokens / calls:.2f} tokens per target call")
    eager = eager_wall_times(export_dir, metadata, chosen, new_tokens)
    log(f"[figures] eager ms per token: {eager}")
    return Figures(files, count, nbytes, math.exp(nll / count), nll / nbytes / math.log(2),
                   len(chosen), prompt_tokens, new_tokens, acceptance, per_call, eager)


def eager_wall_times(export_dir: Path, metadata: Metadata, prompts: list[list[int]],
                     new_tokens: int) -> dict[str, float]:
    import torch

    from museflash.runtime.generate import GenerateOptions, open_backends

    torch.set_num_threads(1)  # one sequence: small matmuls, pool wake-ups would dominate

    spec = metadata.speculative_decoding
    options = GenerateOptions(export_dir=export_dir, prompt="", backend="eager")
    target, drafter = open_backends(options, metadata)
    seconds = {"target alone": 0.0, f"with drafter (K={spec.block_size})": 0.0}
    tokens = 0
    with torch.no_grad():
        for prompt in prompts:
            began = time.perf_counter()
            alone = target_only_generate(target, prompt, new_tokens,
                                         context_length=metadata.context_length)
            seconds["target alone"] += time.perf_counter() - began
            began = time.perf_counter()
            drafted = speculative_generate(target, drafter, prompt, new_tokens,
                                           mask_token_id=spec.mask_token_id,
                                           context_length=metadata.context_length)
            seconds[f"with drafter (K={spec.block_size})"] += time.perf_counter() - began
            if drafted.tokens != alone.tokens:
                raise AssertionError("eager speculative decoding differs from greedy")
            tokens += len(alone.tokens)
    return {name: round(1000 * value / tokens, 2) for name, value in seconds.items()}


def markdown(figures: Figures) -> str:
    lines = [
        f"held-out: {figures.held_out_files} files, {figures.scored_tokens} tokens scored "
        f"({figures.scored_bytes} bytes): perplexity {figures.perplexity:.3f}, "
        f"{figures.bits_per_byte:.3f} bits per byte",
        "",
        "| sampling | K | acceptance | tokens per target call |",
        "| --- | --- | --- | --- |",
    ]
    for label, by_k in figures.acceptance.items():
        for k, value in by_k.items():
            lines.append(f"| {label} | {k[2:]} | {100 * value:.1f}% | "
                         f"{figures.tokens_per_target_call[label][k]:.2f} |")
    lines.append("")
    lines.append("eager wall time per generated token: " + ", ".join(
        f"{name} {value:.1f} ms" for name, value in figures.eager_ms_per_token.items()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", default="exported", type=resolve_user_path)
    parser.add_argument("--output", default=None, type=resolve_user_path)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-scored-tokens", type=int, default=20000)
    args = parser.parse_args(argv[1:])
    try:
        metadata = Metadata.read(args.export_dir)
        if metadata.tokenizer is None or metadata.drafter_role != AssetRole.DFLASH_DRAFTER:
            print("demo_figures: error: the export needs a tokenizer and a DFlash drafter "
                  "(export the trained demo pair with --fused-target --dflash-drafter)",
                  file=sys.stderr)
            return 2
        metadata.asset(AssetRole.TARGET).function(FunctionName.MAIN)
        check_packages(args.export_dir, metadata)
    except (BundleError, PackageError) as error:
        print(f"demo_figures: error: {error}", file=sys.stderr)
        return 2
    figures = measure(args.export_dir, prompts=args.prompts,
                      max_scored_tokens=args.max_scored_tokens)
    print(markdown(figures))
    if args.output:
        args.output.write_text(json.dumps(asdict(figures), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
