"""training/train_demo_drafter and training/train_demo_dflash2 train through the models' own entry
points, batched: the batched drafting equals the drafter's inject_kv + draft block by block, in
value and in gradient (and DFlash2's batched selector picks its `draft_tokens`), and both tools
run end to end on a tiny trained target, writing a drafter checkpoint in the real layout that
the exporter's checks accept and that drafts better than the untrained one."""

import json

import pytest
import torch
from command_line import run_main

from museflash.builtin.demo_checkpoint import (
    TINY_DFLASH2_CONFIG,
    TINY_DRAFTER_CONFIG,
    write_tiny_checkpoints,
)
from museflash.checkpoint.configs import check_configs, read_config
from museflash.checkpoint.load import load_drafter, load_target
from museflash.cli import train_demo_drafter_main
from museflash.models.dflash2 import DFlash2Drafter
from museflash.training import distil_corpus as distil
from museflash.training import train_demo_dflash2 as dflash2_trainer
from museflash.training import train_demo_drafter as trainer

# Small matrices: one thread is several times faster than two on a shared 2-core machine.
torch.set_num_threads(1)


# The drafter with one KV head: its layers' cache reads are views of the buffer that the next
# layer writes in place (the case training needs allow_mutation_on_saved_tensors for).
@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1"])
def pair(tmp_path_factory, request):
    drafter_config = dict(TINY_DRAFTER_CONFIG, num_key_value_heads=request.param)
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path_factory.mktemp("demo"),
                                                     drafter_config=drafter_config)
    target, drafter = distil.load_pair(target_dir, drafter_dir, max_context=64, max_query=16)
    prompts = distil.random_prompts(4, trainer.PROMPT_LENGTH, target.config.vocab_size,
                                     drafter.config.mask_token_id, seed=3)
    corpus = distil.generate_corpus_batched(target, prompts, 40)
    return target, drafter, corpus


def test_batched_generation_equals_one_sequence_at_a_time(pair):
    target, drafter, corpus = pair
    prompts = corpus.tokens[:3, :trainer.PROMPT_LENGTH].tolist()
    single = distil.generate_corpus(target, prompts, 40)
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
            batched = distil.draft_blocks(drafter, features, ctx, ids, positions)
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


def test_fp16_rings_train_without_copies_and_with_the_fp32_gradients(pair):
    """Training gives the drafter fp16 rings (the device's state dtype) so that autograd needs
    no copies of saved tensors: the loss and gradients are those of fp32 rings with copies, up
    to fp16 rounding of the cached K/V."""
    target, drafter, corpus = pair
    rows = torch.tensor([0, 1, 2, 3])
    low, _ = trainer._anchor_range(corpus, rows, 4)
    trained = trainer.trained_parameters(target, drafter)
    assert not any(name.startswith(("embed_tokens.", "lm_head."))
                   for name, p in drafter.named_parameters()
                   if any(p is q for q in trained))
    results = []
    for dtype in (torch.float32, torch.float16):
        drafter.cache_dtype = dtype
        drafter.reset_caches()
        for p in trained:
            p.requires_grad_(True)
        try:
            with trainer.saved_tensor_copies(drafter):
                loss = trainer.block_loss(target, drafter, corpus, rows, low, 4)
                grads = torch.autograd.grad(loss, trained, allow_unused=True)
        finally:
            for p in trained:
                p.requires_grad_(False)
        results.append((loss.detach(), grads))
    drafter.cache_dtype = torch.float32
    drafter.reset_caches()
    (loss32, grads32), (loss16, grads16) = results
    assert torch.allclose(loss16, loss32, rtol=1e-3)
    for g32, g16 in zip(grads32, grads16, strict=True):
        if g32 is not None:
            assert torch.allclose(g16, g32, rtol=2e-2, atol=1e-3 * float(g32.abs().max()))


def test_blocks_of_one_row_share_its_encoder_pass(pair):
    """Several anchors per row (train's anchors_per_row) read their context from one encoder
    pass over the row: the same features as encoding each block's own context."""
    target, drafter, corpus = pair
    rows = torch.tensor([2, 0, 2, 0, 1])
    low, high = trainer._anchor_range(corpus, rows, 4)
    anchors = torch.minimum(low + torch.tensor([0, 3, 5, 9, 2]), high - 1)
    (features, ctx, _, _), _ = trainer._blocks(target, drafter, corpus, rows, anchors, 4)
    with torch.no_grad():
        alone = torch.stack([target.encoder([corpus.captured[r, c.clamp(min=0)][None]])[0]
                             for r, c in zip(rows, ctx, strict=True)])
    assert torch.allclose(features.detach(), alone, rtol=1e-5, atol=1e-6)
    assert not torch.equal(features[0], features[2])  # same row, other anchors


def test_the_vocabulary_loss_is_the_block_loss_when_it_holds_every_token(pair):
    """vocabulary_block_loss is block_loss with the softmax over fewer tokens: equal over the
    whole vocabulary, lower over a part of it (a smaller normaliser), and a label outside the
    part is refused."""
    target, drafter, corpus = pair
    rows = torch.tensor([0, 1, 2, 3])
    low, _ = trainer._anchor_range(corpus, rows, 4)
    vocab = target.config.vocab_size
    with torch.no_grad():
        full = trainer.block_loss(target, drafter, corpus, rows, low, 4)
        every = trainer.vocabulary_block_loss(torch.arange(vocab))(
            target, drafter, corpus, rows, low, 4)
        part = trainer.vocabulary_block_loss(corpus.tokens.unique())(
            target, drafter, corpus, rows, low, 4)
    assert torch.allclose(every, full, rtol=1e-5)
    assert corpus.tokens.unique().numel() < vocab and float(part) < float(full)
    label = corpus.tokens[0, low[0] + 1]  # the first block's first label
    missing = corpus.tokens.unique()[corpus.tokens.unique() != label]
    with pytest.raises(ValueError, match="outside the loss's vocabulary"):
        trainer.vocabulary_block_loss(missing)(target, drafter, corpus, rows, low, 4)


def test_training_with_anchors_per_row_lowers_the_loss(pair):
    """train() with several anchors per sampled row and the vocabulary loss (the SmolLM2
    recipe's settings) learns: the held loss drops."""
    target, drafter, corpus = pair
    rows = torch.tensor([0, 1, 2, 3])
    low, _ = trainer._anchor_range(corpus, rows, 4)
    loss_fn = trainer.vocabulary_block_loss(corpus.tokens.unique())
    saved = {k: v.clone() for k, v in drafter.state_dict().items()}
    saved_encoder = {k: v.clone() for k, v in target.encoder.state_dict().items()}
    try:
        with torch.no_grad():
            before = float(loss_fn(target, drafter, corpus, rows, low, 4))
        steps = trainer.train(target, drafter, corpus, steps=30, seconds=None, batch=8,
                              blocks=(4,), loss_fn=loss_fn, anchors_per_row=4,
                              log=lambda _: None)
        with torch.no_grad():
            after = float(loss_fn(target, drafter, corpus, rows, low, 4))
    finally:
        drafter.load_state_dict(saved)
        target.encoder.load_state_dict(saved_encoder)
        drafter.reset_caches()
    assert steps == 30 and after < 0.9 * before


def test_context_before_position_zero_is_hidden_as_at_run_time(pair):
    """Anchors right after a short prompt: the batched blocks inject placeholder features at
    negative positions, which must change nothing against injecting only the real ones."""
    target, drafter, _ = pair
    prompts = distil.random_prompts(3, 5, target.config.vocab_size,
                                     drafter.config.mask_token_id, seed=4)
    corpus = distil.generate_corpus_batched(target, prompts, 24)
    assert drafter.config.sliding_window - 4 > 5 + 2  # the third row still reaches below 0
    assert trainer.check_batched_drafting(target, drafter, corpus, block=4) < 1e-4


def test_prompts_are_windows_of_the_documents():
    documents = [[1, *range(10, 30), 2], [1, 5, 2], [1, *range(40, 90), 2]]
    prompts = distil.document_prompts(documents, 50, 8, seed=0)
    assert prompts == distil.document_prompts(documents, 50, 8, seed=0)
    assert len(prompts) == 50 and all(len(p) == 8 for p in prompts)
    windows = {tuple(doc[i:i + 8]) for doc in documents for i in range(len(doc) - 7)}
    assert {tuple(p) for p in prompts} <= windows
    assert trainer.spread_layer_ids(6) == [1, 3, 5] and trainer.spread_layer_ids(2) == [1]


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path_factory.mktemp("dflash2"),
                                                     drafter_config=TINY_DFLASH2_CONFIG)
    target, drafter = distil.load_pair(target_dir, drafter_dir, max_context=64, max_query=16)
    prompts = distil.random_prompts(4, 5, target.config.vocab_size,
                                     drafter.config.mask_token_id, seed=3)
    return target, drafter, distil.generate_corpus_batched(target, prompts, 40)


@pytest.mark.parametrize("block", [4, 8])
def test_dflash2_blocks_get_the_window_per_query_and_the_selector_path(dflash2_pair, block):
    """DFlash2's first query reaches window - 1 positions back, so its batched blocks carry
    that much context (placeholders below position 0 included, as v1's), and the batched
    selector given the drafter's own path as predecessors picks that path."""
    target, drafter, corpus = dflash2_pair
    assert trainer.context_length(drafter.config, block) == drafter.config.sliding_window - 1
    assert dflash2_trainer.check_batched_dflash2(target, drafter, corpus, block=block) < 1e-4


def test_the_selector_loss_reaches_the_codebooks_through_true_predecessors(dflash2_pair):
    target, drafter, corpus = dflash2_pair
    rows, block = torch.tensor([0, 1, 2, 3]), 4
    low, _ = trainer._anchor_range(corpus, rows, block)
    # A random drafter rarely ranks the target's token among its candidates (such positions
    # are left out of the selector's loss); labelled with each row's argmax, every one counts.
    with torch.no_grad():
        _, logits, _, _ = dflash2_trainer.block_outputs(target, drafter, corpus, rows, low,
                                                        block)
    tokens = corpus.tokens.clone()
    tokens[rows[:, None], low[:, None] + torch.arange(1, block)] = logits.argmax(dim=-1)
    labelled = distil.Corpus(tokens, corpus.captured, corpus.starts)
    selector = drafter.candidate_selector
    trained = [selector.predecessor_codebook, selector.successor_codebook]
    losses = {}
    for weight in (0.0, 1.0):
        for p in trained:
            p.requires_grad_(True)
        try:
            with trainer.saved_tensor_copies(drafter):
                loss = dflash2_trainer.make_loss(weight)(target, drafter, labelled, rows, low,
                                                         block)
                grads = torch.autograd.grad(loss, trained, allow_unused=True)
        finally:
            for p in trained:
                p.requires_grad_(False)
        losses[weight] = (float(loss.detach()), grads)
    assert all(g is None or not g.abs().any() for g in losses[0.0][1])
    assert losses[1.0][0] > losses[0.0][0]
    predecessor_grad, successor_grad = losses[1.0][1]
    _, _, labels, predecessors = dflash2_trainer.block_outputs(target, drafter, labelled, rows,
                                                               low, block)
    # The predecessors are the anchor, then the target's own tokens: only their rows learn.
    assert torch.equal(predecessors[:, 1:], labels[:, :-1])
    touched = predecessor_grad.abs().sum(dim=1).nonzero().flatten()
    assert set(touched.tolist()) == set(predecessors.flatten().tolist())
    assert successor_grad.abs().sum() > 0


def test_line_prompts_are_bos_and_a_definition_line():
    from museflash.training.train_demo import load_tokenizer

    texts = ["import os\n\nclass Parser:\n    def feed(self, data):\n        pass\n",
             "x = 1  # def not_a_header\nasync def main():\n    await go()\n"]
    assert distil.definition_lines(texts) == ["class Parser:", "def feed(self, data):",
                                               "async def main():"]
    tokenizer = load_tokenizer(trainer.default_target_dir())
    prompts = distil.line_prompts(tokenizer, texts, 12, 4, bos=1, seed=0)
    assert prompts == distil.line_prompts(tokenizer, texts, 12, 4, bos=1, seed=0)
    assert len(prompts) == 12 and all(p[0] == 1 and 2 <= len(p) <= 4 for p in prompts)
    decoded = {tokenizer.decode(p[1:]) for p in prompts}
    assert all(any(line.startswith(text) for line in distil.definition_lines(texts))
               for text in decoded)


def test_prompts_of_several_lengths_are_generated_in_one_chunk(pair):
    target, drafter, _ = pair
    prompts = [p[:n] for p, n in zip(distil.random_prompts(
        5, 9, target.config.vocab_size, drafter.config.mask_token_id, seed=5),
        (9, 4, 9, 6, 4), strict=True)]
    corpus = distil.generate_corpus_ragged(target, prompts, 20)  # one chunk of every length
    by_length = sorted(prompts, key=len)
    assert corpus.starts.tolist() == [len(p) for p in by_length]
    single = distil.generate_corpus(target, by_length, 20)
    assert torch.equal(corpus.tokens, single.tokens)
    assert torch.allclose(corpus.captured, single.captured, rtol=1e-4, atol=1e-5)


def test_prompts_of_several_lengths_decode_together_at_their_own_positions(pair):
    target, drafter, _ = pair
    prompts = [p[:n] for p, n in zip(distil.random_prompts(
        7, 9, target.config.vocab_size, drafter.config.mask_token_id, seed=6),
        (9, 4, 7, 6, 4, 9, 2), strict=True)]
    # chunks of 3 rows: [2, 4, 4], [6, 7, 9], [9]; a chunk mixes lengths, one holds a single row
    corpus = distil.generate_corpus_ragged(target, prompts, 20, chunk=3)
    by_length = sorted(prompts, key=len)
    assert corpus.starts.tolist() == [len(p) for p in by_length]
    single = distil.generate_corpus(target, by_length, 20)
    assert torch.equal(corpus.tokens, single.tokens)
    assert torch.allclose(corpus.captured, single.captured, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="1 to 19 tokens"):
        distil.generate_corpus_ragged(target, [prompts[0] * 3], 20)


def test_the_corpus_cache_is_read_only_with_the_same_key(pair, tmp_path):
    _, _, corpus = pair
    made = []

    def make():
        made.append(1)
        return corpus

    path = tmp_path / "corpus.pt"
    first, seconds = distil.cached_corpus(path, {"sequences": 4}, make, log=lambda _l: None)
    again, recorded = distil.cached_corpus(path, {"sequences": 4}, make, log=lambda _l: None)
    assert len(made) == 1 and recorded == seconds
    assert torch.equal(again.tokens, corpus.tokens) and torch.equal(again.starts, corpus.starts)
    assert torch.equal(again.captured, corpus.captured)
    distil.cached_corpus(path, {"sequences": 5}, make, log=lambda _l: None)
    assert len(made) == 2


# --- The whole tool on a tiny trained target --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny Muse Glimmer trained by //:train_demo's own run on a few small stdlib files (with
    its tokenizer), the way the committed demo target is made."""
    from museflash.training import train_demo as td

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
                         train_seconds=None, train_steps=150, sequences=40,
                         line_prompts_count=8, prompt_length=8, continuation=24, layers=2,
                         window=16, eval_prompts_count=2, new_tokens=12, heldout_sequences=8,
                         tf_stride=1, batch=16, lr=1e-2, log=lines.append)
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
    for block in trainer.EVAL_BLOCKS:  # held-out <bos> + definition-line prompts
        assert 0 <= report["trained_line_prompts"][block][0] <= 1
    assert report["data"]["sequences"] == 40 and report["data"]["line_prompts"] == 8
    assert report["corpus"]["train_files"] == 24 and report["corpus"]["held_out_files"] == 3
    assert report["corpus"]["same_corpus_as_target"] is True  # train_demo.json's digest
    saved = json.loads((out / "train_demo_drafter.json").read_text())
    assert saved["trained_teacher_forced"]["4"] == report["trained_teacher_forced"][4]
    rows = [line.split() for line in trainer.format_report(report).splitlines()]
    assert [row[0] for row in rows if row and row[0].isdigit()] == [
        str(block) for block in trainer.EVAL_BLOCKS]


def test_tiny_dflash2_run_distils_a_drafter_the_exporter_accepts(tiny_target, tmp_path):
    target_dir, corpus_root = tiny_target
    out = tmp_path / "trained"
    report = dflash2_trainer.run(out, target_dir=target_dir, corpus_root=corpus_root,
                                 train_seconds=None, train_steps=150, sequences=40,
                                 line_prompts_count=8, prompt_length=8, continuation=24,
                                 layers=2, window=16, kernel=2, group=16, rank=8, top_k=4,
                                 eval_prompts_count=2, new_tokens=12, heldout_sequences=8,
                                 tf_stride=1, batch=16, lr=1e-2, log=lambda _line: None)
    print(dflash2_trainer.format_report(report))
    drafter_dir = out / dflash2_trainer.DRAFTER_DIR
    checked = check_configs(target_dir, drafter_dir)
    config = read_config(drafter_dir)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"]["block_size"] == trainer.BLOCK_SIZE
    assert config["dflash_config"]["mask_token_id"] == checked.tokenizer.special_tokens["<mask>"]
    target = load_target(target_dir, drafter_dir, dtype=torch.float32, max_context=64)
    drafter = load_drafter(drafter_dir, target, target_dir=target_dir, dtype=torch.float32)
    assert isinstance(drafter, DFlash2Drafter)
    assert float(drafter.candidate_selector.successor_codebook.abs().max()) > 0
    for block in trainer.EVAL_BLOCKS:
        assert report["trained_teacher_forced"][block] > report[
            "untrained_teacher_forced"][block] + 0.03, block
        for key in ("trained", "trained_argmax", "trained_sampled", "trained_line_prompts"):
            acceptance, length, _ = report[key][block]
            assert 0 <= acceptance <= 1 and 0 <= length <= block - 1
    saved = json.loads((out / dflash2_trainer.REPORT_FILE).read_text())
    assert saved["trained_teacher_forced_argmax"]["4"] == report[
        "trained_teacher_forced_argmax"][4]


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
                    "--threads", "1", "--line-prompts", "4",
                    "--corpus-cache", str(tmp_path / "corpus.pt")) == 0
    assert seen == {"output_dir": tmp_path, "target_dir": tmp_path / "t", "corpus_root": None,
                    "train_seconds": 7.0, "train_steps": 5, "sequences": 16,
                    "line_prompts_count": 4, "prompt_length": 12, "continuation": 24,
                    "layers": 3, "window": 32, "target_layer_ids": [0, 2], "batch": 8,
                    "lr": 1e-3, "seed": 2, "corpus_cache": tmp_path / "corpus.pt"}
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
