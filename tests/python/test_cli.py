"""Every entry point is a command line of museflash.cli: each starts, defines its flags once and
prints its help; a flag it cannot parse is one line and exit status 2; `--no-flag` turns a
boolean off as absl's `--noflag` does."""

import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

import museflash
from museflash.cli.command import dashed_negations
from museflash.paths import resolve_user_path

PACKAGE_ROOT = Path(museflash.__file__).parent
# A flag each command line defines, as its help lists it.
COMMANDS = {
    "benchmark_main": "--sizes:",
    "chat_figures_main": "--history-tokens:",
    "compression_figures_main": "--[no]exports:",
    "demo_checkpoint_main": "--output-dir:",
    "drafter_speedup_main": "--max-new-tokens:",
    "demo_figures_main": "--num-draft-tokens:",
    "export_main": "--[no]fused-target:",
    "generate_main": "--[no]draft:",
    "metadata_examples_main": None,  # a positional OUTPUT.json only
    "metadata_schema_main": None,  # a positional FILE only
    "norm_figures_main": "--width:",
    "quantized_quality_main": "--max-tokens:",
    "runtime_benchmark_main": "--swift-generate:",
    "runtime_goldens_main": "--parity-steps:",
    "target_speed_main": "--threads:",
    "tokenizer_goldens_main": "--[no]speed:",
    "train_demo_dflash2_main": "--selector-rank:",
    "train_demo_drafter_main": "--target-layer-ids:",
    "train_demo_main": "--kv-heads:",
    "train_drafter_main": "--anchors-per-row:",
    "train_smollm2_drafter_main": "--corpus-cache:",
    "traffic_main": "--geometry-context:",
    "tree_figures_main": "--budgets:",
    "verify_main": "--export-dir:",
}


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", f"museflash.cli.{module}", *args],
                          capture_output=True, text=True, check=False)


def test_every_command_line_is_listed():
    assert {p.stem for p in (PACKAGE_ROOT / "cli").glob("*_main.py")} == set(COMMANDS)


def test_no_entry_point_outside_cli_but_the_helper_processes():
    """Only cli/ has `if __name__ == "__main__"`, besides the export's and the benchmark's
    helper processes, which speak a protocol of their own, not flags."""
    found = {p.relative_to(PACKAGE_ROOT).as_posix() for p in PACKAGE_ROOT.rglob("*.py")
             if "__main__" in p.read_text() and p.parent.name != "cli"}
    assert found == {"export/parallel.py", "tools/benchmark.py"}


@pytest.mark.parametrize(("module", "flag"), sorted(COMMANDS.items()))
def test_cli_help_lists_its_flags(module, flag):
    result = _run(module, "--helpfull")
    # absl exits 1 after --helpfull; a flag defined twice would exit 1 with a traceback instead.
    assert result.returncode in (0, 1)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert flag is None or flag in result.stdout


@pytest.mark.parametrize("module", ["export_main", "generate_main", "verify_main"])
def test_the_users_commands_define_their_flags_without_torch(module):
    """export, generate and verify load torch and the exporter or runtime only once they run:
    their --help and a mistyped flag answer in a fraction of a second, not the seconds torch
    takes to import."""
    probe = (f"import sys, museflash.cli.{module}; "
             "print(sorted({'torch', 'coremltools'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("module", ["export_main", "demo_checkpoint_main", "verify_main"])
def test_an_unknown_flag_is_one_line_and_status_2(module):
    result = _run(module, "--no-such-flag=3")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "no-such-flag" in lines[0] and "--help" in lines[0], lines
    assert lines[0].startswith(module.removesuffix("_main") + ": error: ")


def test_a_value_of_the_wrong_type_is_one_line_and_status_2():
    result = _run("demo_checkpoint_main", "--output-dir=out", "--seed=many")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "--seed" in lines[0] and "many" in lines[0], lines


def test_a_boolean_is_turned_off_with_or_without_the_dash():
    flags.DEFINE_bool("dashed-negation-probe", True, "A boolean for this test.")
    flags.DEFINE_bool("no-dash", False, "A flag whose own name starts with no-.")
    flags.DEFINE_string("plain", "", "Not a boolean.")
    argv = ["prog", "--no-dashed-negation-probe", "--no-dash", "--no-plain", "--", "--no-x"]
    assert dashed_negations(argv) == ["prog", "--nodashed-negation-probe", "--no-dash",
                                      "--no-plain", "--", "--no-x"]
    for spelled in (["--no-dashed-negation-probe"], ["--nodashed-negation-probe"]):
        flags.FLAGS(dashed_negations(["prog", *spelled]))
        assert flags.FLAGS["dashed-negation-probe"].value is False
        flags.FLAGS.unparse_flags()


def test_relative_paths_resolve_against_the_bazel_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert resolve_user_path("out") == tmp_path / "out"
    assert resolve_user_path("/abs/out") == tmp_path.anchor / type(tmp_path)("abs/out")
    assert resolve_user_path(None) is None
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY")
    monkeypatch.chdir(tmp_path)
    assert resolve_user_path("x") == tmp_path / "x"
