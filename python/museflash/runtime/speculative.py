"""Reference speculative decoding (DFlash) over an exported bundle, greedy or sampled.

The loop drives only what the app would drive: the target's `prefill` and `main` functions and
the drafter's `inject_kv` and `draft` functions, run by the numpy ML-program interpreter with
caller-owned fp16 states. It is the executable statement of the runtime contract in
docs/metadata.md and docs/positions.md:

  prefill   prompt chunks of the fixed prefill length; a prompt that is not a multiple lets the
            last chunk overlap the previous one (re-writing a position writes the same K/V).
  inject    the drafter gets target features in blocks of exactly block_size rows ending at the
            newest accepted position; overlapping rows re-write identical values.
  step      draft [anchor, MASK x (K-1)] at anchor_pos .. anchor_pos+K-1 (the drafted tokens
            are each row's argmax, or a DFlash2 drafter's `draft_tokens`), verify the same
            positions with ONE target `main` call, accept the longest agreeing prefix plus the
            target's own token, then continue from the first unaccepted position. Nothing is
            truncated: rejected slots are overwritten by the next call (docs/positions.md).
  lookup    with `lookup_min_match` n > 0, a step whose context ends in n or more tokens that
            occurred before proposes what followed them (the latest longest match, copied
            onward: `lookup_proposal`) instead of calling `draft`: a repetition loop is then
            drafted by copying, which a drafter that predicts from its prior does not do
            (docs/demo.md). The proposal is deterministic, so sampled verification judges it
            with a one-hot q; the output's distribution is the target's either way.
  tree      with a tree budget, a step verifies a tree of candidates instead of the chain
            (runtime/tree.py, docs/trees.md): the draft call's rows, the recycled table of the
            target's own earlier rows and the lookup proposal merged best first, verified by
            ONE target `tree` call; the longest path the target's argmax follows is accepted,
            its cache rows moved to their own positions, its features injected. Sampled, the
            tree's tokens are drawn from the drafter's rows and judged by recursive rejection
            (`fill_by_sampling`, `accept_sampled`).
  sampling  with a temperature > 0 the drafts are sampled from the drafter's rows and the
            speculative rejection rule (runtime/sampling.py) replaces "longest agreeing
            prefix", so the output is distributed as the target's own sampling; temperature 0
            (or no sampling) is the greedy loop above, token for token.

Backends are small adapters so the same loop runs over the exported packages (the reference)
and over eager torch modules (used to measure acceptance while training a drafter).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from museflash.bundle import (
    METADATA_FILE,
    Asset,
    AssetKind,
    AssetRole,
    BundleError,
    FunctionName,
    InputName,
    Metadata,
    OutputName,
    target_states,
)
from museflash.runtime.choices import DEFAULT_LOOKUP_MIN_MATCH
from museflash.runtime.interpreter import Interpreter, LazyInterpreters
from museflash.runtime.sampling import Sampling, accept_drafts, probabilities, sample
from museflash.runtime.tree import (
    RecycledTable,
    TokenTree,
    accept_greedy,
    accept_sampled,
    build_tree,
    check_ancestor_mask,
    compact_tree_rows,
    fill_by_sampling,
)

# --- Backends --------------------------------------------------------------------------------


class Target(Protocol):
    prefill_length: int
    verify_length: int
    step_length: int  # tokens per target-alone step: 1 with a `decode` function, else main's
    step_function: FunctionName  # what a target-alone step calls: `decode`, else `main`

    def step(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A target-alone step of `step_length` tokens: -> (logits [T, vocab], features)."""

    def prefill(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> (logits of the chunk's last position [vocab], features [T, width])."""

    def verify(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> (logits [T, vocab], features [T, width])."""

    tree_length: int  # nodes of the `tree` function; 0: none

    def verify_tree(self, ids: np.ndarray, positions: np.ndarray,
                    mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A token tree's nodes (node i written at positions[0] + i, RoPE position
        positions[i], seeing the nodes mask[i] names): -> (logits [N, vocab], features)."""

    def compact(self, base: int, path: list[int]) -> None:
        """After verify_tree at `base`, moves the accepted path's cache rows into place."""

    def reset(self) -> None: ...


def tree_call_inputs(tree: TokenTree, nodes: int, base: int,
                     pad_token_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, positions, mask) of a `tree` call of `nodes` rows for `tree` with its root at
    position `base`: the tree's nodes, then pad nodes, each a child of the root that only the
    root and itself see (their rows are ignored; their cache rows sit past the accepted path,
    where the next call writes first)."""
    count = len(tree)
    if count > nodes:
        raise ValueError(f"a tree of {count} nodes does not fit the {nodes}-node tree function")
    ids = np.full(nodes, pad_token_id, np.int32)
    ids[:count] = tree.tokens
    depths = np.ones(nodes, np.int32)
    depths[:count] = tree.depths()
    mask = np.zeros((nodes, nodes), np.int32)
    mask[:count, :count] = tree.ancestor_mask()
    mask[count:, 0] = 1
    mask[np.arange(count, nodes), np.arange(count, nodes)] = 1
    return ids, (base + depths).astype(np.int32), mask


@dataclass(frozen=True)
class Drafted:
    logits: np.ndarray  # [K, vocab], row 0 at the anchor
    tokens: np.ndarray | None = None  # [K-1] int32: DFlash2's greedy selector path

    def greedy(self) -> np.ndarray:
        """The drafted tokens of greedy decoding: the selector's path when there is one,
        else the argmax of each drafted row."""
        if self.tokens is not None:
            return np.asarray(self.tokens, np.int32).copy()
        return np.argmax(self.logits[1:], axis=-1).astype(np.int32)


class Drafter(Protocol):
    block_size: int

    def inject(self, features: np.ndarray, positions: np.ndarray) -> None: ...

    def draft(self, ids: np.ndarray, positions: np.ndarray) -> Drafted:
        """-> the block's logits and, from a DFlash2 drafter, its selector's path."""

    def reset(self) -> None: ...


class _Package:
    """The interpreters of one asset's functions (its function table: every context bucket's)
    and the states they share."""

    def __init__(self, export_dir: Path, asset: Asset,
                 interpreters: Mapping[str, Interpreter] | None = None):
        self.path = export_dir / asset.path
        if not self.path.is_dir():
            raise BundleError(f"{self.path} not found (listed in {METADATA_FILE})")
        self.asset = asset
        names = [row.name for row in asset.function_table()]
        if interpreters is None:
            interpreters = LazyInterpreters(self.path, names)
        # Each function loads on first use (a LazyInterpreters): a short conversation never
        # loads the large buckets.
        self.functions = (interpreters if isinstance(interpreters, LazyInterpreters)
                          else {name: interpreters[name] for name in names})
        self.query_length = {name: f.query_length for name, f in asset.functions.items()}
        self.states = next(iter(self.functions.values())).zero_states()
        # The Core ML function each call ran, in order (the context bucket it picked).
        self.ran: list[str] = []

    def run(self, function: FunctionName, inputs: dict[str, np.ndarray],
            last: int | None = None) -> dict[str, np.ndarray]:
        """Runs `function` in the smallest context bucket holding the call's last position
        (bundle.Asset.pick: `last`, by default the largest position id), on the shared
        states."""
        if last is None:
            last = int(np.max(inputs[InputName.POSITION_IDS]))
        name = self.asset.pick(function, last).name
        self.ran.append(name)
        return self.functions[name].run(inputs, self.states)

    def reset(self) -> None:
        for value in self.states.values():
            value.fill(0)


class ExportedTarget:
    """The fused target package: `prefill` and `main`, both returning drafter_features."""

    def __init__(self, export_dir: str | Path, metadata: Metadata | None = None,
                 interpreters: Mapping[str, Interpreter] | None = None):
        """`interpreters`: the package's functions (load_role_interpreters), or loaded here."""
        export_dir = Path(export_dir)
        metadata = metadata or Metadata.read(export_dir)
        asset = metadata.asset(AssetRole.TARGET)
        if asset.kind != AssetKind.FUSED_TARGET:
            raise BundleError(f"target kind is {asset.kind!s}; speculative decoding "
                              "with DFlash needs --fused-target (drafter_features output)")
        self.package = _Package(export_dir, asset, interpreters)
        self.prefill_length = self.package.query_length[FunctionName.PREFILL]
        self.verify_length = self.package.query_length[FunctionName.MAIN]
        # Target-alone steps run `decode` (one token) where the export has it, else main.
        self.step_function = FunctionName.DECODE if asset.decode else FunctionName.MAIN
        self.step_length = asset.function(self.step_function).query_length
        self.tree_length = asset.tree.query_length if asset.tree else 0
        self.cache_names = [str(n) for n in target_states(metadata.target.layer_types)]

    def _call(self, function: FunctionName, ids: np.ndarray, positions: np.ndarray,
              mask: np.ndarray | None = None):
        inputs = {InputName.INPUT_IDS: np.asarray(ids, np.int32).reshape(1, -1),
                  InputName.POSITION_IDS: np.asarray(positions, np.int32)}
        last = None
        if mask is not None:
            inputs[InputName.TREE_MASK] = np.asarray(mask, np.int32)
            last = int(positions[0]) + len(positions) - 1  # node i is written at base + i
        out = self.package.run(function, inputs, last)
        return (out[OutputName.LOGITS][0].astype(np.float32),
                out[OutputName.DRAFTER_FEATURES][0])

    def verify_tree(self, ids, positions, mask):
        check_ancestor_mask(mask)
        return self._call(FunctionName.TREE, ids, positions, mask)

    def compact(self, base: int, path: list[int]) -> None:
        compact_tree_rows([self.package.states[n] for n in self.cache_names], base, path)

    def prefill(self, ids, positions):
        logits, features = self._call(FunctionName.PREFILL, ids, positions)
        return logits[-1], features

    def verify(self, ids, positions):
        return self._call(FunctionName.MAIN, ids, positions)

    def step(self, ids, positions):
        return self._call(self.step_function, ids, positions)

    def reset(self) -> None:
        self.package.reset()


class ExportedDrafter:
    """The DFlash drafter package: `inject_kv` and `draft` sharing one ring cache."""

    def __init__(self, export_dir: str | Path, metadata: Metadata | None = None,
                 interpreters: Mapping[str, Interpreter] | None = None):
        export_dir = Path(export_dir)
        metadata = metadata or Metadata.read(export_dir)
        self.package = _Package(export_dir, metadata.asset(AssetRole.DFLASH_DRAFTER),
                                interpreters)
        self.block_size = self.package.query_length[FunctionName.DRAFT]

    def inject(self, features, positions) -> None:
        self.package.run(FunctionName.INJECT_KV, {
            InputName.FEATURES: np.asarray(features, np.float16)[None],
            InputName.POSITION_IDS: np.asarray(positions, np.int32),
        })

    def draft(self, ids, positions) -> Drafted:
        out = self.package.run(FunctionName.DRAFT, {
            InputName.INPUT_IDS: np.asarray(ids, np.int32).reshape(1, -1),
            InputName.POSITION_IDS: np.asarray(positions, np.int32),
        })
        tokens = out.get(OutputName.DRAFT_TOKENS)
        return Drafted(out[OutputName.LOGITS][0].astype(np.float32),
                       None if tokens is None else np.asarray(tokens[0], np.int32))

    def reset(self) -> None:
        self.package.reset()


class EagerTarget:
    """A fused torch target (e.g. from checkpoint.load.load_target with a drafter dir)."""

    def __init__(self, model: torch.nn.Module, prefill_length: int, verify_length: int,
                 step_length: int | None = None, tree_length: int = 0):
        self.model = model
        self.prefill_length = prefill_length
        self.verify_length = verify_length
        self.step_length = step_length or verify_length
        self.step_function = (FunctionName.DECODE if self.step_length < verify_length
                              else FunctionName.MAIN)
        self.tree_length = tree_length

    def _call(self, ids, positions, mask=None):
        with torch.no_grad():
            logits, features = self.model(
                torch.as_tensor(np.asarray(ids), dtype=torch.int32).reshape(1, -1),
                torch.as_tensor(np.asarray(positions), dtype=torch.int32),
                None if mask is None else torch.as_tensor(np.asarray(mask), dtype=torch.int32))
        return logits[0].float().numpy(), features[0].float().numpy()

    def verify_tree(self, ids, positions, mask):
        check_ancestor_mask(mask)
        return self._call(ids, positions, mask)

    def compact(self, base: int, path: list[int]) -> None:
        names = target_states(self.model.config.layer_types)
        compact_tree_rows([getattr(self.model, str(n)).numpy() for n in names], base, path)

    def prefill(self, ids, positions):
        logits, features = self._call(ids, positions)
        return logits[-1], features

    def verify(self, ids, positions):
        return self._call(ids, positions)

    def step(self, ids, positions):
        return self._call(ids, positions)

    def reset(self) -> None:
        self.model.reset_caches()


class EagerDrafter:
    """A torch drafter; `block_size` is the block it drafts (an export's
    `speculative_decoding.block_size`), by default its config's."""

    def __init__(self, model: torch.nn.Module, block_size: int | None = None):
        self.model = model
        self.block_size = block_size or model.config.block_size

    def inject(self, features, positions) -> None:
        with torch.no_grad():
            weight = next(self.model.layers.parameters())
            self.model.inject_kv(torch.as_tensor(np.asarray(features)).to(weight.dtype)[None],
                                 torch.as_tensor(np.asarray(positions), dtype=torch.int32))

    def draft(self, ids, positions) -> Drafted:
        with torch.no_grad():
            out = self.model.draft(torch.as_tensor(np.asarray(ids), dtype=torch.int32)
                                   .reshape(1, -1),
                                   torch.as_tensor(np.asarray(positions), dtype=torch.int32))
        logits, tokens = out if isinstance(out, tuple) else (out, None)
        return Drafted(logits[0].float().numpy(),
                       None if tokens is None else tokens[0].numpy().astype(np.int32))

    def reset(self) -> None:
        self.model.reset_caches()


# --- The loop --------------------------------------------------------------------------------

LOOKUP_MAX_MATCH = 8  # the longest context ending compared when looking up a proposal
LOOKUP_WINDOW = 1024  # earlier occurrences are looked for among the newest this many tokens


def lookup_proposal(context: list[int], count: int, min_match: int) -> list[int] | None:
    """`count` tokens copied from where the context's ending occurred before, or None.

    The ending is the longest suffix of min_match..LOOKUP_MAX_MATCH tokens that also ends at
    an earlier position, among the last LOOKUP_WINDOW positions; among equally long matches
    the latest wins. The proposal is what followed that earlier occurrence, copied on through
    the proposal itself when it runs past the end, so a loop of period p repeats with period
    p. The Swift engine implements the same rule (ContextLookup.proposal).

    The search runs over the tail's bytes (8 per id): for each length from the longest down,
    the latest earlier occurrence of the ending, at an id boundary, by `bytes.rfind`."""
    if min_match < 1 or count < 1:
        raise ValueError(f"lookup needs min_match >= 1 and count >= 1, got {min_match}, {count}")
    tail = context[-(LOOKUP_WINDOW + LOOKUP_MAX_MATCH):]
    length = len(tail)
    data = array("q", tail).tobytes()
    width = 8
    lowest_end = max(0, length - 1 - LOOKUP_WINDOW)  # earlier occurrences end in the window
    best_end = None
    for match in range(min(LOOKUP_MAX_MATCH, length - 1), min_match - 1, -1):
        ending = data[(length - match) * width:]
        first = max(0, lowest_end - match + 1) * width
        found = data.rfind(ending, first, (length - 1) * width)  # ends before the last id
        while found >= 0 and found % width:  # inside an id: look further back
            found = data.rfind(ending, first, found + len(ending) - 1)
        if found >= 0:
            best_end = found // width + match - 1
            break
    if best_end is None:
        return None
    tokens = list(tail)
    for index in range(count):
        tokens.append(tokens[best_end + 1 + index])
    return tokens[length:]


def _context_tail(prompt: list[int], tokens: list[int], size: int) -> list[int]:
    """The last `size` ids of prompt + tokens, without copying the whole context."""
    tail = tokens[-size:]
    return (prompt[-(size - len(tail)):] + tail) if len(tail) < size else tail


@dataclass
class DecodeResult:
    tokens: list[int]
    target_calls: int = 0
    prefill_calls: int = 0
    verify_calls: int = 0  # `main` calls
    decode_calls: int = 0  # target-alone steps through the one-token `decode`
    tree_calls: int = 0  # steps verified by the target's `tree` function
    moved_rows: int = 0  # accepted tree nodes whose cache rows were moved into place
    drafter_calls: int = 0
    inject_calls: int = 0
    draft_calls: int = 0
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted, per step
    lookup_accepted: list[int] = field(default_factory=list)  # accepted, per copying step
    num_draft_tokens: int = 0
    sampling: Sampling | None = None  # None or temperature 0: greedy
    lookup_min_match: int = 0  # 0: every step drafted
    # Prompt ids whose cache entries a session kept from its earlier calls (DecodeSession):
    # the call computed the other len(prompt) - reused_tokens.
    reused_tokens: int = 0
    stopped: bool = False  # ended at one of the caller's stop tokens, not at max_new_tokens

    @property
    def mean_accepted_length(self) -> float:
        """Mean drafted tokens accepted per step (the target's own token not counted)."""
        return float(np.mean(self.accepted)) if self.accepted else 0.0

    @property
    def lookup_steps(self) -> int:
        """Steps that proposed a copy of the context instead of a draft."""
        return len(self.lookup_accepted)

    @property
    def lookup_mean_accepted_length(self) -> float:
        """Mean proposed tokens accepted per step that copied from the context."""
        return float(np.mean(self.lookup_accepted)) if self.lookup_accepted else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Mean fraction of the proposed tokens that were accepted."""
        if not self.accepted or not self.num_draft_tokens:
            return 0.0
        return self.mean_accepted_length / self.num_draft_tokens

    @property
    def tokens_per_target_call(self) -> float:
        return len(self.tokens) / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_verify_call(self) -> float:
        """Tokens produced by decode steps per `main` call (mean accepted length + 1 before
        the final step is cut to the requested length)."""
        decoded = len(self.tokens) - 1  # the first token comes from prefill
        calls = self.verify_calls + self.tree_calls
        return decoded / calls if calls else 0.0

    def summary(self) -> str:
        return (f"{len(self.tokens)} tokens, {self.target_calls} target calls "
                f"({self.prefill_calls} prefill + {self.verify_calls} main"
                + (f" + {self.decode_calls} decode" if self.decode_calls else "")
                + (f" + {self.tree_calls} tree" if self.tree_calls else "") + "), "
                f"{self.drafter_calls} drafter calls ({self.inject_calls} inject_kv + "
                f"{self.draft_calls} draft), mean accepted length "
                f"{self.mean_accepted_length:.2f}/{self.num_draft_tokens} "
                f"({100 * self.acceptance_rate:.1f}%), "
                f"{self.tokens_per_target_call:.2f} tokens per target call, "
                f"{self.tokens_per_verify_call:.2f} per main call"
                + (f", {self.lookup_steps} of {len(self.accepted)} steps copied from the "
                   f"context (mean accepted {self.lookup_mean_accepted_length:.2f})"
                   if self.lookup_min_match else "")
                + (f", sampled ({self.sampling.describe()})" if _sampled(self.sampling) else ""))


def chunk_starts(length: int, chunk: int, first: int = 0) -> list[int]:
    """Starts of fixed-size chunks covering first..length-1; the last one overlaps its
    predecessor (or, when fewer than `chunk` positions are left, positions before `first`)
    instead of running past the end."""
    if length < chunk:
        raise ValueError(f"{length} positions cannot fill one chunk of {chunk}")
    if length - first < chunk:
        return [length - chunk]
    starts = list(range(first, length - chunk + 1, chunk))
    if starts[-1] + chunk < length:
        starts.append(length - chunk)
    return starts


def _check_prompt(prompt: list[int]) -> None:
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")


def _sampled(sampling: Sampling | None) -> bool:
    return sampling is not None and not sampling.greedy


def _check_sampling(sampling: Sampling | None, rng: np.random.Generator | None) -> bool:
    """Whether to sample; sampling needs the caller's Generator (no hidden randomness)."""
    if _sampled(sampling) and rng is None:
        raise ValueError("sampling with a temperature > 0 needs rng=np.random.default_rng(seed)")
    return _sampled(sampling)


def _next_token(logits: np.ndarray, sampling: Sampling | None,
                rng: np.random.Generator | None) -> int:
    """The token after one logits row: argmax, or a sample under `sampling`."""
    if not _sampled(sampling):
        return int(np.argmax(logits))
    return int(sample(probabilities(logits, sampling), rng))


def _prefill(target: Target, prompt: list[int], result: DecodeResult, pad_token_id: int,
             first: int = 0):
    """Returns the logits after the prompt and the features of the prompt positions from
    `first` on (a session's caches hold the ones before; chunks may re-write a few of them,
    which writes the same K/V), and the last position any call wrote.

    A prompt shorter than one prefill chunk is padded at its end: the pad rows write the caches
    at positions after the prompt, which later calls overwrite before any query can see them
    (the rollback argument of docs/positions.md), and the features returned for those positions
    are placeholders of the same kind. `prefill` returns the logits of its last row only, so the
    last prompt token then goes through `main` once more (re-writing its own K/V unchanged)."""
    ids = np.asarray(prompt, np.int32)
    features: dict[int, np.ndarray] = {}
    length = target.prefill_length
    if len(prompt) < length:
        if first:
            raise ValueError(f"a prompt of {len(prompt)} ids, shorter than a prefill chunk, "
                             "is computed from position 0")
        ids = np.concatenate([ids, np.full(length - len(prompt), pad_token_id, np.int32)])
    logits = None
    for start in chunk_starts(len(ids), length, first):
        positions = np.arange(start, start + length, dtype=np.int32)
        logits, rows = target.prefill(ids[start:start + length], positions)
        result.prefill_calls += 1
        features.update(zip(positions.tolist(), rows, strict=True))
    written = len(ids) - 1
    if len(prompt) < length:
        last = len(prompt) - 1
        verify = target.verify_length
        ids = np.array([prompt[-1]] + [pad_token_id] * (verify - 1), np.int32)
        all_logits, rows = target.verify(ids, np.arange(last, last + verify, dtype=np.int32))
        result.verify_calls += 1
        logits = all_logits[0]
        features.update(zip(range(last, last + verify), rows, strict=True))
        written = max(written, last + verify - 1)
    return logits, features, written


def inject_starts(length: int, block: int, first: int = 0) -> list[int]:
    """Blocks that hand the prompt's features from `first` on to the drafter; a prompt shorter
    than a block is injected as one block from position 0 (its tail rows are placeholders, see
    _prefill)."""
    return chunk_starts(length, block, first) if length >= block else [0]


def _emit(result: DecodeResult, tokens: list[int], limit: int,
          on_tokens: Callable[[list[int]], None] | None,
          stop_token_ids: frozenset[int] = frozenset()) -> None:
    """Appends the new tokens (at most up to `limit` in all, and up to the first stop token,
    which is kept) and hands them to `on_tokens`."""
    tokens = tokens[:max(0, limit - len(result.tokens))]
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            tokens = tokens[:index + 1]
            result.stopped = True
            break
    result.tokens.extend(tokens)
    if on_tokens is not None and tokens:
        on_tokens(tokens)


def _done(result: DecodeResult, limit: int) -> bool:
    return result.stopped or len(result.tokens) >= limit


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def _check_room(metadata_context: int | None, prompt_len: int, new_tokens: int, block: int):
    if metadata_context is None:
        return
    # The last verify block starts at most at prompt_len + new_tokens - 1.
    needed = prompt_len + new_tokens + block - 1
    if needed > metadata_context:
        raise ValueError(f"prompt {prompt_len} + {new_tokens} new tokens need positions up to "
                         f"{needed - 1}, beyond the bundle's context_length {metadata_context}")


class DecodeSession:
    """The decoding loop with caches that outlive a call: the target's KV caches and the
    drafter's ring, and which ids they hold. A call whose prompt starts with ids the caches
    already hold computes only from the first one they do not (keeping at least the last
    prompt id, whose logits start the reply); a prompt that parts from them earlier rewinds
    both caches to where it parts. A chat session is this with its history as the prompt.

    What is kept: `held`, the ids at positions 0..len(held)-1 whose K/V are in the target's
    caches and whose features are in the drafter's ring, computed from exactly those ids. A
    reply's last token is not among them (no call has run it yet). Positions past `held` hold
    stale values that queries cannot see until a call re-writes them (docs/positions.md).

    A sliding cache is a ring of `capacity` slots for a window of `window` positions: slot
    p % capacity holds the newest position written there. Once the session wrote position W,
    the slots of positions up to W - capacity hold later ones, so a call that parts from the
    held ids at k can keep them only when every position its first query sees is still in
    its slot: k >= W - (capacity - window). `ring_slack` is the smallest capacity - window of
    the bundle's rings (None when no cache is a ring smaller than the context); a rewind
    further back than that decodes from scratch.

    `drafter` None decodes with the target alone. The first call of a session (and one whose
    prompt shares nothing with `held`) makes exactly the calls a fresh decode makes."""

    def __init__(self, target: Target, drafter: Drafter | None = None, *,
                 mask_token_id: int | None = None, num_draft_tokens: int | None = None,
                 context_length: int | None = None, sampling: Sampling | None = None,
                 rng: np.random.Generator | None = None, pad_token_id: int = 0,
                 lookup_min_match: int = DEFAULT_LOOKUP_MIN_MATCH, ring_slack: int | None = None,
                 tree_budget: int | None = None):
        """`tree_budget`: verify trees of up to this many nodes (the root counted) through the
        target's `tree` function instead of the chain through `main` (greedy only; None or
        0: the chain)."""
        self.sampled = _check_sampling(sampling, rng)
        if lookup_min_match < 0:
            raise ValueError(f"lookup_min_match must be >= 0 (0: off), got {lookup_min_match}")
        self.block = target.verify_length
        self.proposals = 0
        if drafter is not None:
            if mask_token_id is None:
                raise ValueError("speculative decoding needs the drafter's mask_token_id")
            block = drafter.block_size
            if target.verify_length != block:
                raise ValueError(f"target main takes {target.verify_length} tokens but the "
                                 f"drafter's block is {block}; verification needs one main "
                                 "call per block")
            self.proposals = num_draft_tokens if num_draft_tokens is not None else block - 1
            if not 1 <= self.proposals <= block - 1:
                raise ValueError(f"num_draft_tokens {self.proposals} must be in 1..{block - 1}")
        self.target, self.drafter = target, drafter
        self.mask_token_id = mask_token_id
        self.context_length = context_length
        self.sampling, self.rng = sampling, rng
        self.pad_token_id = pad_token_id
        self.lookup_min_match = lookup_min_match if drafter is not None else 0
        self.ring_slack = ring_slack
        self.tree_budget = check_tree_budget(tree_budget, target, drafter, self.sampled)
        self.recycled = RecycledTable()  # the target's own top-k, from every tree call's rows
        self.held: list[int] = []
        self.written_to = -1  # the furthest position any call of this session wrote

    def reset(self) -> None:
        """Forget every cache entry: the next call decodes from scratch."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.held, self.written_to = [], -1

    def reusable(self, prompt: list[int]) -> int:
        """How many of `prompt`'s leading ids this session's caches can keep."""
        keep = min(common_prefix_length(self.held, prompt), len(prompt) - 1)
        if keep and len(prompt) < self.target.prefill_length:
            return 0  # a prompt shorter than a chunk is prefilled padded, from position 0
        if keep and self.ring_slack is not None and keep < self.written_to - self.ring_slack:
            return 0  # the rings no longer hold what the first query would see
        return keep

    def generate(self, prompt: list[int], max_new_tokens: int, *,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 stop_token_ids: frozenset[int] | set[int] = frozenset()) -> DecodeResult:
        """Decodes up to `max_new_tokens` after `prompt` (or up to a stop token, which is the
        last one returned), from the caches' longest reusable prefix of it."""
        _check_prompt(prompt)
        _check_room(self.context_length, len(prompt), max_new_tokens,
                    max(self.block, self.target.tree_length if self.tree_budget else 0))
        keep = self.reusable(prompt)
        if not keep:
            self.reset()
        stops = frozenset(stop_token_ids)
        result = DecodeResult(tokens=[], num_draft_tokens=self.proposals, sampling=self.sampling,
                              lookup_min_match=self.lookup_min_match, reused_tokens=keep)
        if self.drafter is None:
            self._target_only(prompt, keep, max_new_tokens, result, on_tokens, stops)
        else:
            self._speculative(prompt, keep, max_new_tokens, result, on_tokens, stops)
        result.drafter_calls = result.inject_calls + result.draft_calls
        result.target_calls = (result.prefill_calls + result.verify_calls + result.decode_calls
                               + result.tree_calls)
        self.held = list(prompt) + result.tokens[:-1]
        return result

    def _first_computed(self, prompt: list[int], keep: int) -> int:
        """The first position the prefill computes: the drafter's inject blocks end at the
        prompt's last position, so they may reach back before `keep`."""
        if self.drafter is None or not keep:
            return keep
        return min(keep, max(0, len(prompt) - self.block))

    def _target_only(self, prompt, keep, max_new_tokens, result, on_tokens, stops) -> None:
        target, sampling, rng = self.target, self.sampling, self.rng
        block = target.step_length
        logits, _, written = _prefill(target, prompt, result, self.pad_token_id, keep)
        self.written_to = max(self.written_to, written)
        token = _next_token(logits, sampling, rng)
        _emit(result, [token], max_new_tokens, on_tokens, stops)
        position = len(prompt)
        while not _done(result, max_new_tokens):
            ids = np.array([token] + [self.pad_token_id] * (block - 1), np.int32)
            logits, _ = target.step(ids, np.arange(position, position + block, dtype=np.int32))
            if target.step_function == FunctionName.DECODE:
                result.decode_calls += 1
            else:
                result.verify_calls += 1
            self.written_to = max(self.written_to, position + block - 1)
            token = _next_token(logits[0], sampling, rng)
            _emit(result, [token], max_new_tokens, on_tokens, stops)
            position += 1

    def _speculative(self, prompt, keep, max_new_tokens, result, on_tokens, stops) -> None:
        target, drafter, block = self.target, self.drafter, self.block
        sampling, rng, sampled, proposals = self.sampling, self.rng, self.sampled, self.proposals
        first = self._first_computed(prompt, keep)
        logits, features, written = _prefill(target, prompt, result, self.pad_token_id, first)
        self.written_to = max(self.written_to, written)
        anchor = _next_token(logits, sampling, rng)
        _emit(result, [anchor], max_new_tokens, on_tokens, stops)
        for start in inject_starts(len(prompt), block, keep):
            positions = np.arange(start, start + block, dtype=np.int32)
            drafter.inject(np.stack([features[p] for p in positions.tolist()]), positions)
            result.inject_calls += 1
        anchor_pos = len(prompt)
        while not _done(result, max_new_tokens):
            positions = np.arange(anchor_pos, anchor_pos + block, dtype=np.int32)
            copied = (lookup_proposal(_context_tail(prompt, result.tokens,
                                                    LOOKUP_WINDOW + LOOKUP_MAX_MATCH),
                                      block - 1, self.lookup_min_match)
                      if self.lookup_min_match else None)
            if self.tree_budget:
                anchor, anchor_pos = self._tree_step(anchor, anchor_pos, copied, features,
                                                     result, max_new_tokens, on_tokens, stops)
                continue
            if copied is not None:
                guesses = np.asarray(copied, np.int32)
                if sampled:  # a deterministic proposal: q is the one-hot of each copied token
                    q = np.zeros((proposals, logits.shape[-1]), np.float64)
                    q[np.arange(proposals), guesses[:proposals]] = 1.0
            else:
                drafted = self._draft(anchor, anchor_pos, result)
                guesses = drafted.greedy()
                if sampled:
                    # Only the first `proposals` rows are judged; later slots keep their greedy
                    # draft, and their target rows are never used. A DFlash2 selector path is
                    # greedy only: sampled drafts come from each row's own distribution.
                    q = probabilities(drafted.logits[1:proposals + 1], sampling)
                    guesses[:proposals] = sample(q, rng)
            logits, rows = target.verify(np.concatenate([[anchor], guesses]).astype(np.int32),
                                         positions)
            result.verify_calls += 1
            self.written_to = max(self.written_to, anchor_pos + block - 1)
            if sampled:
                accepted, token = accept_drafts(probabilities(logits[:proposals + 1], sampling),
                                                q, guesses[:proposals], rng)
            else:
                greedy = np.argmax(logits, axis=-1)
                accepted = 0
                while accepted < proposals and guesses[accepted] == greedy[accepted]:
                    accepted += 1
                token = int(greedy[accepted])
            result.accepted.append(accepted)
            if copied is not None:
                result.lookup_accepted.append(accepted)
            _emit(result, [int(t) for t in guesses[:accepted]] + [token], max_new_tokens,
                  on_tokens, stops)
            # Rows 0..accepted were computed from correct tokens; later rows saw rejected drafts
            # and stand only at positions the next verify call re-writes (they fill the inject
            # window while fewer than `block` positions are known).
            last = anchor_pos + accepted
            features.update(zip(range(anchor_pos, anchor_pos + block), rows, strict=True))
            self._inject_up_to(last, features, result)
            anchor, anchor_pos = token, last + 1

    def _draft(self, anchor: int, anchor_pos: int, result: DecodeResult) -> Drafted:
        """draft([anchor, MASK x (K-1)]) at anchor_pos .. anchor_pos + K - 1."""
        block = self.block
        result.draft_calls += 1
        return self.drafter.draft(
            np.array([anchor] + [self.mask_token_id] * (block - 1), np.int32),
            np.arange(anchor_pos, anchor_pos + block, dtype=np.int32))

    def _inject_up_to(self, last: int, features: dict[int, np.ndarray], result: DecodeResult,
                      placeholder: np.ndarray | None = None) -> None:
        """Hands the drafter the block of features ending at `last`, the newest accepted
        position (a position without features takes `placeholder`), then forgets the features
        no later block reaches."""
        block = self.block
        first = max(0, last - block + 1)
        window = np.arange(first, first + block, dtype=np.int32)
        rows = [features[p] if placeholder is None else features.get(p, placeholder)
                for p in window.tolist()]
        self.drafter.inject(np.stack(rows), window)
        result.inject_calls += 1
        for old in [p for p in features if p <= last - block]:
            del features[old]

    def _tree_step(self, anchor, anchor_pos, copied, features, result, max_new_tokens,
                   on_tokens, stops) -> tuple[int, int]:
        """One tree step at `anchor_pos` (module docstring, `tree`): -> the next anchor and
        its position."""
        target, block = self.target, self.block
        drafted = self._draft(anchor, anchor_pos, result)
        if self.sampled:
            # The drafter's tree shape, its tokens drawn from its rows: no recycled or copied
            # candidates, each must come from the q it is judged by (docs/trees.md, Sampling).
            q = probabilities(drafted.logits[1:], self.sampling)
            tree = fill_by_sampling(build_tree(anchor, self.tree_budget,
                                               draft_logits=drafted.logits[1:],
                                               max_depth=block - 1), q, self.rng)
        else:
            tree = build_tree(anchor, self.tree_budget, draft_logits=drafted.logits[1:],
                              recycled=self.recycled, lookup=copied, max_depth=block - 1)
        nodes = target.tree_length
        ids, positions, mask = tree_call_inputs(tree, nodes, anchor_pos, self.pad_token_id)
        logits, rows = target.verify_tree(ids, positions, mask)
        result.tree_calls += 1
        self.written_to = max(self.written_to, anchor_pos + nodes - 1)
        count = len(tree)
        if self.sampled:
            path, token = accept_sampled(
                tree, lambda node: probabilities(logits[node], self.sampling), q, self.rng)
        else:
            path, token = accept_greedy(tree, np.argmax(logits[:count], axis=-1))
        target.compact(anchor_pos, path)
        result.moved_rows += sum(node != depth for depth, node in enumerate(path, start=1))
        self.recycled.update(tree.tokens, logits[:count])
        accepted = len(path)
        result.accepted.append(accepted)
        if copied is not None:
            result.lookup_accepted.append(accepted)
        _emit(result, [int(tree.tokens[n]) for n in path] + [token], max_new_tokens,
              on_tokens, stops)
        # The path's rows at their own positions; the inject window's positions past it (a
        # prompt shorter than a block) take the last path row as a placeholder (docs/trees.md).
        last = anchor_pos + accepted
        path_rows = [rows[n] for n in [0, *path]]
        features.update(zip(range(anchor_pos, last + 1), path_rows, strict=True))
        self._inject_up_to(last, features, result, placeholder=path_rows[-1])
        return token, last + 1


def check_tree_budget(budget: int | None, target: Target, drafter: Drafter | None,
                      sampled: bool) -> int:
    """The tree budget a session may use (0: the chain), or a one-line refusal."""
    if not budget:
        return 0
    if drafter is None:
        raise ValueError("a tree budget needs the drafter (drop --no-draft or the budget)")
    if target.tree_length < 2:
        raise ValueError(f"--tree-budget {budget}: this bundle has no tree function; re-export "
                         "it with this museflash (--dflash-drafter adds one; --tree-nodes N "
                         "sets its size)")
    if not 1 <= budget <= target.tree_length:
        raise ValueError(f"--tree-budget {budget}: the bundle's tree function takes "
                         f"{target.tree_length} nodes; give 1 to {target.tree_length}")
    return budget


def speculative_generate(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    *,
    mask_token_id: int,
    num_draft_tokens: int | None = None,
    context_length: int | None = None,
    sampling: Sampling | None = None,
    rng: np.random.Generator | None = None,
    pad_token_id: int = 0,
    on_tokens: Callable[[list[int]], None] | None = None,
    lookup_min_match: int = DEFAULT_LOOKUP_MIN_MATCH,
    tree_budget: int | None = None,
) -> DecodeResult:
    """Speculative decoding from fresh caches. Greedy (no `sampling`, or temperature 0): the
    output equals the target's own greedy output. Sampled: the drafts are sampled from the
    drafter's rows under the same settings and accepted by the rejection rule, so the output is
    distributed as `target_only_generate` with the same settings; `rng` (required then) is the
    only source of randomness. `lookup_min_match` > 0 lets steps propose copies of the context
    (`lookup_proposal`) instead of drafts; 0 drafts every step (what measures a drafter).
    `tree_budget`: verify trees of up to that many nodes (DecodeSession)."""
    session = DecodeSession(target, drafter, mask_token_id=mask_token_id,
                            num_draft_tokens=num_draft_tokens, context_length=context_length,
                            sampling=sampling, rng=rng, pad_token_id=pad_token_id,
                            lookup_min_match=lookup_min_match, tree_budget=tree_budget)
    session.reset()
    return session.generate(prompt, max_new_tokens, on_tokens=on_tokens)


def target_only_generate(
    target: Target,
    prompt: list[int],
    max_new_tokens: int,
    *,
    pad_token_id: int = 0,
    context_length: int | None = None,
    sampling: Sampling | None = None,
    rng: np.random.Generator | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> DecodeResult:
    """Target-only decoding over the same functions from fresh caches: one new token per `main`
    call, greedy (no `sampling`, or temperature 0) or sampled under `sampling` with `rng`.

    `main` has a fixed query length, so each call feeds [newest token, pad ...]: only row 0 is
    used, and the pad rows' cache writes sit at later positions that the next call overwrites
    before any query can see them (the same rollback argument as rejected drafts).
    """
    session = DecodeSession(target, None, context_length=context_length, sampling=sampling,
                            rng=rng, pad_token_id=pad_token_id)
    session.reset()
    return session.generate(prompt, max_new_tokens, on_tokens=on_tokens)


def greedy_generate(
    target: Target,
    prompt: list[int],
    max_new_tokens: int,
    *,
    pad_token_id: int = 0,
    context_length: int | None = None,
) -> DecodeResult:
    """Target-only greedy decoding: `target_only_generate` without sampling."""
    return target_only_generate(target, prompt, max_new_tokens, pad_token_id=pad_token_id,
                                context_length=context_length)


def eager_greedy_generate(model: torch.nn.Module, prompt: list[int],
                          max_new_tokens: int) -> list[int]:
    """Greedy decoding with an eager torch target (fp32 reference), one token per call.

    Works with the plain and the fused target (the fused one returns (logits, features)).
    """
    model.reset_caches()
    tokens: list[int] = []
    ids = torch.tensor([prompt], dtype=torch.int32)
    positions = torch.arange(len(prompt), dtype=torch.int32)
    with torch.no_grad():
        while len(tokens) < max_new_tokens:
            out = model(ids, positions)
            logits = out[0] if isinstance(out, tuple) else out
            token = int(torch.argmax(logits[0, -1]))
            tokens.append(token)
            ids = torch.tensor([[token]], dtype=torch.int32)
            positions = positions[-1:] + 1
    return tokens


def ring_slack(metadata: Metadata) -> int | None:
    """DecodeSession's `ring_slack`: the smallest capacity - window among the bundle's ring
    caches smaller than its context (the target's sliding layers, a sliding drafter's ring), or
    None when it has none (a target of full-attention layers with a full-context drafter)."""
    windows = {AssetRole.TARGET: metadata.target.sliding_window}
    if metadata.speculative_decoding is not None:
        windows[AssetRole.DFLASH_DRAFTER] = metadata.speculative_decoding.drafter.sliding_window
    slacks = [state.capacity - windows.get(role, state.capacity)
              for role, asset in metadata.assets.items() for state in asset.states
              if state.capacity < metadata.context_length]
    return min(slacks, default=None)


def load_role_interpreters(export_dir: Path, metadata: Metadata,
                           roles: list[AssetRole]) -> dict[AssetRole, LazyInterpreters]:
    """The interpreters of each role's functions, each loaded on first use, so the checks and
    the decoding loop reuse them."""
    return {role: LazyInterpreters(export_dir / metadata.asset(role).path,
                                   [row.name for row in metadata.asset(role).function_table()])
            for role in roles}


def load_exported_pair(export_dir: str | Path) -> tuple[ExportedTarget, ExportedDrafter,
                                                       Metadata]:
    """The exported fused target and DFlash drafter of `export_dir`, with its metadata."""
    export_dir = Path(export_dir)
    metadata = Metadata.read(export_dir)
    if metadata.drafter_role != AssetRole.DFLASH_DRAFTER:
        raise BundleError(f"{export_dir} has no DFlash drafter; this loop drives one: export "
                          "with --fused-target --dflash-drafter")
    loaded = load_role_interpreters(export_dir, metadata,
                                    [AssetRole.TARGET, AssetRole.DFLASH_DRAFTER])
    return (ExportedTarget(export_dir, metadata, loaded[AssetRole.TARGET]),
            ExportedDrafter(export_dir, metadata, loaded[AssetRole.DFLASH_DRAFTER]), metadata)
