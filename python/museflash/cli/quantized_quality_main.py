"""museflash quantized_quality: what each compression preset costs a built-in target's perplexity.

  ./bazelw run //:quantized_quality -- --builtin smollm2 [--presets 8bit,4bit] [--documents 24]
      [--max-tokens 1024] [--output FILE.json]

Prints, per preset, the eager target's held-out perplexity with its weights as that preset's
export stores them, its top-1 agreement with the uncompressed model, and its loss per token
against the uncompressed model's with a standard error (tools/quantized_quality.py says how).
Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from museflash.bundle import BUILTIN_PAIRS
from museflash.cli.command import run_command
from museflash.compression import PRESETS
from museflash.paths import resolve_user_path
from museflash.tools import quantized_quality

COMPRESSED_PRESETS = [p for p in PRESETS if p != "none"]

flags.DEFINE_enum("builtin", "smollm2", list(BUILTIN_PAIRS),
                  "Built-in pair whose target to score.")
flags.DEFINE_list("presets", ["8bit", "4bit"],
                  f"Compression presets to score ({', '.join(COMPRESSED_PRESETS)}).")
flags.DEFINE_integer("documents", 24, "Held-out files scored (the first N of the split).",
                     lower_bound=2)
flags.DEFINE_integer("max-tokens", 1024, "Tokens per file at most, its <bos> included.",
                     lower_bound=2)
flags.DEFINE_string("output", None, "Also write the figures to this JSON file.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"quantized_quality: error: unexpected arguments {argv[1:]}; all options are "
              "--flags", file=sys.stderr)
        return 2
    if not FLAGS.presets or not set(FLAGS.presets) <= set(COMPRESSED_PRESETS):
        print(f"quantized_quality: error: --presets {','.join(FLAGS.presets)}: give one or more "
              f"of {', '.join(COMPRESSED_PRESETS)}", file=sys.stderr)
        return 2
    try:
        report = quantized_quality.quality(FLAGS.builtin, FLAGS.presets, FLAGS.documents,
                                           FLAGS["max-tokens"].value)
    except quantized_quality.QualityError as error:
        print(f"quantized_quality: error: {error}", file=sys.stderr)
        return 2
    print(quantized_quality.markdown(report, FLAGS.presets))
    if FLAGS.output:
        resolve_user_path(FLAGS.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run() -> None:
    run_command(main, "quantized_quality")


if __name__ == "__main__":
    run()
