"""museflash target_speed: the Swift engine's target alone against transformers' greedy generate.

  ./bazelw run //:target_speed -- --export-dir E [--export-dir E2 ...]
      [--max-new-tokens 32] [--prompts 16] [--threads 2]

Prints, per bundle, tokens per second of `swift-generate --no-draft` and of transformers'
`generate` over the checkpoint the bundles were exported from, their ratio, and how many
prompts agree token for token (tools/target_speed.py says how). Relative paths resolve against
the directory Bazel was run from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.training.chat_prompts import EVAL_PROMPTS

flags.DEFINE_multi_string("export-dir", [], "A bundle with a tokenizer and a chat template "
                          "(repeat to compare bundles of the same target).")
flags.DEFINE_string("swift-generate", None, "The swift-generate binary (Bazel passes it).")
flags.DEFINE_integer("max-new-tokens", 32, "Tokens to generate per prompt.")
flags.DEFINE_integer("prompts", len(EVAL_PROMPTS), "How many of the held-out chat prompts.")
flags.DEFINE_integer("threads", 2, "torch threads for transformers (the Swift engine uses "
                     "the machine's cores).")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    def refuse(message: str) -> int:
        print(f"target_speed: error: {message}", file=sys.stderr)
        return 2

    if len(argv) > 1:
        return refuse(f"unexpected arguments {argv[1:]}; all options are --flags")
    if not FLAGS["export-dir"].value or FLAGS["swift-generate"].value is None:
        return refuse("give --export-dir (and --swift-generate, which `bazel run "
                      "//:target_speed` passes)")
    count, tokens = FLAGS.prompts, FLAGS["max-new-tokens"].value
    if not 1 <= count <= len(EVAL_PROMPTS) or tokens < 1 or FLAGS.threads < 1:
        return refuse(f"--prompts takes 1 to {len(EVAL_PROMPTS)}, --max-new-tokens and "
                      "--threads at least 1")
    from museflash.builtin.demo_checkpoint import SourceError, checkpoint_dirs
    from museflash.tools import target_speed

    dirs = [resolve_user_path(d) for d in FLAGS["export-dir"].value]
    try:
        metadata = target_speed.check_bundles(dirs)
        with checkpoint_dirs(metadata, None, None) as (target_dir, _, _):
            reference = target_speed.transformers_reference(target_dir, FLAGS.threads)
            figures = target_speed.measure(dirs, Path(FLAGS["swift-generate"].value).resolve(),
                                           list(EVAL_PROMPTS[:count]), tokens, reference)
    except (target_speed.SpeedupError, SourceError) as error:
        return refuse(str(error))
    print(target_speed.format_figures(figures, tokens, FLAGS.threads))
    return 0


def run() -> None:
    run_command(main, "target_speed")


if __name__ == "__main__":
    run()
