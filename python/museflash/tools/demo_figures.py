"""Figures of the trained demo pairs over their EXPORTED packages (docs/benchmarks.md).

    ./bazelw run //:demo_figures -- [--pairs demo,demo-dflash2] [--num-draft-tokens 3,7,15]
        [--lookup-min-match 0,2] [--work-dir DIR] [--prompts 8] [--new-tokens 48]
        [--output FILE.json]

For every pair and every number of drafted tokens k it exports the pair with
`--num-draft-tokens k` (a block of k + 1: `main` verifies exactly what was drafted), and once a
target-only bundle whose `main` takes one token, the fastest way to decode without a drafter.
Exports land in --work-dir (a temporary directory by default); an export already there with the
same settings is reused. Then, on prompts cut from the middle of the held-out files the demo
pairs never saw (training/train_demo.py's split of the Python standard library):

- the target's perplexity and bits per byte from its exported `main` logits;
- per pair, temperature (0 and 0.7), k and lookup setting (0: every step drafts; n: a step
  whose last n tokens occurred before copies from the context instead, runtime/speculative.py):
  the share of steps that copied, acceptance (drafted tokens accepted / drafted),
  mean accepted length (drafted tokens accepted per step), tokens per target call, and wall
  time per generated token with the drafter, on the Python export backend (the numpy
  ML-program interpreter, one thread) and on the Swift engine (//:swift-generate, its
  interpreter backend), the two alternating prompt by prompt in one run;
- the target alone on the one-token `main`, timed the same way, and the speed-up of each row;
- the verify cost: ms per `main` call against its query length (1 and each k + 1), both
  engines.

Greedy Swift tokens must equal the Python loop's, or the tool stops. Sampled runs draw from
different generators (numpy's and the engine's), so only their figures are compared. Wall
times drift on a shared machine: compare rows of one run, not runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from museflash.bundle import BundleError, Metadata  # noqa: E402
from museflash.checkpoint.tensor_files import CheckpointError  # noqa: E402
from museflash.runtime.package_check import PackageError, check_packages  # noqa: E402
from museflash.runtime.sampling import Sampling  # noqa: E402
from museflash.runtime.speculative import (  # noqa: E402
    DEFAULT_LOOKUP_MIN_MATCH,
    ExportedDrafter,
    ExportedTarget,
    speculative_generate,
    target_only_generate,
)

TEMPERATURES = (0.0, 0.7)
DEFAULT_DRAFT_TOKENS = (3, 7, 15)
DEFAULT_LOOKUPS = (0, DEFAULT_LOOKUP_MIN_MATCH)
DEFAULT_PAIRS = ("demo", "demo-dflash2")
TARGET_ALONE = "target-alone"


class FiguresError(Exception):
    """Unusable input: the message names the problem and the fix."""


@dataclass
class Row:
    pair: str
    drafter_kind: str
    temperature: float
    num_draft_tokens: int
    acceptance: float  # drafted tokens accepted / drafted tokens
    mean_accepted_length: float  # drafted tokens accepted per step
    tokens_per_target_call: float
    python_ms_per_token: float
    swift_ms_per_token: float | None
    # The target alone over this export's own main (k + 1 tokens, pads after the first): what
    # `generate`'s speed-up compares with, on the Python backend.
    python_same_export_alone_ms_per_token: float
    lookup_min_match: int = 0  # 0: every step drafted
    copied_steps: float = 0.0  # share of the steps that copied from the context


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
    rows: list[Row] = field(default_factory=list)
    # "t0" / "t0.7" -> engine -> ms per token of the target alone on a one-token main
    target_alone_ms_per_token: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # query length -> engine -> ms per main call
    main_ms_per_call: dict[int, dict[str, float | None]] = field(default_factory=dict)


def held_out_documents(tokenizer) -> tuple[list[list[int]], int]:
    """The held-out files as token lists (`<bos>` text `<eos>`), and how many there are."""
    from museflash.training.train_demo import encode_files, load_corpus

    corpus = load_corpus()
    return encode_files(tokenizer, corpus.held_out), len(corpus.held_out)


def exported_perplexity(target: ExportedTarget, documents: list[list[int]], limit: int,
                        max_tokens: int, decode) -> tuple[float, int, int]:
    """(summed NLL in nats, scored tokens, scored UTF-8 bytes) from `main` blocks. Each file is
    read in windows of `limit` positions from empty caches, one starting every limit // 2
    tokens (train_demo.evaluation_windows): every token after `<bos>` is scored once, and after
    the first window with at least limit // 2 tokens of its file before it, as the training run
    scored its held-out text. Stops after the file that reaches `max_tokens`."""
    from museflash.training.train_demo import IGNORE, evaluation_windows

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


# --- Exports ---------------------------------------------------------------------------------


def export_settings(pair: str, num_draft_tokens: int | None) -> dict:
    """ExportOptions keywords of one measured bundle: the pair fused with its drafter at
    `num_draft_tokens`, or (None) the target alone with a one-token `main`."""
    settings = dict(builtin=pair, fused_target=True)
    if num_draft_tokens is not None:
        settings.update(dflash_drafter=True, num_draft_tokens=num_draft_tokens)
    return settings


def ensure_export(work_dir: Path, name: str, settings: dict, log) -> Path:
    """work_dir/name exported with `settings`, reused when a previous run wrote it with the
    same settings (recorded beside it in name.settings.json)."""
    from museflash.export.options import ExportError, ExportOptions
    from museflash.export.pipeline import export_bundle
    from museflash.export.progress import Progress, quiet_console

    out = work_dir / name
    record = work_dir / f"{name}.settings.json"
    wanted = json.dumps(settings, sort_keys=True)
    if (out / "metadata.json").is_file() and record.is_file() and record.read_text() == wanted:
        try:
            check_packages(out, Metadata.read(out))
        except (BundleError, PackageError) as error:
            log(f"[figures] {out} is damaged ({error}); exporting it again")
        else:
            log(f"[figures] reusing {out}")
            return out
    began = time.perf_counter()
    console = work_dir / f"{name}.export.log"
    try:
        with quiet_console(console):  # coremltools' progress bars and warnings
            export_bundle(ExportOptions(output_dir=out, overwrite=True, **settings),
                          Progress(echo=lambda _line: None))
    except (ExportError, CheckpointError) as error:
        raise FiguresError(f"exporting {name}: {error}") from error
    record.write_text(wanted)
    log(f"[figures] exported {out} ({time.perf_counter() - began:.0f} s)")
    return out


# --- Timing ----------------------------------------------------------------------------------


class TimedMain:
    """Adds up wall time of a package's `main` calls."""

    def __init__(self, package):
        self.seconds, self.calls = 0.0, 0
        original = package.run

        def run(function, inputs):
            began = time.perf_counter()
            try:
                return original(function, inputs)
            finally:
                if str(function) == "main":
                    self.seconds += time.perf_counter() - began
                    self.calls += 1

        package.run = run

    def ms_per_call(self) -> float | None:
        return 1000 * self.seconds / self.calls if self.calls else None


def swift_run(binary: Path, export_dir: Path, prompt: list[int], new_tokens: int,
              temperature: float, seed: int, draft: bool, lookup_min_match: int = 0) -> dict:
    args = [str(binary), "--export-dir", str(export_dir), "--prompt-ids",
            ",".join(map(str, prompt)), "--max-new-tokens", str(new_tokens), "--format", "json",
            "--no-compare", "--temperature", str(temperature), "--seed", str(seed),
            "--lookup-min-match", str(lookup_min_match)]
    # The drafter's chain (its figures measure the drafter), not the engine's choice of steps.
    args.append("--no-tree" if draft else "--no-draft")
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FiguresError(f"swift-generate failed on {export_dir}: {done.stderr.strip()}")
    return json.loads(done.stdout)


@dataclass
class Tally:
    accepted: int = 0
    steps: int = 0
    copied_steps: int = 0
    tokens: int = 0
    target_calls: int = 0
    python_seconds: float = 0.0
    swift_seconds: float = 0.0
    swift_tokens: int = 0
    swift_main_ms: list[float] = field(default_factory=list)
    python_main_ms: float | None = None

    def swift_ms_per_token(self) -> float | None:
        return 1000 * self.swift_seconds / self.swift_tokens if self.swift_tokens else None


def run_rows(export_dir: Path, prompts: list[list[int]], new_tokens: int, temperature: float,
             binary: Path | None, draft: bool, timer: TimedMain | None = None,
             lookup_min_match: int = 0) -> Tally:
    """Every prompt through the Python loop, then the Swift engine, alternating."""
    metadata = Metadata.read(export_dir)
    target = ExportedTarget(export_dir, metadata)
    drafter = ExportedDrafter(export_dir, metadata) if draft else None
    timer = timer or TimedMain(target.package)
    spec = metadata.speculative_decoding
    sampling = Sampling(temperature)
    tally = Tally()
    for number, prompt in enumerate(prompts):
        seed = 1000 + number
        rng = np.random.default_rng(seed)
        began = time.perf_counter()
        if draft:
            result = speculative_generate(target, drafter, prompt, new_tokens,
                                          mask_token_id=spec.mask_token_id,
                                          context_length=metadata.context_length,
                                          sampling=sampling, rng=rng,
                                          lookup_min_match=lookup_min_match)
        else:
            result = target_only_generate(target, prompt, new_tokens,
                                          context_length=metadata.context_length,
                                          sampling=sampling, rng=rng)
        tally.python_seconds += time.perf_counter() - began
        tally.accepted += sum(result.accepted)
        tally.steps += len(result.accepted)
        tally.copied_steps += result.lookup_steps
        tally.tokens += len(result.tokens)
        tally.target_calls += result.target_calls
        if binary is None:
            continue
        report = swift_run(binary, export_dir, prompt, new_tokens, temperature, seed, draft,
                           lookup_min_match)
        if temperature == 0 and result.tokens[:len(report["tokens"])] != report["tokens"]:
            raise FiguresError(f"the Swift engine's greedy tokens differ from the Python loop's "
                               f"on {export_dir} prompt {number}; fix that before timing")
        tally.swift_seconds += report["seconds"]
        tally.swift_tokens += len(report["tokens"])
        tally.swift_main_ms.append(report["functions"]["main"]["ms_per_call"])
    tally.python_main_ms = timer.ms_per_call()
    return tally


def measure(pairs: list[str], draft_counts: list[int], work_dir: Path, binary: Path | None, *,
            lookups: tuple[int, ...] = DEFAULT_LOOKUPS, prompts: int = 8,
            prompt_tokens: int = 48, new_tokens: int = 48,
            max_scored_tokens: int = 20000, log=print) -> Figures:
    from tokenizers import Tokenizer

    exports = {(pair, k): ensure_export(work_dir, f"{pair}-k{k}", export_settings(pair, k), log)
               for pair in pairs for k in draft_counts}
    alone_dir = ensure_export(work_dir, f"{pairs[0]}-{TARGET_ALONE}",
                              export_settings(pairs[0], None), log)
    first = exports[(pairs[0], draft_counts[0])]
    metadata = Metadata.read(first)
    tokenizer = Tokenizer.from_file(str(first / "tokenizer.json"))
    special = set(metadata.tokenizer.special_tokens.values()) if metadata.tokenizer else set()

    def decode(ids):
        return tokenizer.decode([i for i in ids if i not in special])

    documents, files = held_out_documents(tokenizer)
    # Scored through the longest main block: the fewest calls for the same logits.
    longest = exports[(pairs[0], max(draft_counts))]
    scorer = ExportedTarget(longest, Metadata.read(longest))
    began = time.perf_counter()
    nll, count, nbytes = exported_perplexity(scorer, documents,
                                             metadata.context_length - scorer.verify_length,
                                             max_scored_tokens, decode)
    log(f"[figures] perplexity over {count} held-out tokens: {math.exp(nll / count):.3f} "
        f"({time.perf_counter() - began:.0f} s)")
    chosen = prompts_from(documents, prompts, prompt_tokens)
    if len(chosen) < prompts:
        raise FiguresError(f"only {len(chosen)} held-out files are long enough for "
                           f"{prompt_tokens}-token prompts; ask for fewer --prompts")
    figures = Figures(files, count, nbytes, math.exp(nll / count), nll / nbytes / math.log(2),
                      len(chosen), prompt_tokens, new_tokens)
    main_ms: dict[int, dict[str, list[float]]] = {}

    def note_main(length: int, tally: Tally) -> None:
        entry = main_ms.setdefault(length, {"python": [], "swift": []})
        if tally.python_main_ms is not None:
            entry["python"].append(tally.python_main_ms)
        entry["swift"].extend(tally.swift_main_ms)

    for temperature in TEMPERATURES:
        label = f"t{temperature:g}"
        alone = run_rows(alone_dir, chosen, new_tokens, temperature, binary, draft=False)
        note_main(1, alone)
        figures.target_alone_ms_per_token[label] = {
            "python": 1000 * alone.python_seconds / alone.tokens,
            "swift": alone.swift_ms_per_token()}
        log(f"[figures] target alone T={temperature:g}: "
            f"{figures.target_alone_ms_per_token[label]}")
        for pair in pairs:
            for k, lookup in ((k, lookup) for k in draft_counts for lookup in lookups):
                export_dir = exports[(pair, k)]
                kind = Metadata.read(export_dir).speculative_decoding.drafter_kind
                tally = run_rows(export_dir, chosen, new_tokens, temperature, binary, draft=True,
                                 lookup_min_match=lookup)
                note_main(k + 1, tally)
                if lookup == lookups[0]:  # the target alone on this export, once per k
                    same = run_rows(export_dir, chosen, new_tokens, temperature, None,
                                    draft=False)
                row = Row(pair, str(kind), temperature, k, tally.accepted / (tally.steps * k),
                          tally.accepted / tally.steps, tally.tokens / tally.target_calls,
                          1000 * tally.python_seconds / tally.tokens, tally.swift_ms_per_token(),
                          1000 * same.python_seconds / same.tokens, lookup,
                          tally.copied_steps / tally.steps)
                figures.rows.append(row)
                log(f"[figures] {pair} T={temperature:g} k={k} lookup {lookup}: acceptance "
                    f"{100 * row.acceptance:.1f}%, length {row.mean_accepted_length:.2f}, "
                    f"{row.tokens_per_target_call:.2f} tokens/call, "
                    f"{row.python_ms_per_token:.1f} ms/token (Python), "
                    f"{row.swift_ms_per_token or float('nan'):.1f} (Swift)")
    for length in sorted(main_ms):
        figures.main_ms_per_call[length] = {
            engine: (float(np.median(values)) if values else None)
            for engine, values in main_ms[length].items()}
    return figures


# --- Report ----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(alone: float | None, value: float | None) -> str:
    return "-" if alone is None or value is None else f"{alone / value:.2f}x"


def markdown(figures: Figures) -> str:
    lines = [
        f"held-out: {figures.held_out_files} files, {figures.scored_tokens} tokens scored "
        f"({figures.scored_bytes} bytes): perplexity {figures.perplexity:.3f}, "
        f"{figures.bits_per_byte:.3f} bits per byte; {figures.prompts} prompts of "
        f"{figures.prompt_tokens} tokens, {figures.new_tokens} new tokens each",
        "",
        "Speed-ups are against the target alone on a one-token `main` (its row), and, in "
        "brackets, against the target alone on the same export's `main` of k + 1 (what "
        "`generate` compares with).",
        "",
        "Lookup n: a step whose last n tokens occurred before copies what followed them "
        "instead of drafting (off: every step drafts); copied: the share of steps that did.",
        "",
        "| pair | drafter | T | k | lookup | copied | acceptance | mean accepted length "
        "| tokens per target call | ms/token Python | speed-up Python | ms/token Swift "
        "| speed-up Swift |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, alone in figures.target_alone_ms_per_token.items():
        lines.append(f"| target alone (main of 1) | - | {label[1:]} | - | - | - | - | - | 1.00 | "
                     f"{_ms(alone['python'])} | 1.00x | {_ms(alone['swift'])} | "
                     f"{'1.00x' if alone['swift'] is not None else '-'} |")
    for row in figures.rows:
        alone = figures.target_alone_ms_per_token[f"t{row.temperature:g}"]
        same = _ratio(row.python_same_export_alone_ms_per_token, row.python_ms_per_token)
        lines.append(
            f"| {row.pair} | {row.drafter_kind} | {row.temperature:g} | {row.num_draft_tokens} | "
            f"{row.lookup_min_match or 'off'} | {100 * row.copied_steps:.0f}% | "
            f"{100 * row.acceptance:.1f}% | {row.mean_accepted_length:.2f} | "
            f"{row.tokens_per_target_call:.2f} | {_ms(row.python_ms_per_token)} | "
            f"{_ratio(alone['python'], row.python_ms_per_token)} ({same}) | "
            f"{_ms(row.swift_ms_per_token)} | {_ratio(alone['swift'], row.swift_ms_per_token)} |")
    lines += ["", "| main query length | ms per call, Python | ms per call, Swift |",
              "| --- | --- | --- |"]
    for length, engines in sorted(figures.main_ms_per_call.items()):
        lines.append(f"| {length} | {_ms(engines['python'])} | {_ms(engines['swift'])} |")
    return "\n".join(lines)
