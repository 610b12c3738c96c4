"""Chat in the Swift engine (MuseflashRuntime ChatSession, through //:swift-generate --messages
and --chat): every turn decodes exactly what the Python loop's Chat decodes (runtime/chat.py,
the same prompt ids, tokens and prefilled counts), and exactly what decoding the turn's whole
history from scratch decodes, through both backends, on a DFlash and a DFlash2 bundle, also
after drop-oldest; later turns prefill only what is new; --chat reads turns from standard input,
and a person can type into it on the real pair (SmolLM2-135M-Instruct) through a terminal."""

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest
from swift_generate_support import GENERATE, assert_one_line_error, writable_copy
from swift_generate_support import run as swift

from museflash.runtime.generate import GenerateOptions, open_chat

TINY = Path(os.environ["MUSEFLASH_TINY_BUNDLE"])  # DFlash, context 64: drop-oldest is met
DFLASH2 = Path(os.environ["MUSEFLASH_DFLASH2_BUNDLE"])  # DFlash2, context 256, sliding ring
REAL = Path(os.environ["MUSEFLASH_REAL_BUNDLE"])
NEW_TOKENS = 6


def _with_word_template(source: Path, into: Path) -> tuple[Path, list[str]]:
    """A copy of a word-tokenizer bundle with a chat template written in its own words, and the
    template's turn-ending word recorded as metadata.json's end_of_turn_ids, as the export
    records it for a checkpoint with this template."""
    export = writable_copy(source, into)
    vocab = json.loads((export / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(vocab, key=vocab.get)[10:30]
    config_path = export / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["chat_template"] = ("{% for m in messages %}" + words[0] + " {{ m.content }} "
                               + words[1] + " {% endfor %}{% if add_generation_prompt %}"
                               + words[2] + " {% endif %}")
    config_path.write_text(json.dumps(config))
    _set_end_of_turn(export, [vocab[words[1]]])
    return export, words


def _set_end_of_turn(export: Path, ids: list[int]) -> None:
    metadata = json.loads((export / "metadata.json").read_text())
    metadata["tokenizer"]["end_of_turn_ids"] = ids
    (export / "metadata.json").write_text(json.dumps(metadata))


def _script(words: list[str]) -> list[dict[str, str]]:
    """Three user turns in a row (three replies, each seeing the ones before), the first one
    longer than a prefill chunk."""
    return [{"role": "user", "content": " ".join(words[3:8] * 3)},
            {"role": "user", "content": " ".join(words[8:12] * 3)},
            {"role": "user", "content": " ".join(words[12:17] * 3)}]


def _python_turns(export: Path, messages, policy: str) -> list[dict]:
    chat = open_chat(GenerateOptions(export_dir=export, prompt="", max_new_tokens=NEW_TOKENS,
                                     compare=False, on_context_full=policy))
    return [turn.to_json() for turn in chat.run_script(messages)]


def _swift_chat(export: Path, messages, policy: str, backend: str, scratch: Path) -> dict:
    path = scratch / "messages.json"
    path.write_text(json.dumps(messages))
    args = ["--export-dir", export, "--messages", path, "--max-new-tokens", NEW_TOKENS,
            "--format", "json", "--on-context-full", policy, "--backend", backend, "--no-tree"]
    if backend == "coreml":
        args += ["--model-cache", scratch / "cache"]
    done = swift(*args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _fresh(export: Path, prompt_ids: list[int], stops: set[int]) -> list[int]:
    """The history decoded from scratch by a run without a session, cut after its first stop."""
    done = swift("--export-dir", export, "--prompt-ids", ",".join(map(str, prompt_ids)),
                 "--max-new-tokens", NEW_TOKENS, "--format", "json", "--no-compare", "--no-tree")
    assert done.returncode == 0, done.stderr
    tokens = json.loads(done.stdout)["tokens"]
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[:index + 1]
    return tokens


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The two bundles with a word template; the turn-ending id is a token the first reply
    writes (found by a probe conversation), so replies do end on it."""
    made = {}
    for name, source in (("tiny", TINY), ("dflash2", DFLASH2)):
        export, words = _with_word_template(source, tmp_path_factory.mktemp(name) / "bundle")
        mask = json.loads((export / "metadata.json").read_text())[
            "speculative_decoding"]["mask_token_id"]
        _set_end_of_turn(export, [mask])  # no reply ends on the drafter's mask token
        probe = _python_turns(export, _script(words), "drop-oldest")
        stop = probe[0]["tokens"][2]
        _set_end_of_turn(export, [stop])
        made[name] = (export, words, stop)
    return made


@pytest.mark.parametrize("name, backend, policy", [
    ("tiny", "interpreter", "drop-oldest"),
    ("tiny", "coreml", "drop-oldest"),
    ("dflash2", "interpreter", "refuse"),
    ("dflash2", "coreml", "refuse"),
])
def test_swift_sessions_decode_as_python_and_as_from_scratch(exports, name, backend, policy,
                                                             tmp_path):
    export, words, stop = exports[name]
    script = _script(words)
    report = _swift_chat(export, script, policy, backend, tmp_path)
    python = _python_turns(export, script, policy)
    turns = report["turns"]
    assert len(turns) == len(python) == 3
    for swift_turn, python_turn in zip(turns, python, strict=True):
        for key in ("prompt_ids", "tokens", "text", "prefilled_tokens", "dropped_messages",
                    "accepted", "verify_steps", "mean_accepted_length"):
            assert swift_turn[key] == python_turn[key], key
        assert swift_turn["tokens"] == _fresh(export, swift_turn["prompt_ids"], {stop})
    assert turns[0]["tokens"][-1] == stop and turns[0]["stop_reason"] == "eos"
    assert turns[0]["prefilled_tokens"] == len(turns[0]["prompt_ids"])
    kept = [t for t in turns[1:] if not t["dropped_messages"]]
    assert kept, "no turn extended a kept history"
    for turn in kept:
        assert turn["prefilled_tokens"] < len(turn["prompt_ids"])
    if policy == "drop-oldest":
        assert any(t["dropped_messages"] for t in turns), "the context never filled"
    if not any(t["dropped_messages"] for t in turns):
        assert [m["role"] for m in report["messages"]] == ["user", "user", "user"] or \
            [m["role"] for m in report["messages"]] == ["user", "assistant"] * 3


def test_chat_reads_user_turns_from_standard_input(exports):
    export, words, _ = exports["dflash2"]
    script = _script(words)
    lines = "".join(m["content"] + "\n" for m in script) + "\n"  # a blank line is skipped
    done = subprocess.run([str(GENERATE), "--export-dir", str(export), "--chat",
                           "--max-new-tokens", str(NEW_TOKENS), "--format", "json"],
                          input=lines, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    from_stdin = json.loads(done.stdout)["turns"]
    scripted = _python_turns(export, script, "refuse")
    assert [t["tokens"] for t in from_stdin] == [t["tokens"] for t in scripted]
    assert [t["prefilled_tokens"] for t in from_stdin] == [t["prefilled_tokens"] for t in scripted]
    text = subprocess.run([str(GENERATE), "--export-dir", str(export), "--chat",
                           "--max-new-tokens", str(NEW_TOKENS)], input=lines,
                          capture_output=True, text=True, timeout=600, check=False)
    assert text.returncode == 0, text.stderr
    # Text mode: each reply streamed on a line of its own, its figures on stderr.
    assert text.stdout.splitlines() == [t["text"] for t in scripted]
    assert text.stderr.count("[swift-generate] turn ") == 3


def test_a_conversation_that_outgrows_the_context_is_refused_in_one_line(exports, tmp_path):
    export, words, _ = exports["tiny"]
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(_script(words)))
    done = swift("--export-dir", export, "--messages", path, "--max-new-tokens", NEW_TOKENS)
    # The turns that fit were replied to (their figure lines); then one line names the limit.
    assert done.returncode == 1, done.stderr
    *figures, last = done.stderr.strip().splitlines()
    assert figures and all(line.startswith("[swift-generate] turn ") for line in figures)
    assert last.startswith("swift-generate: error:") and "context_length is 64" in last
    assert "--on-context-full drop-oldest" in last


@pytest.mark.parametrize("content, problem", [
    ("[{\"role\": \"user\", ", "is not JSON"),
    ("[]", "empty"),
    ("{\"role\": \"user\", \"content\": \"a\"}", "list"),
    ("[{\"role\": \"robot\", \"content\": \"a\"}]", "role robot"),
    ("[{\"role\": \"user\"}]", "content"),
    ("[{\"role\": \"assistant\", \"content\": \"a\"}]", "no user message"),
])
def test_bad_messages_files_get_one_line(exports, tmp_path, content, problem):
    export, _, _ = exports["tiny"]
    path = tmp_path / "messages.json"
    path.write_text(content)
    assert_one_line_error(swift("--export-dir", export, "--messages", path), problem)


def test_bad_chat_flags_get_one_line(exports):
    export, _, _ = exports["tiny"]
    assert_one_line_error(swift("--export-dir", export, "--chat", "--on-context-full", "wrap"),
                          "--on-context-full", "drop-oldest")
    assert_one_line_error(swift("--export-dir", export, "--prompt", "w1", "--system", "s"),
                          "--system")
    assert_one_line_error(swift("--export-dir", TINY, "--chat"), "chat template")


def _read_until(fd: int, marker: bytes, seen: bytearray, timeout: float, since: int = 0) -> bool:
    """Reads the terminal into `seen` until `marker` appears after offset `since`."""
    deadline = time.monotonic() + timeout
    while marker not in seen[since:]:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return False
        if not chunk:
            return False
        seen.extend(chunk)
    return True


def test_a_person_can_chat_with_the_real_pair_in_a_terminal():
    """swift-generate --chat on a pseudo-terminal, typed into as a person types: the "> " prompt,
    a question, the streamed reply, the next prompt, and end of input to leave."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: swift-generate on the terminal's far side
        os.execv(str(GENERATE), [str(GENERATE), "--export-dir", str(REAL), "--chat",
                                 "--max-new-tokens", "24", "--system",
                                 "You are a concise assistant. Answer in one sentence."])
    seen = bytearray()
    try:
        assert _read_until(fd, b"> ", seen, 600), seen.decode(errors="replace")
        start = len(seen)
        os.write(fd, b"What is the capital of France?\n")
        assert _read_until(fd, b"\n> ", seen, 1200, since=start), seen.decode(errors="replace")
        reply = seen[start:].decode(errors="replace")
        assert "Paris" in reply, reply
        os.write(fd, b"\x04")  # end of input, as Ctrl-D types it
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, seen.decode(errors="replace")
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_chat_figures_compare_a_session_with_re_prefilling_the_history(tmp_path, capsys):
    """//:chat_figures on a DFlash2 bundle: turn 2 of the session prefills only what its caches
    lack while the from-scratch run prefills the whole history, and in the five-turn table the
    session's later turns prefill less than their history; the tool itself stops if the two
    sides decode differently."""
    from museflash.tools import chat_figures
    export, _ = _with_word_template(DFLASH2, tmp_path / "bundle")
    mask = json.loads((export / "metadata.json").read_text())[
        "speculative_decoding"]["mask_token_id"]
    _set_end_of_turn(export, [mask])  # replies run to --max-new-tokens
    chat_figures.figures(export, GENERATE, history_tokens=200, max_new_tokens=8, repeats=1,
                         backend="interpreter")
    out = capsys.readouterr().out
    history = int(out.split("turn 2 of 2: ")[1].split()[0])
    assert 150 <= history <= 200
    (kept, fresh) = _table_rows(out, "| turn 2 |")
    assert int(fresh[1]) == history
    assert 0 < int(kept[1]) < history // 4
    turns = _table_rows(out, "| turn | history tokens |")
    assert [int(row[0]) for row in turns] == [1, 2, 3, 4, 5]
    for row in turns:
        kept_prefilled = int(row[4].split(",")[0])
        fresh_prefilled = int(row[5].split(",")[0])
        assert fresh_prefilled == int(row[1])
        assert kept_prefilled <= fresh_prefilled
    assert all(int(row[4].split(",")[0]) < int(row[1]) for row in turns[1:])


def test_chat_figures_refuse_a_short_context_and_a_decode_that_differs(tmp_path):
    from museflash.tools import chat_figures
    with pytest.raises(chat_figures.FiguresError, match="--max-context-length 298"):
        chat_figures.figures(DFLASH2, GENERATE, history_tokens=250, max_new_tokens=48,
                             repeats=1, backend="interpreter")
    with pytest.raises(chat_figures.FiguresError, match="metadata.json not found"):
        chat_figures.figures(tmp_path / "nothing", GENERATE, history_tokens=200,
                             max_new_tokens=8, repeats=1, backend="interpreter")
    export, _ = _with_word_template(DFLASH2, tmp_path / "bundle")
    with pytest.raises(chat_figures.FiguresError, match="--swift-generate .* cannot be run"):
        chat_figures.figures(export, tmp_path / "no-such-binary", history_tokens=200,
                             max_new_tokens=8, repeats=1, backend="interpreter")
    turn = {"prompt_ids": [1, 2, 3], "tokens": [4, 5]}
    chat_figures.same(turn, dict(turn), "turn 1")
    with pytest.raises(chat_figures.FiguresError, match="turn 2: the session"):
        chat_figures.same(turn, {**turn, "tokens": [4, 6]}, "turn 2")
