"""museflash export benchmark: streaming export against a naive conversion.

  ./bazelw run //:benchmark -- --sizes 0.25,0.5,1,2 --output-dir DIR
  ./bazelw run //:benchmark -- --geometry qwen3-4b --paths streaming,streaming-4bit

Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import sys

from absl import flags, logging

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools.benchmark import GEOMETRIES, run_benchmark
from museflash.tools.family_geometry import FAMILY_GEOMETRIES

flags.DEFINE_list("sizes", ["0.25", "0.5", "1", "2"], "Checkpoint sizes in GB of fp16 weights.")
flags.DEFINE_string("output-dir", "benchmark", "Where benchmark.json and benchmark.png go.")
flags.DEFINE_string("work-dir", None, "Scratch space for checkpoints and exports (default: "
                    "inside --output-dir, removed afterwards).")
flags.DEFINE_list("paths", ["naive", "streaming"],
                  "Which export paths to run: naive, streaming, streaming-8bit, "
                  "streaming-4bit, streaming-palettize4.")

flags.DEFINE_enum("geometry", "scaled", list(GEOMETRIES),
                  "Synthetic checkpoints: 'scaled' (width and depth grow with the size), "
                  "'muse-30b' (Muse Glimmer 30B's layers, depth from the size), or a published "
                  "Qwen3 / Llama 3.1 model at its real geometry with a z-lab-shaped drafter "
                  "(qwen3-4b, qwen3-8b, llama3.1-8b: one size, no --sizes; also reports the "
                  "states' bytes at 4K and 32K context).")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"benchmark: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.WARNING)
    if FLAGS.geometry in FAMILY_GEOMETRIES and FLAGS["sizes"].present:
        print(f"benchmark: --geometry {FLAGS.geometry} is one model at its real size; drop "
              "--sizes", file=sys.stderr)
        return 2
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
