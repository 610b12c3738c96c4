"""Text in, text out: //:swift-generate's greedy text equals Python //:generate's, character for
character, on the trained demo pair (byte-level BPE) and on the DFlash2 bundle (WordLevel),
and its text-mode bad input gets one line and exit status 1.

Both bundles are exported by Bazel (//tests/runtime); Python decodes in-process with the numpy
interpreter, Swift with its own interpreter and tokenizer.
"""

import json
import os
from pathlib import Path

import pytest
from swift_generate_support import assert_one_line_error, writable_copy
from swift_generate_support import run as swift

from museflash.runtime.generate import GenerateOptions, generate

DEMO = Path(os.environ.get("MUSEFLASH_EXPORT_DIR", "tests/runtime/demo_bundle"))
DFLASH2 = Path(os.environ.get("MUSEFLASH_DFLASH2_EXPORT_DIR", "tests/runtime/dflash2_bundle"))


def python_text(bundle: Path, prompt: str, tokens: int, draft: bool = True) -> str:
    options = GenerateOptions(export_dir=bundle, prompt=prompt, max_new_tokens=tokens,
                              draft=draft, compare=False)
    return generate(options, write=lambda _text: None, say=lambda _line: None).text


@pytest.mark.parametrize("bundle, prompt, tokens", [
    (DEMO, "def fibonacci(n):", 40),
    (DEMO, 'class Stack:\n    """A last-in first-out list."""\n\n    def push(self, item):\n', 24),
    (DFLASH2, "w12 w7 w301", 24),
])
def test_greedy_text_equals_python_generate(bundle, prompt, tokens):
    done = swift("--export-dir", bundle, "--prompt", prompt, "--max-new-tokens", tokens,
                 "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    expected = python_text(bundle, prompt, tokens)
    assert expected, "the Python continuation is empty; the comparison would prove nothing"
    assert report["text"] == expected


def test_prompt_file_is_read_as_written(tmp_path):
    prompt = "def area(r):\r\n\treturn 3.14 * r * r  # π\n"
    path = tmp_path / "prompt.txt"
    path.write_bytes(prompt.encode("utf-8"))
    from_file = json.loads(swift("--export-dir", DEMO, "--prompt-file", path, "--max-new-tokens",
                                 8, "--format", "json").stdout)
    inline = json.loads(swift("--export-dir", DEMO, "--prompt", prompt, "--max-new-tokens", 8,
                              "--format", "json").stdout)
    assert from_file["prompt_ids"] == inline["prompt_ids"]
    assert from_file["text"] == inline["text"] == python_text(DEMO, prompt, 8)


def test_text_mode_streams_the_prompt_and_continuation_then_the_speedup():
    done = swift("--export-dir", DEMO, "--prompt", "import os\n", "--max-new-tokens", 12)
    assert done.returncode == 0, done.stderr
    continuation = python_text(DEMO, "import os\n", 12)
    assert done.stdout.startswith("import os\n" + continuation)
    assert "speed-up" in done.stdout


def test_sampled_generation_is_seeded():
    common = ["--export-dir", DEMO, "--prompt", "def f(x):", "--max-new-tokens", 16,
              "--temperature", "0.8", "--top-p", "0.9", "--format", "json"]
    first = json.loads(swift(*common, "--seed", 4).stdout)
    again = json.loads(swift(*common, "--seed", 4).stdout)
    other = json.loads(swift(*common, "--seed", 5).stdout)
    assert first["tokens"] == again["tokens"]
    assert first["tokens"] != other["tokens"]


def test_a_prompt_too_long_is_refused_before_it_is_echoed():
    """Text mode echoes the prompt; it used to do so before the length check, so the error
    followed a screenful of prompt and started in the middle of a line."""
    done = swift("--export-dir", DEMO, "--prompt", "import os\n" * 400, "--max-new-tokens", 4)
    assert_one_line_error(done, "context_length")
    assert done.stdout == ""


def one_line_error(done, keyword):
    assert_one_line_error(done, keyword)


@pytest.mark.parametrize("flags, keyword", [
    (["--prompt", ""], "no tokens"),
    (["--prompt", "x", "--temperature", "-0.5"], "--temperature"),
    (["--prompt", "x", "--top-p", "0"], "--top-p"),
    (["--prompt", "x", "--top-p", "1.01"], "--top-p"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "x", "--prompt-ids", "1,2"], "exactly one"),
])
def test_bad_text_options(flags, keyword):
    one_line_error(swift("--export-dir", DEMO, *flags), keyword)


@pytest.fixture
def copy(tmp_path):
    return writable_copy(DEMO, tmp_path / "bundle")


def test_export_without_a_tokenizer(copy):
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["tokenizer"] = None
    (copy / "metadata.json").write_text(json.dumps(metadata))
    one_line_error(swift("--export-dir", copy, "--prompt", "x"), "no tokenizer")


def test_tokenizer_that_is_not_json(copy):
    (copy / "tokenizer.json").write_text("{not json")
    one_line_error(swift("--export-dir", copy, "--prompt", "x"), "tokenizer.json")


def test_tokenizer_vocabulary_differs_from_the_metadata(copy):
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["tokenizer"]["vocab_size"] += 1
    (copy / "metadata.json").write_text(json.dumps(metadata))
    one_line_error(swift("--export-dir", copy, "--prompt", "x"), "vocab_size")


def test_unsupported_tokenizer_kind(copy):
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    tokenizer["model"]["type"] = "Unigram"
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    one_line_error(swift("--export-dir", copy, "--prompt", "x"), "Unigram")
