"""The exporter: flag and output-dir rules, metadata, atomicity, and the saved packages' specs."""

import copy
import json
import math
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

from museflash.builtin.demo_checkpoint import (
    TINY_DFLASH2_CONFIG,
    TINY_DRAFTER_CONFIG,
    TINY_TARGET_CONFIG,
)
from museflash.bundle import (
    DRAFTER_STATES,
    EMBEDDED_METADATA_KEY,
    SCHEMA_VERSION,
    TARGET_STATES,
    AssetRole,
    DrafterKind,
    FunctionName,
    FunctionRole,
    Metadata,
    OutputName,
)
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.tensor_files import CheckpointError
from museflash.export import pipeline as pipeline_module
from museflash.export import plan as plan_module
from museflash.export.convert import (
    _cast_bf16_outputs,
    check_no_data_dependent_scalars,
    convert,
    trace,
)
from museflash.export.options import ExportError, ExportOptions, check_flag_rules
from museflash.export.pipeline import export_bundle
from museflash.export.plan import _ids_function, speculative_decoding
from museflash.export.progress import Progress
from museflash.export.publish import OutputDirError
from museflash.models.dflash import DFlashConfig
from museflash.models.dflash2 import DFlash2Config

ct = pytest.importorskip("coremltools")


def _quiet(_line):
    pass


# --- Flag rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(dflash_drafter=True), "requires --fused-target"),
        (dict(fused_target=True, dflash_drafter=True, with_drafter=True), "mutually exclusive"),
        (dict(dflash_drafter=True, with_drafter=True), "mutually exclusive"),
        (dict(fused_target=True, prefill_length=0), "--prefill-length must be at least 1"),
        (dict(fused_target=True, prefill_length=64, max_context_length=32), "exceeds"),
        (dict(fused_target=True, max_context_length=100), "multiple of 32.*use 128"),
        (dict(fused_target=True, conversion_processes=0), "--conversion-processes 0 must be"),
    ],
)
def test_flag_rules_fail_before_any_work(tmp_path, flags, message):
    options = ExportOptions(output_dir=tmp_path / "out", builtin="tiny", **flags)
    with pytest.raises(ExportError, match=message) as caught:
        check_flag_rules(options)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("also", "message"), [
    ((("3bit", "b"),), r"--also-export 3bit=.*: '3bit' is not a preset; choose one of"),
    ((("none", "b"),), r"--also-export none=.*: a none bundle is already being written"),
    ((("4bit", "b"), ("4bit", "c")), r"--also-export 4bit=.*c: a 4bit bundle is already"),
    ((("4bit", "out"),), r"out is already the directory of --output-dir"),
    ((("4bit", "b"), ("8bit", "b")), r"--also-export 8bit=.*b is already the directory of "
                                     r"--also-export 4bit="),
])
def test_also_export_rules_fail_before_any_work(tmp_path, also, message):
    options = ExportOptions(output_dir=tmp_path / "out", builtin="tiny", fused_target=True,
                            also_export=tuple((p, tmp_path / d) for p, d in also))
    with pytest.raises(ExportError, match=message) as caught:
        check_flag_rules(options)
    assert "\n" not in str(caught.value)


def test_also_export_may_add_an_uncompressed_bundle_to_a_compressed_one(tmp_path):
    check_flag_rules(ExportOptions(output_dir=tmp_path / "out", builtin="tiny", compression="4bit",
                                   also_export=(("none", tmp_path / "fp16"),
                                                ("8bit", tmp_path / "int8"))))


def test_only_one_of_the_two_checkpoints_is_refused(tmp_path):
    options = ExportOptions(output_dir=tmp_path / "out", fused_target=True,
                            checkpoint=tmp_path)
    with pytest.raises(ExportError, match="both --checkpoint and --drafter-checkpoint"):
        check_flag_rules(options)


def test_missing_checkpoint_directory_is_named(tmp_path):
    missing = tmp_path / "nope"
    options = ExportOptions(output_dir=tmp_path / "out", fused_target=True,
                            checkpoint=missing, drafter_checkpoint=missing)
    with pytest.raises(ExportError, match="nope is not a directory"):
        check_flag_rules(options)


def _forbid_loading(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("the export loaded weights although its input was invalid")

    monkeypatch.setattr(plan_module, "load_target", refuse)
    monkeypatch.setattr(plan_module, "load_drafter", refuse)


def test_non_empty_output_dir_needs_overwrite(tmp_path, monkeypatch):
    _forbid_loading(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    with pytest.raises(OutputDirError, match="--overwrite"):
        export_bundle(ExportOptions(output_dir=out, builtin="tiny", fused_target=True), _Silent())
    assert (out / "keep.txt").read_text() == "keep"


def test_a_non_empty_also_export_dir_is_refused_before_any_work(tmp_path, monkeypatch):
    _forbid_loading(monkeypatch)
    also = tmp_path / "also"
    also.mkdir()
    (also / "keep.txt").write_text("keep")
    with pytest.raises(OutputDirError, match=f"output directory {also} is not empty; pass "
                                             "--overwrite"):
        export_bundle(ExportOptions(output_dir=tmp_path / "out", builtin="tiny",
                                    also_export=(("8bit", also),)), _Silent())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["also"]
    assert (also / "keep.txt").read_text() == "keep"


class _Silent(Progress):
    def __init__(self):
        super().__init__(echo=_quiet)


# --- Command line: one error line, library output in a log beside the output -----------------


def _export_cli(*args, cwd):
    # Run from `cwd` (the log goes beside the output), with this process's import path.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path if p))
    return subprocess.run([sys.executable, "-m", "museflash.cli.export_main", *args],
                          capture_output=True, text=True, check=False, cwd=cwd, env=env)


def test_cli_prints_a_one_line_error_and_exits_2(tmp_path):
    result = _export_cli("--dflash-drafter", f"--output-dir={tmp_path / 'out'}", cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("export: error: --dflash-drafter requires --fused-target")
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no console log


@pytest.mark.parametrize("value", ["4bit", "=b", "4bit="])
def test_cli_refuses_an_also_export_that_is_not_preset_equals_dir(tmp_path, value):
    result = _export_cli(f"--also-export={value}", f"--output-dir={tmp_path / 'out'}",
                         cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"export: error: --also-export {value!r} is not PRESET=DIR; give a compression preset "
        "and a directory, e.g. 4bit=exported-4bit"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_names_an_out_of_range_token_id_in_one_line(tmp_path):
    target_dir, drafter_dir = _write_pair(tmp_path)
    config = json.loads((drafter_dir / "config.json").read_text())
    config["mask_token_id"] = TINY_TARGET_CONFIG["text_config"]["vocab_size"]
    (drafter_dir / "config.json").write_text(json.dumps(config))
    result = _export_cli("--fused-target", "--dflash-drafter", f"--checkpoint={target_dir}",
                         f"--drafter-checkpoint={drafter_dir}", f"--output-dir={tmp_path / 'out'}",
                         cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("export: error: ")
    assert "mask_token_id 512 is outside the target vocabulary" in result.stderr
    assert "fix the config" in result.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.export.log").exists()


@pytest.fixture(scope="module")
def cli_export(tmp_path_factory):
    """(working directory, output, result) of one export of the tiny pair through the command
    line, which the `bundle` tests below read as well: one export for both. Two converting
    processes whatever the machine's core count (the default takes at most the CPU count),
    so the helper's progress lines are there to check. The bundle read is written by
    --also-export none beside an 8-bit --output-dir (the tiny pair has no weight large enough
    to compress, so only the metadata tells the two apart): one conversion, two bundles, and
    test_the_same_export_in_another_process_is_byte_identical holds the also-exported one to
    the build's own export of the pair."""
    cwd = tmp_path_factory.mktemp("export")
    out = cwd / "bundle"
    result = _export_cli("--builtin=tiny", "--fused-target", "--dflash-drafter",
                         "--conversion-processes=2", "--max-context-length=64",
                         "--prefill-length=8", "--compression=8bit",
                         f"--output-dir={cwd / 'bundle-8bit'}", f"--also-export=none={out}",
                         cwd=cwd)
    return cwd, out, result


def test_cli_success_prints_only_stage_lines_and_removes_its_log(cli_export):
    cwd, out, result = cli_export
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines and all(line.startswith("[export] ") for line in lines), result.stdout
    assert lines[-2].startswith(f"[export] wrote {cwd / 'bundle-8bit'}")
    assert lines[-1].startswith(f"[export] wrote {out}")
    assert Metadata.read(cwd / "bundle-8bit").compression.preset == "8bit"
    assert Metadata.read(out).compression is None
    # No bundle-8bit.export.log, and no staging directory left.
    assert sorted(p.name for p in cwd.iterdir()) == ["bundle", "bundle-8bit"]


def test_cli_internal_failure_keeps_the_log_and_prints_its_path(tmp_path, monkeypatch, capfd):
    """An unexpected exception: exit 1, one line naming it and the log; the traceback and
    whatever the libraries printed are in the log, not on the console."""
    from absl import flags

    from museflash.cli import export_main

    def crash(*_args, **_kwargs):
        print("chatter from a library", file=sys.stderr)
        os.write(2, b"native chatter\n")
        raise RuntimeError("injected internal failure")

    monkeypatch.setattr(pipeline_module, "convert_function", crash)
    out = tmp_path / "out"
    flags.FLAGS(["export", "--builtin=tiny", "--fused-target", "--conversion-processes=1",
                 "--max-context-length=64", "--prefill-length=8", f"--output-dir={out}"])
    try:
        status = export_main.main(["export"])
    finally:
        flags.FLAGS.unparse_flags()
    captured = capfd.readouterr()
    log = tmp_path / "out.export.log"
    assert status == 1
    assert captured.err.splitlines() == [
        f"export: failed: RuntimeError: injected internal failure (library output: {log})"]
    assert all(line.startswith("[export] ") for line in captured.out.splitlines())
    logged = log.read_text()
    assert "Traceback" in logged and "injected internal failure" in logged
    assert "chatter from a library" in logged and "native chatter" in logged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.export.log"]


# --- Metadata --------------------------------------------------------------------------------


def _spec(raw, num_draft_tokens=None):
    return speculative_decoding(raw, DFlashConfig.from_dict(raw), DrafterKind.DFLASH,
                                num_draft_tokens)


def test_speculative_block_comes_from_the_drafter_config():
    block = _spec(TINY_DRAFTER_CONFIG)
    assert block.drafter_kind == DrafterKind.DFLASH
    assert block.block_size == TINY_DRAFTER_CONFIG["block_size"]
    assert block.mask_token_id == TINY_DRAFTER_CONFIG["mask_token_id"]
    assert block.target_layer_ids == TINY_DRAFTER_CONFIG["target_layer_ids"]
    assert block.drafter_hidden_size == TINY_DRAFTER_CONFIG["hidden_size"]
    assert block.num_draft_tokens == TINY_DRAFTER_CONFIG["block_size"] - 1
    assert block.shared_embeddings is True
    assert block.drafter.num_hidden_layers == TINY_DRAFTER_CONFIG["num_hidden_layers"]


def test_dflash_config_form_and_mask_alias_are_merged_and_renamed():
    raw = {k: v for k, v in TINY_DRAFTER_CONFIG.items()
           if k not in ("block_size", "mask_token_id", "target_layer_ids")}
    raw["dflash_config"] = {"block_size": 8, "draft_mask_token_id": 7,
                            "target_layer_ids": [0, 2]}
    block = _spec(raw)
    assert (block.block_size, block.mask_token_id, block.target_layer_ids) == (8, 7, [0, 2])


def test_drafter_hidden_size_is_preferred_and_falls_back_to_hidden_size():
    raw = dict(TINY_DRAFTER_CONFIG, drafter_hidden_size=64)
    assert _spec(raw).drafter_hidden_size == 64
    assert "drafter_hidden_size" not in TINY_DRAFTER_CONFIG
    assert _spec(TINY_DRAFTER_CONFIG).drafter_hidden_size == TINY_DRAFTER_CONFIG["hidden_size"]


def test_the_default_draft_length_is_the_measured_one_within_the_trained_block():
    """Without --num-draft-tokens, a block_size-16 drafter drafts DEFAULT_NUM_DRAFT_TOKENS
    (7, measured fastest on the demo pairs), a drafter trained on shorter blocks its own
    block_size - 1."""
    long = _spec(dict(TINY_DRAFTER_CONFIG, block_size=16))
    assert (long.num_draft_tokens, long.block_size) == (plan_module.DEFAULT_NUM_DRAFT_TOKENS,
                                                        plan_module.DEFAULT_NUM_DRAFT_TOKENS + 1)
    assert plan_module.DEFAULT_NUM_DRAFT_TOKENS < 15
    short = _spec(TINY_DRAFTER_CONFIG)
    assert short.num_draft_tokens == TINY_DRAFTER_CONFIG["block_size"] - 1 < 7


def test_num_draft_tokens_sets_the_exported_block_within_the_trained_one():
    short = _spec(TINY_DRAFTER_CONFIG, num_draft_tokens=2)
    assert (short.num_draft_tokens, short.block_size) == (2, 3)
    with pytest.raises(ExportError, match="--num-draft-tokens 4 must be between 1 and"):
        _spec(TINY_DRAFTER_CONFIG, num_draft_tokens=TINY_DRAFTER_CONFIG["block_size"])


def test_a_block_shorter_than_the_dflash2_kernel_is_refused():
    raw = dict(TINY_DFLASH2_CONFIG)
    raw["dflash_config"] = dict(raw["dflash_config"], conv_kernel_size=4)
    config = DFlash2Config.from_dict(raw)
    assert speculative_decoding(raw, config, DrafterKind.DFLASH2, 3).block_size == 4
    with pytest.raises(ExportError, match="shorter than the DFlash2 convolution kernel"):
        speculative_decoding(raw, config, DrafterKind.DFLASH2, 2)


@pytest.mark.parametrize("num_draft_tokens", [1, 2])
def test_main_draft_and_inject_take_the_exported_block(tmp_path, num_draft_tokens):
    """`--num-draft-tokens k` verifies exactly what was drafted: main is k + 1 long, not the
    drafter's block_size."""
    target_dir, drafter_dir = _write_pair(tmp_path)
    options = ExportOptions(output_dir=tmp_path / "out", fused_target=True, dflash_drafter=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir,
                            num_draft_tokens=num_draft_tokens)
    plan = plan_module.plan_export(options, target_dir, drafter_dir)
    lengths = {(asset.role, f.name): f.query_length for asset in plan.assets
               for f in asset.functions}
    block = num_draft_tokens + 1
    assert block < TINY_DRAFTER_CONFIG["block_size"]
    assert lengths[(AssetRole.TARGET, FunctionName.MAIN)] == block
    assert lengths[(AssetRole.DFLASH_DRAFTER, FunctionName.DRAFT)] == block
    assert lengths[(AssetRole.DFLASH_DRAFTER, FunctionName.INJECT_KV)] == block
    assert plan.spec.block_size == block


def test_a_decode_length_other_than_the_block_is_refused_with_a_drafter(tmp_path, monkeypatch):
    target_dir, drafter_dir = _write_pair(tmp_path)
    _forbid_loading(monkeypatch)
    out = tmp_path / "out"
    options = ExportOptions(output_dir=out, fused_target=True, dflash_drafter=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir,
                            num_draft_tokens=2, decode_length=4)
    with pytest.raises(ExportError, match="--decode-length 4 differs from the drafter's block"):
        export_bundle(options, _Silent())
    assert not out.exists()


def _write_pair(tmp_path, target_text=None, drafter=None):
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path / "ckpt", dtype="fp16",
                                  target_config=target_text, drafter_config=drafter)


@pytest.mark.parametrize(
    ("key", "drafter_value", "target_value"),
    [("vocab_size", 262144, 512), ("hidden_size", 96, 64), ("head_dim", 32, 16),
     ("num_attention_heads", 8, 4)],
)
def test_divergent_drafter_fails_before_writing(tmp_path, monkeypatch, key, drafter_value,
                                                target_value):
    target_dir, drafter_dir = _write_pair(tmp_path)
    config_path = drafter_dir / "config.json"
    config = json.loads(config_path.read_text())
    config[key] = drafter_value
    config_path.write_text(json.dumps(config))
    _forbid_loading(monkeypatch)
    out = tmp_path / "out"
    options = ExportOptions(output_dir=out, fused_target=True, dflash_drafter=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir)
    with pytest.raises(CheckpointError,
                       match=f"{key}: drafter has {drafter_value} but target has {target_value}"):
        export_bundle(options, _Silent())
    assert not out.exists()


def test_target_layer_ids_beyond_the_target_fail(tmp_path, monkeypatch):
    demo_before = copy.deepcopy(TINY_DRAFTER_CONFIG)
    target_dir, drafter_dir = _write_pair(tmp_path)
    config = json.loads((drafter_dir / "config.json").read_text())
    config["target_layer_ids"] = [1, 4, 8]
    written = json.dumps(config)
    (drafter_dir / "config.json").write_text(written)
    _forbid_loading(monkeypatch)
    options = ExportOptions(output_dir=tmp_path / "out", fused_target=True, dflash_drafter=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir)
    with pytest.raises(CheckpointError, match=r"target_layer_ids.*\[1, 4, 8\]"):
        export_bundle(options, _Silent())
    assert not (tmp_path / "out").exists()
    # The check only reads: neither the user's config nor the shared demo config is changed.
    assert (drafter_dir / "config.json").read_text() == written
    assert TINY_DRAFTER_CONFIG == demo_before


@pytest.mark.parametrize(
    ("which", "edit", "message"),
    [
        ("drafter", {"mask_token_id": 512}, "mask_token_id 512"),
        ("drafter", {"dflash_config": {"draft_mask_token_id": -1}}, "draft_mask_token_id -1"),
        ("drafter", {"pad_token_id": 4096}, "pad_token_id 4096"),
        ("target", {"eos_token_id": [1, 600]}, "eos_token_id 600"),
        ("target", {"text_config": {"bos_token_id": 512}}, "bos_token_id 512"),
    ],
)
def test_token_ids_outside_the_target_vocabulary_fail_before_any_work(tmp_path, monkeypatch,
                                                                     which, edit, message):
    """On device the embedding gather does not check its index: an id >= vocab_size (512 in
    the demo) must stop the export before anything is loaded or written."""
    target_dir, drafter_dir = _write_pair(tmp_path)
    config_path = (drafter_dir if which == "drafter" else target_dir) / "config.json"
    config = json.loads(config_path.read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            config[key] = dict(config.get(key) or {}, **value)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))
    _forbid_loading(monkeypatch)
    out = tmp_path / "out"
    options = ExportOptions(output_dir=out, fused_target=True, dflash_drafter=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir)
    with pytest.raises(CheckpointError) as caught:
        export_bundle(options, _Silent())
    text = str(caught.value)
    assert "\n" not in text
    assert str(config_path) in text
    assert message in text
    assert "outside the target vocabulary [0, 512)" in text
    assert "fix the config" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_shallower_drafter_and_absent_keys_pass_validation(tmp_path):
    target_dir, drafter_dir = _write_pair(tmp_path)
    config = json.loads((drafter_dir / "config.json").read_text())
    config["num_hidden_layers"] = 1
    config["num_key_value_heads"] = 4
    del config["head_dim"]
    (drafter_dir / "config.json").write_text(json.dumps(config))
    options = ExportOptions(output_dir=tmp_path / "out", builtin="tiny", fused_target=True)
    configs = plan_module.plan_export(options, target_dir, drafter_dir).configs
    assert configs.drafter.num_hidden_layers == 1 < configs.target.num_hidden_layers
    assert configs.drafter_raw["num_key_value_heads"] == 4
    assert configs == check_configs(target_dir, drafter_dir)


# --- Atomicity -------------------------------------------------------------------------------


def test_failure_mid_export_leaves_nothing_behind(tmp_path, monkeypatch):
    """The export's own conversion dies half-way through writing its part while a helper
    process is converting another function: the helper is stopped and nothing is left."""
    out = tmp_path / "out"

    def half_then_crash(module, package, function, part, *args, **kwargs):
        part.mkdir()
        (part / "half-written").write_bytes(b"x" * 100)
        raise RuntimeError("injected failure while converting")

    monkeypatch.setattr(pipeline_module, "convert_function", half_then_crash)
    with pytest.raises(RuntimeError, match="injected failure"):
        export_bundle(ExportOptions(output_dir=out, builtin="tiny",
                                    fused_target=True, dflash_drafter=True,
                                    conversion_processes=2,
                                    also_export=(("8bit", tmp_path / "also"),)), _Silent())
    assert list(tmp_path.iterdir()) == []


def test_a_failed_merge_publishes_none_of_the_bundles(tmp_path, monkeypatch):
    """With --also-export, a failure after the first bundle is merged publishes neither, and
    every staging directory is removed (publish.publish_directories)."""
    merged = []
    merge = pipeline_module.merge

    def merge_once(run, *args):
        if merged:
            raise RuntimeError("injected failure in the second merge")
        merged.append(run.options.output_dir)
        return merge(run, *args)

    monkeypatch.setattr(pipeline_module, "merge", merge_once)
    monkeypatch.setattr(pipeline_module, "convert_function", _convert_nothing)
    monkeypatch.setattr(pipeline_module, "merge_packages", lambda *args: {})
    with pytest.raises(RuntimeError, match="second merge"):
        export_bundle(ExportOptions(output_dir=tmp_path / "out", builtin="tiny",
                                    conversion_processes=1,
                                    also_export=(("8bit", tmp_path / "also"),)), _Silent())
    assert merged == [tmp_path / "out"]
    assert list(tmp_path.iterdir()) == []


def _convert_nothing(module, asset, function, part, *_args, **_kwargs):
    part.mkdir()


def test_failure_keeps_an_existing_export_intact(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metadata.json").write_text("previous")

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline_module, "convert_function", crash)
    with pytest.raises(KeyboardInterrupt):
        export_bundle(ExportOptions(output_dir=out, builtin="tiny",
                                    overwrite=True, fused_target=True,
                                    conversion_processes=2), _Silent())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "metadata.json").read_text() == "previous"


# --- Graph contract --------------------------------------------------------------------------


def test_data_dependent_scalar_reads_are_detected():
    class ReadsAScalar(torch.nn.Module):
        def forward(self, x, positions):
            return x * positions.max().item()

    program = trace(ReadsAScalar(), (torch.ones(1, 4), torch.arange(4)))
    with pytest.raises(ExportError, match=r"aten\.item|_local_scalar_dense"):
        check_no_data_dependent_scalars(program)


def test_bf16_outputs_are_cast_unless_disabled(monkeypatch):
    class Bf16Outputs(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16), [x.to(torch.bfloat16), x]

    module = Bf16Outputs()
    handle = module.register_forward_hook(_cast_bf16_outputs)
    first, (second, third) = module(torch.ones(2))
    assert (first.dtype, second.dtype, third.dtype) == (torch.float16, torch.float16,
                                                       torch.float32)
    monkeypatch.setenv("DISABLE_BFLOAT16_CAST_FOR_LOGITS", "1")
    first, (second, _) = module(torch.ones(2))
    assert (first.dtype, second.dtype) == (torch.bfloat16, torch.bfloat16)
    handle.remove()


# --- The saved bundle (one export of the demo pair, read back with coremltools) -------------


@pytest.fixture(scope="module")
def bundle(cli_export):
    """The tiny pair's export through the command line (cli_export) and its console lines."""
    _, out, result = cli_export
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout.splitlines()


def _spec_of(package):
    return ct.utils.load_spec(str(package))


def _features(descriptions):
    result = {}
    for feature in descriptions:
        kind = feature.type.WhichOneof("Type")
        array = feature.type.stateType.arrayType if kind == "stateType" else \
            feature.type.multiArrayType
        result[feature.name] = (kind, list(array.shape), array.dataType)
    return result


def _functions(spec):
    return {f.name: f for f in spec.description.functions}


FP16 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
INT32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.INT32


def test_progress_has_one_line_per_stage(bundle):
    _, lines = bundle
    stage_lines = [line for line in lines if not line.startswith("[export] wrote")]
    stages = [line.split(" ")[1] for line in stage_lines]
    assert stages.count("load") == 2
    assert stages.count("audit") == 1  # the fp16 range audit, with its scales
    assert stages.count("check") == 2  # each bundle's own program run before publishing
    audit = next(line for line in stage_lines if line.startswith("[export] audit"))
    assert re.search(r"scale 1; drafter peak [\d.e+]+, scale 1;", audit)  # tiny: no scaling
    assert stages.count("trace") == stages.count("convert") == 6  # once for both bundles
    # One package per bundle: the target's, with the drafter's functions.
    assert [line.split(":")[0] for line in stage_lines if " save " in line] == [
        "[export] save (target.mlpackage)", "[export] save (target.mlpackage, none)"]
    converted = [re.search(r"convert \(([\w.]+)", line).group(1) for line in stage_lines
                 if line.startswith("[export] convert")]
    assert sorted(converted) == ["dflash_drafter.draft", "dflash_drafter.inject_kv",
                                 "target.decode", "target.main", "target.prefill",
                                 "target.tree"]
    assert any(", helper 1)" in line for line in stage_lines)  # the second process's work
    assert all(re.search(r": \d+\.\d s", line) for line in stage_lines)
    assert all(re.search(r"\d (B|KB|MB)", line) for line in stage_lines
               if line.split(" ")[1] not in ("trace", "audit", "check"))
    assert lines[-1].startswith("[export] wrote")


def test_target_package_functions_and_signatures(bundle):
    out, _ = bundle
    spec = _spec_of(out / "target.mlpackage")
    functions = _functions(spec)
    assert sorted(functions) == ["decode", "draft", "inject_kv", "main", "prefill", "tree"]
    assert spec.description.defaultFunctionName == "main"
    block = TINY_DRAFTER_CONFIG["block_size"]
    vocab = TINY_TARGET_CONFIG["text_config"]["vocab_size"]
    hidden = TINY_DRAFTER_CONFIG["hidden_size"]
    main = functions["main"]
    assert _features(main.input) == {"input_ids": ("multiArrayType", [1, block], INT32),
                                     "position_ids": ("multiArrayType", [block], INT32)}
    assert _features(main.output) == {
        "logits": ("multiArrayType", [1, block, vocab], FP16),
        "drafter_features": ("multiArrayType", [1, block, hidden], FP16),
    }
    # The one-token decode: main's interface for one token (target-alone steps).
    assert _features(functions["decode"].input) == {
        "input_ids": ("multiArrayType", [1, 1], INT32),
        "position_ids": ("multiArrayType", [1], INT32)}
    assert _features(functions["decode"].output) == {
        "logits": ("multiArrayType", [1, 1, vocab], FP16),
        "drafter_features": ("multiArrayType", [1, 1, hidden], FP16)}
    prefill = _features(functions["prefill"].output)
    assert prefill["logits"][1] == [1, 1, vocab]  # no full-vocabulary logits per position
    assert prefill["drafter_features"][1] == [1, 8, hidden]  # but features for the chunk
    for name in ("main", "prefill", "decode"):
        states = _features(functions[name].state)
        assert sorted(states) == sorted(TARGET_STATES)
        assert {dtype for _, _, dtype in states.values()} == {FP16}


def test_drafter_functions_share_one_state_set(bundle):
    out, _ = bundle
    functions = _functions(_spec_of(out / "target.mlpackage"))
    inject, draft = _features(functions["inject_kv"].state), _features(functions["draft"].state)
    assert inject == draft
    assert sorted(inject) == sorted(DRAFTER_STATES)
    assert not set(inject) & set(TARGET_STATES)
    block = TINY_DRAFTER_CONFIG["block_size"]
    vocab = TINY_TARGET_CONFIG["text_config"]["vocab_size"]
    assert set(_features(functions["inject_kv"].input)) == {"features", "position_ids"}
    assert len(functions["inject_kv"].output) == 1
    assert _features(functions["draft"].input)["input_ids"][1] == [1, block]
    assert _features(functions["draft"].output) == {
        "logits": ("multiArrayType", [1, block, vocab], FP16)}


def test_every_weight_is_stored_once_in_the_bundle(bundle, tmp_path):
    """The bundle's weight files hold each checkpoint tensor once (fp16): the drafter's
    borrowed embedding and lm_head are the target's, and inject_kv and draft share the
    drafter's projections. Only small constants (RoPE tables, masks) come on top."""
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
    from museflash.checkpoint.tensor_files import checkpoint_shapes
    from museflash.models.muse_glimmer import TARGET_IGNORED_PREFIXES

    out, _ = bundle
    stored = sum(p.stat().st_size for p in out.rglob("weight.bin"))
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path / "pair")
    unique = sum(2 * math.prod(shape) for key, shape in
                 checkpoint_shapes(target_dir, drafter_dir).items()
                 if not key.startswith(TARGET_IGNORED_PREFIXES))
    text = TINY_TARGET_CONFIG["text_config"]
    embedding = text["vocab_size"] * text["hidden_size"] * 2
    print(f"bundle weight bytes {stored}, unique checkpoint weights {unique}")
    assert unique <= stored < unique + embedding // 4


def test_metadata_file_and_embedded_copies_agree(bundle):
    out, _ = bundle
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["schema_version"] == SCHEMA_VERSION == 3
    assert metadata["speculative_decoding"]["drafter_kind"] == "dflash"
    assert metadata["source"] == {"checkpoint": "builtin:tiny",
                                  "drafter_checkpoint": "builtin:tiny"}
    for asset in metadata["assets"].values():
        spec = _spec_of(out / asset["path"])
        embedded = json.loads(spec.description.metadata.userDefined[EMBEDDED_METADATA_KEY])
        assert embedded == metadata
        functions = _functions(spec)
        for name, function in asset["functions"].items():
            assert [f.name for f in functions[name].input] == function["inputs"]
            assert [f.name for f in functions[name].output] == function["outputs"]
        for name in asset["functions"]:
            shapes = _features(functions[name].state)
            assert {s["name"]: s["shape"] for s in asset["states"]} == {
                state: shape for state, (_, shape, _) in shapes.items()}


def test_exported_files_are_readable_by_everyone(bundle):
    out, _ = bundle
    for path in out.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o004, f"{path} is not world-readable ({oct(mode)})"
    assert sorted(p.name for p in out.parent.iterdir()) == ["bundle", "bundle-8bit"]


def _large_consts(package):
    """Const name -> (shape, stored bytes) of every 2-D weight in the package's weight file."""
    from museflash.export.blobfile import read_record
    from museflash.export.merge import blob_constants, read_spec

    blob = (package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").read_bytes()
    found = {}
    for function in read_spec(package).mlProgram.functions.values():
        for const in blob_constants(function):
            _, _, size, start = read_record(blob, const.offset)
            if len(const.shape) == 2 and size >= 8192:
                found[const.name] = (list(const.shape), blob[start:start + size])
    return found


def test_real_weights_replace_every_placeholder(bundle, tmp_path):
    """The export converts stand-ins (one row repeated) and writes the real weights after;
    none may be left behind, and the embedding must be the checkpoint's, bit for bit."""
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
    from museflash.checkpoint.load import load_target

    out, _ = bundle
    consts = _large_consts(out / "target.mlpackage")
    assert len(consts) >= 8
    for name, (shape, data) in consts.items():
        rows = torch.frombuffer(bytearray(data), dtype=torch.float16).reshape(shape)
        assert not bool((rows == rows[0]).all()), f"{name} still holds a placeholder"
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path / "demo")
    target = load_target(target_dir, drafter_dir, dtype=torch.float16, max_context=64)
    embedding = target.embed_tokens.weight.detach().numpy().tobytes()
    assert embedding in {data for _, data in consts.values()}


def test_conversion_keeps_placeholders_unmaterialised(tmp_path):
    """Memory stays bounded only while every stand-in stays a stride-0 view through conversion;
    a weight the converter copies (e.g. promoted to fp32 because its input was fp32) shows up
    here as a contiguous array. Four layers of the tiny target (three sliding, one global) have
    every kind of weight, at half the conversion."""
    import numpy as np

    from museflash.builtin.demo_checkpoint import shallow_tiny_pair_configs, write_tiny_checkpoints
    from museflash.checkpoint.load import load_target
    from museflash.export.placeholders import PlaceholderWeights

    target_config, drafter_config = shallow_tiny_pair_configs()
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path, target_config=target_config,
                                                     drafter_config=drafter_config)
    placeholders = PlaceholderWeights()
    target = load_target(target_dir, drafter_dir, dtype=torch.float16, max_context=64,
                         max_query_len=4, placeholders=placeholders)
    assert len(placeholders.by_row) >= 8
    function = _ids_function(FunctionName.MAIN, FunctionRole.DECODE, "forward", 4,
                             [OutputName.LOGITS, OutputName.DRAFTER_FEATURES])
    program = trace(target.with_entry_point(function.entry_point), function.example_args)
    model = convert(program, function.inputs, function.outputs, target, TARGET_STATES)
    materialised, kept = [], 0
    for op in model._mil_program.functions["main"].operations:
        value = op.outputs[0].val if op.op_type == "const" else None
        if not isinstance(value, np.ndarray) or value.ndim != 2 or value.size < 4096:
            continue
        if value.strides[0] == 0:
            kept += 1
        else:
            materialised.append((op.outputs[0].name, value.dtype.name))
    assert kept >= 8
    assert materialised == []
    # The part package stores each placeholder as its one row, not the weight's full size.
    from pathlib import Path

    from museflash.bundle import PACKAGE_WEIGHT_FILE

    full = sum(2 * location.shape[0] * location.shape[1]
               for location in placeholders.by_row.values())
    part = (Path(model.package_path) / PACKAGE_WEIGHT_FILE).stat().st_size
    print(f"part weight file {part} bytes; placeholders in full {full}")
    assert part < full / 4  # in full it would be more than `full`


def test_context_defaults_to_the_trained_positions_and_refuses_more(tmp_path):
    from museflash.builtin.demo_checkpoint import builtin_checkpoints

    with builtin_checkpoints("demo") as (target_dir, drafter_dir):
        trained = json.loads((target_dir / "config.json").read_text())[
            "text_config"]["max_position_embeddings"]
        assert trained < 512
        default = plan_module.plan_export(ExportOptions(output_dir=tmp_path / "out"),
                                          target_dir, None)
        assert default.context_length == trained // 32 * 32
        with pytest.raises(ExportError, match=f"max_position_embeddings {trained}"):
            plan_module.plan_export(ExportOptions(output_dir=tmp_path / "out",
                                                  max_context_length=512), target_dir, None)
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints

    tiny_target, _ = write_tiny_checkpoints(tmp_path / "tiny")
    assert plan_module.plan_export(ExportOptions(output_dir=tmp_path / "out"), tiny_target,
                                   None).context_length == 512


def _digests(root):
    import hashlib
    return {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def test_the_same_export_in_another_process_is_byte_identical(bundle):
    """The build's //tests/integration:demo_bundle is this fixture's export (the same pair and
    flags) made by another process: every file is the same bytes, Manifest.json's identifiers
    and the spec's map order included (describe.stable_manifest, deterministic serialising)."""
    built = os.environ.get("MUSEFLASH_TINY_BUNDLE")
    if not built:
        pytest.fail("MUSEFLASH_TINY_BUNDLE is not set: run this test through Bazel")
    from pathlib import Path
    ours, theirs = _digests(bundle[0]), _digests(Path(built))
    assert ours.keys() == theirs.keys()
    assert [name for name in ours if ours[name] != theirs[name]] == []


def test_manifest_identifiers_come_from_the_item_paths(bundle, tmp_path):
    """Random identifiers, as coremltools writes them, become the same derived ones."""
    import shutil
    import uuid

    from museflash.export.describe import stable_manifest
    package = tmp_path / "target.mlpackage"
    shutil.copytree(bundle[0] / "target.mlpackage", package)
    manifest_path = package / "Manifest.json"
    original = json.loads(manifest_path.read_text())
    drawn = {old: str(uuid.UUID(int=1000 + index))
             for index, old in enumerate(original["itemInfoEntries"])}
    shuffled = {"fileFormatVersion": original["fileFormatVersion"],
                "itemInfoEntries": {drawn[old]: item
                                    for old, item in original["itemInfoEntries"].items()},
                "rootModelIdentifier": drawn[original["rootModelIdentifier"]]}
    manifest_path.write_text(json.dumps(shuffled))
    stable_manifest(package)
    assert json.loads(manifest_path.read_text()) == original
    root = original["itemInfoEntries"][original["rootModelIdentifier"]]
    assert root["path"] == "com.apple.CoreML/model.mlmodel"
