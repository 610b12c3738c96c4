"""museflash train_demo_dflash2: distil a DFlash2 drafter from the trained demo target, its
candidate selector trained in the loop.

  ./bazelw run //:train_demo_dflash2 -- --output-dir DIR [--corpus-cache FILE]
      [--train-steps N | --train-seconds S] [--layers 3] [--window 32] [--selector-rank 64]

Writes DIR/drafter-dflash2 and DIR/train_demo_dflash2.json and prints held-out acceptance for
K = 4, 8 and 16 (training/train_demo_dflash2.py says how). Relative paths resolve against the
directory Bazel was run from.
"""

from __future__ import annotations

import sys

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.training import train_demo_dflash2 as trainer  # sets OMP_WAIT_POLICY before torch

flags.DEFINE_string("output-dir", None,
                    f"Writes DIR/{trainer.DRAFTER_DIR} and DIR/{trainer.REPORT_FILE}.")
flags.DEFINE_string("target-dir", None,
                    "The target checkpoint with its tokenizer (default: demo/target).")
flags.DEFINE_string("corpus-root", None, "The target's corpus (default: this interpreter's "
                    "stdlib).")
flags.DEFINE_float("train-seconds", None,
                   "Also stop after this many seconds, whichever comes first.")
flags.DEFINE_integer("train-steps", 4000, "Optimizer steps.")
flags.DEFINE_integer("sequences", 16384, "Windows of the training files, continued by the target.")
flags.DEFINE_integer("line-prompts", 8192,
                     "<bos> + a definition line of a training file, continued by the target.")
flags.DEFINE_integer("prompt-length", 32, "Tokens per prompt.")
flags.DEFINE_integer("continuation", 96, "Tokens the target generates after each prompt.")
flags.DEFINE_integer("layers", 3, "Drafter layers.")
flags.DEFINE_integer("window", 32, "Drafter sliding window, per query (|q - k| < window).")
flags.DEFINE_integer("conv-kernel-size", 4, "Offsets of each layer's dynamic convolutions.")
flags.DEFINE_integer("conv-group-size", 16, "Channels sharing one dynamic convolution weight.")
flags.DEFINE_integer("selector-rank", 64, "Width of the candidate selector's codebooks.")
flags.DEFINE_integer("selector-top-k", 8, "Candidates the selector scores per position.")
flags.DEFINE_float("selector-weight", 1.0, "Weight of the selector's loss against the rows'.")
flags.DEFINE_list("target-layer-ids", None, "e.g. 1,3,5 (default: spread over the depth).")
flags.DEFINE_list("block-cycle", [str(k) for k in trainer.v1.EVAL_BLOCKS],
                  "The K of successive steps, cycled.")
flags.DEFINE_integer("batch", 64, "Blocks per optimizer step.")
flags.DEFINE_float("lr", 2e-3, "Peak learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of initialisation, prompts and batch order.")
flags.DEFINE_string("corpus-cache", None, "Keep the generated corpus in this file (shared with "
                    "//:train_demo_drafter runs of the same data settings).")
flags.DEFINE_integer("threads", 1, "torch CPU threads.")

FLAGS = flags.FLAGS


def _integers(flag: str) -> list[int] | None:
    """The comma-separated integers of list flag `flag` (None when unset)."""
    values = FLAGS[flag].value
    return None if values is None else [int(value) for value in values]


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"train_demo_dflash2: error: unexpected arguments {argv[1:]}; all options are "
              "--flags", file=sys.stderr)
        return 2
    if FLAGS["output-dir"].value is None:
        print("train_demo_dflash2: error: --output-dir is required (where the drafter and "
              "its report go)", file=sys.stderr)
        return 2
    try:
        layer_ids, blocks = _integers("target-layer-ids"), _integers("block-cycle")
    except ValueError:
        print("train_demo_dflash2: error: --target-layer-ids and --block-cycle take "
              "comma-separated integers, e.g. 1,3,5", file=sys.stderr)
        return 2
    import torch  # here: the trainer module sets OMP_WAIT_POLICY before torch first loads

    torch.set_num_threads(FLAGS.threads)
    torch.set_flush_denormal(True)
    report = trainer.run(
        resolve_user_path(FLAGS["output-dir"].value),
        target_dir=resolve_user_path(FLAGS["target-dir"].value),
        corpus_root=resolve_user_path(FLAGS["corpus-root"].value),
        train_seconds=FLAGS["train-seconds"].value, train_steps=FLAGS["train-steps"].value,
        sequences=FLAGS.sequences, line_prompts_count=FLAGS["line-prompts"].value,
        prompt_length=FLAGS["prompt-length"].value, continuation=FLAGS.continuation,
        layers=FLAGS.layers, window=FLAGS.window, kernel=FLAGS["conv-kernel-size"].value,
        group=FLAGS["conv-group-size"].value, rank=FLAGS["selector-rank"].value,
        top_k=FLAGS["selector-top-k"].value, selector_weight=FLAGS["selector-weight"].value,
        blocks=tuple(blocks), target_layer_ids=layer_ids, batch=FLAGS.batch, lr=FLAGS.lr,
        seed=FLAGS.seed, corpus_cache=resolve_user_path(FLAGS["corpus-cache"].value))
    print(trainer.format_report(report))
    return 0


def run() -> None:
    run_command(main, "train_demo_dflash2")


if __name__ == "__main__":
    run()
