"""museflash verify: check an export against its source checkpoints and decode with it.

  ./bazelw run //:verify -- --export-dir exported [--prompt-tokens N --new-tokens M]
      [--checkpoint DIR --drafter-checkpoint DIR]

The checkpoints default to the `source` record of metadata.json (`builtin:demo` regenerates the
demo pair). Exit status: 0 everything passed, 1 a mismatch, 2 unusable input.
Relative paths resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from absl import flags, logging

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path

if TYPE_CHECKING:  # checks.verify imports torch: it loads when verify runs, not for --help
    from museflash.checks.verify import VerifyOptions

flags.DEFINE_string("export-dir", None, "Export directory (holds metadata.json).")
flags.DEFINE_integer("prompt-tokens", None,
                     "Length of the deterministic prompt (default: 1.5 prefill chunks).")
flags.DEFINE_integer("new-tokens", 24, "Tokens to generate with speculative decoding.")
flags.DEFINE_string("checkpoint", None,
                    "Target checkpoint (default: metadata.json source.checkpoint).")
flags.DEFINE_string("drafter-checkpoint", None,
                    "Drafter checkpoint (default: metadata.json source.drafter_checkpoint).")

FLAGS = flags.FLAGS


def options_from_flags() -> VerifyOptions:
    from museflash.checks.verify import VerifyOptions

    return VerifyOptions(
        export_dir=resolve_user_path(FLAGS["export-dir"].value),
        prompt_tokens=FLAGS["prompt-tokens"].value,
        new_tokens=FLAGS["new-tokens"].value,
        checkpoint=resolve_user_path(FLAGS["checkpoint"].value),
        drafter_checkpoint=resolve_user_path(FLAGS["drafter-checkpoint"].value),
    )


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"verify: error: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    if FLAGS["export-dir"].value is None:
        print("verify: error: --export-dir is required", file=sys.stderr)
        return 2
    # coremltools logs graph passes at INFO through absl's handler; keep the figures readable.
    logging.set_verbosity(logging.WARNING)
    from museflash.checks.verify import run_verify

    return run_verify(options_from_flags())


def run() -> None:
    run_command(main, "verify")


if __name__ == "__main__":
    run()
