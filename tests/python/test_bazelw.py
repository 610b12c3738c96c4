"""./bazelw on a bad environment: each missing piece is named together with its fix, and on a
good one every argument reaches Bazel unchanged."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BAZELW = Path(os.environ.get("MUSEFLASH_BAZELW", "bazelw")).resolve()
TOOLS = ["bash", "tr", "dirname", "id", "grep", "cat", "env"]


@pytest.fixture
def sandbox(tmp_path):
    """A repository copy with only bazelw and .bazelversion, and a PATH of chosen tools."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(BAZELW, repo / "bazelw")
    (repo / ".bazelversion").write_text("4.2.3\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"test needs {tool}"
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    return repo, bin_dir


def _fake(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def _run(repo, bin_dir, *args, **env):
    environment = {"PATH": str(bin_dir), "HOME": str(repo)}
    environment.update(env)
    return subprocess.run([str(bin_dir / "bash"), str(repo / "bazelw"), *args], cwd=repo,
                          env=environment, capture_output=True, text=True, check=False)


def test_missing_swift_names_where_it_looked_and_the_fix(sandbox):
    repo, bin_dir = sandbox
    _fake(bin_dir, "bazel-4", 'echo "bazel ran"')
    result = _run(repo, bin_dir, "test", "//...")
    assert result.returncode == 2
    assert "bazel ran" not in result.stdout
    # Names what is missing, where it looked, and the setting that fixes it.
    assert all(word in result.stderr for word in ("swiftc", "PATH", "SWIFT_HOME"))


def test_bad_swift_home_lists_the_paths_tried(sandbox, tmp_path):
    repo, bin_dir = sandbox
    _fake(bin_dir, "bazel-4", 'echo "bazel ran"')
    home = tmp_path / "not-swift"
    result = _run(repo, bin_dir, "build", SWIFT_HOME=str(home))
    assert result.returncode == 2
    assert f"{home}/usr/bin/swiftc, {home}/bin/swiftc, PATH" in result.stderr


def test_missing_bazel_without_apt_says_what_to_install(sandbox):
    repo, bin_dir = sandbox
    result = _run(repo, bin_dir, "test", "//...")
    assert result.returncode == 2
    assert "no apt-get" in result.stderr
    assert "bazel-bootstrap" in result.stderr


def test_failed_apt_install_says_how_to_fix(sandbox):
    repo, bin_dir = sandbox
    _fake(bin_dir, "apt-get", "exit 100")
    result = _run(repo, bin_dir, "test", "//...")
    assert result.returncode == 2
    # The fix: the package to install, and how.
    assert "apt-get install" in result.stderr and "bazel-bootstrap" in result.stderr


def test_arguments_pass_through_unchanged(sandbox):
    repo, bin_dir = sandbox
    _fake(bin_dir, "bazel-4", 'for a in "$@"; do printf "<%s>\\n" "$a"; done')
    _fake(bin_dir, "swiftc", "exit 0")
    args = ["run", "//:export", "--", "--output-dir", "my dir/with spaces", "--x=a'b\"c", ""]
    result = _run(repo, bin_dir, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"<{a}>" for a in args]
