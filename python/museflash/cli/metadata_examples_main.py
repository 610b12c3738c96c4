"""museflash metadata_examples: the golden metadata.json examples both readers are tested against.

  metadata_examples OUTPUT.json      (the build runs it: //python:metadata_examples)

Writes tools/metadata_examples.py's `examples()` to OUTPUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from museflash.cli.command import run_command
from museflash.tools.metadata_examples import examples


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("metadata_examples: error: give the OUTPUT.json to write, and nothing else",
              file=sys.stderr)
        return 2
    Path(argv[1]).write_text(json.dumps(examples(), indent=1) + "\n")
    return 0


def run() -> None:
    run_command(main, "metadata_examples")


if __name__ == "__main__":
    run()
