"""museflash drafter_speedup: the drafter's speed-up in the Swift engine on held-out chat prompts.

  ./bazelw run //:drafter_speedup -- --export-dir E [--export-dir E2 ...]
      [--target-only-dir SOLO] [--max-new-tokens 64] [--prompts 16]

Prints, per bundle, tokens per second with the drafter and with the target alone, their ratio,
tokens per target call and the mean accepted length, pooled over the prompts
(tools/drafter_speedup.py says how); with --target-only-dir, also the speed-up against that
bundle of the same checkpoint exported without a drafter. Relative paths resolve against the
directory Bazel was run from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools import drafter_speedup
from museflash.training.chat_prompts import EVAL_PROMPTS

flags.DEFINE_multi_string("export-dir", [], "An export with a drafter and a chat template "
                          "(repeat to compare bundles on the same prompts).")
flags.DEFINE_string("target-only-dir", None, "A bundle of the same checkpoint exported without "
                    "a drafter, also timed on every prompt (--no-draft).")
flags.DEFINE_string("swift-generate", None, "The swift-generate binary (Bazel passes it).")
flags.DEFINE_integer("max-new-tokens", 64, "Tokens to generate per prompt.")
flags.DEFINE_integer("prompts", len(EVAL_PROMPTS), "How many of the held-out chat prompts.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"drafter_speedup: error: unexpected arguments {argv[1:]}; all options are "
              "--flags", file=sys.stderr)
        return 2
    if not FLAGS["export-dir"].value or FLAGS["swift-generate"].value is None:
        print("drafter_speedup: error: give --export-dir (and --swift-generate, which "
              "`bazel run //:drafter_speedup` passes)", file=sys.stderr)
        return 2
    count = FLAGS.prompts
    if not 1 <= count <= len(EVAL_PROMPTS) or FLAGS["max-new-tokens"].value < 1:
        print(f"drafter_speedup: error: --prompts takes 1 to {len(EVAL_PROMPTS)} and "
              "--max-new-tokens at least 1", file=sys.stderr)
        return 2
    dirs = [resolve_user_path(d) for d in FLAGS["export-dir"].value]
    solo = FLAGS["target-only-dir"].value
    try:
        figures = drafter_speedup.measure(
            dirs, Path(FLAGS["swift-generate"].value).resolve(), list(EVAL_PROMPTS[:count]),
            FLAGS["max-new-tokens"].value,
            target_only=resolve_user_path(solo) if solo is not None else None)
    except drafter_speedup.SpeedupError as error:
        print(f"drafter_speedup: error: {error}", file=sys.stderr)
        return 2
    print(drafter_speedup.format_figures(figures, count, FLAGS["max-new-tokens"].value))
    return 0


def run() -> None:
    run_command(main, "drafter_speedup")


if __name__ == "__main__":
    run()
