"""museflash export benchmark: streaming export against a naive conversion.

  ./bazelw run //:benchmark -- --sizes 0.25,0.5,1,2 --output-dir DIR

Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import sys

from absl import flags, logging

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools.benchmark import run_benchmark

flags.DEFINE_list("sizes", ["0.25", "0.5", "1", "2"], "Checkpoint sizes in GB of fp16 weights.")
flags.DEFINE_string("output-dir", "benchmark", "Where benchmark.json and benchmark.png go.")
flags.DEFINE_string("work-dir", None, "Scratch space for checkpoints and exports (default: "
                    "inside --output-dir, removed afterwards).")
flags.DEFINE_list("paths", ["naive", "streaming"],
                  "Which export paths to run: naive, streaming, streaming-8bit, "
                  "streaming-4bit, streaming-palettize4.")

flags.DEFINE_enum("geometry", "scaled", ["scaled", "muse-30b"],
                  "Synthetic checkpoints: 'scaled' (width and depth grow with the size) or "
                  "'muse-30b' (Muse Glimmer 30B's layers, depth from the size).")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"benchmark: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.WARNING)
    try:
        sizes = [float(s) for s in FLAGS.sizes]
    except ValueError:
        print(f"benchmark: --sizes must be numbers, got {FLAGS.sizes}", file=sys.stderr)
        return 2
    run_benchmark(sizes, resolve_user_path(FLAGS["output-dir"].value),
                  resolve_user_path(FLAGS["work-dir"].value), tuple(FLAGS.paths),
                  geometry=FLAGS.geometry)
    return 0


def run() -> None:
    run_command(main, "benchmark")


if __name__ == "__main__":
    run()
