"""museflash metadata_schema: the JSON Schema of metadata.json, generated from museflash.bundle.

  ./bazelw run //:metadata_schema            # rewrites docs/metadata.schema.json in the workspace
  ./bazelw run //:metadata_schema -- FILE    # writes FILE instead

tests/python/test_bundle.py fails while the checked-in schema differs from the generated one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from museflash.bundle import schema_text
from museflash.cli.command import run_command

CHECKED_IN = Path("docs") / "metadata.schema.json"


def main(argv: list[str]) -> int:
    if len(argv) > 2:
        print(f"metadata_schema: error: unexpected arguments {argv[2:]}; give at most one FILE",
              file=sys.stderr)
        return 2
    workspace = Path(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."))
    destination = Path(argv[1]) if len(argv) == 2 else workspace / CHECKED_IN
    destination.write_text(schema_text())
    print(f"wrote {destination}")
    return 0


def run() -> None:
    run_command(main, "metadata_schema")


if __name__ == "__main__":
    run()
