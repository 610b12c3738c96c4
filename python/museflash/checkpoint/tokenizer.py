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
    return Tokenizer(files=files, vocab_size=size, special_tokens=special)
