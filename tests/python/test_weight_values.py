"""Weights an fp16 package cannot hold are refused at export (issue 25): a NaN or an inf, or a
bf16/fp32 value beyond fp16's range, in a streamed weight (fp16 or compressed), in a small
tensor loaded for real, or in a compressed weight's scales. Each refusal is one line that names
the tensor, the count of bad values and the largest magnitude; a failed --overwrite export
leaves the previous export as it was."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from museflash.checkpoint.load import load_target
from museflash.checkpoint.tensor_files import SafetensorsReader
from museflash.checkpoint.weight_values import WeightValueError, unholdable
from museflash.compression import Scheme
from museflash.export import weights
from museflash.export.placeholders import PlaceholderWeights
from museflash.export.weights import write_weights


def _locations(tmp_path, tensors):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    reader = SafetensorsReader(directory)
    return [reader.locate(key) for key in tensors]


def _weight(rows, columns, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, columns, generator=generator) * 0.02).to(dtype)


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch):
    monkeypatch.setattr(weights, "_ROWS_BYTES", 512)  # several slices, on both threads


def test_unholdable_sees_nan_inf_and_what_rounds_to_inf():
    fine = np.array([0.0, -1.5, 65504.0, -65519.0], np.float32)
    assert not unholdable(fine)
    assert not unholdable(fine.astype(np.float16))
    for bad in (np.nan, np.inf, -np.inf, 65520.0, -1e6):
        values = np.append(fine, np.float32(bad))
        assert unholdable(values), bad
        with np.errstate(over="ignore"):
            assert unholdable(values.astype(np.float16)), bad


def test_nan_in_a_streamed_weight_is_refused_naming_it(tmp_path):
    bad = _weight(50, 70, torch.bfloat16, seed=1)
    bad[41, 3] = float("nan")
    bad[49, 69] = float("nan")
    locations = _locations(tmp_path, {"good": _weight(40, 64, torch.bfloat16),
                                      "layers.7.mlp.down_proj.weight": bad})
    with pytest.raises(WeightValueError) as caught:
        write_weights(tmp_path / "w.bin", locations, {})
    message = str(caught.value)
    assert "'layers.7.mlp.down_proj.weight'" in message
    assert "holds 2 value" in message and "2 NaN" in message
    assert "\n" not in message


def test_bf16_beyond_fp16_range_is_refused_with_its_magnitude(tmp_path):
    bad = _weight(50, 70, torch.bfloat16)
    bad[10, 0] = 131072.0  # exact in bf16; inf in fp16
    bad[20, 5] = -70144.0
    locations = _locations(tmp_path, {"big": bad})
    with pytest.raises(WeightValueError, match=r"'big'.* 2 value.*2 beyond.*131072"):
        write_weights(tmp_path / "w.bin", locations, {})


def test_fp32_value_that_rounds_to_fp16_max_is_kept(tmp_path):
    edge = _weight(50, 70, torch.float32)
    edge[3, 3] = 65510.0  # rounds to 65504, fp16's largest value
    written = write_weights(tmp_path / "w.bin", _locations(tmp_path, {"edge": edge}), {})
    assert "edge" in written.placed


@pytest.mark.parametrize("scheme", [Scheme("linear", 8), Scheme("linear", 4, block_size=32),
                                    Scheme("palettize", 4, group_size=5)])
def test_a_compressed_weight_beyond_fp16_range_is_refused(tmp_path, scheme):
    # Quantized, 1e5 fits an int8 scale; the constexpr op would still rebuild it as inf.
    bad = _weight(50, 64, torch.float32)
    bad[47, 60] = 1e5
    locations = _locations(tmp_path, {"proj": bad})
    with pytest.raises(WeightValueError, match=r"'proj'.* 1 value.*100000"):
        write_weights(tmp_path / "w.bin", locations, {"proj": scheme})


def test_nan_in_a_compressed_weight_is_refused_naming_it(tmp_path):
    bad = _weight(50, 64, torch.bfloat16)
    bad[30, 1] = float("inf")
    locations = _locations(tmp_path, {"lm_head.weight": bad})
    with pytest.raises(WeightValueError, match=r"'lm_head.weight'.*, 1 inf"):
        write_weights(tmp_path / "w.bin", locations, {"lm_head.weight": Scheme("linear", 8)})


@pytest.mark.parametrize("scheme, blob, named", [
    (Scheme("linear", 8), 1, "linear 8-bit scales"),
    (Scheme("affine", 8), 1, "affine 8-bit scales"),
    (Scheme("affine", 4, block_size=32), 2, "affine 4-bit offsets"),
])
def test_a_scale_or_offset_that_overflows_fp16_is_refused(tmp_path, monkeypatch, scheme, blob,
                                                          named):
    real = weights.compress

    def overflowing(values, scheme):
        blobs = list(real(values, scheme))
        blobs[blob] = np.full_like(blobs[blob], np.inf)
        return tuple(blobs)

    monkeypatch.setattr(weights, "compress", overflowing)
    locations = _locations(tmp_path, {"q": _weight(40, 64, torch.float16)})
    with pytest.raises(WeightValueError, match=rf"'q'.*{named} overflow fp16"):
        write_weights(tmp_path / "w.bin", locations, {"q": scheme})


def _tiny_pair(tmp_path, damage):
    """The tiny random pair, fp32, with `damage(tensors)` applied to the target's tensors."""
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints

    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path / "pair", dtype="fp32",
                                                     tokenizer=True)
    path = target_dir / "model.safetensors"
    tensors = load_file(path)
    damage(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return target_dir, drafter_dir


def test_a_small_tensor_the_export_loads_for_real_is_refused(tmp_path):
    key = "model.language_model.layers.3.input_layernorm.weight"

    def damage(tensors):
        tensors[key][5] = float("nan")

    target_dir, _ = _tiny_pair(tmp_path, damage)
    load_target(target_dir)  # eager models (verify, generate) load it as it is
    with pytest.raises(WeightValueError, match=rf"'{key}'.*\(1 NaN"):
        load_target(target_dir, dtype=torch.float16, placeholders=PlaceholderWeights())


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_nan_late_in_the_weights_fails_overwrite_and_keeps_the_previous_export(tmp_path):
    """The weights pass finds a NaN in one of the last weights it writes, after most weight
    files are written and while the functions convert: one line naming the tensor, exit 2,
    and the export being replaced is byte for byte as it was, nothing left beside it."""
    key = "model.language_model.layers.7.mlp.down_proj.weight"

    def damage(tensors):
        tensors[key][-1, -1] = float("nan")

    target_dir, drafter_dir = _tiny_pair(tmp_path, damage)
    previous = tmp_path / "exported"
    (previous / "target.mlpackage" / "Data").mkdir(parents=True)
    (previous / "metadata.json").write_text(json.dumps({"schema_version": "previous"}))
    (previous / "target.mlpackage" / "Data" / "weight.bin").write_bytes(b"\x01" * 4096)
    before = _snapshot(previous)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path if p))
    result = subprocess.run(
        [sys.executable, "-m", "museflash.cli.export_main", f"--checkpoint={target_dir}",
         f"--drafter-checkpoint={drafter_dir}", "--fused-target", "--dflash-drafter",
         "--max-context-length=64", "--prefill-length=8", "--overwrite",
         f"--output-dir={previous}"],
        capture_output=True, text=True, check=False, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert key in lines[0] and "(1 NaN" in lines[0]
    assert _snapshot(previous) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "pair"]
