"""Chat over an export: the bundle's own chat template renders the conversation, and one
DecodeSession keeps the target's caches and the drafter's ring from turn to turn, so a turn
prefills only the ids after the longest prefix the caches already hold.

A turn renders the whole history with `add_generation_prompt`, tokenizes it without adding
special tokens (the template writes its own), and decodes until an end-of-turn token
(`metadata.json` `tokenizer.end_of_turn_ids`; the tokenizer's eos token for bundles written
before) or `max_new_tokens`. The reply's text, without its end-of-turn token, joins the history
as the assistant's message, which the next turn renders again: the ids the caches hold and the
re-rendered ones then agree up to about the reply's end, and the session keeps those.

A history that outgrows the context follows a policy: `refuse` (the default) stops in one line
naming the limit; `drop-oldest` drops the oldest turns after the system prompt until it fits, and
the session then re-prefills from where the history changed (everything after the system
prompt).

The Swift engine's ChatSession implements the same turns (swift/Sources/MuseflashRuntime).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from museflash.checkpoint.chat_template import ChatTemplateError, read_chat_template, render_chat
from museflash.runtime.choices import CONTEXT_POLICIES, DROP_OLDEST, REFUSE
from museflash.runtime.speculative import DecodeResult, DecodeSession

ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """A conversation that cannot go on; one line naming the problem and the fix."""


def parse_messages(raw: object, where: str) -> list[dict[str, str]]:
    """A conversation: a non-empty JSON list of {"role", "content"} objects."""
    if not isinstance(raw, list):
        raise ChatError(f"{where}: expected a JSON list of {{\"role\", \"content\"}} objects, "
                        f"got {type(raw).__name__}")
    if not raw:
        raise ChatError(f"{where}: the list of messages is empty; give at least one user "
                        "message")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise ChatError(f"{where}: message {index} is not an object with \"role\" and "
                            "\"content\"")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ChatError(f"{where}: message {index} has role {role!r}; roles are "
                            f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ChatError(f"{where}: message {index} ({role}) has no string \"content\"")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise ChatError(f"{where}: no user message; a reply answers a user message")
    return messages


def read_messages(path: str | Path) -> list[dict[str, str]]:
    """The conversation of a --messages file."""
    path = Path(path)
    if not path.is_file():
        raise ChatError(f"--messages {path} does not exist or is not a file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ChatError(f"--messages {path} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ChatError(f"--messages {path} is not JSON ({error.msg} at line {error.lineno} "
                        f"column {error.colno})") from None
    return parse_messages(raw, f"--messages {path}")


def reply_points(messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Indices of the user messages a scripted conversation replies to: each one that no
    assistant message follows directly ([user, assistant, user]: the last; [user, user]: both)."""
    return [i for i, m in enumerate(messages) if m["role"] == "user"
            and (i + 1 == len(messages) or messages[i + 1]["role"] != "assistant")]


@dataclass
class Turn:
    prompt_ids: list[int]  # the whole rendered history this reply continues
    tokens: list[int]  # the reply, its end-of-turn token included when it ended on one
    text: str  # the reply as it joins the history
    prefilled_tokens: int  # ids of prompt_ids this turn computed (the rest were held)
    time_to_first_token_seconds: float
    seconds: float
    result: DecodeResult
    dropped_messages: int = 0  # oldest messages dropped by drop-oldest before this turn

    def to_json(self) -> dict[str, object]:
        return {"prompt_ids": self.prompt_ids, "tokens": self.tokens, "text": self.text,
                "prefilled_tokens": self.prefilled_tokens,
                "time_to_first_token_seconds": self.time_to_first_token_seconds,
                "seconds": self.seconds, "accepted": self.result.accepted,
                "target_calls": self.result.target_calls,
                "tokens_per_target_call": self.result.tokens_per_target_call,
                "verify_steps": len(self.result.accepted),
                "mean_accepted_length": self.result.mean_accepted_length,
                "dropped_messages": self.dropped_messages}


@dataclass
class ChatTemplate:
    """A bundle's chat template and the special tokens it may name (bos_token, ...)."""
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_export(cls, export_dir: str | Path) -> ChatTemplate:
        found = read_chat_template(export_dir)
        if found is None:
            raise ChatError(f"{export_dir} has no chat template (tokenizer_config.json "
                            "chat_template or chat_template.jinja); export an instruct "
                            "checkpoint that has one, or pass --prompt")
        return cls(*found)

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        try:
            return render_chat(self.source, messages, add_generation_prompt=True,
                               special_tokens=self.special_tokens)
        except ChatTemplateError as error:
            raise ChatError(str(error)) from error


class Chat:
    """A conversation over one DecodeSession. `encode` turns rendered text into ids (no
    special tokens added), `decode` a reply's ids into text (special tokens left out)."""

    def __init__(self, session: DecodeSession, template: ChatTemplate, *,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 stop_token_ids: Sequence[int], context_length: int, max_new_tokens: int,
                 on_context_full: str = REFUSE, system: str | None = None):
        if on_context_full not in CONTEXT_POLICIES:
            raise ChatError(f"--on-context-full {on_context_full!r} is not one of "
                            f"{list(CONTEXT_POLICIES)}")
        if not stop_token_ids:
            raise ChatError("the bundle names no end-of-turn token (metadata.json "
                            "tokenizer.end_of_turn_ids, or an eos_token); a reply would never "
                            "end: re-export with this museflash")
        self.session, self.template = session, template
        self.encode, self.decode = encode, decode
        self.stop_token_ids = frozenset(stop_token_ids)
        self.context_length, self.max_new_tokens = context_length, max_new_tokens
        self.on_context_full = on_context_full
        self.messages: list[dict[str, str]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})

    def _needed(self, ids: list[int]) -> int:
        return len(ids) + self.max_new_tokens + self.session.block - 1

    def _prompt(self) -> tuple[list[int], int]:
        """The rendered history's ids, dropping the oldest turns first under drop-oldest."""
        dropped = 0
        while True:
            ids = self.encode(self.template.render(self.messages))
            needed = self._needed(ids)
            if needed <= self.context_length:
                return ids, dropped
            first = next((i for i, m in enumerate(self.messages) if m["role"] != "system"), None)
            if self.on_context_full != DROP_OLDEST or first is None or first >= len(
                    self.messages) - 1:
                advice = ("start a new conversation or ask for fewer --max-new-tokens"
                          if self.on_context_full == DROP_OLDEST else
                          "start a new conversation, ask for fewer --max-new-tokens, or pass "
                          "--on-context-full drop-oldest")
                raise ChatError(f"the conversation ({len(ids)} tokens) and --max-new-tokens "
                                f"{self.max_new_tokens} need {needed} positions but the "
                                f"export's context_length is {self.context_length}; {advice}")
            # Drop whole turns: a user message goes with the assistant reply after it.
            count = 2 if (self.messages[first]["role"] == "user" and first + 1 < len(
                self.messages) - 1 and self.messages[first + 1]["role"] == "assistant") else 1
            del self.messages[first:first + count]
            dropped += count

    def reply(self, on_text: Callable[[str], None] | None = None) -> Turn:
        """The assistant's reply to the history as it stands (its last message a user's);
        the reply joins the history."""
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ChatError("a reply answers a user message; the history ends with "
                            f"{self.messages[-1]['role'] if self.messages else 'nothing'}")
        began = time.perf_counter()
        ids, dropped = self._prompt()
        first_token: list[float] = []
        shown = _ReplyStream(self.decode, self.stop_token_ids, on_text)

        def on_tokens(tokens: list[int]) -> None:
            if not first_token:
                first_token.append(time.perf_counter() - began)
            shown(tokens)

        result = self.session.generate(ids, self.max_new_tokens, on_tokens=on_tokens,
                                       stop_token_ids=self.stop_token_ids)
        seconds = time.perf_counter() - began
        body = [t for t in result.tokens if t not in self.stop_token_ids]
        text = self.decode(body)
        self.messages.append({"role": "assistant", "content": text})
        return Turn(prompt_ids=ids, tokens=result.tokens, text=text,
                    prefilled_tokens=len(ids) - result.reused_tokens,
                    time_to_first_token_seconds=first_token[0] if first_token else seconds,
                    seconds=seconds, result=result, dropped_messages=dropped)

    def say(self, content: str, on_text: Callable[[str], None] | None = None) -> Turn:
        """A user message and the reply to it."""
        self.messages.append({"role": "user", "content": content})
        return self.reply(on_text)

    def run_script(self, messages: Sequence[Mapping[str, str]],
                   on_text: Callable[[str], None] | None = None) -> list[Turn]:
        """A scripted conversation (--messages): its messages join the history in order, and
        each user message no assistant message follows gets a reply (`reply_points`)."""
        if self.messages and messages and messages[0]["role"] == "system":
            raise ChatError("--system and a system message in --messages both set the system "
                            "prompt; give one")
        wanted = set(reply_points(messages))
        turns = []
        for index, message in enumerate(messages):
            self.messages.append(dict(message))
            if index in wanted:
                turns.append(self.reply(on_text))
        return turns


class _ReplyStream:
    """Hands on the reply's text as tokens arrive: holds back a trailing incomplete UTF-8
    sequence and stops at an end-of-turn token."""

    def __init__(self, decode: Callable[[list[int]], str], stops: frozenset[int],
                 write: Callable[[str], None] | None):
        self.decode, self.stops, self.write = decode, stops, write
        self.tokens: list[int] = []
        self.shown = ""
        self.ended = False

    def __call__(self, tokens: list[int]) -> None:
        if self.ended or self.write is None:
            return
        for token in tokens:
            if token in self.stops:
                self.ended = True
                break
            self.tokens.append(token)
        text = self.decode(self.tokens)
        if not self.ended:
            text = text.rstrip("\ufffd")
        if text.startswith(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
