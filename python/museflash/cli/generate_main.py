"""museflash generate: text in, text out over an export, with speculative decoding.

  ./bazelw run //:generate -- --export-dir exported --prompt 'def fibonacci(n):'
      [--max-new-tokens N] [--temperature T] [--top-p P] [--no-draft] [--seed S]
      [--backend export|eager] [--lookup-min-match N]

Streams the text as the target accepts it, then prints the figures (tokens per target call,
accepted drafts per step, wall time against the target alone). The default backend runs the
exported packages with the numpy ML-program interpreter; `eager` runs the same loop on the
torch models rebuilt from the export's source checkpoints. Relative paths resolve against the
directory Bazel was run from.
"""

from __future__ import annotations

import sys

from absl import flags, logging

from museflash.checkpoint.tensor_files import CheckpointError
from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.runtime.generate import BACKENDS, GenerateError, GenerateOptions, generate
from museflash.runtime.speculative import DEFAULT_LOOKUP_MIN_MATCH

flags.DEFINE_string("export-dir", "exported", "Export directory (holds metadata.json).")
flags.DEFINE_string("prompt", None, "Text to continue.")
flags.DEFINE_integer("max-new-tokens", 64, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_float("top-p", 1.0, "Nucleus sampling mass, in (0, 1].")
flags.DEFINE_bool("draft", True, "Use the drafter (--no-draft: the target alone).")
flags.DEFINE_integer("seed", 0, "Seed of the sampler.")
flags.DEFINE_enum("backend", "export", list(BACKENDS),
                  "export: the exported packages (numpy interpreter); eager: torch modules.")
flags.DEFINE_bool("compare", True, "Also time the target alone for the speed-up figure.")
flags.DEFINE_integer("lookup-min-match", DEFAULT_LOOKUP_MIN_MATCH,
                     "A step whose last N tokens occurred before proposes a copy of what "
                     "followed them instead of a draft; 0: draft every step.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"generate: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    logging.set_verbosity(logging.ERROR)
    if FLAGS.prompt is None:
        print("generate: error: --prompt is required (the text to continue)", file=sys.stderr)
        return 2
    options = GenerateOptions(
        export_dir=resolve_user_path(FLAGS["export-dir"].value),
        prompt=FLAGS.prompt,
        max_new_tokens=FLAGS["max-new-tokens"].value,
        temperature=FLAGS.temperature,
        top_p=FLAGS["top-p"].value,
        draft=FLAGS.draft,
        seed=FLAGS.seed,
        backend=FLAGS.backend,
        compare=FLAGS.compare,
        lookup_min_match=FLAGS["lookup-min-match"].value,
    )

    if options.backend == "eager":
        import torch

        # One sequence decodes through small matmuls: a second thread only adds pool wake-ups
        # (measured: 100x slower per call on a loaded 2-core machine).
        torch.set_num_threads(1)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        generate(options, write, print)
    except (GenerateError, CheckpointError) as error:
        print(f"generate: error: {error}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    run_command(main, "generate")


if __name__ == "__main__":
    run()
