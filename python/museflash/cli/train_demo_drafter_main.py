"""museflash train_demo_drafter: distil the demo DFlash drafter from the trained demo target.

  ./bazelw run //:train_demo_drafter -- --output-dir DIR [--target-dir demo/target]
      [--train-steps 8000 | --train-seconds S] [--layers 3] [--window 48] [--sequences 16384]
      [--line-prompts 8192] [--corpus-cache FILE]

Writes DIR/drafter and DIR/train_demo_drafter.json and prints held-out acceptance for K = 4, 8
and 16 before and after training (training/train_demo_drafter.py says how). Relative paths resolve
against the directory Bazel was run from.
"""

from __future__ import annotations

import sys

import torch
from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.training import train_demo_drafter as trainer

flags.DEFINE_string("output-dir", None, "Writes DIR/drafter and DIR/train_demo_drafter.json.")
flags.DEFINE_string("target-dir", None,
                    "The target checkpoint with its tokenizer (default: demo/target).")
flags.DEFINE_string("corpus-root", None, "The target's corpus (default: this interpreter's "
                    "stdlib).")
flags.DEFINE_float("train-seconds", None,
                   "Also stop after this many seconds, whichever comes first.")
flags.DEFINE_integer("train-steps", 8000, "Optimizer steps (about 30 minutes on one CPU core).")
flags.DEFINE_integer("sequences", 16384,
                     "Windows of the training files, continued by the target.")
flags.DEFINE_integer("line-prompts", 8192, "<bos> + a definition line of a training file, "
                     "continued by the target (prompts of a user's shape).")
flags.DEFINE_integer("prompt-length", 32, "Tokens per prompt.")
flags.DEFINE_integer("continuation", 96, "Tokens the target generates after each prompt.")
flags.DEFINE_integer("layers", 3, "Drafter layers.")
flags.DEFINE_integer("window", 48,
                     "Drafter sliding window: context + block positions a draft sees.")
flags.DEFINE_list("target-layer-ids", None, "e.g. 1,3,5 (default: spread over the depth).")
flags.DEFINE_integer("batch", 64, "Blocks per optimizer step.")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of initialisation, prompts and batch order.")
flags.DEFINE_string("corpus-cache", None, "Keep the generated corpus in this file (reused by a "
                    "later run with the same target and data settings; several GB).")
flags.DEFINE_integer("threads", 1, "torch CPU threads (small matrices: 1 is fastest, several "
                     "times so on a machine shared with another job).")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"train_demo_drafter: error: unexpected arguments {argv[1:]}; all options are "
              "--flags", file=sys.stderr)
        return 2
    if FLAGS["output-dir"].value is None:
        print("train_demo_drafter: error: --output-dir is required (where the drafter and "
              "its report go)", file=sys.stderr)
        return 2
    layer_ids = FLAGS["target-layer-ids"].value
    try:
        layer_ids = None if layer_ids is None else [int(i) for i in layer_ids]
    except ValueError:
        print(f"train_demo_drafter: error: --target-layer-ids {','.join(layer_ids)} is not a "
              "comma-separated list of layer numbers, e.g. 1,3,5", file=sys.stderr)
        return 2
    torch.set_num_threads(FLAGS.threads)
    torch.set_flush_denormal(True)
    report = trainer.run(
        resolve_user_path(FLAGS["output-dir"].value),
        target_dir=resolve_user_path(FLAGS["target-dir"].value),
        corpus_root=resolve_user_path(FLAGS["corpus-root"].value),
        train_seconds=FLAGS["train-seconds"].value, train_steps=FLAGS["train-steps"].value,
        sequences=FLAGS.sequences, line_prompts_count=FLAGS["line-prompts"].value,
        prompt_length=FLAGS["prompt-length"].value, continuation=FLAGS.continuation,
        layers=FLAGS.layers, window=FLAGS.window, target_layer_ids=layer_ids, batch=FLAGS.batch,
        lr=FLAGS.lr, seed=FLAGS.seed,
        corpus_cache=resolve_user_path(FLAGS["corpus-cache"].value))
    print(trainer.format_report(report))
    return 0


def run() -> None:
    run_command(main, "train_demo_drafter")


if __name__ == "__main__":
    run()
