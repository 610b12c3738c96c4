"""The Swift chat-template renderer (swift/Sources/ChatTemplate, through `swift-tokenize
--messages`) against Python's: transformers' `apply_chat_template` and museflash's own
`render_chat` (jinja2), as text and as token ids, on the template the real pair's bundle carries
(SmolLM2-135M-Instruct's, read from its GGUF file) and on templates in the shapes of Llama 3 and
Qwen, over seeded conversations: with and without a system prompt, one to four turns, with and
without the generation prompt, and content with quotes, newlines, non-ASCII text, surrounding
blanks and text that looks like template syntax."""

import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from museflash.checkpoint.chat_template import check_renderable, render_chat

BUNDLE = Path(os.environ["MUSEFLASH_REAL_BUNDLE"])
TOKENIZE = Path(os.environ["MUSEFLASH_SWIFT_TOKENIZE"])
TEMPLATES = Path(__file__).parent / "chat_templates"

# Llama 3's shape: bos_token, a system message taken out of the list and trimmed, namespace
# state across the loop, raise_exception on roles out of turn, and tojson.
LLAMA3_STYLE = (TEMPLATES / "llama3_style.jinja").read_text()

# Qwen's shape: the last user message found by walking the list backwards, string methods,
# elif chains, a reasoning block split off assistant content, and a dict literal through tojson.
QWEN_STYLE = (TEMPLATES / "qwen_style.jinja").read_text()

PIECES = ["Hello", "How do I reverse a list in Python?", 'She said "yes" and \'no\'.',
          "line one\nline two\n\nline four", "café, naïve, Ærø, 日本語, emoji 🙂",
          "{{ messages }} and {% if x %}not a tag{% endif %}", "  padded with blanks \t\n",
          "<think>\nreasoning here\n</think>\n\nthe answer", "back\\slash and \\n literally",
          "<|im_end|> inside text", "", "x" * 40]


def _conversations(seed: int, count: int):
    """Seeded conversations in the shapes chat templates must handle."""
    rng = random.Random(seed)
    for index in range(count):
        messages = []
        if index % 2:
            messages.append({"role": "system", "content": rng.choice(PIECES)})
        turns = rng.randint(1, 4)
        for turn in range(turns):
            messages.append({"role": "user", "content": rng.choice(PIECES)})
            if turn < turns - 1 or rng.random() < 0.3:
                messages.append({"role": "assistant", "content": rng.choice(PIECES)})
        yield messages, bool(index % 3)


def _reference_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _swift_render(export_dir: Path, messages, generation_prompt: bool, scratch: Path):
    path = scratch / "messages.json"
    path.write_text(json.dumps(messages, ensure_ascii=False))
    args = [str(TOKENIZE), "--export-dir", str(export_dir), "--messages", str(path)]
    if not generation_prompt:
        args.append("--no-generation-prompt")
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _export_with_template(template: str | None, into: Path) -> Path:
    """The real bundle's tokenizer files and metadata with `template` in place of its own."""
    into.mkdir()
    for name in ("metadata.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(BUNDLE / name, into / name)
        (into / name).chmod(0o644)
    if template is not None:
        config = json.loads((into / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (into / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return into


@pytest.mark.parametrize("name, template", [("smollm2", None), ("llama3_style", LLAMA3_STYLE),
                                            ("qwen_style", QWEN_STYLE)])
def test_swift_renders_as_transformers(name, template, tmp_path):
    export_dir = _export_with_template(template, tmp_path / name)
    reference = _reference_tokenizer(export_dir)
    source = json.loads((export_dir / "tokenizer_config.json").read_text())["chat_template"]
    check_renderable(source)
    special = {role: getattr(reference, role) for role in ("bos_token", "eos_token")
               if isinstance(getattr(reference, role), str)}
    compared = 0
    for messages, generation_prompt in _conversations(seed=len(name), count=14):
        expected = reference.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        assert render_chat(source, messages, add_generation_prompt=generation_prompt,
                           special_tokens=special) == expected
        swift = _swift_render(export_dir, messages, generation_prompt, tmp_path)
        assert swift["text"] == expected, messages
        assert swift["ids"] == reference(expected, add_special_tokens=False).input_ids, messages
        compared += 1
    assert compared >= 10


def test_the_real_template_is_smollm2s_own():
    """The bundle carries the template of the GGUF file (ChatML with SmolLM's system line)."""
    source = json.loads((BUNDLE / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in source and "SmolLM" in source


def test_raise_exception_stops_both_renderers(tmp_path):
    export_dir = _export_with_template(LLAMA3_STYLE, tmp_path / "llama3_style")
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    done = subprocess.run([str(TOKENIZE), "--export-dir", str(export_dir), "--messages",
                           str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1
    assert "roles must alternate" in done.stderr
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat(LLAMA3_STYLE, messages)


@pytest.mark.parametrize("construct, template", [
    ("{% macro %}", "{% macro f(m) %}{{ m.content }}{% endmacro %}"
                    "{% for m in messages %}{{ f(m) }}{% endfor %}"),
    ("function strftime_now()", "{{ strftime_now('%d %b %Y') }}{% for m in messages %}"
                                "{{ m.content }}{% endfor %}"),
])
def test_a_template_outside_the_subset_is_refused_by_both(construct, template, tmp_path):
    export_dir = _export_with_template(template, tmp_path / "refused")
    with pytest.raises(ValueError, match=re.escape(f"{construct} is not supported")):
        check_renderable(template)
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "user", "content": "a"}]))
    done = subprocess.run([str(TOKENIZE), "--export-dir", str(export_dir), "--messages",
                           str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert construct in done.stderr and len(done.stderr.strip().splitlines()) == 1
