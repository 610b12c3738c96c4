"""museflash chat_figures: chat sessions against re-prefilling the history (docs/chat.md).

  ./bazelw run //:chat_figures -- --export-dir DIR [--history-tokens 1000] [--repeats 2]
      [--max-new-tokens 48] [--backend interpreter|coreml]

Prints turn 2's time to first token with a session and with the whole history re-prefilled,
then tokens per target call per turn over five turns, session against from scratch
(tools/chat_figures.py says how). Relative paths resolve against the directory Bazel was run
from. The export needs a context of at least --history-tokens plus --max-new-tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path

flags.DEFINE_string("export-dir", None, "Export directory (holds metadata.json).")
flags.DEFINE_string("swift-generate", None, "The swift-generate binary (Bazel passes it).")
flags.DEFINE_integer("history-tokens", 1000, "Turn 2's history, in tokens, about.")
flags.DEFINE_integer("max-new-tokens", 48, "Tokens per reply at most.")
flags.DEFINE_integer("repeats", 2, "Runs of each side of the time-to-first-token figure.")
flags.DEFINE_enum("backend", "interpreter", ["interpreter", "coreml"],
                  "swift-generate's backend.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"chat_figures: error: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    if FLAGS["export-dir"].value is None or FLAGS["swift-generate"].value is None:
        print("chat_figures: error: --export-dir and --swift-generate are required",
              file=sys.stderr)
        return 2
    if FLAGS["history-tokens"].value < 200 or FLAGS["max-new-tokens"].value < 1 \
            or FLAGS.repeats < 1:
        print("chat_figures: error: --history-tokens must be at least 200, --max-new-tokens "
              "and --repeats at least 1", file=sys.stderr)
        return 2
    from museflash.tools.chat_figures import FiguresError, figures

    try:
        figures(resolve_user_path(FLAGS["export-dir"].value),
                Path(FLAGS["swift-generate"].value).resolve(), FLAGS["history-tokens"].value,
                FLAGS["max-new-tokens"].value, FLAGS.repeats, FLAGS.backend)
    except FiguresError as error:
        print(f"chat_figures: error: {error}", file=sys.stderr)
        return 1
    return 0


def run() -> None:
    run_command(main, "chat_figures")


if __name__ == "__main__":
    run()
