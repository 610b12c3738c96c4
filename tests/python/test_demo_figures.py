"""The demo figures tool: perplexity through the exported `main` blocks is the model's own."""

import math

import numpy as np
import pytest
import torch

from museflash.bundle import Metadata
from museflash.checkpoint import load_target
from museflash.demo_checkpoint import write_tiny_checkpoints
from museflash.export.options import ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress
from museflash.runtime.speculative import ExportedTarget
from museflash.tools.demo_figures import exported_perplexity, prompts_from


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("figures")
    target, drafter = write_tiny_checkpoints(root / "pair")
    out = root / "export"
    export_bundle(ExportOptions(output_dir=out, checkpoint=target, drafter_checkpoint=drafter,
                                fused_target=True, dflash_drafter=True, max_context_length=64,
                                prefill_length=8), Progress(echo=lambda _line: None))
    return out, target


def _eager_nll(target_dir, documents, limit):
    """The same windows, scored by eager fp32 torch over each whole window at once."""
    from museflash.tools.train_demo import IGNORE, evaluation_windows

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
