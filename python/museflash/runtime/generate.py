"""Text in, text out over an export: tokenize with the bundle's own tokenizer, decode with the
speculative loop (or the target alone), stream the text as tokens are accepted, and report the
figures.

The default backend runs the EXPORTED packages with the numpy ML-program interpreter (what the
device would run, slowly); `eager` runs the same loop over the eager torch modules rebuilt from
the checkpoints the export came from (its `source` record), for speed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from museflash.bundle import (
    TOKENIZER_FILE,
    AssetKind,
    AssetRole,
    BundleError,
    FunctionName,
    Metadata,
)
from museflash.runtime.chat import Chat, ChatError, ChatTemplate, Turn
from museflash.runtime.choices import BACKENDS, DEFAULT_LOOKUP_MIN_MATCH, REFUSE
from museflash.runtime.package_check import PackageError, check_packages
from museflash.runtime.sampling import Sampling
from museflash.runtime.speculative import (
    DecodeResult,
    DecodeSession,
    EagerDrafter,
    EagerTarget,
    ExportedDrafter,
    ExportedTarget,
    check_tree_budget,
    load_role_interpreters,
    ring_slack,
    speculative_generate,
    target_only_generate,
)


class GenerateError(ValueError):
    """The request cannot run; one line naming the problem and the fix."""


@dataclass
class GenerateOptions:
    export_dir: Path
    prompt: str
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    draft: bool = True
    seed: int = 0
    backend: str = "export"
    compare: bool = True  # also time the target alone, for the speed-up figure
    # A step whose context ends in this many tokens seen before copies what followed them
    # instead of drafting (runtime/speculative.py's `lookup`); 0 drafts every step.
    lookup_min_match: int = DEFAULT_LOOKUP_MIN_MATCH
    # Verify trees of up to this many nodes through the target's `tree` function (greedy;
    # docs/trees.md); 0: the chain through `main`.
    tree_budget: int = 0
    # Chat (runtime/chat.py): the system prompt, and what a history that outgrows the context
    # does (`refuse` or `drop-oldest`).
    system: str | None = None
    on_context_full: str = REFUSE


class TextTokenizer:
    """The bundle's tokenizer.json, read with the tokenizers library, plus the conventions of
    its tokenizer_config.json (a BOS token is put in front when the config names one and does
    not switch `add_bos_token` off)."""

    def __init__(self, export_dir: Path, metadata: Metadata):
        if metadata.tokenizer is None:
            raise GenerateError(f"{export_dir} has no tokenizer (metadata.json tokenizer is "
                                "null); export a checkpoint whose folder holds tokenizer.json")
        from tokenizers import Tokenizer

        path = export_dir / TOKENIZER_FILE
        if not path.is_file():
            raise GenerateError(f"{path} is missing (listed in metadata.json); re-export")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = export_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = metadata.tokenizer.special_tokens
        self.bos = special.get(_token_text(config.get("bos_token")))
        if config.get("add_bos_token") is False:
            self.bos = None
        self.eos = special.get(_token_text(config.get("eos_token")))
        self.pad = special.get(_token_text(config.get("pad_token")), 0)
        self.special_ids = set(special.values())

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise GenerateError(f"--prompt {text!r} has no tokens after tokenization; give "
                                "some text")
        return ([self.bos] if self.bos is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.special_ids],
                                     skip_special_tokens=True)


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a token as its text or as {"content": text, ...}."""
    return value.get("content") if isinstance(value, dict) else value


class TextStream:
    """Writes the decoded text as tokens arrive; holds back a trailing incomplete UTF-8
    sequence (byte-level BPE splits characters) and stops at the end-of-sequence token."""

    def __init__(self, tokenizer: TextTokenizer, write: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.write = write
        self.tokens: list[int] = []
        self.shown = ""
        self.ended = False

    def __call__(self, tokens: list[int]) -> None:
        if self.ended:
            return
        for token in tokens:
            if token == self.tokenizer.eos:
                self.ended = True
                break
            self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not self.ended:
            text = text.rstrip("\ufffd")  # the start of a character split across tokens
        if text.startswith(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text


@dataclass
class Run:
    result: DecodeResult
    seconds: float
    text: str

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / max(1, len(self.result.tokens))


def open_backends(options: GenerateOptions, metadata: Metadata):
    """(target, drafter or None) for the chosen backend."""
    target_asset = metadata.asset(AssetRole.TARGET)
    drafting = options.draft
    if drafting and metadata.drafter_role != AssetRole.DFLASH_DRAFTER:
        raise GenerateError(f"{options.export_dir} has no DFlash drafter; pass --no-draft or "
                            "export with --fused-target --dflash-drafter")
    if options.backend == "export":
        try:
            check_packages(options.export_dir, metadata)
        except PackageError as error:
            raise GenerateError(str(error)) from error
        if target_asset.kind != AssetKind.FUSED_TARGET:
            raise GenerateError("the exported target is not fused (no drafter_features); "
                                "export with --fused-target")
        roles = [AssetRole.TARGET] + ([AssetRole.DFLASH_DRAFTER] if drafting else [])
        loaded = load_role_interpreters(Path(options.export_dir), metadata, roles)
        target = ExportedTarget(options.export_dir, metadata, loaded[AssetRole.TARGET])
        drafter = (ExportedDrafter(options.export_dir, metadata,
                                   loaded[AssetRole.DFLASH_DRAFTER]) if drafting else None)
        return target, drafter
    from museflash.builtin.demo_checkpoint import checkpoint_dirs
    from museflash.checkpoint.load import load_drafter, load_target

    prefill = target_asset.function(FunctionName.PREFILL).query_length
    verify = target_asset.function(FunctionName.MAIN).query_length
    # fp32 weights and caches: torch's CPU kernels for fp16 matmuls are many times slower.
    sizes = dict(dtype=torch.float32, cache_dtype=torch.float32,
                 max_context=metadata.context_length, max_query_len=metadata.max_query_length())
    with checkpoint_dirs(metadata, None, None) as (target_dir, drafter_dir, _):
        model = load_target(target_dir, drafter_dir, **sizes)
        drafter = (EagerDrafter(load_drafter(drafter_dir, model, target_dir=target_dir, **sizes),
                                metadata.speculative_decoding.block_size)
                   if drafting else None)
    tree = target_asset.tree.query_length if target_asset.tree else 0
    return EagerTarget(model, prefill, verify, tree_length=tree), drafter


def decode(target, drafter, prompt: list[int], options: GenerateOptions, metadata: Metadata,
           pad: int, on_tokens=None) -> tuple[DecodeResult, float]:
    sampling = Sampling(options.temperature, options.top_p)
    rng = np.random.default_rng(options.seed)
    began = time.perf_counter()
    with torch.no_grad():
        if drafter is None:
            result = target_only_generate(target, prompt, options.max_new_tokens,
                                          pad_token_id=pad, context_length=metadata.context_length,
                                          sampling=sampling, rng=rng, on_tokens=on_tokens)
        else:
            spec = metadata.speculative_decoding
            result = speculative_generate(target, drafter, prompt, options.max_new_tokens,
                                          mask_token_id=spec.mask_token_id,
                                          num_draft_tokens=spec.num_draft_tokens,
                                          context_length=metadata.context_length,
                                          sampling=sampling, rng=rng, pad_token_id=pad,
                                          on_tokens=on_tokens,
                                          lookup_min_match=options.lookup_min_match,
                                          tree_budget=options.tree_budget)
    return result, time.perf_counter() - began


def _check_tree_budget(options: GenerateOptions, target, drafter) -> None:
    if options.tree_budget and drafter is None:
        raise GenerateError("--tree-budget verifies the drafter's candidates; drop it or "
                            "--no-draft")
    try:
        check_tree_budget(options.tree_budget, target, drafter,
                          not Sampling(options.temperature, options.top_p).greedy)
    except ValueError as error:
        raise GenerateError(str(error)) from error


def check_options(options: GenerateOptions) -> Metadata:
    if options.backend not in BACKENDS:
        raise GenerateError(f"--backend {options.backend!r} is not one of {list(BACKENDS)}")
    if options.max_new_tokens < 1:
        raise GenerateError("--max-new-tokens must be at least 1")
    if options.lookup_min_match < 0:
        raise GenerateError(f"--lookup-min-match must be >= 0 (0 drafts every step), got "
                            f"{options.lookup_min_match}")
    if options.tree_budget < 0:
        raise GenerateError(f"--tree-budget must be >= 0 (0: the chain), got "
                            f"{options.tree_budget}")
    try:
        Sampling(options.temperature, options.top_p)
    except ValueError as error:
        raise GenerateError(str(error)) from error
    if not Path(options.export_dir).is_dir():
        raise GenerateError(f"--export-dir {options.export_dir} is not a directory; point it "
                            "at a folder written by //:export")
    try:
        return Metadata.read(options.export_dir)
    except BundleError as error:
        raise GenerateError(str(error)) from error


def generate(options: GenerateOptions, write: Callable[[str], None],
             say: Callable[[str], None]) -> Run:
    """Streams the generated text through `write`; figures go through `say`."""
    metadata = check_options(options)
    export_dir = Path(options.export_dir)
    tokenizer = TextTokenizer(export_dir, metadata)
    prompt = tokenizer.encode(options.prompt)
    needed = len(prompt) + options.max_new_tokens + metadata.max_query_length()
    if needed > metadata.context_length:
        raise GenerateError(f"the prompt ({len(prompt)} tokens) and --max-new-tokens "
                            f"{options.max_new_tokens} need {needed} positions but the export's "
                            f"context_length is {metadata.context_length}; ask for fewer tokens")
    target, drafter = open_backends(options, metadata)
    _check_tree_budget(options, target, drafter)
    stream = TextStream(tokenizer, write)
    write(options.prompt)
    result, seconds = decode(target, drafter, prompt, options, metadata, tokenizer.pad, stream)
    write("\n")
    run = Run(result, seconds, stream.shown)
    say(f"[generate] {options.backend} backend, {result.summary()}")
    say(f"[generate] {seconds:.2f} s, {1000 * run.seconds_per_token:.1f} ms per token")
    if drafter is not None:
        per_step = ", ".join(str(a) for a in result.accepted)
        say(f"[generate] accepted drafts per step (of {result.num_draft_tokens}): {per_step}")
        if options.compare:
            alone, alone_seconds = decode(target, None, prompt, options, metadata,
                                          tokenizer.pad)
            same = "same tokens" if alone.tokens == result.tokens else "other tokens (sampled)"
            say(f"[generate] target alone ({same}): {alone_seconds:.2f} s, "
                f"{1000 * alone_seconds / max(1, len(alone.tokens)):.1f} ms per token; "
                f"speed-up {alone_seconds / seconds:.2f}x")
    return run


def open_chat(options: GenerateOptions) -> Chat:
    """A conversation over the export: its chat template, one DecodeSession for every turn."""
    metadata = check_options(options)
    export_dir = Path(options.export_dir)
    tokenizer = TextTokenizer(export_dir, metadata)
    try:
        template = ChatTemplate.of_export(export_dir)
    except ChatError as error:
        raise GenerateError(str(error)) from error
    target, drafter = open_backends(options, metadata)
    _check_tree_budget(options, target, drafter)
    spec = metadata.speculative_decoding
    session = DecodeSession(
        target, drafter, mask_token_id=spec.mask_token_id if drafter else None,
        num_draft_tokens=spec.num_draft_tokens if drafter else None,
        context_length=metadata.context_length,
        sampling=Sampling(options.temperature, options.top_p),
        rng=np.random.default_rng(options.seed), pad_token_id=tokenizer.pad,
        lookup_min_match=options.lookup_min_match,
        ring_slack=ring_slack(metadata), tree_budget=options.tree_budget if drafter else 0)
    stops = metadata.tokenizer.end_of_turn_ids or (
        [tokenizer.eos] if tokenizer.eos is not None else [])

    def encode(text: str) -> list[int]:
        return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

    try:
        return Chat(session, template, encode=encode, decode=tokenizer.decode,
                    stop_token_ids=stops, context_length=metadata.context_length,
                    max_new_tokens=options.max_new_tokens,
                    on_context_full=options.on_context_full, system=options.system)
    except ChatError as error:
        raise GenerateError(str(error)) from error


def turn_summary(index: int, turn: Turn) -> str:
    return (f"[generate] turn {index + 1}: {len(turn.prompt_ids)} history tokens, "
            f"{turn.prefilled_tokens} prefilled, {len(turn.tokens)} new; first token after "
            f"{turn.time_to_first_token_seconds:.2f} s, {turn.seconds:.2f} s in all, "
            f"{turn.result.tokens_per_target_call:.2f} tokens per target call"
            + (f"; dropped the {turn.dropped_messages} oldest messages to fit the context"
               if turn.dropped_messages else ""))
