"""The Swift contract check on a real export, broken one property at a time.

The bundles are exported by Bazel build actions (//tests/integration:demo_bundle, and
:compressed_bundle with weights stored as constexpr ops); each test copies one, breaks one
thing in the protobuf spec, the weight file, the metadata or the package layout, runs the
check-contract binary and asserts on the exact property (or input error) it reports.
"""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from coremltools.proto import Model_pb2
from package_surgery import constexpr_weights, set_embedded_metadata, set_input_shape, store_as_fp16

BUNDLE = Path(os.environ.get("MUSEFLASH_EXPORT_DIR", "tests/integration/demo_bundle"))
COMPRESSED = Path(os.environ.get("MUSEFLASH_COMPRESSED_EXPORT_DIR",
                                 "tests/integration/compressed_bundle"))
DFLASH2 = Path(os.environ.get("MUSEFLASH_DFLASH2_EXPORT_DIR",
                              "tests/runtime/dflash2_bundle"))
SLICE = Path(os.environ.get("MUSEFLASH_SLICE_EXPORT_DIR", "tests/runtime/dflash2_slice_bundle"))
# The planted fp16 pair whose audit folds 7 norms' weights into their factor (docs/fp16.md).
FOLDED = Path(os.environ.get("MUSEFLASH_FOLDED_EXPORT_DIR",
                             "tests/runtime/fp16_small_channels_bundle"))
CHECKER = Path(os.environ.get("MUSEFLASH_CHECK_CONTRACT", "swift/check-contract"))
SPEC = Path("Data") / "com.apple.CoreML" / "model.mlmodel"


def interface_copy(source, destination):
    """A writable copy of an exported bundle, weight files included (the checker reads the
    header of every blob the programs reference: `<owner>.weight_file`)."""
    shutil.copytree(source, destination)
    for path in destination.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return destination


@pytest.fixture
def bundle(tmp_path):
    return interface_copy(BUNDLE, tmp_path / "bundle")


def check(bundle):
    result = subprocess.run([str(CHECKER), "--export-dir", str(bundle)], capture_output=True,
                            text=True, check=False)
    failed = {line.split(" ")[1].rstrip(":") for line in result.stdout.splitlines()
              if line.startswith("FAIL ")}
    passed = {line.split(" ")[1] for line in result.stdout.splitlines()
              if line.startswith("PASS ")}
    return result, failed, passed


def every_property_holds(bundle):
    """The names of the properties that passed, after asserting that none failed."""
    result, failed, passed = check(bundle)
    assert result.returncode == 0, result.stdout + result.stderr
    assert failed == set()
    return passed


def edit_spec(package, edit):
    path = package / SPEC
    spec = Model_pb2.Model()
    spec.ParseFromString(path.read_bytes())
    edit(spec)
    path.write_bytes(spec.SerializeToString())


def function(spec, name):
    return next(f for f in spec.description.functions if f.name == name)


def test_the_exported_bundle_satisfies_every_property(bundle):
    passed = every_property_holds(bundle)
    assert {"drafter.functions", "drafter.shared_states", "target.outputs"} <= passed


def test_renamed_drafter_function(bundle):
    def rename(spec):
        function(spec, "draft").name = "draft_v2"

    edit_spec(bundle / "target.mlpackage", rename)
    result, failed, _ = check(bundle)
    assert result.returncode == 1
    assert "drafter.functions" in failed
    assert not any(name.startswith("metadata.") for name in failed)


def test_one_function_with_another_state_shape(bundle):
    def widen(spec):
        state = function(spec, "inject_kv").state[0].type.stateType.arrayType
        state.shape[2] += 32

    edit_spec(bundle / "target.mlpackage", widen)
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
    assert {"target.embedded_metadata", "drafter.draft_signature"} <= failed


def test_missing_manifest_is_an_input_error(bundle):
    (bundle / "target.mlpackage" / "Manifest.json").unlink()
    result, _, _ = check(bundle)
    assert result.returncode == 2
    assert "Manifest.json" in result.stderr


def test_truncated_spec_is_an_input_error(bundle):
    path = bundle / "target.mlpackage" / SPEC
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    result, _, _ = check(bundle)
    assert result.returncode == 2
    assert "model.mlmodel" in result.stderr
    assert "Traceback" not in result.stderr and "Fatal error" not in result.stderr


WEIGHT_FILE = Path("Data") / "com.apple.CoreML" / "weights" / "weight.bin"


@pytest.mark.parametrize("damage", [
    lambda data: data[:len(data) // 3],  # cut to a third (check-contract passed it, issue 25)
    lambda data: data[:-1],  # the last payload one byte short
    lambda data: bytes(len(data)),  # zero-filled
], ids=["cut_to_a_third", "one_byte_short", "zero_filled"])
def test_damaged_weight_file_fails_weight_file(bundle, damage):
    path = bundle / "target.mlpackage" / WEIGHT_FILE
    path.write_bytes(damage(path.read_bytes()))
    result, failed, _ = check(bundle)
    assert result.returncode == 1, result.stdout + result.stderr
    assert failed == {"target.weight_file"}, result.stdout
    assert "weight.bin" in result.stdout


def test_manifest_path_leaving_the_package_is_refused(bundle):
    manifest_path = bundle / "target.mlpackage" / "Manifest.json"
    manifest = json.loads(manifest_path.read_text())
    root = manifest["rootModelIdentifier"]
    manifest["itemInfoEntries"][root]["path"] = "../../elsewhere.mlpackage/" + str(SPEC)
    manifest_path.write_text(json.dumps(manifest))
    result, _, _ = check(bundle)
    assert result.returncode == 2
    assert "outside the package" in result.stderr


# --- The compressed bundle ------------------------------------------------------------------

COMPRESSION_PROPERTIES = ("ops_declared", "stored_compressed", "bytes", "functions_agree")
LINEAR = "constexpr_blockwise_shift_scale"


@pytest.fixture
def compressed(tmp_path):
    """A copy of the compressed bundle, weight files included (their blob headers are checked)."""
    copy = tmp_path / "compressed"
    shutil.copytree(COMPRESSED, copy)
    for path in copy.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


def blockwise_weight(package):
    """The name and (data, scale) shapes of a weight stored int4 in blocks (scale [O, I/block])."""
    for name, (op_type, inputs) in constexpr_weights(package).items():
        if op_type == LINEAR and inputs["scale"][1][1] > 1:
            return name, inputs["data"][1], inputs["scale"][1]
    raise AssertionError(f"no blockwise {LINEAR} in {package}")


def rewrite_metadata(bundle, edit):
    """Edits metadata.json and, alike, the copy every package embeds (so only what the edit
    says is wrong, not the copies' disagreement)."""
    path = bundle / "metadata.json"
    metadata = json.loads(path.read_text())
    edit(metadata)
    text = json.dumps(metadata, indent=2) + "\n"
    path.write_text(text)
    for asset in metadata["assets"].values():
        set_embedded_metadata(bundle / asset["path"], text)


def test_the_compressed_bundle_satisfies_every_property(compressed):
    passed = every_property_holds(compressed)
    metadata = json.loads((compressed / "metadata.json").read_text())
    assert {group["mode"] for group in metadata["compression"]["groups"]} == {
        "linear", "affine", "palettize"}
    # One package holds the target's and the drafter's functions: its owner, target, names
    # the per-package properties.
    assert {asset["path"] for asset in metadata["assets"].values()} == {"target.mlpackage"}
    assert {f"target.compression.{name}" for name in COMPRESSION_PROPERTIES} | {
        "metadata.compression", "package.functions"} <= passed
    assert not any(name.startswith("dflash_drafter.compression") for name in passed)
    ops = {op_type for op_type, _ in constexpr_weights(compressed / "target.mlpackage").values()}
    assert ops == {LINEAR, "constexpr_lut_to_dense"}


def test_weight_stored_as_fp16(compressed):
    package = compressed / "target.mlpackage"
    name, _, _ = blockwise_weight(package)
    # Every target function: the drafter's may use the same name for another tensor.
    assert store_as_fp16(package, name, functions=("main", "prefill", "decode", "tree")) == 4
    result, failed, passed = check(compressed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "target.compression.stored_compressed" in failed
    assert {"target.compression.ops_declared", "target.compression.functions_agree",
            "target.embedded_metadata"} <= passed


def test_scale_shape_with_the_wrong_block_size(compressed):
    package = compressed / "target.mlpackage"
    name, _, (rows, blocks) = blockwise_weight(package)
    set_input_shape(package, name, "scale", [rows, 2 * blocks])
    result, failed, passed = check(compressed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "target.compression.ops_declared" in failed
    assert "metadata.compression" in passed


def test_lying_byte_count_in_metadata(compressed):
    def lie(metadata):
        group = next(g for g in metadata["compression"]["groups"] if "target" in g["packages"])
        group["packages"]["target"]["bytes"] += 64
        group["bytes_after"] += 64

    rewrite_metadata(compressed, lie)
    result, failed, passed = check(compressed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "target.compression.bytes" in failed
    assert {"target.embedded_metadata", "target.compression.stored_compressed"} <= passed


def test_compressed_weights_without_declaration(compressed):
    def undeclare(metadata):
        metadata["compression"] = None
        metadata["schema_version"] = 1

    rewrite_metadata(compressed, undeclare)
    result, failed, _ = check(compressed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "target.compression.ops_declared" in failed


# --- A DFlash2 drafter: `draft` must return draft_tokens, int32 [1, block_size - 1] ----------


@pytest.fixture
def dflash2(tmp_path):
    return interface_copy(DFLASH2, tmp_path / "dflash2")


def draft_tokens(spec):
    return next(o for o in function(spec, "draft").output if o.name == "draft_tokens")


def test_the_dflash2_bundle_satisfies_every_property(dflash2):
    passed = every_property_holds(dflash2)
    assert {"drafter.draft_tokens", "metadata.drafter_kind", "drafter.draft_signature"} <= passed


def test_dflash2_draft_without_draft_tokens(dflash2):
    def drop(spec):
        outputs = function(spec, "draft").output
        del outputs[next(i for i, o in enumerate(outputs) if o.name == "draft_tokens")]

    edit_spec(dflash2 / "target.mlpackage", drop)
    result, failed, passed = check(dflash2)
    assert result.returncode == 1
    # The package no longer has the outputs metadata declares either.
    assert failed == {"drafter.draft_tokens", "dflash_drafter.function_map"}
    assert "drafter.draft_signature" in passed


def _reshaped(shape):
    def edit(array):
        assert list(array.shape) == [1, 3]  # block_size 4
        del array.shape[:]
        array.shape.extend(shape)
    return edit


def _as_float16(array):
    array.dataType = Model_pb2.ArrayFeatureType.FLOAT16


@pytest.mark.parametrize("edit", [_reshaped([1, 4]), _reshaped([3]), _reshaped([1, 3, 1]),
                                  _as_float16], ids=["1x4", "3", "1x3x1", "float16"])
def test_dflash2_draft_tokens_of_the_wrong_shape_or_type(dflash2, edit):
    edit_spec(dflash2 / "target.mlpackage",
              lambda spec: edit(draft_tokens(spec).type.multiArrayType))
    result, failed, _ = check(dflash2)
    assert result.returncode == 1
    assert failed == {"drafter.draft_tokens"}


def test_dflash2_bundle_declared_as_dflash(dflash2):
    def downgrade(metadata):
        metadata["speculative_decoding"]["drafter_kind"] = "dflash"
        metadata["speculative_decoding"]["dflash2"] = None

    rewrite_metadata(dflash2, downgrade)
    result, failed, _ = check(dflash2)
    assert result.returncode == 1
    assert {"metadata.drafter_kind", "drafter.draft_tokens"} <= failed


# --- kv_write: the graph against what metadata.json says (docs/kv-write.md) ------------------


def test_the_slice_bundle_satisfies_every_property(tmp_path):
    passed = every_property_holds(interface_copy(SLICE, tmp_path / "slice"))
    assert "target.kv_write" in passed


@pytest.mark.parametrize(("source", "claimed"), [(SLICE, "blend"), (BUNDLE, "slice")])
def test_a_graph_its_kv_write_does_not_describe_fails_kv_write(tmp_path, source, claimed):
    bundle = interface_copy(source, tmp_path / "bundle")
    rewrite_metadata(bundle, lambda metadata: metadata.update(kv_write=claimed))
    result, failed, _ = check(bundle)
    assert result.returncode == 1
    assert failed == {"target.kv_write"}
    line = next(line for line in result.stdout.splitlines()
                if line.startswith("FAIL target.kv_write"))
    assert "main" in line and "prefill" in line and f"--kv-write {claimed}" in line


# --- norm form: the graph against fp16_range.norm (docs/fp16.md) -------------------------------


def test_the_recorded_norm_form_is_the_graphs(bundle):
    passed = every_property_holds(bundle)
    assert "target.norm_form" in passed
    metadata = json.loads((bundle / "metadata.json").read_text())
    assert metadata["fp16_range"]["norm"] == "max_abs"


@pytest.mark.parametrize("claimed", ["plain", "banana"])
def test_a_norm_form_the_graph_does_not_write_fails_norm_form(bundle, claimed):
    """A record of "plain" on a max_abs graph, in both copies, once passed check-contract."""
    rewrite_metadata(bundle, lambda metadata: metadata["fp16_range"].update(norm=claimed))
    result, failed, _ = check(bundle)
    assert result.returncode == 1
    assert failed == {"target.norm_form"}
    line = next(line for line in result.stdout.splitlines()
                if line.startswith("FAIL target.norm_form"))
    assert "fp16_range.norm" in line and claimed in line
    if claimed == "plain":
        assert "main" in line and "prefill" in line and "max_abs" in line


def test_the_folded_norms_are_the_graphs(tmp_path):
    """tiny-small-channels' record lists the 7 norms its graphs fold; one dropped from the
    record fails by function, naming both counts."""
    folded = interface_copy(FOLDED, tmp_path / "folded")
    assert "target.norm_form" in every_property_holds(folded)
    rewrite_metadata(folded, lambda metadata: metadata["fp16_range"]["folded_norms"].pop())
    result, failed, _ = check(folded)
    assert result.returncode == 1 and failed == {"target.norm_form"}
    line = next(line for line in result.stdout.splitlines()
                if line.startswith("FAIL target.norm_form"))
    assert "folded_norms lists 6" in line and "in 7" in line
    assert "main" in line and "prefill" in line


def test_a_fold_the_graph_does_not_write_fails_norm_form(bundle):
    """The demo's graphs fold no norm; a record claiming one does not describe them."""
    fold = {"norm": "norm", "unfolded_error": 0.05, "folded_error": 0.001, "fold_bound": 400.0}
    rewrite_metadata(bundle, lambda metadata: metadata["fp16_range"].update(folded_norms=[fold]))
    result, failed, _ = check(bundle)
    assert result.returncode == 1 and failed == {"target.norm_form"}
    line = next(line for line in result.stdout.splitlines()
                if line.startswith("FAIL target.norm_form"))
    assert "folded_norms lists 1" in line and "in 0" in line


# --- Context buckets: main_<c> and prefill_<c> read the global caches' first c slots ----------
# (python/museflash/bundle.py ContextBucket). //tests/runtime:demo_bundle has buckets of 64 and
# 128 slots below its capacity of 256; the tests read the numbers from its metadata.json.

BUCKETED = Path(os.environ.get("MUSEFLASH_BUCKETED_EXPORT_DIR", "tests/runtime/demo_bundle"))


@pytest.fixture
def bucketed(tmp_path):
    return interface_copy(BUCKETED, tmp_path / "bucketed")


def target_asset(bundle):
    return json.loads((bundle / "metadata.json").read_text())["assets"]["target"]


def global_capacity(asset):
    return next(state["capacity"] for state in asset["states"] if state["kind"] == "global_kv")


def failure(result, name):
    """The detail of property `name`'s FAIL line."""
    return next(line for line in result.stdout.splitlines() if line.startswith(f"FAIL {name}:"))


def rename_functions(package, renames, description=True):
    """Renames functions of the ML program (and, with `description`, of the interface)."""
    def rename(spec):
        if description:
            for entry in spec.description.functions:
                entry.name = renames.get(entry.name, entry.name)
        program = spec.mlProgram.functions
        bodies = {old: program[old].SerializeToString() for old in renames}
        for old in renames:
            del program[old]
        for old, new in renames.items():
            program[new].ParseFromString(bodies[old])

    edit_spec(package, rename)


def test_the_bucketed_bundle_satisfies_every_property(bucketed):
    passed = every_property_holds(bucketed)
    assert {"target.buckets", "package.functions", "target.function_map", "target.states",
            "target.inputs"} <= passed
    buckets = target_asset(bucketed)["buckets"]
    assert len(buckets) >= 2
    result, _, _ = check(bucketed)
    assert "listed by no asset" not in result.stdout
    for bucket in buckets:
        for name in bucket["functions"]:
            assert f"  function {name}_{bucket['context']}\n" in result.stdout


def test_a_bucket_its_graph_does_not_read_fails_buckets(bucketed):
    """The first bucket's functions renamed, in the package and in metadata.json alike, to a
    context between it and the next: the names agree, the graph still reads the old slots."""
    asset = target_asset(bucketed)
    buckets = asset["buckets"]
    first = buckets[0]["context"]
    claimed = (first + (buckets[1]["context"] if len(buckets) > 1 else global_capacity(asset))) // 2
    names = [*buckets[0]["functions"], *(["tree"] if "tree" in buckets[0] else [])]
    rename_functions(bucketed / "target.mlpackage",
                     {f"{name}_{first}": f"{name}_{claimed}" for name in names})
    rewrite_metadata(bucketed, lambda metadata: (
        metadata["assets"]["target"]["buckets"][0].update(context=claimed)))
    result, failed, _ = check(bucketed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert failed == {"target.buckets"}, result.stdout
    line = failure(result, "target.buckets")
    # Each renamed function is named with the slots its graph reads.
    for name in ("main", "prefill"):
        assert re.search(rf"{name}_{claimed} [^;]*\[0, {first}\)", line), line
    assert "re-export" in line


def test_a_whole_capacity_function_reading_a_bucket_fails_buckets(bucketed):
    """main's program and the first bucket's main_<c> swapped, the interfaces kept."""
    first = target_asset(bucketed)["buckets"][0]["context"]
    rename_functions(bucketed / "target.mlpackage",
                     {"main": f"main_{first}", f"main_{first}": "main"}, description=False)
    result, failed, _ = check(bucketed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert failed == {"target.buckets"}, result.stdout
    line = failure(result, "target.buckets")
    assert f"main runs over the whole capacity but reads only slots [0, {first})" in line
    assert f"main_{first} reads no [0, {first}) slice of globalKeyCache layer 0" in line


def test_a_bucket_the_package_lacks_fails(bucketed):
    """metadata.json lists one more bucket, between the last and the capacity."""
    asset = target_asset(bucketed)
    last = asset["buckets"][-1]
    extra = (last["context"] + global_capacity(asset)) // 2
    rewrite_metadata(bucketed, lambda metadata: metadata["assets"]["target"]["buckets"].append(
        {"context": extra, "functions": last["functions"]}))
    result, failed, _ = check(bucketed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert failed == {"package.functions", "target.function_map", "target.buckets"}, result.stdout
    assert (f"the package has no program for main_{extra}, prefill_{extra}, decode_{extra}, "
            "which metadata.json's buckets list") in failure(result, "target.buckets")
    for name in ("main", "prefill", "decode"):
        assert f"{name}_{extra}" in failure(result, "package.functions")


@pytest.mark.parametrize("edit", [
    lambda buckets: buckets.reverse(),
    lambda buckets: buckets[0]["functions"]["prefill"].update(
        query_length=buckets[0]["functions"]["prefill"]["query_length"] + 1),
    lambda buckets: buckets[-1].update(context=256 * 1024),
], ids=["descending", "prefill_differs", "beyond_capacity"])
def test_buckets_metadata_json_describes_wrongly_fail_buckets(bucketed, edit):
    rewrite_metadata(bucketed, lambda metadata: edit(metadata["assets"]["target"]["buckets"]))
    result, failed, _ = check(bucketed)
    assert result.returncode == 1, result.stdout + result.stderr
    line = failure(result, "target.buckets")
    assert line.startswith("FAIL target.buckets: metadata.json: ") and "--context-buckets" in line
    # A context changed names functions the package lacks; the other edits fail nothing else.
    others = {"package.functions", "target.function_map"}
    assert failed - others == {"target.buckets"}, result.stdout


def test_bucket_functions_no_asset_lists_fail_package_functions(bucketed):
    """Without `buckets` in metadata.json, the bucket functions are nobody's."""
    rewrite_metadata(bucketed, lambda metadata: metadata["assets"]["target"].pop("buckets"))
    result, failed, passed = check(bucketed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert failed == {"package.functions"}, result.stdout
    assert "no asset stored in it lists" in failure(result, "package.functions")
    assert "target.buckets" in passed


def test_bucket_functions_are_held_to_kv_write_too(bucketed):
    """The bucket functions write the global caches as main and prefill do (the blend here)."""
    first = target_asset(bucketed)["buckets"][0]["context"]
    rewrite_metadata(bucketed, lambda metadata: metadata.update(kv_write="slice"))
    result, failed, _ = check(bucketed)
    assert result.returncode == 1, result.stdout + result.stderr
    assert failed == {"target.kv_write"}, result.stdout
    line = failure(result, "target.kv_write")
    for name in (f"main_{first}", f"prefill_{first}", "main", "prefill"):
        assert f"but {name} has 0 position-indexed slice_update" in line
