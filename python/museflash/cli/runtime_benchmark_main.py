"""museflash runtime_benchmark: the Swift engine against the Python reference loop, side by side.

  ./bazelw run //:runtime_benchmark -- --export-dir exported [--prompt TEXT]
      [--max-new-tokens 48] [--repeats 3]

Both engines decode the same prompt greedily over the same packages; prints tokens per second
and milliseconds per call of each function (tools/runtime_benchmark.py says how). Relative
paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags, logging

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools import runtime_benchmark  # sets OPENBLAS_NUM_THREADS before numpy loads

flags.DEFINE_string("export-dir", None, "Export directory (holds metadata.json).")
flags.DEFINE_string("swift-generate", None, "The swift-generate binary (Bazel passes it).")
flags.DEFINE_string("prompt", runtime_benchmark.DEFAULT_PROMPT,
                    "Prompt text, tokenized by the bundle's tokenizer.")
flags.DEFINE_integer("max-new-tokens", 48, "Tokens to generate per run.")
flags.DEFINE_integer("repeats", 3, "Runs of each side, alternating.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"runtime_benchmark: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 1
    if FLAGS["export-dir"].value is None or FLAGS["swift-generate"].value is None:
        print("runtime_benchmark: error: --export-dir and --swift-generate are required",
              file=sys.stderr)
        return 1
    # coremltools logs every loaded var at INFO through absl's handler.
    logging.set_verbosity(logging.WARNING)
    runtime_benchmark.benchmark(
        resolve_user_path(FLAGS["export-dir"].value),
        Path(FLAGS["swift-generate"].value).resolve(), FLAGS.prompt,
        FLAGS["max-new-tokens"].value, FLAGS.repeats)
    return 0


def run() -> None:
    run_command(main, "runtime_benchmark")


if __name__ == "__main__":
    run()
