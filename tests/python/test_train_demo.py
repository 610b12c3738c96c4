"""The demo target's training tool: corpus split, tokenizer, batching, a tiny training run."""

import json
import math
import random
import re

import pytest
import torch

from museflash.bundle import LayerType
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.load import load_target
from museflash.checkpoint.tokenizer import read_tokenizer
from museflash.training import train_demo as td

# --- Corpus ----------------------------------------------------------------------------------


def _write(root, relative, data=b"x = 1\n"):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_corpus_keeps_library_sources_only(tmp_path):
    kept = ["os.py", "json/decoder.py", "encodings/cp437.py", "email/mime/text.py"]
    dropped = ["site-packages/pkg/mod.py", "test/test_os.py", "ctypes/test/test_x.py",
               "lib2to3/tests/data/f.py", "idlelib/idle_test/t.py", "pydoc_data/topics.py",
               "_sysconfigdata__linux_x86_64-linux-gnu.py", "__pycache__/os.py"]
    for relative in kept + dropped:
        _write(tmp_path, relative)
    _write(tmp_path, "README.txt")
    assert td.corpus_paths(tmp_path) == sorted(kept)
    with_tests = td.corpus_paths(tmp_path, include_tests=True)
    assert set(with_tests) - set(kept) == {"test/test_os.py", "ctypes/test/test_x.py",
                                           "lib2to3/tests/data/f.py", "idlelib/idle_test/t.py"}


def test_split_is_by_file_from_the_path_alone_and_disjoint(tmp_path):
    paths = [f"pkg{i % 7}/mod_{i}.py" for i in range(400)]
    for relative in paths:
        _write(tmp_path, relative, f"value = {len(relative)}\n".encode())
    _write(tmp_path, "latin1.py", "name = 'caf\xe9'\n".encode("latin-1"))
    first = td.load_corpus(tmp_path)
    second = td.load_corpus(tmp_path)
    assert first == second
    train = {f.path for f in first.train}
    held_out = {f.path for f in first.held_out}
    assert not train & held_out
    assert train | held_out == set(paths)
    assert first.skipped == ("latin1.py",)
    assert held_out == {p for p in paths if td.is_held_out(p)}
    assert 0.02 < len(held_out) / len(paths) < 0.09
    # A file's side depends on nothing but its path: other files coming or going change nothing.
    for relative in paths[::2]:
        (tmp_path / relative).unlink()
    thinned = td.load_corpus(tmp_path)
    assert {f.path for f in thinned.held_out} == {p for p in held_out if p in paths[1::2]}


def test_split_of_the_real_stdlib_is_pinned():
    # The rule is sha256(relative path) -> [0, 100) < 5; docs/demo.md records its outcome.
    assert td.is_held_out("traceback.py") and td.is_held_out("importlib/_bootstrap_external.py")
    assert not td.is_held_out("os.py") and not td.is_held_out("typing.py")
    assert 0.0 <= td.path_bucket("os.py") < 100.0
    paths = td.corpus_paths(td.stdlib_root())
    assert "os.py" in paths and not any(p.startswith(("test/", "site-packages/")) for p in paths)
    share = sum(td.is_held_out(p) for p in paths) / len(paths)
    assert 0.03 < share < 0.08


# --- Tokenizer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_corpus():
    """A few real stdlib files, split by the real rule."""
    root = td.stdlib_root()
    chosen = [p for p in td.corpus_paths(root) if (root / p).stat().st_size < 12_000]
    train = [p for p in chosen if not td.is_held_out(p)][:40]
    held_out = [p for p in chosen if td.is_held_out(p)][:3]
    return root, train, held_out


@pytest.fixture(scope="module")
def tokenizer(small_corpus):
    root, train, _ = small_corpus
    return td.train_tokenizer(((root / p).read_text("utf-8") for p in train), vocab_size=400)


def test_tokenizer_has_the_special_tokens_and_its_size(tokenizer):
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 400
    assert [tokenizer.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<mask>")] == [
        td.PAD_ID, td.BOS_ID, td.EOS_ID, td.MASK_ID]
    assert tokenizer.encode("<mask>", add_special_tokens=False).ids == [td.MASK_ID]


def test_tokenizer_round_trips_unseen_text(tokenizer, small_corpus):
    root, _, held_out = small_corpus
    texts = [(root / p).read_text("utf-8") for p in held_out] + [
        "def f(x):\n\tif x:  # caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f40d\n"
        "        return 'a'\r\n",
        "   leading and trailing   \n\n\n", "\x00\x7f odd bytes \ufeff", ""]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert not any(i < len(td.SPECIAL_TOKENS) for i in ids)
        assert tokenizer.decode(ids) == text


def test_tokenizer_training_is_deterministic(tokenizer, small_corpus):
    root, train, _ = small_corpus
    again = td.train_tokenizer(((root / p).read_text("utf-8") for p in train), vocab_size=400)
    assert again.to_str() == tokenizer.to_str()


def test_tokenizer_files_are_the_hugging_face_layout(tmp_path, tokenizer):
    td.save_tokenizer(tokenizer, tmp_path, model_max_length=256)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["pad_token"], config["bos_token"], config["eos_token"],
            config["mask_token"]) == ("<pad>", "<bos>", "<eos>", "<mask>")
    described = read_tokenizer(tmp_path, 400, mask_token_id=td.MASK_ID)
    assert described.special_tokens == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<mask>": 3}
    assert td.load_tokenizer(tmp_path).to_str() == tokenizer.to_str()


def test_files_are_encoded_between_bos_and_eos(tokenizer):
    files = [td.SourceFile("a.py", "x = 1\n"), td.SourceFile("b.py", "")]
    docs = td.encode_files(tokenizer, files)
    assert docs[1] == [td.BOS_ID, td.EOS_ID]
    assert docs[0][0] == td.BOS_ID and docs[0][-1] == td.EOS_ID
    assert tokenizer.decode(docs[0][1:-1]) == "x = 1\n"
    with pytest.raises(ValueError, match="c.py: contains the text of a special token"):
        td.encode_files(tokenizer, [td.SourceFile("c.py", "x = '<eos>'\n")])


# --- Batching and evaluation -----------------------------------------------------------------


def test_training_batches_are_seeded_and_cover_each_epoch():
    stream = torch.arange(1000)
    first = td.training_batches(stream, batch_size=4, context=9, seed=5)
    second = td.training_batches(stream, batch_size=4, context=9, seed=5)
    epoch = [next(first) for _ in range(25)]  # 1000 // 10 = 100 windows (or 99) = 25 batches
    assert all(torch.equal(a, next(second)) for a in epoch)
    assert epoch[0].shape == (4, 10)
    windows = torch.cat(epoch)
    assert torch.equal(windows[:, 1:] - windows[:, :-1], torch.ones(100, 9, dtype=torch.int64))
    assert len({int(w[0]) for w in windows}) == 100  # no window twice within the epoch
    other = td.training_batches(stream, batch_size=4, context=9, seed=6)
    assert not torch.equal(next(other), epoch[0])


@pytest.mark.parametrize(("context", "stride"), [(8, None), (8, 8), (8, 3), (5, 1)])
def test_evaluation_scores_every_token_once_with_its_own_file_as_context(context, stride):
    rng = random.Random(context)
    docs = [[td.BOS_ID] + [rng.randrange(4, 50) for _ in range(n)] + [td.EOS_ID]
            for n in (0, 1, 6, 7, 8, 30)]
    inputs, targets = td.evaluation_windows(docs, context, stride)
    scored = targets[targets != td.IGNORE].tolist()
    assert scored == [token for doc in docs for token in doc[1:]]
    min_context = context - (stride or context // 2)
    for x, y in zip(inputs, targets, strict=True):
        columns = (y != td.IGNORE).nonzero().flatten().tolist()
        # A window either starts its file (inputs begin with <bos>) or every scored token
        # sees at least context - stride earlier tokens.
        assert x[0] == td.BOS_ID or columns[0] >= min_context


# --- Schedule and training -------------------------------------------------------------------


def test_schedule_warms_up_holds_and_decays_to_zero():
    peak, total = 1.0, 100
    rates = [td.learning_rate_at(s, total, peak, warmup=10) for s in range(total)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == rates[79] == peak
    assert rates[80] == peak and rates[99] == pytest.approx(1 / 20)
    assert td.learning_rate_at(500, None, peak, warmup=10) == peak
    for start in range(0, 300):
        total = td.total_steps_for(start)
        assert total - td.decay_steps(total) == start


def _copy_files(source_root, paths, destination):
    for relative in paths:
        _write(destination, relative, (source_root / relative).read_bytes())


def test_a_tiny_training_run_learns_and_writes_a_loadable_checkpoint(tmp_path, small_corpus):
    root, train, held_out = small_corpus
    corpus_root = tmp_path / "stdlib"
    _copy_files(root, train + held_out, corpus_root)
    settings = td.Settings(
        # One thread: tiny matrices on a shared machine run ~7x faster than with two.
        output_dir=tmp_path / "out", steps=60, threads=1, vocab_size=320, context=32, batch_size=8,
        learning_rate=1e-2, warmup_steps=5, corpus_root=corpus_root, log_every=20,
        arch=td.Architecture(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             sliding_window=8))
    lines = []
    report = td.run(settings, lines.append)
    assert report["steps"] == 60
    assert report["corpus"]["held_out_files"] == len(held_out)
    # Every held-out token is scored but each file's <bos>, which is given.
    assert report["held_out_scored_tokens"] == report["corpus"]["held_out_tokens"] - len(held_out)
    assert report["last_losses_mean"] < report["first_loss"] - 1.0
    assert report["first_loss"] == pytest.approx(math.log(320), abs=1.0)
    assert 1.0 < report["held_out_perplexity"] < 320 / 2
    assert report["held_out_bits_per_byte"] == pytest.approx(
        report["held_out_loss_per_token"] * report["held_out_scored_tokens"]
        / report["held_out_bytes"] / math.log(2))
    target_dir = tmp_path / "out" / "target"
    assert sorted(p.name for p in target_dir.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    checked = check_configs(target_dir)
    assert checked.target.vocab_size == 320 == checked.tokenizer.vocab_size
    sliding, full = LayerType.SLIDING_ATTENTION, LayerType.FULL_ATTENTION
    assert checked.target.layer_types == [sliding] * 2 + [full]
    config = json.loads((target_dir / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == td.EOS_ID == config["eos_token_id"]
    model = load_target(target_dir, dtype=torch.float32, max_context=32)
    assert td.parameter_count(model) == report["parameters"]
    saved = json.loads((tmp_path / "out" / "train_demo.json").read_text())
    assert saved["held_out_perplexity"] == report["held_out_perplexity"]
    assert any("perplexity per token" in line and "bits per byte" in line for line in lines)


def test_a_time_budget_fixes_the_step_count_when_the_decay_starts(monkeypatch):
    """Once the budget's decay fraction is left, the step count is fixed, announced with the
    --steps that repeats the run, and the run ends exactly there. The clock is a fake one that
    advances a second per reading, so the test does not depend on the machine's speed."""
    class Clock:
        now = 0.0

        def perf_counter(self):
            self.now += 1.0
            return self.now

    monkeypatch.setattr(td, "time", Clock())
    arch = td.Architecture(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           sliding_window=4)
    torch.set_num_threads(1)
    model = td.build_model(td.target_config(64, arch, 16), 16, seed=0)
    settings = td.Settings(output_dir=None, minutes=0.5, warmup_steps=2, log_every=10**6)
    ids = torch.randint(4, 64, (2000,), generator=torch.Generator().manual_seed(0))
    batches = td.training_batches(ids, 4, 16, seed=0)
    lines = []
    figures = td.train(model, batches, settings, lines.append)
    announced = [match for line in lines
                 if (match := re.match(r"step (\d+):.*--steps (\d+)\)$", line))]
    assert len(announced) == 1
    fixed_at, steps = (int(group) for group in announced[0].groups())
    # Fixed when 80% of the 30 s budget had passed (a second per step on this clock) ...
    assert fixed_at == pytest.approx(30 * (1 - td.DECAY_FRACTION), abs=2)
    # ... to the shortest run whose decay starts there, and the run is exactly that long.
    assert steps == td.total_steps_for(fixed_at) == figures["steps"] == len(figures["losses"])
    assert steps - td.decay_steps(steps) >= fixed_at
