"""The drafter's speed-up in the Swift engine, on held-out chat prompts, side by side in one run.

  ./bazelw run //:drafter_speedup -- --export-dir E [--export-dir E2 ...]
      [--max-new-tokens 64] [--prompts 16]

Each held-out chat prompt (training/chat_prompts.py `EVAL_PROMPTS`, which no drafter trained
on) is rendered with the bundle's own chat template and decoded greedily by `swift-generate`
(the Swift interpreter, no n-gram lookup) twice in one process: with the drafter, then the
target alone (`--compare`). Per bundle it prints the figures pooled over the prompts: tokens
per second each way and their ratio (the speed-up), tokens per target call and the mean
accepted length. Give several bundles to compare drafters on the same prompts; their runs
alternate prompt by prompt, so drift on a shared machine falls on all alike.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from museflash.bundle import BundleError, Metadata
from museflash.checkpoint.chat_template import user_turn_ids


class SpeedupError(ValueError):
    """A bundle the figures cannot be measured on."""


@dataclass
class Pooled:
    """What the runs of one bundle add up to."""
    tokens: int = 0
    seconds: float = 0.0
    alone_seconds: float = 0.0  # the target alone decodes the same greedy tokens
    target_calls: int = 0
    accepted: list[int] = field(default_factory=list)

    def add(self, run: dict) -> None:
        """One `swift-generate --format json --compare` report."""
        if "target_alone_seconds" not in run:
            raise SpeedupError("swift-generate reported no target-alone run; it needs --compare "
                               "and a bundle with a drafter")
        self.tokens += len(run["tokens"])
        self.seconds += run["seconds"]
        self.alone_seconds += run["target_alone_seconds"]
        self.target_calls += run["target_calls"]
        self.accepted += run["accepted"]

    def figures(self) -> dict[str, float]:
        with_drafter = self.tokens / self.seconds
        alone = self.tokens / self.alone_seconds
        return {"tokens_per_second": with_drafter, "target_alone_tokens_per_second": alone,
                "speedup": with_drafter / alone,
                "tokens_per_target_call": self.tokens / self.target_calls,
                "mean_accepted_length": sum(self.accepted) / max(1, len(self.accepted))}


def chat_prompt_ids(export_dir: Path, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn rendered with the bundle's chat template (generation prompt
    added), in the bundle tokenizer's ids."""
    ids = user_turn_ids(export_dir, texts)
    if ids is None:
        raise SpeedupError(f"{export_dir} has no chat template; export a chat model (its "
                           "template travels in tokenizer_config.json)")
    return ids


def bundle_metadata(export_dir: Path) -> Metadata:
    try:
        return Metadata.read(export_dir)
    except BundleError as error:
        raise SpeedupError(f"--export-dir {export_dir}: {error}") from error


def require_tokenizer(export_dir: Path) -> None:
    if not (export_dir / "tokenizer.json").is_file():
        raise SpeedupError(f"--export-dir {export_dir} has no tokenizer.json; export a "
                           "checkpoint with its tokenizer")


def check_bundle(export_dir: Path) -> None:
    if bundle_metadata(export_dir).speculative_decoding is None:
        raise SpeedupError(f"--export-dir {export_dir} has no drafter; export with "
                           "--dflash-drafter to measure its speed-up")
    require_tokenizer(export_dir)


def run_prompt(swift_generate: Path, export_dir: Path, ids: list[int],
               max_new_tokens: int) -> dict:
    result = subprocess.run(
        [str(swift_generate), "--export-dir", str(export_dir),
         "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(max_new_tokens),
         "--lookup-min-match", "0", "--format", "json", "--compare"],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SpeedupError(f"swift-generate failed on {export_dir}: "
                           f"{result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout)


def measure(export_dirs: list[Path], swift_generate: Path, texts: list[str],
            max_new_tokens: int, log=print) -> dict[Path, dict[str, float]]:
    for export_dir in export_dirs:
        check_bundle(export_dir)
    prompts = {d: chat_prompt_ids(d, texts) for d in export_dirs}
    pooled = {d: Pooled() for d in export_dirs}
    for index in range(len(texts)):
        for export_dir in export_dirs:
            pooled[export_dir].add(run_prompt(swift_generate, export_dir,
                                              prompts[export_dir][index], max_new_tokens))
        log(f"[speedup] prompt {index + 1}/{len(texts)} done")
    return {d: p.figures() for d, p in pooled.items()}


def format_figures(figures: dict[Path, dict[str, float]], prompts: int,
                   max_new_tokens: int) -> str:
    lines = [f"{prompts} held-out chat prompts x {max_new_tokens} new tokens, greedy, Swift "
             "interpreter, no lookup; pooled over the prompts",
             "| bundle | with drafter, tokens/s | target alone, tokens/s | speed-up | "
             "tokens per target call | mean accepted length |",
             "|---|---|---|---|---|---|"]
    for export_dir, f in figures.items():
        lines.append(f"| {export_dir} | {f['tokens_per_second']:.2f} | "
                     f"{f['target_alone_tokens_per_second']:.2f} | {f['speedup']:.2f}x | "
                     f"{f['tokens_per_target_call']:.2f} | {f['mean_accepted_length']:.2f} |")
    return "\n".join(lines)
