"""tools/train_demo_drafter trains through the models' own entry points, batched: the batched
drafting equals the drafter's inject_kv + draft block by block, in value and in gradient, and
the tool runs end to end on a tiny budget, writing checkpoints in the real layout."""

import json

import pytest
import torch

from museflash.checkpoint import load_drafter, load_target, read_config
from museflash.demo_checkpoint import write_demo_checkpoints
from museflash.tools import train_demo_drafter as trainer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = write_demo_checkpoints(tmp_path_factory.mktemp("demo"))
    target, drafter = trainer.load_pair(target_dir, drafter_dir, max_context=64, max_query=16)
    prompts = trainer.random_prompts(4, trainer.PROMPT_LENGTH, target.config.vocab_size,
                                     drafter.config.mask_token_id, seed=3)
    corpus = trainer.generate_corpus_batched(target, prompts, 40)
    return target, drafter, corpus


def test_batched_generation_equals_one_sequence_at_a_time(pair):
    target, drafter, corpus = pair
    prompts = corpus.tokens[:3, :trainer.PROMPT_LENGTH].tolist()
    single = trainer.generate_corpus(target, prompts, 40)
    assert torch.equal(single.tokens, corpus.tokens[:3])
    assert torch.allclose(single.captured, corpus.captured[:3], rtol=1e-4, atol=1e-5)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    assert corpus.captured.shape == (4, 40, width)


@pytest.mark.parametrize("block", [4, 16])  # with injected context, and with none
def test_batched_drafting_has_the_entry_points_values_and_gradients(pair, block):
    target, drafter, corpus = pair
    rows = torch.tensor([0, 1, 2, 3])
    low, high = trainer._anchor_range(corpus, rows, block, drafter.config.sliding_window)
    anchors = torch.minimum(low + rows, high - 1)
    trained = [p for m in (target.encoder, drafter.layers, drafter.norm) for p in m.parameters()]
    weights = torch.randn(len(rows), block, target.config.vocab_size,
                          generator=torch.Generator().manual_seed(0))

    def gradients(loss):
        found = torch.autograd.grad(loss, trained, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g.clone()
                for p, g in zip(trained, found, strict=True)]

    for p in trained:
        p.requires_grad_(True)
    try:
        (features, ctx, ids, positions), _ = trainer._blocks(target, drafter, corpus, rows,
                                                            anchors, block)
        batched = trainer.draft_blocks(drafter, features, ctx, ids, positions)
        batched_grads = gradients((batched * weights).sum())

        # The entry points write each layer's cache in place after the previous layer read
        # its own; plain autograd refuses that (one version counter per cache buffer), so the
        # reference keeps copies of whatever it saved.
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            (features, ctx, ids, positions), _ = trainer._blocks(target, drafter, corpus, rows,
                                                                anchors, block)
            alone, loss = [], 0.0
            for i in range(len(rows)):
                drafter.reset_caches()
                if features.shape[1]:
                    drafter.inject_kv(features[i:i + 1], ctx[i].to(torch.int32))
                logits = drafter.draft(ids[i:i + 1].to(torch.int32),
                                       positions[i].to(torch.int32))
                alone.append(logits[0].detach())
                loss = loss + (logits[0] * weights[i]).sum()
            alone_grads = gradients(loss)
    finally:
        for p in trained:
            p.requires_grad_(False)
        drafter.reset_caches()
    assert torch.allclose(batched.detach(), torch.stack(alone), rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(batched_grads, alone_grads, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-3, atol=1e-5)
    # The encoder (run inside the fused target) learns from the injected context, if any.
    encoder_learns = any(bool(g.abs().max() > 0) for g in batched_grads[:len(
        list(target.encoder.parameters()))])
    assert encoder_learns == (block < drafter.config.sliding_window)
    assert all(bool(g.abs().max() > 0) for g in batched_grads[-2:])  # the drafter's last layers


def test_tiny_run_writes_real_checkpoints_and_the_report(tmp_path):
    out = tmp_path / "trained"
    report = trainer.run(out, train_seconds=None, train_steps=3, sequences=16, continuation=24,
                         eval_prompts_count=2, new_tokens=8, heldout_sequences=4, batch=8,
                         log=lambda _line: None)
    assert report["train_steps"] == 3
    target_dir, _ = write_demo_checkpoints(tmp_path / "demo")
    target = load_target(target_dir, out / "drafter", dtype=torch.float32, max_context=64)
    for block in trainer.EVAL_BLOCKS:
        directory = out / ("drafter" if block == 4 else f"drafter-k{block}")
        assert report["drafter_dirs"][block] == str(directory)
        assert read_config(directory)["block_size"] == block
        drafter = load_drafter(directory, target, target_dir=target_dir, dtype=torch.float32)
        assert drafter.config.block_size == block
        for key in ("untrained", "trained"):
            acceptance, length, per_call = report[key][block]
            assert 0 <= acceptance <= 1 and 0 <= length <= block - 1 and per_call >= 1
        for key in ("untrained_teacher_forced", "trained_teacher_forced"):
            assert 0 <= report[key][block] <= 1
    rows = [line.split() for line in trainer.format_report(report).splitlines()]
    assert [row[0] for row in rows if row and row[0].isdigit()] == [
        str(block) for block in trainer.EVAL_BLOCKS]


def test_command_line_flags_reach_the_run_and_the_report_is_saved(tmp_path, monkeypatch,
                                                                  capsys):
    seen = {}

    def fake_run(output_dir, **kwargs):
        seen.update(kwargs, output_dir=output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)  # as run() does
        return {"fake": "report"}

    monkeypatch.setattr(trainer, "run", fake_run)
    monkeypatch.setattr(trainer, "format_report", lambda report: f"REPORT {report['fake']}")
    trainer.main(["--output-dir", str(tmp_path), "--train-steps", "5", "--train-seconds", "7",
                  "--sequences", "16", "--continuation", "24", "--seed", "2", "--threads", "1"])
    assert seen == {"output_dir": tmp_path, "train_seconds": 7.0, "train_steps": 5,
                    "sequences": 16, "continuation": 24, "seed": 2}
    assert capsys.readouterr().out == "REPORT report\n"
    assert json.loads((tmp_path / "acceptance.json").read_text()) == {"fake": "report"}
    # A relative --output-dir is relative to where `bazel run` was typed.
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    trainer.main(["--output-dir", "relative"])
    assert seen["output_dir"] == tmp_path / "relative"
    assert (tmp_path / "relative" / "acceptance.json").is_file()
