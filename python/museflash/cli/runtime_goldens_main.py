"""museflash runtime_goldens: golden files of the reference decoding loop over one export.

  runtime_goldens --export-dir D --output F.json [--prompt-lengths 1,7,31,33,200]
      [--max-new-tokens N] [--wrap-prompt-length L] [--parity-steps 0,-1]

The build runs it for tests/runtime's bundles (//tests/runtime:runtime_goldens_tool);
tools/runtime_goldens.py says what the file holds. Relative paths resolve against the directory
Bazel was run from.
"""

from __future__ import annotations

import json
import sys

from absl import flags, logging

from museflash.bundle import BundleError
from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools import runtime_goldens  # sets OPENBLAS_NUM_THREADS before numpy loads

flags.DEFINE_string("export-dir", None, "Export directory (holds metadata.json).")
flags.DEFINE_string("output", None, "The golden JSON file to write.")
flags.DEFINE_string("prompt-lengths", runtime_goldens.DEFAULT_PROMPT_LENGTHS,
                    "Comma-separated prompt lengths in tokens, one speculative and one "
                    "target-only case each.")
flags.DEFINE_integer("max-new-tokens", 48,
                     "New tokens per case (fewer when the context has no room for them).")
flags.DEFINE_integer("wrap-prompt-length", 33,
                     "The prompt length (one of --prompt-lengths) whose cases generate until "
                     "the rings wrap while decoding; the parity records come from its "
                     "speculative case; 0: no such case and no parity records.")
flags.DEFINE_string("parity-steps", "0,-1",
                    "Which calls of each function of the ring-wrapping speculative case become "
                    "parity records: indices into that function's calls, negative from the end.")

FLAGS = flags.FLAGS


def _int_list(flag: str, value: str) -> list[int]:
    try:
        values = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise runtime_goldens.GoldensError(f"--{flag} {value!r} is not a comma-separated "
                                           "list of integers") from None
    if not values:
        raise runtime_goldens.GoldensError(f"--{flag} is empty")
    return values


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"runtime_goldens: unexpected arguments {argv[1:]}; all options are --flags",
              file=sys.stderr)
        return 2
    logging.set_verbosity(logging.ERROR)
    if FLAGS["export-dir"].value is None or FLAGS.output is None:
        print("runtime_goldens: error: --export-dir and --output are required",
              file=sys.stderr)
        return 2
    export_dir = resolve_user_path(FLAGS["export-dir"].value)
    output = resolve_user_path(FLAGS.output)
    try:
        lengths = _int_list("prompt-lengths", FLAGS["prompt-lengths"].value)
        if min(lengths) < 1:
            raise runtime_goldens.GoldensError("--prompt-lengths must be positive")
        goldens = runtime_goldens.build_goldens(
            export_dir, lengths, FLAGS["max-new-tokens"].value, FLAGS["wrap-prompt-length"].value,
            _int_list("parity-steps", FLAGS["parity-steps"].value), say=print)
    except (runtime_goldens.GoldensError, BundleError, OSError) as error:
        print(f"runtime_goldens: error: {error}", file=sys.stderr)
        return 2
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    partial.write_text(json.dumps(goldens, indent=1) + "\n")
    partial.replace(output)
    print(f"[runtime_goldens] wrote {output} ({output.stat().st_size:,} bytes, "
          f"{len(goldens['cases'])} cases, {len(goldens['parity'])} parity records)")
    return 0


def run() -> None:
    run_command(main, "runtime_goldens")


if __name__ == "__main__":
    run()
