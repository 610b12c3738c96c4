"""Entry point of every pytest_test target: runs pytest on the files Bazel passes as arguments."""

import os
import sys

import pytest


def main() -> int:
    # Bazel's runfiles tree is read-only in spirit: keep pytest's cache and bytecode out of it.
    sys.dont_write_bytecode = True
    args = ["-p", "no:cacheprovider", "-q", "-rfEs"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args += ["--junitxml", xml]
    return pytest.main(args + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
