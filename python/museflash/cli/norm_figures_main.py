"""museflash norm_figures: the overflow-proof RMSNorm candidates side by side (docs/fp16.md).

  ./bazelw run //:norm_figures -- [--width 2560] [--rows 8] [--repeats 50]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import flags, logging

from museflash.cli.command import run_command

flags.DEFINE_integer("width", 2560, "Row width (the model's hidden size).")
flags.DEFINE_integer("rows", 8, "Rows per call (a main call's query length).")
flags.DEFINE_integer("repeats", 50, "Timed calls per candidate (the median is printed).")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"norm_figures: error: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    if FLAGS.width < 2 or FLAGS.rows < 1 or FLAGS.repeats < 1:
        print("norm_figures: error: --width must be at least 2, --rows and --repeats at least "
              "1", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.ERROR)
    from museflash.export.progress import quiet_console
    from museflash.tools.norm_figures import report

    with quiet_console(Path(os.devnull)):
        lines = report(FLAGS.width, FLAGS.rows, FLAGS.repeats)
    print("\n".join(lines))
    return 0


def run() -> None:
    run_command(main, "norm_figures")


if __name__ == "__main__":
    run()
