"""Every command line starts, defines its flags once, and prints its help."""

import subprocess
import sys

import pytest

from museflash.paths import resolve_user_path


@pytest.mark.parametrize(
    ("module", "flag"),
    [
        ("museflash.cli.export_main", "--fused-target"),
        ("museflash.cli.verify_main", "--export-dir"),
        ("museflash.cli.benchmark_main", "--sizes"),
    ],
)
def test_cli_help_lists_its_flags(module, flag):
    result = subprocess.run([sys.executable, "-m", module, "--helpfull"], capture_output=True,
                            text=True, check=False)
    # absl exits 1 after --helpfull; a flag defined twice would exit 1 with a traceback instead.
    assert result.returncode in (0, 1)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert flag in result.stdout


def test_relative_paths_resolve_against_the_bazel_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert resolve_user_path("out") == tmp_path / "out"
    assert resolve_user_path("/abs/out") == tmp_path.anchor / type(tmp_path)("abs/out")
    assert resolve_user_path(None) is None
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY")
    monkeypatch.chdir(tmp_path)
    assert resolve_user_path("x") == tmp_path / "x"
