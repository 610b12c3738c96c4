"""The export's placeholders: stand-ins for exactly the large weights, each derived from its
tensor alone, so every process that loads a checkpoint makes the same ones."""

import pytest
import torch

import museflash.export.placeholders as placeholders_module
from museflash.builtin.demo_checkpoint import write_tiny_checkpoints
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.tensor_files import CheckpointError, WeightLocation
from museflash.export.placeholders import PlaceholderWeights


@pytest.fixture(scope="module")
def fp32_dirs(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("fp32"), seed=5, dtype="fp32")


def _load(target_dir, drafter_dir, dtype=torch.float32):
    target = load_target(target_dir, drafter_dir, dtype=dtype, max_context=64, max_query_len=10)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=dtype,
                           max_query_len=10)
    return target, drafter


def test_placeholders_stand_in_for_the_large_weights_only(fp32_dirs):
    placeholders = PlaceholderWeights()
    target = load_target(*fp32_dirs, dtype=torch.float16, max_context=64, max_query_len=10,
                         placeholders=placeholders)
    drafter = load_drafter(fp32_dirs[1], target, dtype=torch.float16, max_query_len=10,
                           placeholders=placeholders)
    real_target, real_drafter = _load(*fp32_dirs, dtype=torch.float16)
    stand_ins = 0
    for model, real in ((target, real_target), (drafter, real_drafter)):
        real_parameters = dict(real.named_parameters())
        for name, parameter in model.named_parameters():
            if placeholders.wants(tuple(parameter.shape)):
                assert parameter.stride(0) == 0, name
                assert placeholders.row_of(parameter) is not None, name
                stand_ins += 1
            else:
                assert torch.equal(parameter, real_parameters[name]), name
    assert stand_ins >= 10
    # Each stand-in points back at its own checkpoint tensor, read only when asked.
    row = placeholders.row_of(target.embed_tokens.weight)
    assert torch.equal(placeholders.by_row[row].read(torch.float16),
                       real_target.embed_tokens.weight)


def _location(path, key, shape=(64, 32)):
    return WeightLocation(path=path, offset=0, nbytes=2 * shape[0] * shape[1], dtype="F16",
                          shape=shape, key=key)


def test_placeholder_rows_depend_on_the_tensor_not_on_the_load_order(tmp_path):
    """The export and its helper processes each make their own placeholders; the merge finds
    a weight again by its row, so every instance must make the same row for the same tensor
    whatever it loaded before."""
    shard = tmp_path / "model.safetensors"
    a_weight, b_weight = (_location(shard, "model.a.weight"),
                             _location(shard, "model.b.weight", shape=(128, 32)))
    forward, backward = PlaceholderWeights(), PlaceholderWeights()
    made_forward = {loc.key: forward.make(loc, torch.float16) for loc in (a_weight, b_weight)}
    made_backward = {loc.key: backward.make(loc, torch.float16)
                     for loc in (b_weight, a_weight)}
    for location in (a_weight, b_weight):
        ours, theirs = made_forward[location.key], made_backward[location.key]
        assert ours.shape == theirs.shape == location.shape
        assert torch.equal(ours, theirs)
        assert forward.row_of(ours) == backward.row_of(theirs) is not None
        assert forward.by_row[forward.row_of(ours)] == location
    a, b = made_forward["model.a.weight"], made_forward["model.b.weight"]
    assert not torch.equal(a[0], b[0])  # different tensors, different rows
    # The same key in another file (another shard, another checkpoint) is another tensor.
    elsewhere = PlaceholderWeights().make(_location(tmp_path / "other.safetensors",
                                                    "model.a.weight"), torch.float16)
    assert not torch.equal(elsewhere, a)


def test_placeholder_rows_follow_the_file_not_the_spelling_of_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    absolute = PlaceholderWeights().make(_location(tmp_path / "model.safetensors", "w"),
                                         torch.float16)
    relative = PlaceholderWeights().make(_location(type(tmp_path)("model.safetensors"), "w"),
                                         torch.float16)
    assert torch.equal(absolute, relative)


def test_coinciding_placeholder_rows_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(placeholders_module, "_name_seeded",
                        lambda _location: torch.Generator().manual_seed(1))
    placeholders = PlaceholderWeights()
    shard = tmp_path / "model.safetensors"
    placeholders.make(_location(shard, "model.a.weight"), torch.float16)
    placeholders.make(_location(shard, "model.a.weight"), torch.float16)  # the same tensor again
    with pytest.raises(CheckpointError) as error:
        placeholders.make(_location(shard, "model.b.weight"), torch.float16)
    # The error names both tensors, so the user knows which to rename.
    assert "model.a.weight" in str(error.value) and "model.b.weight" in str(error.value)


def test_fresh_placeholder_instances_make_the_same_model(fp32_dirs):
    """Two independent loads (as in two processes) give bit-identical stand-ins, parameter by
    parameter, and each names the same checkpoint tensor."""
    loaded = []
    for _ in range(2):
        placeholders = PlaceholderWeights()
        target = load_target(*fp32_dirs, dtype=torch.float16, max_context=64, max_query_len=10,
                             placeholders=placeholders)
        drafter = load_drafter(fp32_dirs[1], target, dtype=torch.float16, max_query_len=10,
                               placeholders=placeholders)
        loaded.append((placeholders, dict(target.named_parameters()),
                       dict(drafter.named_parameters())))
    (first, *first_models), (second, *second_models) = loaded
    compared = 0
    for ours, theirs in zip(first_models, second_models, strict=True):
        for name, parameter in ours.items():
            row = first.row_of(parameter)
            if row is None:
                continue
            assert torch.equal(parameter, theirs[name]), name
            assert second.row_of(theirs[name]) == row, name
            assert first.by_row[row] == second.by_row[row], name
            compared += 1
    assert compared >= 10
