"""swift/Package.swift and swift/BUILD.bazel as an app's Mac build sees them, and the macOS CI
workflow, read as text: nothing here can build for Apple platforms, so these rules are what CI
can check of the Mac build (docs/mac.md)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(os.environ.get("TEST_SRCDIR", ".")) / os.environ.get("TEST_WORKSPACE", "museflash")
PACKAGE = ROOT / "swift" / "Package.swift"
SWIFT_BUILD = ROOT / "swift" / "BUILD.bazel"
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"
FIRST_RUN = ROOT / "tools" / "mac" / "first_run.sh"

# What the Core ML backend calls needs (shared/coreml-api.md): MLModelConfiguration.functionName,
# MLState, makeState() and stateful prediction are macOS 15 / iOS 18.
REQUIRED_PLATFORMS = {"macOS": (15, 0), "iOS": (18, 0)}


def platform_problems(package: str) -> list[str]:
    """Why `package` (Package.swift's text) would not build the Core ML backend on a Mac."""
    found = re.search(r"platforms:\s*\[([^\]]*)\]", package)
    if not found:
        return ["Package.swift declares no platforms:, so SwiftPM builds for the SDK's "
                "oldest deployment target and the Core ML backend's macOS 15 / iOS 18 calls "
                "do not compile"]
    declared = {name: tuple(int(p) for p in version.split("."))
                for name, version in re.findall(r'\.(\w+)\("([\d.]+)"\)', found.group(1))}
    problems = []
    for name, least in REQUIRED_PLATFORMS.items():
        version = declared.get(name)
        if version is None or version < least:
            problems.append(f"platforms: declares {name} {version}, the Core ML backend needs "
                            f"{'.'.join(map(str, least))}")
    return problems


def targets(package: str) -> dict[str, tuple[str, str]]:
    """Each target of Package.swift: name -> (kind, its declaration's text)."""
    body = package[package.index("targets:"):]
    declaration = r"\.(target|executableTarget|testTarget)\("
    starts = [(m.start(), m.group(1)) for m in re.finditer(declaration, body)]
    result = {}
    for (start, kind), (end, _) in zip(starts, starts[1:] + [(len(body), "")], strict=True):
        text = body[start:end]
        name = re.search(r'name:\s*"([^"]+)"', text).group(1)
        result[name] = (kind, text)
    return result


def unsafe_flag_problems(package: str) -> list[str]:
    """Library and executable targets with unsafe flags (SwiftPM refuses them in a package an
    app depends on by version); test targets may have them."""
    return [f"target {name} has unsafeFlags; SwiftPM refuses them in a versioned dependency"
            for name, (kind, text) in targets(package).items()
            if kind != "testTarget" and "unsafeFlags" in text]


def test_package_declares_the_platforms_the_core_ml_backend_needs():
    assert platform_problems(PACKAGE.read_text()) == []


def test_the_platform_rule_sees_a_package_without_or_below_them():
    package = PACKAGE.read_text()
    without = re.sub(r"platforms:\s*\[[^\]]*\],?", "", package)
    assert "declares no platforms" in platform_problems(without)[0]
    lower = package.replace('.macOS("15.0")', '.macOS("14.0")')
    assert platform_problems(lower) == ["platforms: declares macOS (14, 0), the Core ML backend "
                                        "needs 15.0"]


def test_no_library_target_has_unsafe_flags():
    package = PACKAGE.read_text()
    assert "MuseflashRuntime" in targets(package)
    assert unsafe_flag_problems(package) == []


def test_the_unsafe_flag_rule_sees_one_added():
    package = PACKAGE.read_text()
    marked = package.replace('.target(name: "MILInterpreter", dependencies: ["MLPackage"])',
                             '.target(name: "MILInterpreter", dependencies: ["MLPackage"], '
                             'swiftSettings: [.unsafeFlags(["-Ounchecked"])])')
    assert marked != package, "the MILInterpreter line this test edits has changed"
    assert unsafe_flag_problems(marked) == ["target MILInterpreter has unsafeFlags; SwiftPM "
                                            "refuses them in a versioned dependency"]


def test_bazel_builds_every_swiftpm_target_without_ounchecked():
    build = SWIFT_BUILD.read_text()
    bazel = set(re.findall(r'name = "([^"]+)"', build))
    bazel |= set(re.findall(r'module_name = "([^"]+)"', build))
    for name in targets(PACKAGE.read_text()):
        if name in {"ContractOnExportTests", "RuntimeGoldenTests"}:
            continue  # compiled in tests/ against bundles exported there
        spelled = {"swift-generate": "swift-generate", "check-contract": "check-contract",
                   "swift-tokenize": "swift-tokenize"}.get(name, name)
        assert spelled in bazel, f"SwiftPM target {name} has no Bazel target in swift/BUILD.bazel"
    assert "\"-Ounchecked\"" not in build, "a Bazel Swift target has -Ounchecked in its copts"


def test_macos_workflow_builds_tests_and_runs_the_first_run_script():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    jobs = workflow["jobs"]
    assert jobs, "the workflow has no jobs"
    runs = [step.get("run", "") for job in jobs.values() for step in job["steps"]]
    assert all(str(job["runs-on"]).startswith("macos-15") for job in jobs.values())
    script = "\n".join(runs)
    assert "swift build" in script and "swift test" in script
    assert "tools/mac/first_run.sh" in script
    # True is YAML 1.1's reading of a bare `on:` key.
    assert "on" in workflow or True in workflow


def test_first_run_script_parses_and_refuses_unknown_arguments():
    assert os.access(FIRST_RUN, os.X_OK)
    subprocess.run(["bash", "-n", str(FIRST_RUN)], check=True)
    done = subprocess.run(["bash", str(FIRST_RUN), "--no-such-flag"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "--no-such-flag" in done.stderr
