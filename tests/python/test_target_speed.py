"""tools/target_speed.py: every bundle decodes every rendered prompt alone (--no-draft, no
lookup) and the reference decodes as many tokens from the same ids, the figures are pooled over
the prompts with the agreeing prompts counted, and bundles it cannot compare are refused in one
line."""

import json
import stat

import pytest
from prebuilt import prebuilt_bundle

from museflash.bundle import METADATA_FILE
from museflash.tools import target_speed

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def chat_bundle(tmp_path):
    bundle = prebuilt_bundle(tmp_path / "one")
    config = bundle / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps(dict(settings, chat_template=TEMPLATE)))
    return bundle


def fake_swift_generate(tmp_path, log, tokens):
    """Records its arguments and reports `tokens` decoded in 2 s."""
    script = tmp_path / "swift-generate"
    body = json.dumps({"tokens": tokens, "seconds": 2.0})
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho '{body}'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_each_prompt_is_decoded_by_every_bundle_then_by_the_reference(chat_bundle, tmp_path):
    log = tmp_path / "calls.txt"
    second = prebuilt_bundle(tmp_path / "two")
    (second / "tokenizer_config.json").write_text(
        (chat_bundle / "tokenizer_config.json").read_text())
    asked = []

    def reference(ids, count):  # agrees on the first prompt only, at half the speed
        asked.append((ids, count))
        return ([5, 6, 7, 8] if len(asked) <= 2 else [0] * count), 4.0

    texts = ["hello", "a longer request"]
    figures = target_speed.measure([chat_bundle, second],
                                   fake_swift_generate(tmp_path, log, [5, 6, 7, 8]), texts, 9,
                                   reference, log=lambda _: None)
    calls = log.read_text().splitlines()
    assert [c.split()[1] for c in calls] == [str(chat_bundle), str(second)] * 2
    assert all("--no-draft" in c and "--max-new-tokens 9" in c and "--lookup-min-match 0" in c
               for c in calls)
    ids = target_speed.chat_prompt_ids(chat_bundle, texts)
    assert ids[0] != ids[1]
    assert asked == [(ids[0], 4), (target_speed.chat_prompt_ids(second, texts)[0], 4),
                     (ids[1], 4), (target_speed.chat_prompt_ids(second, texts)[1], 4)]
    assert figures[chat_bundle] == {"tokens_per_second": 2.0, "reference_tokens_per_second": 1.0,
                                    "ratio": 2.0, "agreeing_prompts": 1, "prompts": 2}
    table = target_speed.format_figures(figures, 9, 2)
    assert f"| {second} | 2.00 | 1.00 | 2.00x | 1/2 |" in table.splitlines()


def test_bundles_it_cannot_compare_are_refused(chat_bundle, tmp_path):
    with pytest.raises(target_speed.SpeedupError, match="nowhere.*metadata.json"):
        target_speed.check_bundles([tmp_path / "nowhere"])
    other = prebuilt_bundle(tmp_path / "other")
    metadata = json.loads((other / METADATA_FILE).read_text())
    metadata["source"]["checkpoint"] = "/elsewhere/target"
    (other / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(target_speed.SpeedupError, match="different checkpoints"):
        target_speed.check_bundles([chat_bundle, other])
    (other / "tokenizer.json").unlink()
    with pytest.raises(target_speed.SpeedupError, match="no tokenizer.json"):
        target_speed.check_bundles([other])
