"""//:generate: text in, text out over an export (the numpy interpreter), with its errors."""

import json
from dataclasses import replace

import pytest
from prebuilt import prebuilt_bundle

from museflash.builtin.demo_checkpoint import write_word_tokenizer
from museflash.bundle import METADATA_FILE, Metadata
from museflash.checkpoint.tokenizer import read_tokenizer
from museflash.runtime.generate import (
    GenerateError,
    GenerateOptions,
    TextStream,
    TextTokenizer,
    generate,
)

MASK = 511


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two copies of the tiny pair the build exported (//tests/integration:demo_bundle): one
    given a tokenizer with <pad>, <eos> and <mask>, recorded as the export records a
    checkpoint's tokenizer (checkpoint.tokenizer.read_tokenizer over the files it copies; the
    tokenizer is a file beside the package, so no export is needed); one as an export of a
    checkpoint without tokenizer files writes it: metadata.json's tokenizer null and no
    tokenizer file beside the package."""
    root = tmp_path_factory.mktemp("generate")
    with_tokenizer = prebuilt_bundle(root / "tokenizer")
    metadata = Metadata.read(with_tokenizer)
    for name in metadata.tokenizer.files:
        (with_tokenizer / name).unlink()
    write_word_tokenizer(with_tokenizer, 512, {"<pad>": 0, "<eos>": 2, "<mask>": MASK})
    (with_tokenizer / "tokenizer_config.json").write_text(
        '{"eos_token": "<eos>", "pad_token": "<pad>"}')
    tokenizer = read_tokenizer(with_tokenizer, metadata.vocab_size, MASK)
    (with_tokenizer / METADATA_FILE).write_text(replace(metadata, tokenizer=tokenizer).dumps())
    plain = prebuilt_bundle(root / "plain")
    raw = json.loads((plain / METADATA_FILE).read_text())
    for name in raw["tokenizer"]["files"]:
        (plain / name).unlink()
    raw["tokenizer"] = None
    (plain / METADATA_FILE).write_text(json.dumps(raw))
    return {"tokenizer": with_tokenizer, "plain": plain}


def _generate(export_dir, **kwargs):
    written, said = [], []
    run = generate(GenerateOptions(export_dir=export_dir, **kwargs), written.append, said.append)
    return run, "".join(written), said


def test_greedy_text_with_the_drafter_is_the_targets_own(exports):
    prompt = "w5 w7 w9"
    drafted, text, said = _generate(exports["tokenizer"], prompt=prompt, max_new_tokens=10)
    alone, alone_text, _ = _generate(exports["tokenizer"], prompt=prompt, max_new_tokens=10,
                                     draft=False)
    assert drafted.result.tokens == alone.result.tokens
    assert text == alone_text
    assert drafted.result.draft_calls > 0 and alone.result.draft_calls == 0
    # The stream wrote the prompt, then exactly the decoded tokens (none after <eos>).
    tokens = drafted.result.tokens[:drafted.result.tokens.index(2)] \
        if 2 in drafted.result.tokens else drafted.result.tokens
    assert text == prompt + " ".join(f"w{t}" for t in tokens if t != 0) + "\n"
    assert any("same tokens" in line for line in said), said


def test_sampling_is_reproducible_by_seed(exports):
    first = _generate(exports["tokenizer"], prompt="w1", max_new_tokens=8, temperature=1.0,
                      seed=3, compare=False)[0].result.tokens
    again = _generate(exports["tokenizer"], prompt="w1", max_new_tokens=8, temperature=1.0,
                      seed=3, compare=False)[0].result.tokens
    other = [_generate(exports["tokenizer"], prompt="w1", max_new_tokens=8, temperature=1.0,
                       seed=s, compare=False)[0].result.tokens for s in (4, 5)]
    assert first == again
    assert any(o != first for o in other)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, "--temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"--top-p must be in \(0, 1\]"),
    ({"prompt": "   "}, "has no tokens after tokenization"),
    ({"backend": "coreml"}, "--backend 'coreml' is not one of"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be at least 1"),
    ({"lookup_min_match": -1}, "--lookup-min-match must be >= 0"),
    ({"max_new_tokens": 60}, "context_length is 64"),
])
def test_bad_requests_are_one_line_errors(exports, kwargs, message):
    options = {"prompt": "w3", **kwargs}
    with pytest.raises(GenerateError, match=message):
        _generate(exports["tokenizer"], **options)


def test_an_export_without_tokenizer_is_refused(exports):
    with pytest.raises(GenerateError, match="has no tokenizer"):
        _generate(exports["plain"], prompt="hello")


def test_the_stream_holds_back_half_a_character_and_stops_at_eos():
    class Bytes(TextTokenizer):
        """Token i is byte i (UTF-8), 0 is <eos>."""

        def __init__(self):
            self.eos, self.special_ids = 0, {0}

        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    shown = []
    stream = TextStream(Bytes(), shown.append)
    euro = list("€".encode())
    stream([ord("a"), euro[0]])
    stream([euro[1]])
    assert "".join(shown) == "a"  # no replacement character while the euro sign is split
    stream([euro[2], ord("b"), 0, ord("c")])
    stream([ord("d")])
    assert "".join(shown) == "a€b"
