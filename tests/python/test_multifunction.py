"""Merging single-function packages: the result is save_multifunction's, byte for byte, and
placeholders become the real weights or the merge fails loudly."""

import shutil

import numpy as np
import pytest
import torch

from museflash.builtin.demo_checkpoint import shallow_tiny_pair_configs, write_tiny_checkpoints
from museflash.bundle import PACKAGE_SPEC, PACKAGE_WEIGHT_FILE
from museflash.checkpoint.tensor_files import WeightLocation
from museflash.export.blobfile import read_record
from museflash.export.convert import convert_function
from museflash.export.merge import (
    MergeError,
    blob_constants,
    merge_packages,
    read_spec,
)
from museflash.export.options import ExportOptions
from museflash.export.placeholders import PlaceholderWeights
from museflash.export.plan import load_modules, plan_export
from museflash.export.progress import Progress
from museflash.export.weights import write_weights
from museflash.tools.benchmark import _const_values as const_values
from museflash.tools.benchmark import _without_state_op_debug_names as without_labels

ct = pytest.importorskip("coremltools")


class _Quiet(Progress):
    def __init__(self):
        super().__init__(echo=lambda _line: None)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny target's two functions converted into single-function packages, once with the
    real weights and once with placeholders. Four of its eight layers (three sliding, one
    global) are enough to merge, and each conversion is a quarter of the work."""
    root = tmp_path_factory.mktemp("parts")
    target_config, drafter_config = shallow_tiny_pair_configs()
    target_dir, drafter_dir = write_tiny_checkpoints(root / "demo", target_config=target_config,
                                                     drafter_config=drafter_config)
    options = ExportOptions(output_dir=root / "unused", checkpoint=target_dir, fused_target=True,
                            max_context_length=64, prefill_length=8)
    plan = plan_export(options, target_dir, drafter_dir)
    package = plan.asset("target")
    made = {}
    for label, placeholders in (("real", None), ("placeholders", PlaceholderWeights())):
        modules = load_modules(options, plan, _Quiet(), placeholders)
        (root / label).mkdir()
        functions = []
        for function in package.functions:
            part = root / label / f"{function.name}.mlpackage"
            convert_function(modules["target"], package, function, part, _Quiet())
            functions.append((function.name, part))
        rows = None
        if placeholders is not None:
            rows = {placeholders.row_of(p) for p in modules["target"].parameters()} - {None}
        made[label] = (functions, placeholders, rows)
    return made


def _weights(package):
    return (package / PACKAGE_WEIGHT_FILE).read_bytes()


def test_merge_writes_what_save_multifunction_writes(parts, tmp_path):
    functions, _, _ = parts["real"]
    merged = tmp_path / "merged.mlpackage"
    merge_packages(functions, merged, "main")

    descriptor = ct.utils.MultiFunctionDescriptor()
    for name, part in functions:
        descriptor.add_function(str(part), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = "main"
    reference = tmp_path / "reference.mlpackage"
    ct.utils.save_multifunction(descriptor, str(reference))

    # save_multifunction renumbers the read_state/write_state ops' debug labels as it lowers
    # the program again; the merge keeps the parts'. Everything else is equal.
    assert without_labels(read_spec(merged)) == without_labels(read_spec(reference))
    assert _weights(merged) == _weights(reference)
    # The two functions share their weights: the merged file is far smaller than both parts.
    part_bytes = sum(len(_weights(part)) for _, part in functions)
    assert len(_weights(merged)) < 0.6 * part_bytes


def test_placeholders_become_the_real_weights(parts, tmp_path):
    real = tmp_path / "real.mlpackage"
    merge_packages(parts["real"][0], real, "main")
    functions, placeholders, rows = parts["placeholders"]
    streamed = tmp_path / "streamed.mlpackage"
    stored = merge_packages(functions, streamed, "main", placeholders, rows)
    # One real weight per placeholder, stored fp16 at its checkpoint shape.
    locations = {placeholders.by_row[row].key: placeholders.by_row[row] for row in rows}
    assert len(locations) >= 8 and stored.keys() == locations.keys()
    assert all(weight.scheme is None and weight.shape == locations[key].shape
               for key, weight in stored.items())
    assert _weights(streamed) == _weights(real)


def test_weights_written_ahead_are_pointed_at_not_written_again(parts, tmp_path):
    """The export's route: the real weights go to the weight file while the parts convert
    (weights.write_weights); the merge appends the other constants and points each placeholder
    const at its blob. Every const then holds the real merge's bytes, in a file of equal size."""
    real = tmp_path / "real.mlpackage"
    merge_packages(parts["real"][0], real, "main")
    functions, placeholders, rows = parts["placeholders"]
    locations = [placeholders.by_row[row] for row in sorted(rows)]
    written = write_weights(tmp_path / "ahead.weights", locations, {})
    streamed = tmp_path / "streamed.mlpackage"
    assert len(merge_packages(functions, streamed, "main", placeholders, rows,
                              written=written)) == len(rows)
    assert const_values(streamed, read_spec(streamed)) == const_values(real, read_spec(real))
    assert len(_weights(streamed)) == len(_weights(real))
    assert not (tmp_path / "ahead.weights").exists()  # it became the package's weight file


def _first_placeholder_blob(part, placeholders):
    data = (part / PACKAGE_WEIGHT_FILE).read_bytes()
    for const in blob_constants(read_spec(part).mlProgram.functions["main"]):
        _, _, size, start = read_record(data, const.offset)
        if len(const.shape) == 2 and data[start:start + 2 * const.shape[1]] in placeholders.by_row:
            return start, size
    raise AssertionError(f"no placeholder blob in {part}")


def test_parts_store_each_placeholder_as_its_row_and_a_changed_row_is_refused(parts, tmp_path):
    functions, placeholders, rows = parts["placeholders"]
    damaged = []
    for name, part in functions:
        copy = tmp_path / part.name
        shutil.copytree(part, copy)
        damaged.append((name, copy))
    start, size = _first_placeholder_blob(damaged[0][1], placeholders)
    assert size < 4096  # one row (a 64-wide fp16 row here), not the whole weight
    with (damaged[0][1] / PACKAGE_WEIGHT_FILE).open("r+b") as handle:
        handle.seek(start + size - 2)
        last = handle.read(2)
        handle.seek(start + size - 2)
        handle.write(bytes([last[0] ^ 0x01, last[1]]))
    destination = tmp_path / "merged.mlpackage"
    with pytest.raises(MergeError, match="stored as one row, which no placeholder has"):
        merge_packages(damaged, destination, "main", placeholders, rows)
    assert not destination.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for _, p in damaged)


def test_a_placeholder_written_whole_is_checked_row_by_row(tmp_path):
    """A part converted without compact broadcasts holds placeholders whole; a change past the
    first row means conversion transformed the weight."""
    from museflash.export.merge import _WeightFile

    row = np.arange(64, dtype=np.float16).tobytes()
    weights = tmp_path / "part.mlpackage" / PACKAGE_WEIGHT_FILE
    weights.parent.mkdir(parents=True)
    weights.write_bytes(row * 9 + row[:-2] + bytes([1, 2]))
    source = _WeightFile(tmp_path / "part.mlpackage")
    try:
        source.verify_repeated_row(0, 9 * len(row), row, "w", "key")
        with pytest.raises(MergeError, match="differs further on"):
            source.verify_repeated_row(0, 10 * len(row), row, "w", "key")
    finally:
        source.close()


def test_a_weight_missing_from_the_parts_is_refused(parts, tmp_path):
    functions, placeholders, rows = parts["placeholders"]
    lost = WeightLocation(path=tmp_path / "nowhere.safetensors", offset=0, nbytes=2 * 64 * 64,
                          dtype="F16", shape=(64, 64), key="model.lost.weight")
    extra = PlaceholderWeights()
    extra.by_row.update(placeholders.by_row)
    row = extra.row_of(extra.make(lost, torch.float16))
    with pytest.raises(MergeError, match=r"\['model.lost.weight'\] are not stored"):
        merge_packages(functions, tmp_path / "merged.mlpackage", "main", extra, rows | {row})
    assert not (tmp_path / "merged.mlpackage").exists()


def test_the_default_function_must_be_one_of_the_parts(parts, tmp_path):
    with pytest.raises(MergeError, match="default function 'decode' is not among"):
        merge_packages(parts["real"][0], tmp_path / "merged.mlpackage", "decode")


def test_a_multifunction_part_is_refused(parts, tmp_path):
    merged = tmp_path / "merged.mlpackage"
    merge_packages(parts["real"][0], merged, "main")
    with pytest.raises(MergeError, match="is not a single-function ML program"):
        merge_packages([("main", merged)], tmp_path / "again.mlpackage", "main")
    assert (merged / PACKAGE_SPEC).exists()
