"""//:swift-generate on a real export: its JSON report, and one-line errors for bad input.

The bundle is exported by Bazel (//tests/runtime:demo_bundle); each bad-input test copies it,
breaks one thing, runs the swift-generate binary and checks for exit status 1 and a single
line on stderr that names the problem (by a keyword, not the whole sentence).
"""

import json
import os
from pathlib import Path

import pytest
from coremltools.proto import Model_pb2
from swift_generate_support import assert_one_line_error, run, writable_copy

BUNDLE = Path(os.environ.get("MUSEFLASH_EXPORT_DIR", "tests/runtime/demo_bundle"))
SPEC = Path("target.mlpackage") / "Data" / "com.apple.CoreML" / "model.mlmodel"
WEIGHTS = Path("target.mlpackage") / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"


@pytest.fixture
def bundle(tmp_path):
    return writable_copy(BUNDLE, tmp_path / "bundle")


def test_json_report_has_the_generation_and_its_figures():
    result = run("--export-dir", BUNDLE, "--prompt-ids", "1,40,41,42,43,44,45",
                 "--max-new-tokens", "20", "--format", "json", "--no-tree")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["prompt_ids"] == [1, 40, 41, 42, 43, 44, 45]
    assert report["automatic"] is False and report["steps"] == {"chain": len(report["accepted"])}
    assert len(report["tokens"]) == 20 or report["stop_reason"] == "eos"
    assert report["calls"]["prefill"] == 1
    # One verify call per step, one inject after prefill and one per step; the 7-token prompt
    # is shorter than a prefill chunk, so its last token also goes through main once.
    assert report["calls"]["main"] == len(report["accepted"]) + 1
    assert report["calls"]["inject_kv"] == len(report["accepted"]) + 1
    assert all(0 <= a <= report["num_draft_tokens"] for a in report["accepted"])
    assert report["peak_rss_bytes"] > report["weight_bytes"] > 0


def test_no_draft_gives_the_same_greedy_tokens_with_one_decode_call_per_token():
    common = ["--export-dir", BUNDLE, "--prompt-ids", "1,40,41,42,43,44,45", "--max-new-tokens",
              "12", "--format", "json"]
    drafted = json.loads(run(*common, "--no-tree").stdout)
    alone = json.loads(run(*common, "--no-draft").stdout)
    assert alone["tokens"] == drafted["tokens"]
    # The first token comes from prefill's logits (plus the short prompt's one main call);
    # each later one from a one-token decode, not a padded verify block.
    assert alone["calls"]["decode"] == len(alone["tokens"]) - 1
    assert alone["calls"]["main"] == 1
    assert "draft" not in alone["calls"] and "decode" not in drafted["calls"]


def test_each_target_call_runs_in_the_smallest_context_bucket_holding_it():
    """The demo bundle has buckets of 64 and 128 slots (tests/runtime/bundles.bzl): a short
    prompt and 8 new tokens stay below 64, so no target call runs a larger function."""
    report = json.loads(run("--export-dir", BUNDLE, "--prompt-ids", "1,40,41,42,43,44,45",
                            "--max-new-tokens", "8", "--format", "json", "--no-tree").stdout)
    ran = report["ran_functions"]
    assert {"prefill_64", "main_64"} <= set(ran) <= {"prefill_64", "main_64", "inject_kv", "draft"}
    calls = report["calls"]
    assert ran["prefill_64"] + ran["main_64"] == calls["prefill"] + calls["main"]
    # A bucket's functions load on first use: the 128 bucket's never did.
    whole = {"main", "prefill", "inject_kv", "draft"}  # decode too, once a step decodes alone
    assert set(report["loaded_functions"]) == whole | {"prefill_64", "main_64"}


@pytest.mark.parametrize("edit, keyword", [
    # A bucket metadata.json lists (in order) whose functions the package lacks.
    (lambda buckets: buckets.insert(1, dict(buckets[0], context=96)), "no function main_96"),
    # Buckets out of order: a reader cannot pick the smallest that holds a call.
    (lambda buckets: buckets.reverse(), "not strictly ascending"),
])
def test_a_bundle_whose_buckets_break_the_contract_is_refused(bundle, edit, keyword):
    metadata = json.loads((bundle / "metadata.json").read_text())
    edit(metadata["assets"]["target"]["buckets"])
    (bundle / "metadata.json").write_text(json.dumps(metadata))
    assert_one_line_error(run("--export-dir", bundle, "--prompt-ids", "1,2,3",
                              "--max-new-tokens", "4"), keyword)


def test_profile_ops_splits_each_functions_time_by_op_type():
    report = json.loads(run("--export-dir", BUNDLE, "--prompt-ids", "1,40,41,42,43,44,45",
                            "--max-new-tokens", "8", "--format", "json", "--profile-ops").stdout)
    profile = report["op_ms_per_call"]
    assert set(profile) == set(report["calls"])
    for function, ops in profile.items():
        # Every call of these functions reads and writes its states and multiplies matrices.
        assert {"read_state", "slice_update", "linear"} <= set(ops), function
        assert all(ms >= 0 for ms in ops.values()), function
        # The parts cannot add up to more than the whole call.
        assert sum(ops.values()) <= report["functions"][function]["ms_per_call"] * 1.001 + 0.01


@pytest.mark.parametrize("extra, keyword", [(["--backend", "coreml"], "--backend"),
                                            (["--format", "text"], "--format json"),
                                            (["--format", "json", "--compare"], "--compare")])
def test_profile_ops_refuses_what_it_cannot_time(extra, keyword):
    assert_one_line_error(run("--export-dir", BUNDLE, "--prompt-ids", "1,2,3", "--profile-ops",
                              *extra), keyword)


def test_missing_export_directory(tmp_path):
    assert_one_line_error(run("--export-dir", tmp_path / "nowhere", "--prompt-ids", "1"),
                          "does not exist")


def test_package_lacking_a_function_metadata_lists(bundle):
    spec = Model_pb2.Model()
    spec.ParseFromString((bundle / SPEC).read_bytes())
    del spec.mlProgram.functions["draft"]
    kept = [f for f in spec.description.functions if f.name != "draft"]
    del spec.description.functions[:]
    spec.description.functions.extend(kept)
    (bundle / SPEC).write_bytes(spec.SerializeToString())
    assert_one_line_error(run("--export-dir", bundle, "--prompt-ids", "1,2,3"), "draft")


def test_an_op_the_interpreter_does_not_know_is_named_with_its_function(bundle):
    spec = Model_pb2.Model()
    spec.ParseFromString((bundle / SPEC).read_bytes())
    function = spec.mlProgram.functions["main"]
    block = function.block_specializations[function.opset]
    op = next(op for op in block.operations if op.type == "tanh")
    op.type = "tanh_with_a_new_name"
    (bundle / SPEC).write_bytes(spec.SerializeToString())
    assert_one_line_error(run("--export-dir", bundle, "--prompt-ids", "1,2,3"),
                          "tanh_with_a_new_name", "main")


def test_unknown_schema_version(bundle):
    metadata = json.loads((bundle / "metadata.json").read_text())
    metadata["schema_version"] = 99
    (bundle / "metadata.json").write_text(json.dumps(metadata))
    assert_one_line_error(run("--export-dir", bundle, "--prompt-ids", "1,2,3"), "99")


@pytest.mark.parametrize("ids, keyword", [("", "empty"), ("1,,2", "integers"),
                                          ("1,4096", "vocabulary"), ("-1", "vocabulary")])
def test_empty_or_out_of_vocabulary_prompt(ids, keyword):
    assert_one_line_error(run("--export-dir", BUNDLE, "--prompt-ids", ids), keyword)


def test_prompt_longer_than_the_context():
    context = json.loads((BUNDLE / "metadata.json").read_text())["context_length"]
    ids = ",".join(["5"] * (context + 1))
    assert_one_line_error(run("--export-dir", BUNDLE, "--prompt-ids", ids), "context_length")


def test_truncated_weight_file(bundle):
    weights = bundle / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 3])
    assert_one_line_error(run("--export-dir", bundle, "--prompt-ids", "1,2,3"), "weight.bin")


@pytest.mark.parametrize("flag, value", [("--max-new-tokens", "0"), ("--backend", "gpu"),
                                         ("--compute-units", "tpu"),
                                         ("--format", "xml"), ("--num-draft-tokens", "99"),
                                         ("--lookup-min-match", "-1"),
                                         ("--lookup-min-match", "two")])
def test_bad_options(flag, value):
    result = run("--export-dir", BUNDLE, "--prompt-ids", "1,2,3", flag, value)
    assert_one_line_error(result, flag)


def test_core_ml_backend_compiles_once_into_the_cache_and_reuses_it(tmp_path):
    """Two launches with one --model-cache: the first compiles into it, the second reuses it,
    and both decode the interpreter's tokens (on Linux through the Core ML stand-in)."""
    common = ["--export-dir", BUNDLE, "--prompt-ids", "1,40,41,42,43,44,45", "--max-new-tokens",
              "12", "--format", "json", "--no-compare"]
    interpreter = json.loads(run(*common).stdout)
    cache = ["--backend", "coreml", "--compute-units", "cpu", "--model-cache", tmp_path / "cache"]
    first, second = (json.loads(run(*common, *cache).stdout) for _ in range(2))
    assert list(first["compiled_models"].values()) == ["compiled_into_cache"]
    assert list(second["compiled_models"].values()) == ["cached"]
    assert first["tokens"] == second["tokens"] == interpreter["tokens"]
    assert first["compute_units"] == "cpu"


def test_an_unwritable_model_cache_warns_in_one_line_and_decodes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run("--export-dir", BUNDLE, "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                 "--format", "json", "--backend", "coreml", "--model-cache", blocker / "cache")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("\n") == 1 and str(blocker / "cache") in result.stderr
    report = json.loads(result.stdout)
    assert list(report["compiled_models"].values()) == ["compiled_temporarily"]


def test_by_default_the_engine_chooses_each_step_and_reports_its_choice():
    """Without a forced budget the engine chooses each step (StepPlanner): it tries the tree
    and the target alone first, keeps the target's greedy tokens, and reports its figures;
    --tree-budget N forces trees."""
    common = ["--export-dir", BUNDLE, "--prompt-ids", "1,40,41,42,43,44,45", "--max-new-tokens",
              "24", "--format", "json", "--no-compare"]
    chosen = json.loads(run(*common).stdout)
    alone = json.loads(run(*common, "--no-draft").stdout)
    assert chosen["tokens"] == alone["tokens"]
    steps = chosen["steps"]
    assert chosen["automatic"] is True and set(steps) <= {"tree", "alone"}, steps
    assert steps["tree"] >= 2 and steps["alone"] >= 2, steps
    assert sum(steps.values()) == len(chosen["accepted"]) + steps["alone"]
    assert chosen["calls"]["decode"] == steps["alone"] and chosen["calls"]["tree"] == steps["tree"]
    assert "tree" in chosen["plan"] and "alone" in chosen["plan"]
    forced = json.loads(run(*common, "--tree-budget", "2").stdout)
    assert forced["automatic"] is False and set(forced["steps"]) == {"tree"}
    assert forced["tokens"] == alone["tokens"]
