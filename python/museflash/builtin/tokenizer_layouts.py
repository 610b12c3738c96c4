"""Fixture tokenizers in the tokenizer.json layouts of the Qwen3 and Llama 3.1 targets.

The published files cannot be downloaded here, so these are built with the `tokenizers`
library to the same configuration, over a BPE trained on a little text:

  qwen2  (Qwen2 / Qwen2.5 / Qwen3): normalizer NFC; pre_tokenizer Sequence[Split(QWEN2_PATTERN,
         Isolated), ByteLevel(add_prefix_space=false, trim_offsets=false, use_regex=false)];
         BPE; ByteLevel post-processor and decoder; the special tokens after the vocabulary.
         tokenizer_config.json: no BOS (bos_token null, add_bos_token false).
  llama3 (Llama 3 / 3.1): no normalizer; pre_tokenizer Sequence[Split(LLAMA3_PATTERN, Isolated),
         ByteLevel(add_prefix_space=false, trim_offsets=true, use_regex=false)]; BPE with
         ignore_merges true; post-processor Sequence[ByteLevel, TemplateProcessing putting
         <|begin_of_text|> in front]; ByteLevel decoder. tokenizer_config.json:
         bos_token <|begin_of_text|> (and no add_bos_token, as published).

The two split patterns differ only in digits: Qwen2 takes one number character per piece,
Llama 3 up to three. //python:tokenizer_goldens writes the library's ids for both (the Swift
tokenizer's parity tests); tests/python/test_tokenizer_layouts.py checks the layouts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _REST
LLAMA3_PATTERN = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _REST

QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LAYOUTS = ("qwen2", "llama3")
VOCAB_SIZE = 1500  # before the special tokens

# A little non-code text, so merges exist for letters of other scripts, contractions and digits.
EXTRA_TRAINING_TEXT = [
    "I'm sure it's fine; we'll see what they've done. You're right, I'd say: don't.",
    "THE QUICK BROWN FOX DOESN'T JUMP. IT'S LAZY, ISN'T IT? WE'LL SEE.",
    "Numbers: 0 1 12 123 1234 12345 3.14159 2024-06-01 $1,000,000.00 ٣٤٥٦ ²³",
    "Größe, café, naïve, résumé, Ångström, smörgåsbord, façade, jalapeño.",
    "日本語のテキストを少し。中文字符和标点。한국어 텍스트도 조금.",
    "Привет, мир! Γειά σου κόσμε! नमस्ते दुनिया! مرحبا بالعالم!",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>",
]


# Merges added by hand after training (byte-level token text). Training never learns them: a
# Qwen2 piece holds one digit, and a contraction piece ends at its letter; so these tokens appear
# only where a tokenizer splits differently from the pattern (three digits in one Qwen2 piece,
# 'ſt as one piece where 'ſ is a contraction: U+017F folds to s).
HAND_MERGES = (("1", "2"), ("12", "3"), ("'", "Å"), ("'Å", "¿"), ("'Å¿", "t"))


# Whole pieces added to Llama 3's vocabulary without merges that make them: with ignore_merges a
# piece in the vocabulary is one token, so these are what tell ignore_merges from merging.
IGNORE_MERGES_TOKENS = ("(hello", "world", "Ġfamily", "Ġflag", "Ġfibonacci")


def _with_merges(tokenizer, merges: tuple[tuple[str, str], ...]):
    """`tokenizer` with `merges` appended (last in rank), each making a new vocabulary token."""
    from tokenizers import Tokenizer

    document = json.loads(tokenizer.to_str())
    vocab, known = document["model"]["vocab"], document["model"]["merges"]
    for left, right in merges:
        if [left, right] not in known and left + right not in vocab:
            known.append([left, right])
            vocab[left + right] = len(vocab)
    return Tokenizer.from_str(json.dumps(document, ensure_ascii=False))


def _train(texts: Iterable[str], pattern: str, *, trim_offsets: bool, nfc: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=trim_offsets,
                                 use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(texts) + EXTRA_TRAINING_TEXT * 20, trainer)
    return _with_merges(tokenizer, HAND_MERGES)


def qwen2_layout(texts: Iterable[str]) -> str:
    """tokenizer.json text in Qwen2's layout, its BPE trained on `texts`."""
    from tokenizers import processors

    tokenizer = _train(texts, QWEN2_PATTERN, trim_offsets=False, nfc=True)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                   use_regex=False)
    tokenizer.add_special_tokens(list(QWEN2_SPECIAL))
    return tokenizer.to_str()


def llama3_layout(texts: Iterable[str]) -> str:
    """tokenizer.json text in Llama 3's layout, its BPE trained on `texts`."""
    from tokenizers import Tokenizer, processors

    document = json.loads(_train(texts, LLAMA3_PATTERN, trim_offsets=True, nfc=False).to_str())
    model = document["model"]
    model["ignore_merges"] = True
    for token in IGNORE_MERGES_TOKENS:
        model["vocab"].setdefault(token, len(model["vocab"]))
    # The special tokens after these, as in the published file (the library renumbers added
    # tokens that sit below a vocabulary id).
    tokenizer = Tokenizer.from_str(json.dumps(document, ensure_ascii=False))
    tokenizer.add_special_tokens(list(LLAMA3_SPECIAL))
    bos = LLAMA3_SPECIAL[0]
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                      special_tokens=[(bos, tokenizer.token_to_id(bos))]),
    ])
    return tokenizer.to_str()


def tokenizer_config(layout: str) -> dict[str, Any]:
    """The BOS-relevant part of each family's tokenizer_config.json."""
    if layout == "qwen2":
        return {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>", "tokenizer_class": "Qwen2Tokenizer"}
    if layout == "llama3":
        return {"bos_token": LLAMA3_SPECIAL[0], "eos_token": "<|eot_id|>",
                "tokenizer_class": "PreTrainedTokenizerFast"}
    raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def layouts(texts: list[str]) -> dict[str, str]:
    """Both layouts' tokenizer.json text, trained on `texts`."""
    return {"qwen2": qwen2_layout(texts), "llama3": llama3_layout(texts)}
