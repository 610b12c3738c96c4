"""The Swift contract check on a real export, broken one property at a time.

The bundle is exported by a Bazel build action (//tests/integration:demo_bundle); each test
copies it, breaks one thing in the protobuf spec, the metadata or the package layout, runs the
check-contract binary and asserts on the exact property (or input error) it reports.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from coremltools.proto import Model_pb2

BUNDLE = Path(os.environ.get("MUSEFLASH_EXPORT_DIR", "tests/integration/demo_bundle"))
CHECKER = Path(os.environ.get("MUSEFLASH_CHECK_CONTRACT", "swift/check-contract"))
SPEC = Path("Data") / "com.apple.CoreML" / "model.mlmodel"


@pytest.fixture
def bundle(tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(BUNDLE, copy, ignore=shutil.ignore_patterns("weights"))
    return copy


def check(bundle):
    result = subprocess.run([str(CHECKER), "--export-dir", str(bundle)], capture_output=True,
                            text=True, check=False)
    failed = {line.split(" ")[1].rstrip(":") for line in result.stdout.splitlines()
              if line.startswith("FAIL ")}
    passed = {line.split(" ")[1] for line in result.stdout.splitlines()
              if line.startswith("PASS ")}
    return result, failed, passed


def edit_spec(package, edit):
    path = package / SPEC
    spec = Model_pb2.Model()
    spec.ParseFromString(path.read_bytes())
    edit(spec)
    path.write_bytes(spec.SerializeToString())


def function(spec, name):
    return next(f for f in spec.description.functions if f.name == name)


def test_the_exported_bundle_satisfies_every_property(bundle):
    result, failed, passed = check(bundle)
    assert result.returncode == 0, result.stdout + result.stderr
    assert failed == set()
    assert {"drafter.functions", "drafter.shared_states", "target.outputs"} <= passed


def test_renamed_drafter_function(bundle):
    def rename(spec):
        function(spec, "draft").name = "draft_v2"
        spec.description.defaultFunctionName = "draft_v2"

    edit_spec(bundle / "dflash_drafter.mlpackage", rename)
    result, failed, _ = check(bundle)
    assert result.returncode == 1
    assert "drafter.functions" in failed
    assert not any(name.startswith("metadata.") for name in failed)


def test_one_function_with_another_state_shape(bundle):
    def widen(spec):
        state = function(spec, "inject_kv").state[0].type.stateType.arrayType
        state.shape[2] += 32

    edit_spec(bundle / "dflash_drafter.mlpackage", widen)
    result, failed, passed = check(bundle)
    assert result.returncode == 1
    assert "drafter.shared_states" in failed
    assert "drafter.functions" in passed


def test_dropped_target_output(bundle):
    def drop(spec):
        outputs = function(spec, "main").output
        index = next(i for i, o in enumerate(outputs) if o.name == "drafter_features")
        del outputs[index]

    edit_spec(bundle / "target.mlpackage", drop)
    result, failed, passed = check(bundle)
    assert result.returncode == 1
    assert "target.outputs" in failed
    assert "drafter.draft_signature" in passed


def test_changed_metadata_value(bundle):
    path = bundle / "metadata.json"
    metadata = json.loads(path.read_text())
    metadata["speculative_decoding"]["block_size"] += 1
    path.write_text(json.dumps(metadata))
    result, failed, _ = check(bundle)
    assert result.returncode == 1
    assert {"target.embedded_metadata", "dflash_drafter.embedded_metadata",
            "drafter.draft_signature"} <= failed


def test_missing_manifest_is_an_input_error(bundle):
    (bundle / "target.mlpackage" / "Manifest.json").unlink()
    result, _, _ = check(bundle)
    assert result.returncode == 2
    assert "Manifest.json" in result.stderr


def test_truncated_spec_is_an_input_error(bundle):
    path = bundle / "dflash_drafter.mlpackage" / SPEC
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result, _, _ = check(bundle)
    assert result.returncode == 2
    assert "model.mlmodel" in result.stderr
    assert "Traceback" not in result.stderr and "Fatal error" not in result.stderr


def test_manifest_path_leaving_the_package_is_refused(bundle):
    manifest_path = bundle / "target.mlpackage" / "Manifest.json"
    manifest = json.loads(manifest_path.read_text())
    root = manifest["rootModelIdentifier"]
    manifest["itemInfoEntries"][root]["path"] = "../../dflash_drafter.mlpackage/" + str(SPEC)
    manifest_path.write_text(json.dumps(manifest))
    result, _, _ = check(bundle)
    assert result.returncode == 2
    assert "outside the package" in result.stderr
