"""museflash tokenizer_goldens: the `tokenizers` library's token ids the Swift tokenizer is
tested against, or the two tokenizers' speed side by side.

  tokenizer_goldens OUTPUT.json      (the build runs it: //python:tokenizer_goldens)
  ./bazelw run //python:tokenizer_goldens_tool -- --speed \\
      --swift-tokenize bazel-bin/swift/swift-tokenize --export-dir exported [--repeat 5]

tools/tokenizer_goldens.py says what the goldens hold; docs/tokenizer.md has the speed figures.
Relative paths of --speed resolve against the directory Bazel was run from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import flags

from museflash.cli.command import run_command
from museflash.paths import resolve_user_path
from museflash.tools import tokenizer_goldens

flags.DEFINE_bool("speed", False, "Measure encode throughput instead of writing the goldens.")
flags.DEFINE_string("swift-tokenize", None,
                    "--speed: the swift-tokenize binary (bazel-bin/swift/swift-tokenize).")
flags.DEFINE_string("export-dir", None, "--speed: an export whose tokenizer is measured.")
flags.DEFINE_integer("repeat", 5, "--speed: passes of each side; the best is reported.")

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
    if FLAGS.speed:
        return speed(argv)
    if len(argv) != 2:
        print("tokenizer_goldens: error: give the OUTPUT.json to write (or --speed with "
              "--swift-tokenize BIN --export-dir DIR)", file=sys.stderr)
        return 2
    result = tokenizer_goldens.goldens()
    Path(argv[1]).write_text(json.dumps(result, ensure_ascii=False) + "\n", encoding="utf-8")
    summary = result["held_out"]
    same = "" if summary["same_as_demo_training"] else " (NOT the files the demo was trained with)"
    print(f"{len(result['cases'])} encode cases, {len(result['decodes'])} decode cases; held out: "
          f"{summary['files']} files, {summary['bytes']} bytes from {summary['root']}{same}",
          file=sys.stderr)
    return 0


def speed(argv: list[str]) -> int:
    missing = [f"--{name}" for name in ("swift-tokenize", "export-dir")
               if FLAGS[name].value is None]
    if missing:
        print(f"tokenizer_goldens: error: --speed needs {' and '.join(missing)}",
              file=sys.stderr)
        return 2
    if len(argv) > 1:
        print(f"tokenizer_goldens: error: unexpected arguments {argv[1:]} with --speed",
              file=sys.stderr)
        return 2
    repeat = FLAGS.repeat
    result = tokenizer_goldens.speed(resolve_user_path(FLAGS["swift-tokenize"].value),
                                     resolve_user_path(FLAGS["export-dir"].value), repeat)
    for name in ("tokenizers", "swift"):
        r = result[name]
        print(f"{name:10s} {r['files']} files {r['bytes']:,} bytes {r['tokens']:,} tokens: "
              f"{r['mb_per_s']:.2f} MB/s (best of {repeat}), first pass "
              f"{r['bytes'] / r['first_pass_seconds'] / 1e6:.2f} MB/s")
    print(f"swift / tokenizers: {result['ratio']:.2f}x (first pass "
          f"{result['first_pass_ratio']:.2f}x)")
    print(json.dumps(result))
    return 0


def run() -> None:
    run_command(main, "tokenizer_goldens")


if __name__ == "__main__":
    run()
