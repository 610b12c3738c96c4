"""The target checkpoint's tokenizer: its Hugging Face files, checked against the model.

A tokenizer is optional (a checkpoint without `tokenizer.json` exports without one). When
present its ids must index the model's vocabulary, since the bundle's logits are indexed by
token id: it has at most `vocab_size` tokens. Fewer is how real checkpoints ship (Qwen3 has
151936 embedding rows for 151669 tokens): the rows past the tokenizer are padding, which no
text encodes to. The drafter's mask token must be one of its special tokens. The export copies
the files `read_tokenizer` lists; `//:check-contract` checks the same on the copies.
"""

from __future__ import annotations

import json
from pathlib import Path

from museflash.bundle import TOKENIZER_FILE, TOKENIZER_FILES, Tokenizer
from museflash.checkpoint.tensor_files import CheckpointError


def read_tokenizer(target_dir: Path, vocab_size: int,
                   mask_token_id: int | None = None) -> Tokenizer | None:
    """The checkpoint's Hugging Face tokenizer files, when it has a tokenizer.json: its ids
    must lie inside the model's vocabulary, and the drafter's mask token must be one of its
    special tokens."""
    target_dir = Path(target_dir)
    path = target_dir / TOKENIZER_FILE
    if not path.is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tokenizer = HFTokenizer.from_file(str(path))
        added = json.loads(path.read_text()).get("added_tokens") or []
    except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library reads "
                              f"({error})") from error
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {size} tokens but config.json's vocab_size is "
            f"{vocab_size}; the bundle's logits are indexed by token id, so every id the "
            "tokenizer produces must be below vocab_size")
    special = {t["content"]: int(t["id"]) for t in added if t.get("special")}
    if mask_token_id is not None and mask_token_id not in special.values():
        raise CheckpointError(
            f"{path}: the drafter's mask_token_id {mask_token_id} is not one of the "
            f"tokenizer's special tokens {sorted(special.values())}; add it as a special token")
    files = [name for name in TOKENIZER_FILES if (target_dir / name).is_file()]
    check_chat_template(target_dir)
    ends = end_of_turn_ids(target_dir, special)
    if ends is not None and max(ends) >= size:
        raise CheckpointError(f"{target_dir / GENERATION_CONFIG_FILE}: eos_token_id {max(ends)} "
                              f"is not a token of the tokenizer ({size} tokens); fix the file")
    return Tokenizer(files=files, vocab_size=size, special_tokens=special, end_of_turn_ids=ends)


def check_chat_template(target_dir: Path) -> None:
    """Refuses a chat template the Swift runtime cannot render (naming the construct), or one
    that jinja2 cannot render on a probe conversation: no bundle ships a template its runtime
    cannot render."""
    from museflash.checkpoint.chat_template import (
        TEMPLATE_FILE,
        TOKENIZER_CONFIG_FILE,
        ChatTemplateError,
        check_renderable,
        read_chat_template,
        render_chat,
    )

    found = read_chat_template(target_dir)
    if found is None:
        return
    template, tokens = found
    source = target_dir / (TEMPLATE_FILE if (target_dir / TEMPLATE_FILE).is_file()
                           else TOKENIZER_CONFIG_FILE)
    try:
        check_renderable(template)
        render_chat(template, [{"role": "user", "content": "probe"},
                               {"role": "assistant", "content": _PROBE_REPLY}],
                    add_generation_prompt=False, special_tokens=tokens)
    except ChatTemplateError as error:
        raise CheckpointError(f"{source}: {error}") from error


GENERATION_CONFIG_FILE = "generation_config.json"
_PROBE_REPLY = "museflash probe reply"


def end_of_turn_ids(target_dir: Path, special: dict[str, int]) -> list[int] | None:
    """The ids that end a reply, or None when the checkpoint names none: generation_config.json's
    `eos_token_id` (an id or a list), tokenizer_config.json's `eos_token`, and the special token
    the chat template writes right after an assistant message (rendered on a probe
    conversation: `<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3)."""
    ids: set[int] = set()
    generation = target_dir / GENERATION_CONFIG_FILE
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
            raise CheckpointError(f"{generation}: not a JSON object ({error}); fix or remove "
                                  "the file") from error
        ids.update(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    config_path = target_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    eos_text = config.get("eos_token")
    eos_text = eos_text.get("content") if isinstance(eos_text, dict) else eos_text
    if eos_text in special:
        ids.add(special[eos_text])
    from museflash.checkpoint.chat_template import (
        ChatTemplateError,
        read_chat_template,
        render_chat,
    )

    found = read_chat_template(target_dir)
    if found is not None:
        template, tokens = found
        try:
            text = render_chat(template, [{"role": "user", "content": "probe"},
                                          {"role": "assistant", "content": _PROBE_REPLY}],
                               add_generation_prompt=False, special_tokens=tokens)
        except ChatTemplateError:
            text = ""  # the export's template check names what is wrong with it
        after = text[text.rfind(_PROBE_REPLY) + len(_PROBE_REPLY):].lstrip() \
            if _PROBE_REPLY in text else ""
        ending = max((t for t in special if t and after.startswith(t)), key=len, default=None)
        if ending is not None:
            ids.add(special[ending])
    return sorted(ids) or None
