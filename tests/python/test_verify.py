"""`verify` checks an export against the checkpoints it was made from, then decodes with it.

The tiny fused pair the build exported once (//tests/integration:demo_bundle); its metadata says
`builtin:tiny`, so verify regenerates the pair itself.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prebuilt import prebuilt_bundle

from museflash.builtin.demo_checkpoint import shallow_tiny_pair_configs, write_tiny_checkpoints
from museflash.checks.verify import VerifyOptions, run_verify
from museflash.export.options import ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress

pytest.importorskip("coremltools")

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return prebuilt_bundle(tmp_path_factory.mktemp("verify"))


def _verify(export_dir, **kwargs):
    lines = []
    status = run_verify(VerifyOptions(export_dir=export_dir, echo=lines.append, **kwargs))
    print("\n".join(lines))
    return status, lines


def test_builtin_demo_export_verifies(bundle):
    status, lines = _verify(bundle, new_tokens=16)
    assert status == 0
    assert lines[-1].startswith("verify: OK")
    parity = [line for line in lines if line.startswith("parity ")]
    assert [line.split(":")[0] for line in parity] == [
        "parity target.main", "parity target.prefill", "parity target.decode",
        "parity target.tree", "parity dflash_drafter.inject_kv+draft"]
    assert all(line.count(" OK") == 1 and "wraps the ring" in line for line in parity)
    assert any(line.startswith("lossless: speculative == ") for line in lines)


def test_checkpoint_of_another_seed_is_a_mismatch(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path / "seed1", seed=1)
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["source"] = {"checkpoint": str(target_dir), "drafter_checkpoint": str(drafter_dir)}
    (copy / "metadata.json").write_text(json.dumps(metadata))
    status, lines = _verify(copy, new_tokens=8)
    assert status == 1
    assert lines[-1].startswith("verify: FAILED target.main")
    parity = [line for line in lines if line.startswith("parity ")]
    assert len(parity) == 5 and all(" FAILED" in line for line in parity)


def _reads_one_slot_past_the_window(base, context):
    return {"sliding_causal_mask": lambda positions, capacity, window:
            base.sliding_causal_mask(positions, capacity, window + 1),
            "tree_sliding_mask": lambda positions, mask, capacity, window:
            base.tree_sliding_mask(positions, mask, capacity, window + 1)}


def _one_slot_on(base, context):
    """A LayerCache that writes each position one slot on in a cache shorter than `context`."""
    class OneSlotOn(base.LayerCache):
        __slots__ = ()

        def __init__(self, keys, values, layer, slots, *rest, **options):
            if keys.shape[2] < context:  # a ring; the global caches hold every position
                slots = (slots + 1) % keys.shape[2]
            super().__init__(keys, values, layer, slots, *rest, **options)
    return OneSlotOn


def _writes_one_ring_slot_on(base, context):
    return {"LayerCache": _one_slot_on(base, context)}


@pytest.mark.parametrize("damage", [_reads_one_slot_past_the_window, _writes_one_ring_slot_on])
def test_a_ring_slot_read_or_written_wrong_is_a_mismatch(bundle, monkeypatch, damage):
    """verify writes the positions before the checked ones with the eager model first
    (checks/verify.py, _write_prefix), so the checked steps attend to what a prompt makes;
    a model that reads a stale ring slot or writes a position to the wrong one must still
    differ from the package on the sliding layers. Here the reference carries the damage."""
    from museflash.builtin.demo_checkpoint import builtin_checkpoints
    from museflash.bundle import Metadata
    from museflash.checks import verify
    from museflash.models import base, muse_glimmer

    metadata = Metadata.read(bundle)
    for name, replacement in damage(base, metadata.context_length).items():
        monkeypatch.setattr(muse_glimmer, name, replacement)
    with builtin_checkpoints("tiny") as dirs:
        target, _ = verify.load_reference_models(metadata, *dirs)
    checks = verify.target_checks(metadata)
    assert [c[0] for c in checks] == ["main", "prefill", "decode", "tree"]  # no buckets here
    for function, entry, seed, bucket in checks:
        result = verify.check_target(bundle, metadata, target, function, entry, seed,
                                     bucket=bucket)
        assert not result.ok and "wraps the ring" in result.note, result.line()


def test_a_drafter_ring_slot_written_wrong_is_a_mismatch(bundle, monkeypatch):
    """verify writes the drafter's ring positions before the checked blocks with the eager
    drafter, from the eager target's drafter_features (checks/verify.py,
    _write_drafter_prefix); a drafter that writes each position one slot on must still differ
    from the package. Here the reference drafter carries the damage."""
    from museflash.builtin.demo_checkpoint import builtin_checkpoints
    from museflash.bundle import Metadata
    from museflash.checks import verify
    from museflash.models import base, dflash

    metadata = Metadata.read(bundle)
    with builtin_checkpoints("tiny") as dirs:
        target, drafters = verify.load_reference_models(metadata, *dirs)
    drafter = drafters[verify.AssetRole.DFLASH_DRAFTER]
    healthy = verify.check_dflash_drafter(bundle, metadata, drafter, target, seed=5)
    assert healthy.ok, healthy.line()
    # Every drafter cache is a ring: the context bound shifts them all.
    monkeypatch.setattr(dflash, "LayerCache", _one_slot_on(base, metadata.context_length + 1))
    damaged = verify.check_dflash_drafter(bundle, metadata, drafter, target, seed=5)
    assert not damaged.ok and "wraps the ring" in damaged.note, damaged.line()


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_tokens": 3}, "--prompt-tokens 3 is shorter"),
    ({"prompt_tokens": 40, "new_tokens": 30}, "context_length is 64"),
    ({"checkpoint": Path("/nonexistent/target")}, "checkpoint /nonexistent/target (from the "
                                                  "command line) is not a directory"),
])
def test_bad_input_exits_2_with_one_line(bundle, kwargs, message):
    status, lines = _verify(bundle, **kwargs)
    assert status == 2
    assert lines[-1].startswith("verify: error: ") and message in lines[-1]


def test_missing_metadata_exits_2(tmp_path):
    status, lines = _verify(tmp_path)
    assert status == 2 and "metadata.json not found" in lines[-1]


def test_cli_resolves_relative_paths_against_the_bazel_working_directory(tmp_path):
    env = dict(os.environ, BUILD_WORKING_DIRECTORY=str(tmp_path),
               PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "museflash.cli.verify_main",
                           "--export-dir", "exported"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("verify: error")]
    # One error, naming the directory resolved against BUILD_WORKING_DIRECTORY.
    assert len(errors) == 1, done.stdout
    assert f" {tmp_path / 'exported'} " in errors[0]


def test_zlab_layout_drafter_exports_and_verifies(tmp_path):
    """A DFlash v1 drafter in z-lab's layout (fc / hidden_norm, dflash_config, is_causal false)
    exports with its per-query sliding window, and the exported draft matches eager."""
    from zlab_layout import to_zlab_layout

    target_config, drafter_config = shallow_tiny_pair_configs()  # depth is not the subject
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path / "pair", target_config=target_config,
                                                     drafter_config=drafter_config)
    to_zlab_layout(drafter_dir, target_depth=target_config["text_config"]["num_hidden_layers"])
    out = tmp_path / "bundle"
    export_bundle(ExportOptions(output_dir=out, checkpoint=target_dir,
                                drafter_checkpoint=drafter_dir, fused_target=True,
                                dflash_drafter=True, max_context_length=64, prefill_length=8,
                                conversion_processes=1),
                  Progress(echo=lambda _: None))
    status, lines = _verify(out, new_tokens=16)
    assert status == 0
    parity = [line for line in lines if line.startswith("parity dflash_drafter")]
    assert len(parity) == 1 and " OK" in parity[0] and "wraps the ring" in parity[0]
