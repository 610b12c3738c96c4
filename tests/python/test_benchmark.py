"""The benchmark machinery on a tiny checkpoint: records, files, and the two paths' outputs.
Speed and memory targets are read from the real benchmark's figures, never asserted here."""

import json

import pytest
from prebuilt import prebuilt_bundle

from museflash.bundle import LayerType
from museflash.tools import benchmark

pytest.importorskip("coremltools")


def test_synthetic_configs_scale_depth_and_width():
    small_target, small_drafter = benchmark.synthetic_configs(0.25e9)
    large_target, _ = benchmark.synthetic_configs(2e9)
    small, large = small_target["text_config"], large_target["text_config"]
    assert large["num_hidden_layers"] > small["num_hidden_layers"]
    assert large["hidden_size"] > small["hidden_size"]
    sliding, full = LayerType.SLIDING_ATTENTION, LayerType.FULL_ATTENTION
    assert small["layer_types"][:4] == [sliding] * 3 + [full]
    assert small["num_hidden_layers"] % 4 == 0
    assert small_drafter["hidden_size"] == small["hidden_size"]


def test_muse_30b_geometry_keeps_the_layer_and_grows_the_depth():
    rows = [benchmark.synthetic_configs(size, "muse-30b")[0]["text_config"]
            for size in (2e9, 8e9)]
    assert {r["hidden_size"] for r in rows} == {6656}
    assert {r["intermediate_size"] for r in rows} == {19968}
    assert rows[1]["num_hidden_layers"] == 2 * rows[0]["num_hidden_layers"]
    with pytest.raises(ValueError, match="unknown geometry"):
        benchmark.synthetic_configs(2e9, "muse-7b")


def test_tiny_benchmark_writes_records_and_files(tmp_path, monkeypatch):
    compared = []
    compare = benchmark.compare_exports

    def recording_compare(naive, streaming):
        compared.append(compare(naive, streaming))
        return compared[-1]

    monkeypatch.setattr(benchmark, "compare_exports", recording_compare)
    lines = []
    records = benchmark.run_benchmark([0.002], tmp_path / "out", echo=lines.append,
                                      paths=("naive", "streaming", "streaming-4bit"))
    assert [r.path for r in records] == ["naive", "streaming", "streaming-4bit"]
    saved = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    exports = [e for e in saved if e["path"] in benchmark.ALL_PATHS]
    assert len(exports) == 3
    for entry in exports:
        for key in ("path", "weight_bytes", "wall_s", "peak_rss_bytes", "peak_anon_bytes",
                    "output_bytes"):
            assert key in entry
        assert entry["peak_rss_bytes"] >= entry["peak_anon_bytes"] > 0
    naive, streaming, compressed = exports
    assert naive["output_bytes"] > 0.9 * naive["weight_bytes"]
    assert streaming["output_bytes"] > 0.9 * streaming["weight_bytes"]
    # Most of the synthetic weights are large enough to be stored in 4 (or 8) bits.
    assert compressed["output_bytes"] < 0.6 * streaming["output_bytes"]
    assert naive["weight_bytes"] == streaming["weight_bytes"]
    assert naive["processes"] == 1 <= streaming["processes"]
    copies = [e for e in saved if e["path"] == "file copy"]
    assert [c["when"] for c in copies] == ["before", "after"]
    assert all(c["bytes"] > 0 and c["mb_per_s"] > 0 for c in copies)
    assert (tmp_path / "out" / "benchmark.png").stat().st_size > 0
    # Both paths export the same model: equal specs and every weight constant bit for bit,
    # compared once, and the verdict is recorded.
    assert len(compared) == 1
    problems, _notes = compared[0]
    assert problems == []
    assert (tmp_path / "out" / "equivalence.txt").stat().st_size > 0
    assert lines[-1].startswith(benchmark.format_table(records).splitlines()[0])
    assert not (tmp_path / "out" / "work").exists()


def test_comparison_finds_a_changed_weight_and_sets_aside_only_debug_names(tmp_path):
    import shutil

    from coremltools.proto import Model_pb2

    first = prebuilt_bundle(tmp_path / "first")
    second = tmp_path / "second"
    shutil.copytree(first, second)
    assert benchmark.compare_exports(first, second) == ([], [])

    spec_path = second / "target.mlpackage" / "Data" / "com.apple.CoreML" / \
        "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    renamed = next(benchmark._state_ops(spec))
    renamed.attributes["name"].immediateValue.tensor.strings.values[0] = "elsewhere"
    spec_path.write_bytes(spec.SerializeToString())
    problems, notes = benchmark.compare_exports(first, second)
    # Set aside, and said so, for the one package whose labels differ.
    assert problems == []
    assert len(notes) == 1 and notes[0].startswith("target.mlpackage:"), notes

    weights = second / "target.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / \
        "weight.bin"
    data = bytearray(weights.read_bytes())
    data[-2] ^= 0x01  # the last weight's last fp16 value
    weights.write_bytes(bytes(data))
    problems, _ = benchmark.compare_exports(first, second)
    # One blob, shared by main and prefill: one problem, in the target package's values.
    assert len(problems) == 1 and problems[0].startswith("target.mlpackage:"), problems
    assert "value" in problems[0], problems



def test_naive_path_is_skipped_where_it_would_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "memory_total", lambda: 10**6)
    lines = []
    records = benchmark.run_benchmark([0.002], tmp_path / "out", echo=lines.append,
                                      paths=("naive",))
    assert records == []
    saved = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    notes = [e["note"] for e in saved if e["path"] == "skipped"]
    assert len(notes) == 1 and "naive" in notes[0] and "would need" in notes[0]
