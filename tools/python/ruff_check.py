"""The lint test: ruff over the Python files given as arguments, with the repository's config."""

import subprocess
import sys


def main() -> int:
    config, *files = sys.argv[1:]
    if not files:
        print("ruff_check: no files to lint; the lint target's data is empty", file=sys.stderr)
        return 1
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", config, *files]
    result = subprocess.run(command, check=False)
    if result.returncode == 0:
        print(f"ruff: {len(files)} files clean")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
