"""What the swift-generate tests share: running the binary, a writable copy of a bundle, and
the check that bad input gets one line on stderr and exit status 1."""

import os
import shutil
import subprocess
from pathlib import Path

GENERATE = Path(os.environ.get("MUSEFLASH_SWIFT_GENERATE", "swift/swift-generate"))


def run(*args, timeout=600):
    return subprocess.run([str(GENERATE), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)


def writable_copy(source: Path, destination: Path) -> Path:
    """A copy of a Bazel-built bundle (whose files are read-only) that a test may damage."""
    shutil.copytree(source, destination)
    for path in destination.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return destination


def assert_one_line_error(result, *keywords):
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("swift-generate: error:"), lines[0]
    for keyword in keywords:
        assert keyword in lines[0], (keyword, lines[0])
    assert "Fatal error" not in result.stderr
