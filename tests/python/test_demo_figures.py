"""The demo figures tool: perplexity through the exported `main` blocks is the model's own."""

import math
import shutil

import numpy as np
import pytest
import torch
from prebuilt import prebuilt_bundle

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.bundle import Metadata
from museflash.checkpoint.load import load_target
from museflash.runtime.speculative import ExportedTarget
from museflash.tools.demo_figures import exported_perplexity, prompts_from


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """The tiny pair the build exported (//tests/integration:demo_bundle, context 64) and the
    same pair's checkpoints, written again as the export read them (`builtin:tiny`)."""
    root = tmp_path_factory.mktemp("figures")
    out = prebuilt_bundle(root / "export")
    assert Metadata.read(out).source.checkpoint == "builtin:tiny"
    with builtin_checkpoints("tiny") as (target, _):
        shutil.copytree(target, root / "target")
    return out, root / "target"


def _eager_nll(target_dir, documents, limit):
    """The same windows, scored by eager fp32 torch over each whole window at once."""
    from museflash.training.train_demo import IGNORE, evaluation_windows

    model = load_target(target_dir, dtype=torch.float32, max_context=64, max_query_len=64,
                        cache_dtype=torch.float32)
    total, count = 0.0, 0
    inputs, targets = evaluation_windows(documents, limit)
    for ids, wanted in zip(inputs, targets, strict=True):
        model.reset_caches()
        with torch.no_grad():
            logits = model(ids[None].to(torch.int32),
                           torch.arange(len(ids), dtype=torch.int32))[0].double()
        scored = wanted != IGNORE
        log_probs = torch.log_softmax(logits[scored], dim=-1)
        total -= float(log_probs[torch.arange(int(scored.sum())), wanted[scored]].sum())
        count += int(scored.sum())
    return total, count


def test_exported_perplexity_matches_the_eager_model(export):
    out, target_dir = export
    metadata = Metadata.read(out)
    rng = np.random.default_rng(3)
    documents = [rng.integers(0, 511, n).tolist() for n in (9, 30, 80)]
    target = ExportedTarget(out, metadata)
    limit = metadata.context_length - target.verify_length
    nll, count, nbytes = exported_perplexity(target, documents, limit, 10_000,
                                             lambda ids: "x" * len(ids))
    eager_nll, eager_count = _eager_nll(target_dir, documents, limit)
    # Every token after the first of each file, once (the 80-token file over three windows).
    assert count == eager_count == 8 + 29 + 79
    assert nbytes == count
    # fp16 export against fp32 eager: per-token perplexity within 2%.
    assert math.exp(nll / count) == pytest.approx(math.exp(eager_nll / eager_count), rel=0.02)
    # Scoring stops after the file that reaches the token budget.
    assert exported_perplexity(target, documents, limit, 5, lambda ids: "")[1] == 8


def test_prompts_come_from_the_middle_of_files_twice_their_length():
    documents = [[1] * 10, list(range(40)), [3] * 16, [4] * 50]
    assert prompts_from(documents, 5, 8) == [list(range(16, 24)), [3] * 8, [4] * 8]
    assert prompts_from(documents, 1, 8) == [list(range(16, 24))]


def test_exports_are_reused_only_with_the_same_settings(tmp_path, monkeypatch):
    from museflash.export import pipeline
    from museflash.tools import demo_figures

    written = []

    def fake_export(options, _progress):
        written.append(options.num_draft_tokens)
        options.output_dir.mkdir(parents=True, exist_ok=True)
        (options.output_dir / "metadata.json").write_text("{}")

    monkeypatch.setattr(pipeline, "export_bundle", fake_export)
    # The fake exports hold no packages; the package check of a reused export is the damaged
    # bundle tests' business (test_damaged_bundles.py).
    monkeypatch.setattr(demo_figures, "check_packages", lambda _dir, _metadata: None)
    monkeypatch.setattr(demo_figures.Metadata, "read", staticmethod(lambda _dir: None))
    settings = demo_figures.export_settings("demo", 3)
    first = demo_figures.ensure_export(tmp_path, "demo-k3", settings, log=lambda _l: None)
    again = demo_figures.ensure_export(tmp_path, "demo-k3", settings, log=lambda _l: None)
    assert first == again == tmp_path / "demo-k3"
    assert written == [3]
    demo_figures.ensure_export(tmp_path, "demo-k3", demo_figures.export_settings("demo", 7),
                               log=lambda _l: None)
    assert written == [3, 7]
    # The target-only bundle has no drafter, so its main takes one token.
    assert "dflash_drafter" not in demo_figures.export_settings("demo", None)


def test_speed_ups_are_against_both_target_alone_baselines():
    from museflash.tools.demo_figures import Figures, Row, markdown

    figures = Figures(1, 10, 20, 8.0, 1.0, 2, 48, 48,
                      rows=[Row("demo", "dflash", 0.0, 3, 0.5, 1.5, 2.2, 10.0, 4.0, 25.0, 3,
                                0.25)],
                      target_alone_ms_per_token={"t0": {"python": 20.0, "swift": 6.0}},
                      main_ms_per_call={1: {"python": 20.0, "swift": 3.0}})
    row = next(line for line in markdown(figures).splitlines() if line.startswith("| demo"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4:9] == ["3", "25%", "50.0%", "1.50", "2.20"]
    assert cells[10] == "2.00x (2.50x)"  # 20 / 10 against main of 1; 25 / 10 on the same export
    assert cells[12] == "1.50x"  # 6 / 4
