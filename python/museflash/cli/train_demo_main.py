"""museflash train_demo: train the demo target on the Python standard library's sources, on CPU.

  ./bazelw run //:train_demo -- --output-dir DIR [--minutes 26 | --steps N] [--seed 0]

Writes DIR/target and DIR/train_demo.json and prints the held-out perplexity and bits per byte
(training/train_demo.py says how; docs/demo.md has the committed run). Relative paths resolve
against the directory Bazel was run from.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.training import train_demo  # sets OMP_WAIT_POLICY before anything loads torch

ARCH, SETTINGS = train_demo.Architecture(), train_demo.Settings(output_dir=Path("."))
flags.DEFINE_string("output-dir", None, "Writes DIR/target and DIR/train_demo.json.")
flags.DEFINE_float("minutes", SETTINGS.minutes, "Training-loop time budget.")
flags.DEFINE_integer("steps", None, "Exact number of optimiser steps (overrides --minutes).")
flags.DEFINE_integer("seed", SETTINGS.seed, "Seed of initialisation and batch order.")
flags.DEFINE_integer("threads", SETTINGS.threads, "torch CPU threads.")
flags.DEFINE_integer("vocab-size", SETTINGS.vocab_size, "Tokens, special ones included.")
flags.DEFINE_integer("context", SETTINGS.context, "Training sequence length.")
flags.DEFINE_integer("batch-size", SETTINGS.batch_size, "Sequences per step.")
flags.DEFINE_float("lr", SETTINGS.learning_rate, "Peak AdamW learning rate.")
flags.DEFINE_integer("warmup-steps", SETTINGS.warmup_steps, "Linear warmup steps.")
flags.DEFINE_bool("include-tests", SETTINGS.include_tests,
                  "Also train on the stdlib's test packages.")
flags.DEFINE_integer("hidden-size", ARCH.hidden_size, "Model width.")
flags.DEFINE_integer("intermediate-size", ARCH.intermediate_size, "MLP width.")
flags.DEFINE_integer("layers", ARCH.num_hidden_layers, "Decoder layers.")
flags.DEFINE_integer("heads", ARCH.num_attention_heads, "Query heads.")
flags.DEFINE_integer("kv-heads", ARCH.num_key_value_heads, "Key/value heads.")
flags.DEFINE_integer("head-dim", ARCH.head_dim, "Attention head width.")
flags.DEFINE_integer("sliding-window", ARCH.sliding_window, "Sliding layers' window.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"train_demo: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    if FLAGS["output-dir"].value is None:
        print("train_demo: --output-dir is required", file=sys.stderr)
        return 2
    arch = train_demo.Architecture(
        hidden_size=FLAGS["hidden-size"].value,
        intermediate_size=FLAGS["intermediate-size"].value,
        num_hidden_layers=FLAGS["layers"].value,
        num_attention_heads=FLAGS["heads"].value,
        num_key_value_heads=FLAGS["kv-heads"].value,
        head_dim=FLAGS["head-dim"].value,
        sliding_window=FLAGS["sliding-window"].value,
        global_every=ARCH.global_every,
    )
    settings = train_demo.Settings(
        output_dir=resolve_user_path(FLAGS["output-dir"].value),
        seed=FLAGS.seed,
        minutes=FLAGS.minutes,
        steps=FLAGS.steps,
        threads=FLAGS.threads,
        vocab_size=FLAGS["vocab-size"].value,
        context=FLAGS.context,
        batch_size=FLAGS["batch-size"].value,
        learning_rate=FLAGS.lr,
        warmup_steps=FLAGS["warmup-steps"].value,
        include_tests=FLAGS["include-tests"].value,
        arch=arch,
    )
    train_demo.run(settings, lambda line: print(line, flush=True))
    return 0


def run() -> None:
    run_command(main, "train_demo")


if __name__ == "__main__":
    run()
