"""museflash demo_figures: the trained demo pairs' figures over their exported packages.

  ./bazelw run //:demo_figures -- [--pairs demo,demo-dflash2] [--num-draft-tokens 3,7,15]
      [--work-dir DIR] [--prompts 8] [--new-tokens 48] [--output FILE.json]

Exports each pair at each --num-draft-tokens, then prints perplexity, acceptance, tokens per
target call and wall time per token on both engines (tools/demo_figures.py says how;
docs/benchmarks.md has the last run). Relative paths resolve against the directory Bazel was
run from.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from absl import flags, logging

from museflash.bundle import BundleError
from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools import demo_figures  # sets OPENBLAS_NUM_THREADS before numpy loads

flags.DEFINE_list("pairs", list(demo_figures.DEFAULT_PAIRS),
                  "Built-in pairs to export and measure.")
flags.DEFINE_list("num-draft-tokens", [str(k) for k in demo_figures.DEFAULT_DRAFT_TOKENS],
                  "Drafted tokens per step, k: one export per k (a block of k + 1).")
flags.DEFINE_string("work-dir", None, "Where the exports go (default: a temporary directory); "
                    "exports already there with the same settings are reused.")
flags.DEFINE_list("lookup-min-match", [str(n) for n in demo_figures.DEFAULT_LOOKUPS],
                  "Lookup settings measured per k (0: every step drafts).")
flags.DEFINE_integer("prompts", 8, "Held-out prompts per row.")
flags.DEFINE_integer("prompt-tokens", 48, "Tokens per prompt.")
flags.DEFINE_integer("new-tokens", 48, "Tokens generated per prompt.")
flags.DEFINE_integer("max-scored-tokens", 20000, "Held-out tokens scored for perplexity.")
flags.DEFINE_string("output", None, "Also write the figures to this JSON file.")
flags.DEFINE_string("swift-generate", None, "The swift-generate binary (Bazel passes it); "
                    "without it only the Python backend is timed.")

FLAGS = flags.FLAGS


def _sorted_integers(flag: str) -> list[int] | None:
    """The list flag's distinct values in order, or None when one is not an integer."""
    try:
        return sorted({int(value) for value in FLAGS[flag].value})
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"demo_figures: error: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    logging.set_verbosity(logging.ERROR)
    counts = _sorted_integers("num-draft-tokens")
    if counts is None:
        print("demo_figures: error: --num-draft-tokens takes integers, e.g. 3,7,15",
              file=sys.stderr)
        return 2
    lookups = _sorted_integers("lookup-min-match")
    if not lookups or min(lookups) < 0:
        print("demo_figures: error: --lookup-min-match takes integers >= 0, e.g. 0,2",
              file=sys.stderr)
        return 2
    if not FLAGS.pairs or not counts:
        print("demo_figures: error: give at least one --pairs name and one --num-draft-tokens",
              file=sys.stderr)
        return 2
    binary = (Path(FLAGS["swift-generate"].value).resolve()
              if FLAGS["swift-generate"].value else None)
    with tempfile.TemporaryDirectory(prefix="museflash-figures-") as scratch:
        work_dir = resolve_user_path(FLAGS["work-dir"].value) if FLAGS["work-dir"].value \
            else Path(scratch)
        work_dir.mkdir(parents=True, exist_ok=True)
        try:
            figures = demo_figures.measure(
                FLAGS.pairs, counts, work_dir, binary, lookups=tuple(lookups),
                prompts=FLAGS.prompts,
                prompt_tokens=FLAGS["prompt-tokens"].value, new_tokens=FLAGS["new-tokens"].value,
                max_scored_tokens=FLAGS["max-scored-tokens"].value)
        except (demo_figures.FiguresError, BundleError) as error:
            print(f"demo_figures: error: {error}", file=sys.stderr)
            return 2
    print(demo_figures.markdown(figures))
    if FLAGS.output:
        out = resolve_user_path(FLAGS.output)
        out.write_text(json.dumps(asdict(figures), indent=2) + "\n")
    return 0


def run() -> None:
    run_command(main, "demo_figures")


if __name__ == "__main__":
    run()
