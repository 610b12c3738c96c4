"""The benchmark machinery on a tiny checkpoint: records, files, and the two paths' outputs.
Speed and memory targets are read from the real benchmark's figures, never asserted here."""

import json

import pytest

from museflash import benchmark

pytest.importorskip("coremltools")


def test_synthetic_configs_scale_depth_and_width():
    small_target, small_drafter = benchmark.synthetic_configs(0.25e9)
    large_target, _ = benchmark.synthetic_configs(2e9)
    small, large = small_target["text_config"], large_target["text_config"]
    assert large["num_hidden_layers"] > small["num_hidden_layers"]
    assert large["hidden_size"] > small["hidden_size"]
    assert small["layer_types"][:4] == ["sliding_attention"] * 3 + ["full_attention"]
    assert small["num_hidden_layers"] % 4 == 0
    assert small_drafter["hidden_size"] == small["hidden_size"]


def test_tiny_benchmark_writes_records_and_files(tmp_path):
    lines = []
    records = benchmark.run_benchmark([0.002], tmp_path / "out", echo=lines.append)
    assert [r.path for r in records] == ["naive", "streaming"]
    saved = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert len(saved) == 2
    for entry in saved:
        for key in ("path", "weight_bytes", "wall_s", "peak_rss_bytes", "peak_anon_bytes",
                    "output_bytes"):
            assert key in entry
        assert entry["peak_rss_bytes"] >= entry["peak_anon_bytes"] > 0
        assert entry["output_bytes"] > 0.9 * entry["weight_bytes"]
    assert saved[0]["weight_bytes"] == saved[1]["weight_bytes"]
    assert (tmp_path / "out" / "benchmark.png").stat().st_size > 0
    # Both paths export the same model: equal specs and every weight constant bit for bit.
    equivalence = (tmp_path / "out" / "equivalence.txt").read_text()
    assert equivalence.strip().endswith("specs and every weight constant equal"), equivalence
    assert any(line.startswith("path") for line in lines[-1].splitlines())
    assert not (tmp_path / "out" / "work").exists()
