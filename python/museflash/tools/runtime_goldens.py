"""Golden files of the reference decoding loop, for the Swift engine and interpreter tests.

  runtime_goldens --export-dir D --output F.json   (cli/runtime_goldens_main.py)
      [--prompt-lengths 1,7,31,33,200] [--max-new-tokens N] [--wrap-prompt-length L]
      [--parity-steps 0,-1]

Runs runtime/speculative.py's loop over the exported packages (the numpy ML-program
interpreter) and writes ONE JSON file:

  format     1
  metadata   the bundle's metadata.json object, verbatim
  environment  {"OPENBLAS_NUM_THREADS": the value the interpreter ran with} (see below)
  prompt     where the prompt ids come from and the pad token the loop is given
  cases      per prompt length, greedy speculative decoding (the bundle's mask token and
             num_draft_tokens) drafting every step (`speculative`), the same with steps that
             copy from the context at the default lookup_min_match (`speculative-lookup`),
             tree steps at the tree function's size with lookup merged (`speculative-tree`,
             `tree_budget`, and `moved_rows`: accepted nodes whose cache rows moved; a bundle
             with a `tree` function only), and target-only greedy decoding: the prompt, the
             lookup_min_match, the generated tokens, the drafted tokens accepted per step, the
             call counts the loop reports and the trace of EVERY function call in order
             (function, first position, number of positions); a prompt length the context
             cannot hold is a case with `skipped`
  defaults   {"lookup_min_match": the loop's default}, which the Swift engine's must equal
  lookups    lookup_proposal over seeded contexts: context, count, min_match, proposal (null:
             no match), for the Swift engine's copy of the rule
  trees      runtime/tree.py's build_tree over seeded sources: anchor, budget, max_depth,
             draft_logits (fp16 values), the recycled table's rows (tokens and their logits
             rows, given to RecycledTable.update), lookup, and the tree (tokens, parents,
             sources), for the Swift engine's copy of the builder
  parity     single function calls captured from the speculative decoding of the ring-wrapping
             case: inputs, every state of the package before and after, and every output, so
             an interpreter can be checked one function at a time; `ran` names the Core ML
             function that computed it (a context bucket's, `main_64`, or `function` itself)

A tensor is {"dtype": "float16" | "float32" | "int32", "shape": [...], "base64": little-endian
raw bytes in C order}. Calls are recorded by a proxy around each package's `run`; the loop
itself is the one generate and verify use, unchanged.

Prompts: the bundle's tokenizer (as `generate` uses it, BOS included) over a fixed Python
source text, repeated until it is long enough, the first L ids taken; seeded ids when the
bundle has no tokenizer or it maps the text mostly to its unknown token. The pad token is the
tokenizer's (generate.py's TextTokenizer.pad: tokenizer_config.json's pad_token, else 0).

The ring-wrapping case (--wrap-prompt-length) generates until its decode steps run past the
largest ring (sliding_kv state) capacity, so both the target's sliding ring and the drafter's
ring wrap while decoding; the other cases generate --max-new-tokens, all within the room the
context leaves (prompt + new + block - 1 <= context_length). --wrap-prompt-length 0 makes no
such case, and the file then has no parity records.

BLAS threads: the interpreter's float results can depend on OpenBLAS's thread count (with fp32
accumulation in its matmuls they differed in the last fp16 bit or two between 1 and 2 threads),
so `environment` records the setting the goldens were made with. Imported before numpy (as
its command line is), this module defaults OPENBLAS_NUM_THREADS to 1 (the small matmuls were
also several times faster on one thread on a busy 2-core machine); the Bazel rules set it
explicitly.
"""

from __future__ import annotations

import os

# Before numpy loads OpenBLAS (only effective when nothing imported numpy earlier).
BLAS_THREADS = "OPENBLAS_NUM_THREADS"
os.environ.setdefault(BLAS_THREADS, "1")

import base64  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from museflash.bundle import (  # noqa: E402
    METADATA_FILE,
    FunctionName,
    InputName,
    Metadata,
    StateKind,
)
from museflash.runtime.speculative import (  # noqa: E402
    DEFAULT_LOOKUP_MIN_MATCH,
    LOOKUP_WINDOW,
    DecodeResult,
    load_exported_pair,
    lookup_proposal,
    speculative_generate,
    target_only_generate,
)
from museflash.runtime.tree import RecycledTable, build_tree  # noqa: E402

FORMAT = 1
DEFAULT_PROMPT_LENGTHS = "1,7,31,33,200"
RANDOM_PROMPT_SEED = 0

# The prompt text: plain Python of the kind the demo target was trained on (the standard
# library's sources), so the demo drafter's drafts get accepted at realistic, varying rates.
PROMPT_TEXT = '''\
"""A small inventory of parts, counted by bin."""

import collections
import os


class Inventory:
    """Counts parts by name; bins hold at most `capacity` parts each."""

    def __init__(self, capacity=10):
        self.capacity = capacity
        self.counts = collections.Counter()

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must not be negative")
        self.counts[name] += count
        return self.counts[name]

    def remove(self, name, count=1):
        if self.counts[name] < count:
            raise KeyError(name)
        self.counts[name] -= count
        if not self.counts[name]:
            del self.counts[name]

    def bins(self, name):
        """Number of bins the parts called `name` fill."""
        full, rest = divmod(self.counts[name], self.capacity)
        return full + (1 if rest else 0)

    def __len__(self):
        return sum(self.counts.values())

    def __repr__(self):
        return "%s(%r)" % (self.__class__.__name__, dict(self.counts))


def load(path):
    inventory = Inventory()
    if not os.path.exists(path):
        return inventory
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, _, count = line.partition("=")
            inventory.add(name.strip(), int(count))
    return inventory
'''

class GoldensError(ValueError):
    pass


# --- Tensors -------------------------------------------------------------------------------

_DTYPES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
           np.dtype(np.int32): "int32"}


def encode_tensor(value: np.ndarray) -> dict[str, Any]:
    array = np.asarray(value)
    if array.dtype not in _DTYPES:
        raise GoldensError(f"tensor of dtype {array.dtype} has no golden encoding "
                           f"(only {sorted(_DTYPES.values())})")
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return {"dtype": _DTYPES[array.dtype], "shape": list(array.shape),
            "base64": base64.b64encode(little.tobytes()).decode("ascii")}


def _tensors(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    return {str(name): encode_tensor(value) for name, value in arrays.items()}


# --- Recording -----------------------------------------------------------------------------


@dataclass
class Call:
    """One function call, captured whole."""
    function: str
    # The Core ML function that ran it: `function`, or a context bucket's (`main_64`).
    ran: str
    inputs: dict[str, np.ndarray]
    states_before: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    states_after: dict[str, np.ndarray]


class Recorder:
    """Wraps the `run` of the target's and the drafter's packages (an instance attribute over
    the class's method, removed again by `close`): every call is appended to `trace`, in the
    loop's order across both packages, and while `capture` is set kept whole in `calls`."""

    def __init__(self, packages):
        self.packages = list(packages)
        self.trace: list[dict[str, Any]] = []
        self.calls: list[Call] = []
        self.capture = False
        for package in self.packages:
            package.run = self._recording(package)

    def _recording(self, package):
        run = type(package).run.__get__(package)

        def recorded(function, inputs, last=None):
            positions = np.asarray(inputs[InputName.POSITION_IDS]).reshape(-1)
            before = ({name: value.copy() for name, value in package.states.items()}
                      if self.capture else None)
            outputs = run(function, inputs, last)
            self.trace.append({"function": str(function),
                               "first_position": int(positions[0]),
                               "length": int(positions.shape[0])})
            if self.capture:
                self.calls.append(Call(
                    function=str(function), ran=package.ran[-1],
                    inputs={str(k): np.array(v, copy=True) for k, v in inputs.items()},
                    states_before=before,
                    outputs={str(k): np.array(v, copy=True) for k, v in outputs.items()},
                    states_after={k: v.copy() for k, v in package.states.items()}))
            return outputs

        return recorded

    def start(self, capture: bool = False) -> None:
        self.trace, self.calls, self.capture = [], [], capture

    def close(self) -> None:
        for package in self.packages:
            if "run" in vars(package):
                del package.run


# --- Prompts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # long enough for the longest prompt length
    pad_token_id: int
    source: str


def prompt_ids(export_dir: Path, metadata: Metadata, length: int) -> Prompt:
    """`length` prompt ids (and the pad token): the bundle's tokenizer over PROMPT_TEXT, or
    seeded ids when there is no tokenizer or it knows too few of the text's words."""
    reason = "the bundle has no tokenizer"
    pad = 0
    if metadata.tokenizer is not None:
        from museflash.runtime.generate import TextTokenizer

        tokenizer = TextTokenizer(export_dir, metadata)
        pad = tokenizer.pad
        text = PROMPT_TEXT
        ids = tokenizer.encode(text)
        while len(ids) < length:
            text += "\n\n" + PROMPT_TEXT
            ids = tokenizer.encode(text)
        unknown_text = getattr(tokenizer.tokenizer.model, "unk_token", None)
        unknown = None if unknown_text is None else tokenizer.tokenizer.token_to_id(unknown_text)
        unknown_share = sum(i == unknown for i in ids) / len(ids) if unknown is not None else 0
        if unknown_share <= 0.5:
            bos = "" if tokenizer.bos is None else f", BOS {tokenizer.bos} first"
            return Prompt(ids[:length], pad,
                          f"tokenizer.json over the tool's Python text{bos}")
        reason = f"its tokenizer maps {100 * unknown_share:.0f}% of the text to its unknown token"
    # Uniform over the vocabulary without the mask token.
    rng = np.random.default_rng(RANDOM_PROMPT_SEED)
    mask = metadata.speculative_decoding.mask_token_id
    ids = rng.integers(0, metadata.vocab_size - 1, size=length)
    ids = np.where(ids >= mask, ids + 1, ids)
    return Prompt([int(i) for i in ids], pad,
                  f"seeded ids (numpy default_rng({RANDOM_PROMPT_SEED}), the vocabulary without "
                  f"the mask token): {reason}")


# --- Cases ---------------------------------------------------------------------------------


def ring_capacity(metadata: Metadata) -> int:
    """The largest ring among the bundle's states (target sliding and drafter caches)."""
    capacities = [state.capacity for asset in metadata.assets.values()
                  for state in asset.states if state.kind == StateKind.SLIDING_KV]
    return max(capacities, default=0)


def new_tokens_for(prompt_length: int, room: int, max_new_tokens: int, wraps: bool,
                   capacity: int, block: int) -> int:
    """New tokens of one case: --max-new-tokens, or for the ring-wrapping case enough that a
    decode step starts a block past the largest ring; never more than the room."""
    wanted = max_new_tokens
    if wraps:
        wanted = max(wanted, capacity + block - prompt_length)
    return min(wanted, room)


MODES = ("speculative", "speculative-lookup", "speculative-tree", "target_only")
TREE_MODE = "speculative-tree"  # only for a bundle with a `tree` function
# --wrap-prompt-length 0: no ring-wrapping case and so no parity records, for goldens that only
# the decoding comparisons read (a real model's ring wraps only at the end of its context).
NO_WRAP = 0


def lookup_examples(count: int = 120) -> list[dict[str, Any]]:
    """Seeded contexts over small vocabularies, half ending on a copy of an earlier piece, a
    few longer than LOOKUP_WINDOW, with lookup_proposal's answer for each."""
    rng = np.random.default_rng(7)
    examples = []
    for index in range(count):
        vocab = int(rng.choice([2, 3, 8, 50]))
        length = LOOKUP_WINDOW + int(rng.integers(-8, 40)) if index % 20 == 0 else \
            int(rng.integers(1, 60))
        context = rng.integers(0, vocab, length).tolist()
        if rng.random() < 0.5:
            start = int(rng.integers(0, len(context)))
            context += context[start:start + int(rng.integers(1, 12))]
        size, min_match = int(rng.integers(1, 16)), int(rng.integers(1, 6))
        examples.append({"context": context, "count": size, "min_match": min_match,
                         "proposal": lookup_proposal(context, size, min_match)})
    return examples


def tree_examples(count: int = 60) -> list[dict[str, Any]]:
    """Seeded trees: each from the drafter's rows, a recycled table, a lookup chain, or a mix,
    over small vocabularies (so the sources propose the same edges often), at budgets from 1 to
    40, with build_tree's answer for each."""
    rng = np.random.default_rng(11)
    examples = []
    for index in range(count):
        vocab = int(rng.choice([6, 16, 40]))
        depth = int(rng.integers(1, 8))
        anchor = int(rng.integers(0, vocab))
        kind = index % 4  # 0 drafter, 1 recycled, 2 lookup, 3 all
        draft = (rng.normal(0, 2.5, (depth, vocab)).astype(np.float16)
                 if kind in (0, 3) else None)
        table_tokens, table_logits, table = [], [], None
        if kind in (1, 3):
            table_tokens = [anchor] + rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
            table_logits = rng.normal(0, 2.5, (len(table_tokens), vocab)).astype(np.float16)
            table = RecycledTable()
            table.update(table_tokens, table_logits.astype(np.float32))
        lookup = (rng.integers(0, vocab, int(rng.integers(1, depth + 3))).tolist()
                  if kind in (2, 3) else None)
        budget = int(rng.integers(1, 41))
        tree = build_tree(anchor, budget, draft_logits=(None if draft is None
                                                        else draft.astype(np.float32)),
                          recycled=table, lookup=lookup, max_depth=depth)
        examples.append({"anchor": anchor, "budget": budget, "max_depth": depth,
                         "draft_logits": None if draft is None else draft.astype(float).tolist(),
                         "recycled_tokens": table_tokens,
                         "recycled_logits": [row.astype(float).tolist() for row in table_logits],
                         "lookup": lookup, "tokens": tree.tokens.tolist(),
                         "parents": tree.parents.tolist(), "sources": tree.sources.tolist()})
    return examples


def _calls(result: DecodeResult) -> dict[str, int]:
    calls = {str(FunctionName.PREFILL): result.prefill_calls,
             str(FunctionName.MAIN): result.verify_calls,
             str(FunctionName.INJECT_KV): result.inject_calls,
             str(FunctionName.DRAFT): result.draft_calls}
    if result.decode_calls:  # target-alone steps of a bundle with a one-token decode
        calls[str(FunctionName.DECODE)] = result.decode_calls
    if result.tree_calls:
        calls[str(FunctionName.TREE)] = result.tree_calls
    return calls


def select_calls(calls: list[Call], steps: list[int]) -> list[tuple[int, int, Call]]:
    """(index in the trace, index among the function's calls, call) of the parity steps."""
    by_function: dict[str, list[tuple[int, Call]]] = {}
    for index, call in enumerate(calls):
        by_function.setdefault(call.function, []).append((index, call))
    chosen = []
    for name in FunctionName:
        own = by_function.get(str(name), [])
        picks = sorted({step % len(own) for step in steps if -len(own) <= step < len(own)})
        chosen += [(own[i][0], i, own[i][1]) for i in picks]
    return chosen


def parity_record(case: str, trace_index: int, nth: int, call: Call) -> dict[str, Any]:
    return {"function": call.function,
            "ran": call.ran,
            "label": f"{case} {call.ran} call {nth}",
            "case": case,
            "trace_index": trace_index,
            "inputs": _tensors(call.inputs),
            "states_before": _tensors(call.states_before),
            "outputs": _tensors(call.outputs),
            "states_after": _tensors(call.states_after)}


def build_goldens(export_dir: Path, prompt_lengths: list[int], max_new_tokens: int,
                  wrap_prompt_length: int, parity_steps: list[int],
                  say=lambda _line: None) -> dict[str, Any]:
    if wrap_prompt_length != NO_WRAP and wrap_prompt_length not in prompt_lengths:
        raise GoldensError(f"--wrap-prompt-length {wrap_prompt_length} is not one of "
                           f"--prompt-lengths {prompt_lengths} (or {NO_WRAP}: no such case)")
    if max_new_tokens < 1:
        raise GoldensError("--max-new-tokens must be at least 1")
    raw_metadata = json.loads((export_dir / METADATA_FILE).read_text())
    target, drafter, metadata = load_exported_pair(export_dir)
    spec = metadata.speculative_decoding
    block = drafter.block_size
    context = metadata.context_length
    capacity = ring_capacity(metadata)
    prompt = prompt_ids(export_dir, metadata, max(prompt_lengths))
    recorder = Recorder([target.package, drafter.package])
    cases: list[dict[str, Any]] = []
    parity: list[dict[str, Any]] = []
    try:
        for length in prompt_lengths:
            longest = max(block, target.tree_length)  # the widest call a step makes
            room = context - length - (longest - 1)
            if room < 1:
                reason = (f"a prompt of {length} tokens leaves no room for a new token in "
                          f"context_length {context} (calls of {longest}: prompt + new + "
                          f"{longest - 1} must be <= {context})")
                if length == wrap_prompt_length:
                    raise GoldensError(f"--wrap-prompt-length {length}: {reason}; the parity "
                                       "records come from that case, choose a shorter one")
                for mode in MODES:
                    cases.append({"name": f"{mode}-p{length}", "skipped": reason})
                continue
            wraps = length == wrap_prompt_length
            new = new_tokens_for(length, room, max_new_tokens, wraps, capacity, block)
            ids = prompt.ids[:length]
            for mode in MODES:
                if mode == TREE_MODE and not target.tree_length:
                    continue
                name = f"{mode}-p{length}"
                lookup = (DEFAULT_LOOKUP_MIN_MATCH if mode in ("speculative-lookup", TREE_MODE)
                          else 0)
                budget = target.tree_length if mode == TREE_MODE else None
                capture = wraps and mode == "speculative"
                recorder.start(capture=capture)
                began = time.perf_counter()
                if mode != "target_only":
                    result = speculative_generate(
                        target, drafter, ids, new, mask_token_id=spec.mask_token_id,
                        num_draft_tokens=spec.num_draft_tokens, context_length=context,
                        pad_token_id=prompt.pad_token_id, lookup_min_match=lookup,
                        tree_budget=budget)
                else:
                    result = target_only_generate(target, ids, new,
                                                  pad_token_id=prompt.pad_token_id,
                                                  context_length=context)
                say(f"[runtime_goldens] {name}: {result.summary()} "
                    f"({time.perf_counter() - began:.1f} s)")
                cases.append({
                    "name": name,
                    "mode": mode,
                    "prompt_ids": [int(i) for i in ids],
                    "max_new_tokens": new,
                    "lookup_min_match": lookup,
                    **({"tree_budget": budget, "moved_rows": result.moved_rows} if budget else {}),
                    "num_draft_tokens": result.num_draft_tokens,
                    "tokens": [int(t) for t in result.tokens],
                    "accepted": [int(a) for a in result.accepted],
                    "lookup_steps": result.lookup_steps,
                    "calls": _calls(result),
                    "trace": recorder.trace,
                })
                if capture:
                    parity += [parity_record(name, index, nth, call) for index, nth, call
                               in select_calls(recorder.calls, parity_steps)]
                    recorder.calls = []
    finally:
        recorder.close()
    return {"format": FORMAT,
            "metadata": raw_metadata,
            "environment": {BLAS_THREADS: os.environ.get(BLAS_THREADS)},
            "prompt": {"source": prompt.source, "pad_token_id": prompt.pad_token_id},
            "cases": cases,
            "defaults": {"lookup_min_match": DEFAULT_LOOKUP_MIN_MATCH},
            "lookups": lookup_examples(),
            "trees": tree_examples(),
            "parity": parity}
