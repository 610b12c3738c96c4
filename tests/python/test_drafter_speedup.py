"""tools/drafter_speedup.py: the figures are pooled over the prompts (sums of tokens and of
seconds, not a mean of per-prompt ratios), every bundle decodes every prompt, rendered with its
own chat template, with the drafter and alone in one process (and a target-only bundle, when
given, right after them), and a bundle the figures cannot be measured on is refused in one
line."""

import dataclasses
import json
import stat

import pytest
from prebuilt import prebuilt_bundle

from museflash.bundle import METADATA_FILE
from museflash.tools import drafter_speedup as speedup

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def report(tokens, seconds, alone_seconds, calls, accepted):
    return {"tokens": list(range(tokens)), "seconds": seconds,
            "target_alone_seconds": alone_seconds, "target_calls": calls, "accepted": accepted}


def test_figures_are_pooled_over_the_prompts():
    pooled = speedup.Pooled()
    pooled.add(report(10, 1.0, 4.0, 5, [1, 1, 0, 2, 1]))  # a 4x prompt
    pooled.add(report(30, 6.0, 6.0, 30, [0] * 30))  # a 1x prompt, three times the tokens
    figures = pooled.figures()
    assert figures["tokens_per_second"] == pytest.approx(40 / 7)
    assert figures["target_alone_tokens_per_second"] == pytest.approx(40 / 10)
    assert figures["speedup"] == pytest.approx(10 / 7)  # not (4 + 1) / 2
    assert figures["tokens_per_target_call"] == pytest.approx(40 / 35)
    assert figures["mean_accepted_length"] == pytest.approx(5 / 35)
    with pytest.raises(speedup.SpeedupError, match="--compare"):
        pooled.add({"tokens": [1], "seconds": 1.0, "target_calls": 1, "accepted": [0]})


@pytest.fixture
def chat_bundle(tmp_path):
    bundle = prebuilt_bundle(tmp_path)
    config = bundle / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps(dict(settings, chat_template=TEMPLATE)))
    return bundle


def fake_swift_generate(tmp_path, log):
    """A stand-in for swift-generate that records its arguments and reports a fixed run."""
    script = tmp_path / "swift-generate"
    body = json.dumps(report(4, 2.0, 3.0, 2, [1, 1]))
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho '{body}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_every_bundle_decodes_every_rendered_prompt_with_and_without_the_drafter(
        chat_bundle, tmp_path):
    log = tmp_path / "calls.txt"
    other = tmp_path / "other"
    other.mkdir()
    second = prebuilt_bundle(other)
    (second / "tokenizer_config.json").write_text(
        (chat_bundle / "tokenizer_config.json").read_text())
    texts = ["hello", "a longer request"]
    figures = speedup.measure([chat_bundle, second], fake_swift_generate(tmp_path, log), texts,
                              7, log=lambda _: None)
    calls = log.read_text().splitlines()
    assert [c.split()[1] for c in calls] == [str(chat_bundle), str(second)] * 2  # alternating
    assert all("--compare" in c and "--max-new-tokens 7" in c and "--lookup-min-match 0" in c
               for c in calls)
    ids = speedup.chat_prompt_ids(chat_bundle, texts)
    assert ids[0] != ids[1] and f"--prompt-ids {','.join(map(str, ids[1]))}" in calls[2]
    assert figures[second]["speedup"] == pytest.approx(1.5)


def test_a_bundle_it_cannot_measure_is_refused(chat_bundle, tmp_path):
    with pytest.raises(speedup.SpeedupError, match="metadata.json"):
        speedup.check_bundle(tmp_path / "nowhere")
    (chat_bundle / "tokenizer_config.json").unlink()
    with pytest.raises(speedup.SpeedupError, match="no chat template"):
        speedup.chat_prompt_ids(chat_bundle, ["hello"])
    metadata = json.loads((chat_bundle / METADATA_FILE).read_text())
    metadata["speculative_decoding"] = None
    (chat_bundle / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(speedup.SpeedupError, match="no drafter"):
        speedup.check_bundle(chat_bundle)


def read_without_drafter(monkeypatch, solo):
    """The bundle at `solo` read as one exported without a drafter (the prebuilt one has)."""
    read = speedup.bundle_metadata
    monkeypatch.setattr(speedup, "bundle_metadata", lambda d, *flag: (
        dataclasses.replace(read(d, *flag), speculative_decoding=None) if d == solo
        else read(d, *flag)))


def test_a_target_only_bundle_decodes_every_prompt_after_the_drafted_ones(chat_bundle, tmp_path,
                                                                         monkeypatch):
    log = tmp_path / "calls.txt"
    solo = prebuilt_bundle(tmp_path / "solo")
    (solo / "tokenizer_config.json").write_text(
        (chat_bundle / "tokenizer_config.json").read_text())
    # The stand-in's drafter run: 4 tokens in 2 s; its --no-draft run: 4 tokens in 1 s.
    script = fake_swift_generate(tmp_path, log)
    fast = json.dumps({"tokens": [1, 2, 3, 4], "seconds": 1.0})
    script.write_text(script.read_text().replace(
        "echo '", f"case \"$*\" in *--no-draft*) echo '{fast}'; exit 0;; esac\necho '", 1))
    without_drafter = json.loads((solo / METADATA_FILE).read_text())
    read_without_drafter(monkeypatch, solo)
    assert without_drafter["source"] == json.loads(
        (chat_bundle / METADATA_FILE).read_text())["source"]
    figures = speedup.measure([chat_bundle], script, ["hello", "again"], 5, log=lambda _: None,
                              target_only=solo)
    calls = log.read_text().splitlines()
    assert [c.split()[1] for c in calls] == [str(chat_bundle), str(solo)] * 2
    assert ["--no-draft" in c for c in calls] == [False, True] * 2
    assert not any("--compare" in c for c in calls[1::2])
    assert figures[chat_bundle]["target_only_tokens_per_second"] == pytest.approx(4.0)
    assert figures[chat_bundle]["speedup_against_target_only"] == pytest.approx(0.5)
    table = speedup.format_figures(figures, 2, 5)
    assert "against the target-only bundle (4.00 tokens/s): 0.50x" in table


def test_a_target_only_bundle_it_cannot_compare_is_refused(chat_bundle, tmp_path, monkeypatch):
    with pytest.raises(speedup.SpeedupError, match="--target-only-dir .*nowhere.*metadata.json"):
        speedup.check_target_only(tmp_path / "nowhere", [chat_bundle])
    solo = prebuilt_bundle(tmp_path / "solo")
    with pytest.raises(speedup.SpeedupError, match="has a drafter"):
        speedup.check_target_only(solo, [chat_bundle])
    read_without_drafter(monkeypatch, solo)
    metadata = json.loads((solo / METADATA_FILE).read_text())
    metadata["source"]["checkpoint"] = "/elsewhere/target"
    (solo / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(speedup.SpeedupError, match="elsewhere.*one target"):
        speedup.check_target_only(solo, [chat_bundle])
