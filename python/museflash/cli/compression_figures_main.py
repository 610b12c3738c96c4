"""museflash compression_figures: what each compression preset costs and saves on the demo pair.

  ./bazelw run //:compression_figures [-- --output FILE.json] [--no-exports]

Prints held-out perplexity, top-1 agreement, drafter acceptance and weight error for each
preset, and (unless --no-exports) the bundle sizes of each preset's export
(tools/compression_figures.py says how; docs/benchmarks.md has the last run). Relative paths
resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools import compression_figures

flags.DEFINE_string("output", None, "Also write the figures to this JSON file.")
flags.DEFINE_bool("exports", True,
                  "Export each preset to measure the bundle sizes (--no-exports: skip them).")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"compression_figures: error: unexpected arguments {argv[1:]}; all options are "
              "--flags", file=sys.stderr)
        return 2
    report = {"quality": compression_figures.quality()}
    if FLAGS.exports:
        report["sizes"] = compression_figures.sizes()
    print(compression_figures.markdown(report))
    if FLAGS.output:
        resolve_user_path(FLAGS.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run() -> None:
    run_command(main, "compression_figures")


if __name__ == "__main__":
    run()
