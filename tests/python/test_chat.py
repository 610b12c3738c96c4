"""Chat sessions (runtime/chat.py, speculative.DecodeSession): a session keeps the target's
caches and the drafter's ring between turns and prefills only what follows the prefix they hold,
and every turn decodes exactly what decoding its whole history from scratch decodes, also after
a rewind and after drop-oldest; scripted conversations, the context policy, and bad input."""

import json

import numpy as np
import pytest
from command_line import run_main
from prebuilt import DFLASH2_BUNDLE, TINY_BUNDLE, prebuilt_bundle

from museflash.builtin.demo_checkpoint import write_word_tokenizer
from museflash.bundle import Metadata
from museflash.checkpoint.tokenizer import end_of_turn_ids
from museflash.cli import generate_main
from museflash.runtime.chat import (
    DROP_OLDEST,
    Chat,
    ChatError,
    ChatTemplate,
    read_messages,
    reply_points,
)
from museflash.runtime.speculative import (
    DecodeSession,
    ExportedDrafter,
    ExportedTarget,
    ring_slack,
    speculative_generate,
    target_only_generate,
)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {"tiny": prebuilt_bundle(root / "tiny", TINY_BUNDLE),
            "dflash2": prebuilt_bundle(root / "dflash2", DFLASH2_BUNDLE)}


def _open(export_dir, drafting=True):
    metadata = Metadata.read(export_dir)
    target = ExportedTarget(export_dir, metadata)
    drafter = ExportedDrafter(export_dir, metadata) if drafting else None
    return target, drafter, metadata


def _session(target, drafter, metadata):
    spec = metadata.speculative_decoding
    return DecodeSession(target, drafter, mask_token_id=spec.mask_token_id if drafter else None,
                         context_length=metadata.context_length,
                         ring_slack=ring_slack(metadata))


def _fresh(target, drafter, metadata, prompt, new_tokens):
    """The same prompt decoded from reset caches, as a caller without a session decodes it."""
    if drafter is None:
        return target_only_generate(target, prompt, new_tokens,
                                    context_length=metadata.context_length)
    return speculative_generate(target, drafter, prompt, new_tokens,
                                mask_token_id=metadata.speculative_decoding.mask_token_id,
                                context_length=metadata.context_length)


def _words(rng, count, mask):
    return [int(t) for t in rng.choice([i for i in range(3, 500) if i != mask], count)]


@pytest.mark.parametrize("bundle,drafting", [("tiny", True), ("dflash2", True),
                                             ("tiny", False)])
def test_session_turns_equal_decoding_each_history_from_scratch(bundles, bundle, drafting):
    target, drafter, metadata = _open(bundles[bundle], drafting)
    mask = metadata.speculative_decoding.mask_token_id
    session = _session(target, drafter, metadata)
    slack = ring_slack(metadata)
    assert slack is not None, "the rewinds below must meet a sliding ring"
    rng = np.random.default_rng(7)
    prompt = _words(rng, target.prefill_length + 4, mask)
    turns = []
    for _ in range(4):  # each turn continues the last: its prompt + reply + new ids
        result = session.generate(prompt, 6)
        turns.append((list(prompt), result))
        prompt = prompt + result.tokens + _words(rng, 4, mask)
    held = session.held
    # A rewind of a few ids (an edited last message): the rings still hold what it needs.
    near = held[:len(held) - 6] + _words(rng, 5, mask)
    turns.append((near, session.generate(near, 6)))
    # A rewind further back than the rings' slack: the session starts over.
    far_at = session.written_to - slack - 2
    far = session.held[:far_at] + _words(rng, 5, mask)
    turns.append((far, session.generate(far, 6)))
    # A prompt that shares nothing: the session starts over.
    other = _words(rng, target.prefill_length + 6, mask)
    turns.append((other, session.generate(other, 6)))

    for index, (turn_prompt, result) in enumerate(turns):
        fresh = _fresh(target, drafter, metadata, turn_prompt, 6)
        assert result.tokens == fresh.tokens, f"turn {index}"
    reused = [result.reused_tokens for _, result in turns]
    # Continuing turns keep the previous prompt and all of the reply but its last token.
    for (before, earlier), (after, later) in zip(turns[:3], turns[1:4], strict=True):
        assert later.reused_tokens == len(before) + len(earlier.tokens) - 1
        assert later.prefill_calls < _fresh(target, drafter, metadata, after, 6).prefill_calls
    assert reused[4] == len(held) - 6
    assert reused[5] == reused[6] == 0


def test_stop_tokens_end_the_reply_on_the_first_one(bundles):
    target, drafter, metadata = _open(bundles["tiny"])
    session = _session(target, drafter, metadata)
    prompt = _words(np.random.default_rng(3), 12, metadata.speculative_decoding.mask_token_id)
    full = session.generate(prompt, 12)
    stop = full.tokens[5]
    first = full.tokens.index(stop)
    stopped = session.generate(prompt, 12, stop_token_ids={stop})
    assert stopped.tokens == full.tokens[:first + 1]
    assert stopped.stopped and not full.stopped


# A word-level template over the tiny bundle's vocabulary ("w<id>" words): w1 opens a user
# message (w1 w4 a system one), w3 an assistant one (the generation prompt), w2 ends each (the
# end-of-turn token).
WORD_TEMPLATE = ("{% for m in messages %}{{ 'w3 ' if m.role == 'assistant' else ('w1 w4 ' if "
                 "m.role == 'system' else 'w1 ') }}{{ m.content }} w2 {% endfor %}"
                 "{% if add_generation_prompt %}w3 {% endif %}")


def _encode(text):
    return [int(word[1:]) for word in text.split()]


def _decode(ids):
    return " ".join(f"w{i}" for i in ids)


def _chat(bundles, max_new_tokens=6, **kwargs):
    target, drafter, metadata = _open(bundles["tiny"])
    chat = Chat(_session(target, drafter, metadata), ChatTemplate(WORD_TEMPLATE),
                encode=_encode, decode=_decode, stop_token_ids=[2],
                context_length=metadata.context_length, max_new_tokens=max_new_tokens,
                **kwargs)
    return chat, target, drafter, metadata


def _user(rng, count):
    return _decode(_words(rng, count, 511))


def test_a_scripted_conversation_replies_to_each_unanswered_user_message(bundles):
    chat, target, drafter, metadata = _chat(bundles, system=_user(np.random.default_rng(1), 3))
    rng = np.random.default_rng(2)
    script = [{"role": "user", "content": _user(rng, 5)},
              {"role": "user", "content": _user(rng, 4)},
              {"role": "assistant", "content": _user(rng, 3)},
              {"role": "user", "content": _user(rng, 4)}]
    assert reply_points(script) == [0, 3]
    turns = chat.run_script(script)
    assert len(turns) == 2
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    for turn in turns:
        assert turn.tokens == _fresh(target, drafter, metadata, turn.prompt_ids, 6).tokens
    # The second reply's history is the first's, the reply and two messages more: the session
    # computed only what followed the ids it held.
    first, second = turns
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert second.prefilled_tokens == len(second.prompt_ids) - (
        len(first.prompt_ids) + len(first.tokens) - 1)
    assert second.prompt_ids == _encode(ChatTemplate(WORD_TEMPLATE).render(
        chat.messages[:6]))


def test_a_history_past_the_context_is_refused_by_default_and_dropped_on_request(bundles):
    rng = np.random.default_rng(4)
    users = [_user(rng, 9) for _ in range(4)]
    system = _user(rng, 2)
    chat, *_ = _chat(bundles, system=system)
    with pytest.raises(ChatError, match="context_length is 64"):
        for text in users:
            chat.say(text)
    chat, target, drafter, metadata = _chat(bundles, system=system, on_context_full=DROP_OLDEST)
    turns = [chat.say(text) for text in users]
    assert any(turn.dropped_messages for turn in turns)
    assert chat.messages[0] == {"role": "system", "content": system}
    assert chat.messages[-2]["content"] == users[-1]
    for turn in turns:
        assert turn.tokens == _fresh(target, drafter, metadata, turn.prompt_ids, 6).tokens
        assert len(turn.prompt_ids) + 6 + 3 <= 64


@pytest.mark.parametrize("text,problem", [
    ("[{\"role\": \"user\", \"content\": \"hi\"", "not JSON"),
    ("[]", "empty"),
    ("{\"role\": \"user\"}", "list"),
    ("[{\"role\": \"robot\", \"content\": \"hi\"}]", "robot"),
    ("[{\"role\": \"user\", \"content\": 3}]", "content"),
    ("[{\"role\": \"assistant\", \"content\": \"hi\"}]", "no user message"),
])
def test_bad_messages_files_are_one_line_errors(tmp_path, text, problem):
    path = tmp_path / "messages.json"
    path.write_text(text)
    with pytest.raises(ChatError, match=problem) as caught:
        read_messages(path)
    assert "\n" not in str(caught.value)


def test_generate_refuses_a_bad_conversation_before_loading_anything(bundles, tmp_path, capsys):
    path = tmp_path / "messages.json"
    path.write_text("[{\"role\": \"narrator\", \"content\": \"x\"}]")
    status = run_main(generate_main.main, f"--export-dir={bundles['tiny']}",
                      f"--messages={path}")
    err = capsys.readouterr().err
    assert status == 2 and "narrator" in err and len(err.strip().splitlines()) == 1
    status = run_main(generate_main.main, f"--export-dir={bundles['tiny']}", "--prompt=w5",
                      f"--messages={path}")
    assert status == 2 and "exactly one of" in capsys.readouterr().err


def test_generate_without_a_chat_template_names_the_missing_template(bundles, tmp_path, capsys):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": "w5 w6"}]))
    status = run_main(generate_main.main, f"--export-dir={bundles['tiny']}",
                      f"--messages={path}")
    err = capsys.readouterr().err
    assert status == 2 and "chat template" in err and len(err.strip().splitlines()) == 1


def test_generate_runs_a_scripted_conversation_as_json(bundles, tmp_path, capsys):
    export = bundles["dflash2"]
    config_path = export / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    vocab = json.loads((export / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(vocab, key=vocab.get)[10:20]
    config["chat_template"] = ("{% for m in messages %}" + words[0] + " {{ m.content }} "
                               + words[1] + " {% endfor %}{% if add_generation_prompt %}"
                               + words[2] + " {% endif %}")
    config_path.write_text(json.dumps(config))
    # What the export records for a checkpoint with this template: its turn-ending word.
    metadata = json.loads((export / "metadata.json").read_text())
    metadata["tokenizer"]["end_of_turn_ids"] = [vocab[words[1]]]
    (export / "metadata.json").write_text(json.dumps(metadata))
    path = tmp_path / "messages.json"
    # The second history is longer than a prefill chunk (32 here), which a session can extend.
    path.write_text(json.dumps([{"role": "user", "content": " ".join(words[3:6] * 5)},
                                {"role": "user", "content": " ".join(words[6:9] * 5)}]))
    status = run_main(generate_main.main, f"--export-dir={export}", f"--messages={path}",
                      "--format=json", "--max-new-tokens=5")
    out = json.loads(capsys.readouterr().out)
    assert status == 0
    assert [len(t["tokens"]) <= 5 for t in out["turns"]] == [True, True]
    first, second = out["turns"]
    assert first["prefilled_tokens"] == len(first["prompt_ids"])
    assert second["prefilled_tokens"] < len(second["prompt_ids"])
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user", "assistant"]


def test_the_end_of_turn_ids_are_the_eos_and_the_templates_turn_end(tmp_path):
    write_word_tokenizer(tmp_path, 64, {"<pad>": 0, "<eos>": 2, "<|end|>": 5, "<|start|>": 6})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}"
                         "<|end|>\n{% endfor %}"}))
    special = {"<pad>": 0, "<eos>": 2, "<|end|>": 5, "<|start|>": 6}
    assert end_of_turn_ids(tmp_path, special) == [2, 5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert end_of_turn_ids(tmp_path, special) == [2, 5, 7]
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").unlink()
    assert end_of_turn_ids(tmp_path, special) is None
