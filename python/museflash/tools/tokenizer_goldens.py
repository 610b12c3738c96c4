"""Golden token ids from the `tokenizers` library, for the Swift tokenizer's parity tests.

  tokenizer_goldens OUTPUT.json      (the build runs it: //python:tokenizer_goldens)

For the trained demo tokenizer (`demo/target/tokenizer.json`), variants of it that switch on
the settings the Swift side implements besides (prefix space, no regex, `ignore_merges`, added
tokens with `lstrip` / `rstrip` / `single_word` / `normalized`), and the tiny pair's WordLevel
tokenizer (`demo_checkpoint.write_word_tokenizer`), and fixtures in the layouts of the Qwen3
and Llama 3.1 targets (builtin/tokenizer_layouts.py: `qwen2_layout`, `llama3_layout`, with their
tokenizer_config.json under `tokenizer_configs`), the output holds each tokenizer.json as
text and, per text, `encode(text, add_special_tokens=False).ids` with the decode of those ids
both with and without the special tokens (null where equal to the text, or to the decode with
them). The texts: every held-out file of the demo corpus
(`train_demo.load_corpus`, the same split the demo was trained on), hand-made hard cases and
seeded random strings over awkward characters. `decodes` holds seeded random id sequences
(special and out-of-range ids among them) with their decoded text. Built by
`//python:tokenizer_goldens` and read by swift/Tests/MuseflashTokenizerTests.

  ./bazelw run //python:tokenizer_goldens_tool -- --speed --swift-tokenize BIN --export-dir DIR

measures encode throughput of the tokenizers library and of swift-tokenize side by side on the
held-out files (docs/tokenizer.md). The command line is cli/tokenizer_goldens_main.py.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

HUNDRED_KB = 100_000
LAYOUT_TRAINING_FILES = 150

# Hand-made hard cases: (name, text).
HARD_CASES: list[tuple[str, str]] = [
    ("empty", ""),
    ("one space", " "),
    ("spaces", "     "),
    ("spaces between words", "a   b    c"),
    ("leading and trailing spaces", "   leading and trailing   "),
    ("newline runs", "\n\n\n\nx\n\n"),
    ("mixed whitespace run", " \n \n\n  \t x \t"),
    ("tabs", "a\tb\t\tc\t"),
    ("tab indentation", "\tdef f():\n\t\treturn 1\n"),
    ("crlf", "line one\r\nline two\r\n\r\n"),
    ("lone cr", "a\rb\r\r c"),
    ("form feed and vertical tab", "a\x0bb\x0cc \x0b d"),
    ("unicode spaces", "a\u00a0b\u3000c\u2028d\u0085e\u2003f \u00a0 g"),
    ("not white space", "a\u200bb\u180ec\ufeffd\x1ce\x1ff"),
    ("nul and controls", "\x00\x01\x02\x7f x\x00"),
    ("emoji", "👍 👍🏽 😀😃 🎉!"),
    ("zwj sequences", "👨\u200d👩\u200d👧\u200d👦 family, 🏳️\u200d🌈 flag, 🧑🏽\u200d💻"),
    ("flags", "🇫🇷🇩🇪🇯🇵"),
    ("cjk", "日本語のテキスト、中文字符，标点。한국어 텍스트"),
    ("combining marks", "e\u0301 cafe\u0301 n\u0303 Z\u0351\u0364a\u0300\u0316l\u0357g\u0308o"),
    ("devanagari", "\u0915\u094d\u0937 \u0928\u092e\u0938\u094d\u0924\u0947"),
    ("arabic digits and others", "١٢٣ ²³ Ⅻ ⓐ ½ 12345678901234567890"),
    ("titlecase and modifier letters", "ǅemal ʰa ˢb"),
    ("contractions", "I'm it's we'll they've I'd you're don't 'S 'T ''s 'x"),
    ("apostrophes", "' '' ''' 's' ’s"),
    ("special tokens", "<bos>def f():<eos>"),
    ("special tokens adjacent", "<pad><pad><mask><bos><eos>"),
    ("special tokens in words", "a<bos>b <eos>c d<mask> <mask>"),
    ("special token lookalikes", "<bo s> <<bos>> </bos> <BOS> <bos <eos"),
    ("python", "def fibonacci(n):\n    if n < 2:\n        return n\n"
               "    return fibonacci(n - 1) + fibonacci(n - 2)\n"),
    ("punctuation runs", "!!!??? ... --- === +++ (((x))) {[<>]} @#$%^&*"),
    ("100 kB line", "x = [" + ", ".join(f"'item{i}'" for i in range(HUNDRED_KB // 10)) + "]"),
    ("100 kB word", "a" * HUNDRED_KB),
    ("100 kB of spaces", " " * HUNDRED_KB + "x"),
    ("100 kB of one emoji", "😀" * (HUNDRED_KB // 4)),
]

# Only for the variant with extra added tokens.
ADDED_TOKEN_CASES: list[tuple[str, str]] = [
    ("lstrip", "a   <tag>b\t<tag> <tag>"),
    ("rstrip", "</tag>   a</tag>\n\nb </tag>"),
    ("lstrip and rstrip", "x  <tag>  </tag>  y"),
    ("single word", "def f(): undef define def_ _def def\n(def) déf"),
    ("normalized after non-normalized", "ab abc abcd xabcx"),
]

# Only for the Qwen2 and Llama 3 layouts: their split pattern's corners, NFC and special tokens.
LAYOUT_CASES: list[tuple[str, str]] = [
    ("contractions in capitals", "I'M YOU'RE IT'S WE'LL THEY'VE I'D DON'T 'Ll 'rE 'Ve"),
    ("contraction long s", "x'ſt it'\u017f 'ſt It'ſt '\u212a"),
    ("contraction prefixes", "'sound 'tree 'reed 'veal 'mild 'llama 'dog ' s"),
    ("digit runs", "1 12 123 1234 12345 1234567 3.14159 1,000,000 ٣٤٥٦٧ ²³⁴ ⅫⅫⅫⅫ ½¼"),
    ("digits and letters", "abc123def4567 x1y22z333 0x1F 1st 2nd"),
    ("punctuation before letters", "(hello) [world] .net -flag --long _x #tag @user 'quote'"),
    ("punctuation then newlines", "end.\n\nnext!\r\n\r\n?\n  x"),
    ("whitespace before newlines", "a  \n  b\t\n\tc \r\n d\n\n\n   \n"),
    ("unicode spaces before letters", "a\u3000b \u00a0c\u2003d\u0085e"),
    ("nfc composes", "e\u0301 A\u030a \u212b \u1100\u1161\u11a8 \u1e9b\u0323 \u0958"),
    ("nfc reorders marks", "a\u0323\u0301 a\u0301\u0323 q\u0307\u0323"),
    ("qwen chat", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
                  "What's 12+345?<|im_end|>\n<|im_start|>assistant\n"),
    ("llama chat", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                   "What's 12+345?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("special token lookalikes of the layouts", "<|im_end|<|eot_id|> <|begin_of_text <|eot_id||>"),
]

# Awkward pieces for the seeded random strings.
ALPHABET = (list("abcXYZ019 '\t\n\r _-.,;:!?\"()[]{}<>#@")
            + ["  ", "   ", "\u00a0", "\u3000", "\u0085", "\u2028", "\u200b", "é", "e\u0301",
               "日本", "한", "👍", "👨\u200d👩\u200d👧", "\u0663", "²", "\x1c", "\x0b", "'s", "'ll",
               "'re", "<bos>", "<eos>", "<mask>", "<bo", "s>", "\x00", "\ufeff", "ǅ", "ʰ", "\u0300",
               "\u20dd", "‿", "\u200d", "İ", "<tag>", "</tag>", "def", "abc"])


# Added to ALPHABET for the Qwen2 and Llama 3 layouts.
LAYOUT_ALPHABET = ALPHABET + ["1", "23", "456", "7890", "'S", "'RE", "'Ll", "'ſ", "A\u030a",
                              "\u212b", "\u1100\u1161", "\u0323", "\u0301", "\r\n", " \n",
                              "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|eot_id|>",
                              "<|begin_of_text|>", "<|", "|>", "Ω", "ß", "ﬁ"]


def random_texts(seed: int, count: int, alphabet: list[str] = ALPHABET) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def demo_tokenizer_json() -> str:
    from museflash.builtin.demo_checkpoint import TRAINED_DEMO_DIR

    return (TRAINED_DEMO_DIR / "target" / "tokenizer.json").read_text(encoding="utf-8")


def variant(base: str, edit) -> str:
    document = json.loads(base)
    edit(document)
    return json.dumps(document, ensure_ascii=False)


def with_added_tokens(base: str) -> str:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(base)
    tokenizer.add_tokens([
        AddedToken("<tag>", lstrip=True, normalized=False),
        AddedToken("</tag>", rstrip=True, normalized=False),
        AddedToken("def", single_word=True, normalized=False),
        AddedToken("ab", normalized=False),
        AddedToken("abc", normalized=True),
    ])
    return tokenizer.to_str()


def word_level_json() -> str:
    from museflash.builtin.demo_checkpoint import write_word_tokenizer

    with tempfile.TemporaryDirectory(prefix="museflash-wordlevel-") as scratch:
        write_word_tokenizer(Path(scratch), 512, {"<mask>": 3})
        return (Path(scratch) / "tokenizer.json").read_text(encoding="utf-8")


def layout_tokenizers() -> dict[str, str]:
    """The Qwen2- and Llama 3-layout fixtures' tokenizer.json text, their BPE trained on the
    first files of the demo corpus's training split."""
    from museflash.builtin import tokenizer_layouts
    from museflash.training import train_demo

    texts = [f.text for f in train_demo.load_corpus().train[:LAYOUT_TRAINING_FILES]]
    return {f"{name}_layout": text for name, text in tokenizer_layouts.layouts(texts).items()}


def layout_configs() -> dict[str, str]:
    """Their tokenizer_config.json text (the BOS convention)."""
    from museflash.builtin import tokenizer_layouts

    return {f"{name}_layout": json.dumps(tokenizer_layouts.tokenizer_config(name))
            for name in tokenizer_layouts.LAYOUTS}


def tokenizers_under_test() -> dict[str, str]:
    demo = demo_tokenizer_json()

    def set_pre(key: str, value: Any):
        return lambda document: document["pre_tokenizer"].__setitem__(key, value)

    return {
        "demo": demo,
        "demo_prefix_space": variant(demo, set_pre("add_prefix_space", True)),
        "demo_no_regex": variant(demo, set_pre("use_regex", False)),
        "demo_ignore_merges": variant(demo, lambda d: d["model"].update(ignore_merges=True)),
        # SmolLM2's layout (a GGUF "smollm" pre-tokenizer, checkpoint/gguf.py): digits alone.
        "demo_digits": variant(demo, lambda d: d.__setitem__("pre_tokenizer", {
            "type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {**d["pre_tokenizer"], "add_prefix_space": False}]})),
        "demo_added_tokens": with_added_tokens(demo),
        "word_level": word_level_json(),
        **layout_tokenizers(),
    }


def held_out_texts() -> tuple[list[tuple[str, str]], dict[str, Any]]:
    from museflash.builtin.demo_checkpoint import TRAINED_DEMO_DIR
    from museflash.training import train_demo

    corpus = train_demo.load_corpus()
    recorded = json.loads((TRAINED_DEMO_DIR / "train_demo.json").read_text())
    stats = corpus.stats()
    summary = {"root": str(corpus.root), "files": stats["held_out_files"],
               "bytes": stats["held_out_bytes"], "sha256": stats["held_out_sha256"],
               "same_as_demo_training":
                   stats["held_out_sha256"] == _find(recorded, "held_out_sha256")}
    return [("held_out/" + f.path, f.text) for f in corpus.held_out], summary


def _find(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        if key in value:
            return value[key]
        for item in value.values():
            found = _find(item, key)
            if found is not None:
                return found
    return None


def goldens() -> dict[str, Any]:
    import tokenizers
    from tokenizers import Tokenizer

    files = tokenizers_under_test()
    held_out, held_out_summary = held_out_texts()
    cases: list[dict[str, Any]] = []
    decodes: list[dict[str, Any]] = []
    for index, (name, text_json) in enumerate(files.items()):
        tokenizer = Tokenizer.from_str(text_json)
        layout = name.endswith("_layout")
        texts = list(HARD_CASES)
        alphabet = LAYOUT_ALPHABET if layout else ALPHABET
        texts += [(f"random {i}", t)
                  for i, t in enumerate(random_texts(1000 + index, 400, alphabet))]
        if name in ("demo", "word_level") or layout:
            texts += held_out
        if name == "demo_added_tokens":
            texts += ADDED_TOKEN_CASES
        if layout:
            texts += LAYOUT_CASES
        for case_name, text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            decoded = tokenizer.decode(ids, skip_special_tokens=False)
            skipping = tokenizer.decode(ids, skip_special_tokens=True)
            # null: the same as the text (decoded) or as decoded (decoded_skipping_special)
            cases.append({"tokenizer": name, "name": case_name, "text": text, "ids": ids,
                          "decoded": None if decoded == text else decoded,
                          "decoded_skipping_special": None if skipping == decoded else skipping})
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        rng = random.Random(2000 + index)
        for _ in range(200):
            ids = [rng.randrange(size + 3) for _ in range(rng.randint(0, 12))]
            decodes.append({
                "tokenizer": name, "ids": ids,
                "decoded": tokenizer.decode(ids, skip_special_tokens=False),
                "decoded_skipping_special": tokenizer.decode(ids, skip_special_tokens=True)})
    return {"tokenizers_version": tokenizers.__version__, "tokenizer_files": files,
            "tokenizer_configs": layout_configs(),
            "vocab_sizes": {name: Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
                            for name, text in files.items()},
            "held_out": held_out_summary, "cases": cases, "decodes": decodes}


def speed(swift_tokenize: Path, export_dir: Path, repeat: int) -> dict[str, Any]:
    """Encode throughput over the held-out files, single-threaded: the tokenizers library in this
    process and `swift-tokenize --benchmark` on the same files, one after the other; each does a
    first pass (cold cache) and then reports the best of `repeat` passes."""
    import os
    import subprocess
    import time

    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    from museflash.training import train_demo

    corpus = train_demo.load_corpus()
    paths = [str(corpus.root / f.path) for f in corpus.held_out]
    texts = [f.text for f in corpus.held_out]
    nbytes = sum(f.nbytes for f in corpus.held_out)
    tokenizer = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts)
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for text in texts:
            tokenizer.encode(text, add_special_tokens=False)
        best = min(best, time.perf_counter() - start)
    rust = {"files": len(texts), "bytes": nbytes, "tokens": tokens, "first_pass_seconds": first,
            "seconds": best, "mb_per_s": nbytes / best / 1e6}
    done = subprocess.run([str(swift_tokenize), "--export-dir", str(export_dir), "--repeat",
                           str(repeat), "--benchmark", *paths], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{swift_tokenize} failed: {done.stderr.strip()}")
    swift = json.loads(done.stdout)
    if swift["tokens"] != tokens:
        raise SystemExit(f"swift-tokenize made {swift['tokens']} tokens, tokenizers {tokens}")
    return {"tokenizers": rust, "swift": swift, "ratio": swift["mb_per_s"] / rust["mb_per_s"],
            "first_pass_ratio": rust["first_pass_seconds"] / swift["first_pass_seconds"]}
