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

`--compare` times the target alone in the same bundle, whose `main` verifies a whole block in
every call. Give `--target-only-dir`, a bundle of the same checkpoint exported without a
drafter (its `main` takes one token), and each prompt is also decoded by it (`--no-draft`), right
after the bundles above: the speed-up against the bundle a user would ship without a drafter.
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


def bundle_metadata(export_dir: Path, flag: str = "--export-dir") -> Metadata:
    try:
        return Metadata.read(export_dir)
    except BundleError as error:
        raise SpeedupError(f"{flag} {export_dir}: {error}") from error


def require_tokenizer(export_dir: Path) -> None:
    if not (export_dir / "tokenizer.json").is_file():
        raise SpeedupError(f"--export-dir {export_dir} has no tokenizer.json; export a "
                           "checkpoint with its tokenizer")


def check_bundle(export_dir: Path) -> None:
    if bundle_metadata(export_dir).speculative_decoding is None:
        raise SpeedupError(f"--export-dir {export_dir} has no drafter; export with "
                           "--dflash-drafter to measure its speed-up")
    require_tokenizer(export_dir)


def require_one_checkpoint(found: list[Metadata], why: str = "") -> None:
    """Bundles (their metadata) all exported from one source checkpoint; `why` ends the error."""
    sources = {m.source.checkpoint if m.source else None for m in found}
    if len(sources) != 1 or None in sources:
        raise SpeedupError(f"the bundles were exported from different checkpoints "
                           f"{sorted(map(str, sources))}; give bundles of one target{why}")


def check_target_only(export_dir: Path, drafted: list[Path]) -> None:
    """A bundle without a drafter, of the checkpoint every bundle in `drafted` was exported from."""
    metadata = bundle_metadata(export_dir, "--target-only-dir")
    if metadata.speculative_decoding is not None:
        raise SpeedupError(f"--target-only-dir {export_dir} has a drafter; give a bundle of the "
                           "same checkpoint exported without --dflash-drafter")
    require_tokenizer(export_dir)
    require_one_checkpoint([metadata, *map(bundle_metadata, drafted)])


def swift_generate_json(swift_generate: Path, export_dir: Path, ids: list[int],
                        max_new_tokens: int, mode: str) -> dict:
    """`swift-generate` (no lookup) on one prompt, with `mode` (`--compare`: the drafter's
    chain, not the engine's own choice of steps, then the target alone; `--no-draft`), and its
    JSON report."""
    chain = ["--no-tree"] if mode == "--compare" else []
    result = subprocess.run(
        [str(swift_generate), "--export-dir", str(export_dir),
         "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(max_new_tokens),
         "--lookup-min-match", "0", "--format", "json", mode, *chain],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SpeedupError(f"swift-generate failed on {export_dir}: "
                           f"{result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout)


def run_target_only(swift_generate: Path, export_dir: Path, ids: list[int],
                    max_new_tokens: int) -> tuple[list[int], float]:
    """`swift-generate --no-draft`: the greedy tokens and the seconds they took."""
    report = swift_generate_json(swift_generate, export_dir, ids, max_new_tokens, "--no-draft")
    return report["tokens"], report["seconds"]


def run_prompt(swift_generate: Path, export_dir: Path, ids: list[int],
               max_new_tokens: int) -> dict:
    return swift_generate_json(swift_generate, export_dir, ids, max_new_tokens, "--compare")


def measure(export_dirs: list[Path], swift_generate: Path, texts: list[str],
            max_new_tokens: int, log=print,
            target_only: Path | None = None) -> dict[Path, dict[str, float]]:
    """Figures per bundle; with `target_only`, each also gets `target_only_tokens_per_second`
    (that bundle's, pooled the same way) and `speedup_against_target_only`."""
    for export_dir in export_dirs:
        check_bundle(export_dir)
    if target_only is not None:
        check_target_only(target_only, export_dirs)
    prompts = {d: chat_prompt_ids(d, texts) for d in export_dirs}
    solo_prompts = chat_prompt_ids(target_only, texts) if target_only is not None else None
    pooled = {d: Pooled() for d in export_dirs}
    solo_tokens, solo_seconds = 0, 0.0
    for index in range(len(texts)):
        for export_dir in export_dirs:
            pooled[export_dir].add(run_prompt(swift_generate, export_dir,
                                              prompts[export_dir][index], max_new_tokens))
        if solo_prompts is not None:
            tokens, seconds = run_target_only(swift_generate, target_only, solo_prompts[index],
                                              max_new_tokens)
            solo_tokens, solo_seconds = solo_tokens + len(tokens), solo_seconds + seconds
        log(f"[speedup] prompt {index + 1}/{len(texts)} done")
    figures = {d: p.figures() for d, p in pooled.items()}
    if target_only is not None:
        solo = solo_tokens / solo_seconds
        for each in figures.values():
            each["target_only_tokens_per_second"] = solo
            each["speedup_against_target_only"] = each["tokens_per_second"] / solo
    return figures


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
    for export_dir, f in figures.items():
        if "speedup_against_target_only" in f:
            lines.append(f"{export_dir} with its drafter against the target-only bundle "
                         f"({f['target_only_tokens_per_second']:.2f} tokens/s): "
                         f"{f['speedup_against_target_only']:.2f}x")
    return "\n".join(lines)
