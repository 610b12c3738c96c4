"""The Swift engine against the Python reference loop, timed side by side in one run.

  ./bazelw run //:runtime_benchmark -- --export-dir exported [--prompt TEXT]
      [--max-new-tokens 48] [--repeats 3]

Both decode the same prompt greedily over the same exported packages: the Python loop
(runtime/speculative.py) with the numpy ML-program interpreter, the Swift engine
(MuseflashRuntime, //:swift-generate) with the Swift interpreter. Runs alternate, Python then
Swift, `--repeats` times, with and without the drafter; the table gives the median of each
figure: tokens per second, and milliseconds per call of each function. It also prints the
Swift process's peak resident memory against the bundle's weight bytes plus its states.
Both must produce the same tokens, or the benchmark stops: a speed figure of a wrong answer
means nothing. Figures drift on a shared machine, so compare within one run, not across runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

DEFAULT_PROMPT = ('def read_lines(path):\n    """Return the stripped lines of a text file."""\n'
                  '    with open(path) as handle:\n        return [line.strip() for line in')

from museflash.bundle import Metadata  # noqa: E402
from museflash.runtime.generate import TextTokenizer  # noqa: E402
from museflash.runtime.speculative import (  # noqa: E402
    load_exported_pair,
    speculative_generate,
    target_only_generate,
)

FUNCTIONS = ("prefill", "main", "inject_kv", "draft")


class TimedPackage:
    """Wraps a package's `run` to add up wall time per function."""

    def __init__(self, package):
        self.package = package
        self.original = package.run
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        package.run = self.run

    def run(self, function, inputs):
        began = time.perf_counter()
        try:
            return self.original(function, inputs)
        finally:
            name = str(function)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
            self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self):
        self.seconds, self.calls = {}, {}


def python_run(target, drafter, metadata, prompt, new_tokens, draft: bool, timers):
    for timer in timers:
        timer.reset()
    spec = metadata.speculative_decoding
    began = time.perf_counter()
    if draft:
        result = speculative_generate(target, drafter, prompt, new_tokens,
                                      mask_token_id=spec.mask_token_id,
                                      num_draft_tokens=spec.num_draft_tokens,
                                      context_length=metadata.context_length,
                                      pad_token_id=PAD[0])
    else:
        result = target_only_generate(target, prompt, new_tokens, pad_token_id=PAD[0],
                                      context_length=metadata.context_length)
    seconds = time.perf_counter() - began
    per_call = {}
    for timer in timers:
        for name, total in timer.seconds.items():
            per_call[name] = 1000 * total / timer.calls[name]
    return result.tokens, len(result.tokens) / seconds, per_call


PAD = [0]


def swift_run(binary: Path, export_dir: Path, prompt, new_tokens, draft: bool):
    args = [str(binary), "--export-dir", str(export_dir), "--prompt-ids",
            ",".join(map(str, prompt)), "--max-new-tokens", str(new_tokens), "--format", "json"]
    # The drafter's chain, not the engine's own choice of steps: what the Python side times.
    args.append("--no-tree" if draft else "--no-draft")
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"runtime_benchmark: swift-generate failed: {done.stderr.strip()}")
    report = json.loads(done.stdout)
    per_call = {name: entry["ms_per_call"] for name, entry in report["functions"].items()}
    # The Swift engine stops at the end-of-sequence token; the Python loop does not.
    return report["tokens"], report["tokens_per_second"], per_call, report


def benchmark(export_dir: Path, binary: Path, prompt: str, new_tokens: int,
              repeats: int) -> None:
    """Decodes `prompt` over the export at `export_dir` with both engines, `repeats` times
    each, alternating, with and without the drafter, and prints the table (medians)."""
    target, drafter, metadata = load_exported_pair(export_dir)
    timers = [TimedPackage(target.package), TimedPackage(drafter.package)]
    tokenizer = TextTokenizer(export_dir, Metadata.read(export_dir))
    PAD[0] = tokenizer.pad
    ids = tokenizer.encode(prompt)
    rows = []
    report = None
    for draft in (True, False):
        figures: dict[str, list[list[float]]] = {"python": [], "swift": []}
        calls: dict[str, list[dict[str, float]]] = {"python": [], "swift": []}
        for _ in range(repeats):
            py_tokens, py_rate, py_calls = python_run(target, drafter, metadata, ids, new_tokens,
                                                      draft, timers)
            sw_tokens, sw_rate, sw_calls, report = swift_run(binary, export_dir, ids, new_tokens,
                                                             draft)
            if py_tokens[:len(sw_tokens)] != sw_tokens:
                raise SystemExit("runtime_benchmark: the Swift engine's tokens differ from the "
                                 "Python loop's; fix that before timing anything")
            figures["python"].append([py_rate])
            figures["swift"].append([sw_rate])
            calls["python"].append(py_calls)
            calls["swift"].append(sw_calls)
        mode = "drafter" if draft else "target alone"
        py_rate = statistics.median(f[0] for f in figures["python"])
        sw_rate = statistics.median(f[0] for f in figures["swift"])
        rows.append((f"tokens/s, {mode}", py_rate, sw_rate, sw_rate / py_rate))
        for name in FUNCTIONS:
            py = [c[name] for c in calls["python"] if name in c]
            sw = [c[name] for c in calls["swift"] if name in c]
            if py and sw:
                py_ms, sw_ms = statistics.median(py), statistics.median(sw)
                rows.append((f"ms per {name} call, {mode}", py_ms, sw_ms, py_ms / sw_ms))
    print(f"{export_dir}: prompt {len(ids)} tokens, {new_tokens} new, median of "
          f"{repeats} alternating runs each")
    print("| figure | Python (numpy interpreter) | Swift (MILInterpreter) | Swift speed-up |")
    print("| --- | --- | --- | --- |")
    for name, py, sw, ratio in rows:
        print(f"| {name} | {py:.2f} | {sw:.2f} | {ratio:.1f}x |")
    if report is not None:
        bundle = report["weight_bytes"] + report["state_bytes"]
        print(f"swift-generate peak RSS {report['peak_rss_bytes'] / 1e6:.1f} MB "
              f"({report['startup_rss_bytes'] / 1e6:.1f} MB before opening the bundle); weights "
              f"{report['weight_bytes'] / 1e6:.2f} MB + states {report['state_bytes'] / 1e6:.2f} "
              f"MB = {bundle / 1e6:.2f} MB; peak / bundle {report['peak_rss_bytes'] / bundle:.2f}x,"
              f" above start-up / bundle "
              f"{(report['peak_rss_bytes'] - report['startup_rss_bytes']) / bundle:.2f}x")
