"""The Qwen2 and Llama 3 tokenizer.json fixtures (builtin/tokenizer_layouts.py): their layout, how
the tokenizers library splits with their patterns, and the BOS convention the Python loop
(runtime/generate.py TextTokenizer) takes from each tokenizer_config.json."""

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from museflash.builtin import tokenizer_layouts
from museflash.checkpoint.tokenizer import read_tokenizer
from museflash.runtime.generate import TextTokenizer

TEXTS = ["def add(x, y):\n    return x + y\n\n\nprint(add(12, 345))\n"] * 40


@pytest.fixture(scope="module")
def layouts():
    return {name: json.loads(text) for name, text in tokenizer_layouts.layouts(TEXTS).items()}


def _tokenizer(document):
    return Tokenizer.from_str(json.dumps(document))


def test_the_layouts_are_the_published_ones(layouts):
    for name, pattern, trim in (("qwen2", tokenizer_layouts.QWEN2_PATTERN, False),
                                ("llama3", tokenizer_layouts.LLAMA3_PATTERN, True)):
        pre = layouts[name]["pre_tokenizer"]
        assert pre["type"] == "Sequence"
        split, byte_level = pre["pretokenizers"]
        assert split == {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                         "invert": False}
        assert byte_level == {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": trim, "use_regex": False}
        assert layouts[name]["decoder"]["type"] == "ByteLevel"
        assert layouts[name]["model"]["type"] == "BPE"
    assert layouts["qwen2"]["normalizer"] == {"type": "NFC"}
    assert layouts["llama3"]["normalizer"] is None
    assert layouts["qwen2"]["model"]["ignore_merges"] is False
    assert layouts["llama3"]["model"]["ignore_merges"] is True
    # The special tokens come after the whole vocabulary, as in the published files.
    for name, special in (("qwen2", tokenizer_layouts.QWEN2_SPECIAL),
                          ("llama3", tokenizer_layouts.LLAMA3_SPECIAL)):
        added = layouts[name]["added_tokens"]
        assert [t["content"] for t in added] == list(special)
        assert all(t["special"] and not t["normalized"] for t in added)
        assert min(t["id"] for t in added) > max(layouts[name]["model"]["vocab"].values())


@pytest.mark.parametrize(("text", "qwen2", "llama3"), [
    ("12345", ["1", "2", "3", "4", "5"], ["123", "45"]),
    ("I'M it's 'sound", ["I", "'M", "Ġit", "'s", "Ġ'", "sound"],
     ["I", "'M", "Ġit", "'s", "Ġ'", "sound"]),
    ("x'ſt", ["x", "'Å¿", "t"], ["x", "'Å¿", "t"]),
    ("(hello) a  b", ["(hello", ")", "Ġa", "Ġ", "Ġb"], ["(hello", ")", "Ġa", "Ġ", "Ġb"]),
    ("a \n\n  b.\n", ["a", "ĠĊĊ", "Ġ", "Ġb", ".Ċ"], ["a", "ĠĊĊ", "Ġ", "Ġb", ".Ċ"]),
])
def test_the_patterns_split_as_documented(layouts, text, qwen2, llama3):
    for name, expected in (("qwen2", qwen2), ("llama3", llama3)):
        pieces = [p for p, _ in _tokenizer(layouts[name]).pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == expected, name


def test_qwen2_normalizes_to_nfc_and_llama3_does_not(layouts):
    composed, decomposed = "\u00e9", "e\u0301"
    qwen, llama = _tokenizer(layouts["qwen2"]), _tokenizer(layouts["llama3"])
    assert qwen.encode(decomposed).ids == qwen.encode(composed).ids
    assert llama.encode(decomposed).ids != llama.encode(composed).ids


def test_hand_merges_are_unreachable_where_the_pattern_splits(layouts):
    """The tokens made by hand (HAND_MERGES) appear only if a tokenizer splits otherwise."""
    qwen = _tokenizer(layouts["qwen2"])
    assert qwen.token_to_id("123") is not None and qwen.token_to_id("'Å¿t") is not None
    tokens = qwen.encode("123 x'ſt", add_special_tokens=False).tokens
    assert "123" not in tokens and "12" not in tokens and "'Å¿t" not in tokens


def test_llama3_ignore_merges_changes_ids(layouts):
    """IGNORE_MERGES_TOKENS are whole pieces no merge makes: ignore_merges is what finds them."""
    document = json.loads(json.dumps(layouts["llama3"]))
    document["model"]["ignore_merges"] = False
    text = "(hello) world fibonacci"
    assert (_tokenizer(layouts["llama3"]).encode(text).ids
            != _tokenizer(document).encode(text).ids)


@pytest.mark.parametrize("name", tokenizer_layouts.LAYOUTS)
def test_bos_convention_of_each_tokenizer_config(tmp_path, layouts, name):
    document = layouts[name]
    (tmp_path / "tokenizer.json").write_text(json.dumps(document))
    config = tokenizer_layouts.tokenizer_config(name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    size = _tokenizer(document).get_vocab_size(with_added_tokens=True)
    files = read_tokenizer(tmp_path, size)
    text = TextTokenizer(tmp_path, SimpleNamespace(tokenizer=files))
    ids = text.encode("hello world")
    plain = _tokenizer(document).encode("hello world", add_special_tokens=False).ids
    if name == "qwen2":  # Qwen3: no BOS
        assert text.bos is None and ids == plain
        assert text.eos == files.special_tokens["<|im_end|>"]
    else:  # Llama 3: <|begin_of_text|>, named by bos_token
        bos = files.special_tokens["<|begin_of_text|>"]
        assert text.bos == bos and ids == [bos] + plain
        # The same as the tokenizer's own template.
        assert _tokenizer(document).encode("hello world").ids == ids
    assert text.decode(ids) == "hello world"
