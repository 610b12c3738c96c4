"""tools/train_demo_drafter trains through the models' own entry points, batched: the batched
drafting equals the drafter's inject_kv + draft block by block, in value and in gradient, and
the tool runs end to end on a tiny trained target, writing a drafter checkpoint in the real
layout that the exporter's checks accept and that drafts better than the untrained one."""

import json

import pytest
import torch
from command_line import run_main

from museflash.checkpoint.configs import check_configs, read_config
from museflash.checkpoint.load import load_drafter, load_target
from museflash.cli import train_demo_drafter_main
from museflash.demo_checkpoint import TINY_DRAFTER_CONFIG, write_tiny_checkpoints
from museflash.tools import train_demo_drafter as trainer

# Small matrices: one thread is several times faster than two on a shared 2-core machine.
torch.set_num_threads(1)


# The drafter with one KV head: its layers' cache reads are views of the buffer that the next
# layer writes in place (the case training needs allow_mutation_on_saved_tensors for).
@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1"])
def pair(tmp_path_factory, request):
    drafter_config = dict(TINY_DRAFTER_CONFIG, num_key_value_heads=request.param)
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path_factory.mktemp("demo"),
                                                     drafter_config=drafter_config)
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
    low, high = trainer._anchor_range(corpus, rows, block)
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
        # The entry points write each layer's cache in place after the previous layer read
        # its own; plain autograd refuses that when the read is a view (one version counter
        # per cache buffer), so both paths keep copies of whatever they saved, as train() does.
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            (features, ctx, ids, positions), _ = trainer._blocks(target, drafter, corpus, rows,
                                                                anchors, block)
            batched = trainer.draft_blocks(drafter, features, ctx, ids, positions)
            batched_grads = gradients((batched * weights).sum())

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


def test_context_before_position_zero_is_hidden_as_at_run_time(pair):
    """Anchors right after a short prompt: the batched blocks inject placeholder features at
    negative positions, which must change nothing against injecting only the real ones."""
    target, drafter, _ = pair
    prompts = trainer.random_prompts(3, 5, target.config.vocab_size,
                                     drafter.config.mask_token_id, seed=4)
    corpus = trainer.generate_corpus_batched(target, prompts, 24)
    assert drafter.config.sliding_window - 4 > 5 + 2  # the third row still reaches below 0
    assert trainer.check_batched_drafting(target, drafter, corpus, block=4) < 1e-4


def test_prompts_are_windows_of_the_documents():
    documents = [[1, *range(10, 30), 2], [1, 5, 2], [1, *range(40, 90), 2]]
    prompts = trainer.document_prompts(documents, 50, 8, seed=0)
    assert prompts == trainer.document_prompts(documents, 50, 8, seed=0)
    assert len(prompts) == 50 and all(len(p) == 8 for p in prompts)
    windows = {tuple(doc[i:i + 8]) for doc in documents for i in range(len(doc) - 7)}
    assert {tuple(p) for p in prompts} <= windows
    assert trainer.spread_layer_ids(6) == [1, 3, 5] and trainer.spread_layer_ids(2) == [1]


# --- The whole tool on a tiny trained target --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny Muse Glimmer trained by //:train_demo's own run on a few small stdlib files (with
    its tokenizer), the way the committed demo target is made."""
    from museflash.tools import train_demo as td

    root = td.stdlib_root()
    small = [p for p in td.corpus_paths(root) if (root / p).stat().st_size < 6_000]
    chosen = ([p for p in small if not td.is_held_out(p)][:24]
              + [p for p in small if td.is_held_out(p)][:3])
    work = tmp_path_factory.mktemp("tiny_target")
    corpus_root = work / "stdlib"
    for relative in chosen:
        (corpus_root / relative).parent.mkdir(parents=True, exist_ok=True)
        (corpus_root / relative).write_bytes((root / relative).read_bytes())
    settings = td.Settings(
        output_dir=work / "out", steps=40, threads=1, vocab_size=300, context=64, batch_size=8,
        learning_rate=1e-2, warmup_steps=5, corpus_root=corpus_root, log_every=10**6,
        arch=td.Architecture(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             sliding_window=16))
    td.run(settings, lambda _line: None)
    return work / "out" / "target", corpus_root


def test_tiny_run_distils_a_drafter_the_exporter_accepts(tiny_target, tmp_path):
    target_dir, corpus_root = tiny_target
    out = tmp_path / "trained"
    lines = []
    report = trainer.run(out, target_dir=target_dir, corpus_root=corpus_root,
                         train_seconds=None, train_steps=150, sequences=48, prompt_length=8,
                         continuation=24, layers=2, window=16, eval_prompts_count=2,
                         new_tokens=12, heldout_sequences=8, tf_stride=1, batch=16, lr=1e-2,
                         log=lines.append)
    print(trainer.format_report(report))
    assert report["train_steps"] == 150
    drafter_dir = out / "drafter"
    assert sorted(p.name for p in drafter_dir.iterdir()) == ["config.json", "model.safetensors"]
    checked = check_configs(target_dir, drafter_dir)  # what the exporter runs first
    config = read_config(drafter_dir)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == trainer.BLOCK_SIZE == 16
    assert config["mask_token_id"] == checked.tokenizer.special_tokens["<mask>"] == 3
    assert config["target_layer_ids"] == [1, 2]
    assert config["hidden_size"] == checked.target.hidden_size == 32
    target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=64)
    assert target.encoder.fc.weight.shape == (32, 2 * 32)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=torch.float32)
    assert drafter.config.num_hidden_layers == 2 and drafter.config.sliding_window == 16
    # Distillation helps on the held-out files' continuations (every anchor counted).
    for block in trainer.EVAL_BLOCKS:
        assert report["trained_teacher_forced"][block] > report[
            "untrained_teacher_forced"][block] + 0.03, block
    assert report["trained"][4][0] > report["untrained"][4][0]
    for key in ("untrained", "trained", "trained_sampled"):
        for block in trainer.EVAL_BLOCKS:
            acceptance, length, per_call = report[key][block]
            # tokens per main call: a prompt shorter than a block costs one extra call
            assert 0 <= acceptance <= 1 and 0 <= length <= block - 1 and per_call > 0.5
    assert report["corpus"]["train_files"] == 24 and report["corpus"]["held_out_files"] == 3
    assert report["corpus"]["same_corpus_as_target"] is True  # train_demo.json's digest
    saved = json.loads((out / "train_demo_drafter.json").read_text())
    assert saved["trained_teacher_forced"]["4"] == report["trained_teacher_forced"][4]
    rows = [line.split() for line in trainer.format_report(report).splitlines()]
    assert [row[0] for row in rows if row and row[0].isdigit()] == [
        str(block) for block in trainer.EVAL_BLOCKS]


def test_command_line_flags_reach_the_run(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(output_dir, **kwargs):
        seen.clear()
        seen.update(kwargs, output_dir=output_dir)
        return {"fake": "report"}

    monkeypatch.setattr(trainer, "run", fake_run)
    monkeypatch.setattr(trainer, "format_report", lambda report: f"REPORT {report['fake']}")
    assert run_main(train_demo_drafter_main.main, "--output-dir", str(tmp_path),
                    "--target-dir", str(tmp_path / "t"), "--train-steps", "5",
                    "--train-seconds", "7", "--sequences", "16", "--prompt-length", "12",
                    "--continuation", "24", "--layers", "3", "--window", "32",
                    "--target-layer-ids", "0,2", "--batch", "8", "--lr", "1e-3", "--seed", "2",
                    "--threads", "1") == 0
    assert seen == {"output_dir": tmp_path, "target_dir": tmp_path / "t", "corpus_root": None,
                    "train_seconds": 7.0, "train_steps": 5, "sequences": 16,
                    "prompt_length": 12, "continuation": 24, "layers": 3, "window": 32,
                    "target_layer_ids": [0, 2], "batch": 8, "lr": 1e-3, "seed": 2}
    assert capsys.readouterr().out == "REPORT report\n"
    # Relative paths are relative to where `bazel run` was typed; the target defaults to the
    # committed demo target (run() resolves None).
    monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path))
    assert run_main(train_demo_drafter_main.main, "--output-dir", "relative") == 0
    assert seen["output_dir"] == tmp_path / "relative" and seen["target_dir"] is None
    assert trainer.default_target_dir().parts[-2:] == ("demo", "target")
    # Unusable input is one line on stderr and exit status 2, before anything runs.
    seen.clear()
    capsys.readouterr()
    assert run_main(train_demo_drafter_main.main, "--output-dir", "x",
                    "--target-layer-ids", "1,b") == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and "--target-layer-ids" in errors[0] and not seen
    assert run_main(train_demo_drafter_main.main) == 2 and not seen
