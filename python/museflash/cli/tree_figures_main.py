"""museflash tree_figures: tokens per target call of tree verification, by budget and source.

  ./bazelw run //:tree_figures -- [--builtin smollm2] [--prompts 16] [--max-new-tokens 64]
      [--budgets 1,4,8,16,32] [--block 16] [--format table|json]

Replays the target's greedy decode of each held-out chat prompt with the eager models and
counts, per node budget, the tokens each step's tree would gain: from the drafter's rows, the
recycled table, lookup, and all together, beside the drafter's width-1 chain
(tools/tree_figures.py says how). The figure does not depend on the machine.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from museflash.cli.command import run_command
from museflash.training.chat_prompts import EVAL_PROMPTS

flags.DEFINE_string("builtin", "smollm2", "A built-in pair with a chat template.")
flags.DEFINE_integer("prompts", 16, "How many of the held-out chat prompts.")
flags.DEFINE_integer("max-new-tokens", 64, "Tokens each prompt's replay decodes.")
flags.DEFINE_list("budgets", ["1", "4", "8", "16", "32"], "Node budgets (the root counts).")
flags.DEFINE_integer("block", None, "Draft call length (default: the drafter's block).")
flags.DEFINE_enum("format", "table", ["table", "json"], "Output format.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"tree_figures: error: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    try:
        budgets = sorted({int(b) for b in FLAGS.budgets})
    except ValueError:
        budgets = []
    if not budgets or budgets[0] < 1:
        print(f"tree_figures: error: --budgets takes node counts of at least 1, got "
              f"{','.join(FLAGS.budgets)}", file=sys.stderr)
        return 2
    if not 1 <= FLAGS.prompts <= len(EVAL_PROMPTS) or FLAGS["max-new-tokens"].value < 1:
        print(f"tree_figures: error: --prompts takes 1 to {len(EVAL_PROMPTS)} and "
              "--max-new-tokens at least 1", file=sys.stderr)
        return 2
    from museflash.tools import tree_figures

    try:
        report = tree_figures.measure(FLAGS.builtin, FLAGS.prompts, FLAGS["max-new-tokens"].value,
                                      budgets, FLAGS.block,
                                      log=lambda line: print(line, file=sys.stderr))
    except (tree_figures.TreeFiguresError, ValueError) as error:
        print(f"tree_figures: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if FLAGS.format == "json" else tree_figures.table(report))
    return 0


def run() -> None:
    run_command(main, "tree_figures")


if __name__ == "__main__":
    run()
