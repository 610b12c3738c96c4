"""museflash demo_checkpoint: the tiny random pair, written in the real checkpoint layout.

  ./bazelw run //:demo_checkpoint -- --output-dir DIR [--seed 0] [--dtype bf16]
      [--max-shard-bytes N]

Writes DIR/target (config.json with `text_config`, model.safetensors or shards, including
`model.vision_*` keys the loader must ignore) and DIR/drafter (flat config.json, weights
without embedding or lm_head): demo_checkpoint.write_tiny_checkpoints. Relative paths resolve
against the directory Bazel was run from.
"""

from __future__ import annotations

import sys

from absl import flags

from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
from museflash.checkpoint.tensor_files import DTYPES
from museflash.cli.command import run_command
from museflash.paths import resolve_user_path

flags.DEFINE_string("output-dir", None, "Writes DIR/target and DIR/drafter.")
flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
flags.DEFINE_enum("dtype", "bf16", sorted(DTYPES), "Stored dtype of the tensors.")
flags.DEFINE_integer("max-shard-bytes", None,
                     "Write model-0000N-of-0000M.safetensors shards of at most this size.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"demo_checkpoint: error: unexpected arguments {argv[1:]}; all options are "
              "--flags", file=sys.stderr)
        return 2
    if FLAGS["output-dir"].value is None:
        print("demo_checkpoint: error: --output-dir is required (where to write the pair)",
              file=sys.stderr)
        return 2
    target_dir, drafter_dir = write_tiny_checkpoints(
        resolve_user_path(FLAGS["output-dir"].value), FLAGS.seed, FLAGS.dtype,
        max_shard_bytes=FLAGS["max-shard-bytes"].value)
    print(f"wrote {target_dir} and {drafter_dir}")
    return 0


def run() -> None:
    run_command(main, "demo_checkpoint")


if __name__ == "__main__":
    run()
