"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it:
Jinja2 in a sandbox, with `raise_exception`, the `tojson` filter, `messages`,
`add_generation_prompt` and the tokenizer's special tokens by role (`bos_token`, ...).

The template itself travels with the checkpoint: `chat_template` in `tokenizer_config.json`
(as transformers writes it, and as museflash writes it for a GGUF file: checkpoint/gguf.py), or
a `chat_template.jinja` beside it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """A template that cannot be rendered; names it and why."""


def read_chat_template(checkpoint_dir: str | Path) -> tuple[str, dict[str, str]] | None:
    """(template, special tokens by role) of a checkpoint folder, or None without a template."""
    directory = Path(checkpoint_dir)
    config_path = directory / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = config.get("chat_template")
    if (directory / TEMPLATE_FILE).is_file():
        template = (directory / TEMPLATE_FILE).read_text()
    if not isinstance(template, str):
        return None
    special = {role: config[role] for role in SPECIAL_TOKEN_ROLES
               if isinstance(config.get(role), str)}
    return template, special


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *,
                add_generation_prompt: bool = True,
                special_tokens: Mapping[str, str] | None = None) -> str:
    """The conversation `messages` ({"role", "content"} each) as the template writes it."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = raise_exception
    try:
        compiled = environment.from_string(template)
        return compiled.render(messages=[dict(m) for m in messages],
                               add_generation_prompt=add_generation_prompt,
                               **dict(special_tokens or {}))
    except TemplateError as error:
        raise ChatTemplateError(f"the chat template cannot be rendered ({error})") from error
