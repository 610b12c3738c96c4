"""The Swift tools read `--flag=value` as `--flag value` (swift/Sources/CommandLineFlags), and
refuse a value given to a flag that takes none in one line: swift-tokenize, swift-generate and
check-contract, run as a user runs them on a bundle the build exported."""

import json
import os
import subprocess
from pathlib import Path

import pytest

BUNDLE = os.environ["MUSEFLASH_EXPORT_DIR"]
TOOLS = {name: Path(os.environ[variable]) for name, variable in (
    ("swift-tokenize", "MUSEFLASH_SWIFT_TOKENIZE"),
    ("swift-generate", "MUSEFLASH_SWIFT_GENERATE"),
    ("check-contract", "MUSEFLASH_CHECK_CONTRACT"))}


def run(tool, *args):
    return subprocess.run([str(TOOLS[tool]), *args], capture_output=True, text=True,
                          timeout=600, check=False)


def test_swift_tokenize_reads_both_spellings_alike():
    spaced = run("swift-tokenize", "--export-dir", BUNDLE, "--prompt", "def f(x): return x")
    joined = run("swift-tokenize", f"--export-dir={BUNDLE}", "--prompt=def f(x): return x")
    assert spaced.returncode == joined.returncode == 0, spaced.stderr + joined.stderr
    ids = json.loads(joined.stdout)
    assert ids == json.loads(spaced.stdout) and len(ids) > 3
    decoded = run("swift-tokenize", f"--export-dir={BUNDLE}", f"--decode={','.join(map(str, ids))}")
    assert decoded.returncode == 0 and decoded.stdout.rstrip("\n") == "def f(x): return x"


def test_swift_generate_reads_both_spellings_alike():
    common = ["--prompt-ids", "1,2,3", "--format", "json", "--no-compare"]
    spaced = run("swift-generate", "--export-dir", BUNDLE, "--max-new-tokens", "4", *common)
    joined = run("swift-generate", f"--export-dir={BUNDLE}", "--max-new-tokens=4", *common)
    assert spaced.returncode == joined.returncode == 0, spaced.stderr + joined.stderr
    assert json.loads(joined.stdout)["tokens"] == json.loads(spaced.stdout)["tokens"]
    assert len(json.loads(joined.stdout)["tokens"]) == 4


def test_check_contract_reads_both_spellings_alike():
    spaced = run("check-contract", "--export-dir", BUNDLE)
    joined = run("check-contract", f"--export-dir={BUNDLE}")
    assert spaced.returncode == joined.returncode == 0, spaced.stdout + spaced.stderr
    assert joined.stdout == spaced.stdout


@pytest.mark.parametrize(("tool", "args", "flag", "status"), [
    ("swift-tokenize", ["--decode", "1", "--skip-special-tokens=yes"], "--skip-special-tokens", 1),
    ("swift-generate", ["--prompt-ids", "1", "--no-draft=1"], "--no-draft", 1),
    ("swift-tokenize", ["--prompt"], "--prompt", 1),
    ("swift-generate", ["--max-new-tokens"], "--max-new-tokens", 1),
    ("check-contract", ["--verbose=1"], "--verbose", 2),
])
def test_a_flag_given_what_it_cannot_take_is_one_line(tool, args, flag, status):
    result = run(tool, f"--export-dir={BUNDLE}", *args)
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tool}:") and flag in lines[0], lines
    assert "Fatal error" not in result.stderr and result.stdout == ""
