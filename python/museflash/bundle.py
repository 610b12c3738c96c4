"""The bundle contract: every name, file and `metadata.json` field of an export, typed once.

The exporter writes through these types, the reference runtime and every tool read through
them, and the JSON Schema in `docs/metadata.schema.json` is generated from them
(`json_schema()`; a test fails when the checked-in copy is stale). The Swift reader
(`swift/Sources/ExportMetadata`) is tested against examples this module produces in the same
Bazel build (`//python:metadata_examples`).

Compatibility rules, stated in the schema and honoured by both readers:
- `schema_version` is the contract's major version. A reader rejects a version it does not
  know; a change of meaning, a removed field or a newly required field bumps it.
- Within a version, fields may be added. Readers ignore object keys they do not know, so an
  older reader still reads a newer exporter's bundle of the same version.
- Enumerated names (asset roles and kinds, function roles, state kinds, ...) are closed: an
  unknown value is an error, since a reader cannot drive what it does not know.
- Optional values are written as null (a field marked `omit_null` is left out instead, so
  bundles written before it keep their bytes); readers also accept them absent.

This module imports nothing from the rest of museflash (and no torch or coremltools).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# 2: `compression` (weights stored as iOS18 constexpr ops). A version-1 bundle is read as one
# without compression.
# 3: assets may share a package: the fused target and the DFlash drafter are one multifunction
# package (every weight stored once), the drafter's states are named drafterKeyCache /
# drafterValueCache, and compression counts are per package, under its owner's role.
SCHEMA_VERSION = 3
SUPPORTED_SCHEMA_VERSIONS = (1, 2, 3)

METADATA_FILE = "metadata.json"
# Key of the user-defined spec metadata entry holding the same JSON text in every package.
EMBEDDED_METADATA_KEY = "museflash.metadata"
# `source.checkpoint` of an export of a built-in pair: "builtin:<name>". `demo` is the trained
# pair under demo/ (training/train_demo.py, with the DFlash v1 drafter), `demo-dflash2` the same
# target with its trained DFlash2 drafter, `tiny` the random 0.8 MB pair the tests export,
# `tiny-dflash2` the same target with a random DFlash2 drafter in z-lab's layout, and
# `tiny-massive` / `tiny-dflash2-massive` those pairs with planted massive activations (residual
# channels past 2^15 on their <bos> and delimiter tokens, as real LLMs carry: docs/fp16.md);
# `tiny-muted` carries one channel near 4e4 on every token that its final norm mutes while it
# lifts the small ones (fp16's precision, not its range, is at stake); `tiny-muted-attention`
# the same with the channel grown by attention, whose values depend on the states attended to;
# `tiny-small-channels` a channel of 1e3 to 3e4 that every later norm mutes, beside channels
# near 1e-4 that the norms lift (the audit folds their weights into the factor).
# `tiny-qwen3` / `tiny-llama`: random Qwen3 and Llama 3.1 targets written by transformers'
# save_pretrained, each with a z-lab-shaped DFlash drafter (hf_tiny_pairs.py).
BUILTIN_PREFIX = "builtin:"
BUILTIN_PAIRS = ("smollm2", "demo", "demo-dflash2", "tiny", "tiny-dflash2", "tiny-massive",
                 "tiny-dflash2-massive", "tiny-muted", "tiny-muted-attention",
                 "tiny-small-channels", "tiny-qwen3", "tiny-llama")


def builtin_source(pair: str) -> str:
    """The `source.checkpoint` an export of the built-in pair `pair` records."""
    return BUILTIN_PREFIX + pair


def builtin_pair(checkpoint: str) -> str | None:
    """The built-in pair a `source.checkpoint` value names; None when it is a directory."""
    return checkpoint[len(BUILTIN_PREFIX):] if checkpoint.startswith(BUILTIN_PREFIX) else None


COMPUTE_PRECISION = "float16"
STATE_DTYPE = "float16"

# Inside a .mlpackage.
# Tokenizer files (Hugging Face layout) copied from the target checkpoint when present.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")

PACKAGE_SUFFIX = ".mlpackage"
PACKAGE_DATA_DIR = Path("Data") / "com.apple.CoreML"
PACKAGE_SPEC = PACKAGE_DATA_DIR / "model.mlmodel"
PACKAGE_WEIGHTS_DIR = PACKAGE_DATA_DIR / "weights"
PACKAGE_WEIGHT_FILE = PACKAGE_WEIGHTS_DIR / "weight.bin"


class BundleError(ValueError):
    """An export directory or its metadata does not follow the contract; says where and why."""


# --- Names -------------------------------------------------------------------------------------


class Name(enum.StrEnum):
    """A closed set of contract names; the value is the spelling in the bundle."""


class AssetRole(Name):
    """Keys of `assets`; the package is `<role>.mlpackage`."""
    TARGET = "target"
    DFLASH_DRAFTER = "dflash_drafter"
    RING_DRAFTER = "ring_drafter"

    @property
    def package(self) -> str:
        return self.value + PACKAGE_SUFFIX


class AssetKind(Name):
    FUSED_TARGET = "fused_target"  # logits + drafter_features
    TARGET = "target"  # logits only
    DFLASH_DRAFTER = "dflash_drafter"
    RING_DRAFTER = "ring_drafter"


class FunctionName(Name):
    MAIN = "main"
    PREFILL = "prefill"
    INJECT_KV = "inject_kv"
    DRAFT = "draft"
    # The target's one-token copy of a multi-token `main`; listed under `Asset.decode`, never
    # under `functions`, so that readers which predate it ignore it (docs/buckets.md).
    DECODE = "decode"
    # The target's verify of a token tree; listed under `Asset.tree` (and a bucket's `tree`),
    # likewise (docs/trees.md).
    TREE = "tree"


class FunctionRole(Name):
    DECODE = "decode"  # target main and decode (one step or a verify block), ring drafter main
    PREFILL = "prefill"  # writes caches for a prompt chunk, logits of its last position only
    INJECT_KV = "inject_kv"  # DFlash: target features -> drafter cache
    DRAFT = "draft"  # DFlash: [anchor, mask x (K-1)] -> logits (DFlash2: and draft_tokens)
    # target: N tree nodes, each attending to the cache and to its ancestors (tree_mask); node
    # i is written at position_ids[0] + i, its RoPE position is position_ids[i]
    TREE = "tree"


class InputName(Name):
    INPUT_IDS = "input_ids"
    POSITION_IDS = "position_ids"
    FEATURES = "features"
    TREE_MASK = "tree_mask"  # `tree`: [N, N] int32, 1 where node i sees node j (j = i or above)


class OutputName(Name):
    LOGITS = "logits"
    DRAFTER_FEATURES = "drafter_features"
    LAST_INJECTED_POSITION = "last_injected_position"
    DRAFT_TOKENS = "draft_tokens"  # DFlash2 `draft`: the selector's greedy path, [1, K-1]


class StateName(Name):
    GLOBAL_KEY_CACHE = "globalKeyCache"
    GLOBAL_VALUE_CACHE = "globalValueCache"
    SLIDING_KEY_CACHE = "slidingKeyCache"  # target sliding layers; ring drafter
    SLIDING_VALUE_CACHE = "slidingValueCache"
    DRAFTER_KEY_CACHE = "drafterKeyCache"  # DFlash drafter (schema 3: shares the target's package)
    DRAFTER_VALUE_CACHE = "drafterValueCache"

    @property
    def kind(self) -> StateKind:
        return StateKind.GLOBAL_KV if self.value.startswith("global") else StateKind.SLIDING_KV

    @property
    def role(self) -> StateRole:
        return StateRole.KEY if "Key" in self.value else StateRole.VALUE


class StateKind(Name):
    GLOBAL_KV = "global_kv"  # absolute position p in slot p
    SLIDING_KV = "sliding_kv"  # a ring: absolute position p in slot p % capacity


class StateRole(Name):
    KEY = "key"
    VALUE = "value"


class DrafterKind(Name):
    DFLASH = "dflash"
    DFLASH2 = "dflash2"  # DFlash's contract, plus `draft_tokens` from its candidate selector
    RING = "ring"


class SelectorDecoding(Name):
    GREEDY = "greedy"  # the only one exported; sampling draws from the `logits` rows instead


class LayerType(Name):
    SLIDING_ATTENTION = "sliding_attention"
    FULL_ATTENTION = "full_attention"


# The target's states: one key/value pair per layer kind, [layers of that kind, kv_heads,
# capacity, head_dim]. A target has the pair of each kind it has layers of, and only those: a
# kind without layers has no states (never a state of zero layers, which Core ML cannot hold).
# So a target whose layers are all full attention (Qwen3, Llama) has exactly globalKeyCache and
# globalValueCache, and its `target.sliding_window` is 0. `target_states` is the rule; both
# readers derive the expected names from `target.layer_types` the same way. Not a schema bump:
# no field is added, removed or newly required, each state keeps its meaning, and every bundle
# written before (both kinds present) has the same four states under the rule.
TARGET_STATES = (StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE,
                 StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE)
TARGET_STATES_BY_LAYER_TYPE = {
    LayerType.FULL_ATTENTION: (StateName.GLOBAL_KEY_CACHE, StateName.GLOBAL_VALUE_CACHE),
    LayerType.SLIDING_ATTENTION: (StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE),
}
# Written as `target.sliding_window` by a target without sliding layers.
NO_SLIDING_WINDOW = 0
DRAFTER_STATES = (StateName.DRAFTER_KEY_CACHE, StateName.DRAFTER_VALUE_CACHE)
RING_DRAFTER_STATES = (StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE)
INT32_OUTPUTS = frozenset({OutputName.LAST_INJECTED_POSITION, OutputName.DRAFT_TOKENS})


def target_states(layer_types: list[str] | list[LayerType]) -> tuple[StateName, ...]:
    """The target's states for these `layer_types`, in TARGET_STATES order: the pair of each
    layer kind present (a target of full-attention layers only: the global pair)."""
    present = {LayerType(t) for t in layer_types}
    return tuple(name for kind, names in TARGET_STATES_BY_LAYER_TYPE.items()
                 if kind in present for name in names)


def _doc(text: str, **kwargs: Any) -> Any:
    return field(metadata={"doc": text}, **kwargs)


# --- metadata.json ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generator:
    name: str = _doc("always `museflash`")
    version: str = _doc("the exporter's version")


@dataclass(frozen=True)
class TargetSettings:
    """The target's structural settings, from its config.json."""
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int = _doc("window of the sliding layers; 0 when the target has none")
    layer_types: list[LayerType] = _doc("one per layer; the target's states are the key/value "
                                        "pair of each kind listed here, and only those")
    final_logit_softcapping: float | None = _doc("tanh soft cap of the logits, or null")


@dataclass(frozen=True)
class Function:
    role: FunctionRole
    query_length: int = _doc("fixed number of tokens (or feature rows) per call")
    inputs: list[InputName] = _doc("input names, in order")
    outputs: list[OutputName] = _doc("output names, in order")


@dataclass(frozen=True)
class State:
    """A Core ML state shared by every function of its package."""
    name: StateName
    kind: StateKind
    role: StateRole
    shape: list[int] = _doc("exact Core ML state shape: [layers, kv_heads, capacity, head_dim], "
                            "optionally preceded by 1s")
    dtype: str = _doc("always `float16`")
    layers: int
    kv_heads: int
    capacity: int = _doc("slots; a sliding cache holds position p in slot p % capacity")
    head_dim: int


@dataclass(frozen=True)
class ContextBucket:
    """Functions that attend to the global caches' first `context` slots only and write only
    there (docs/buckets.md): a call whose last position is below `context` may run one of them
    instead of the function of the same name over the whole capacity, with the same result."""
    context: int = _doc("slots [0, context) of the context-sized KV caches (the target's global "
                        "ones, a full-attention drafter's ring) these functions read and write; "
                        "a multiple of 32 below the capacity")
    functions: dict[FunctionName, Function] = _doc(
        "a subset of the asset's own functions, with their query lengths; the Core ML function "
        "is named `<name>_<context>` (bucket_function_name)")
    tree: Function | None = field(
        default=None, metadata={"doc": "the asset's `tree` in this bucket (`tree_<context>`); "
                                       "absent when the asset has none",
                                "omit_null": True})

    @property
    def all_functions(self) -> dict[FunctionName, Function]:
        """`functions`, and `tree` when there is one."""
        return self.functions | ({FunctionName.TREE: self.tree} if self.tree else {})


def bucket_function_name(function: FunctionName, context: int) -> str:
    """The Core ML name of `function` in the context bucket of `context` slots."""
    return f"{function}_{context}"


@dataclass(frozen=True)
class FunctionEntry:
    """One row of an asset's function table (Asset.function_table): a Core ML function of its
    package, what it computes, and the global cache slots it attends to."""
    name: str  # the Core ML function name
    function: FunctionName
    context: int | None  # its bucket's slots; None: the whole capacity
    spec: Function


@dataclass(frozen=True)
class Asset:
    """A role's functions and states. Assets may share a package (schema 3: the target and the
    DFlash drafter); the package then has exactly the union of their function tables."""
    path: str = _doc("package path relative to the export directory; the fused target and the "
                     "DFlash drafter name the same one")
    kind: AssetKind
    default_function: FunctionName = _doc("one of this asset's functions; the package's default "
                                          "function is its owner's (the first role naming it)")
    functions: dict[FunctionName, Function] = _doc("the functions over the whole capacity")
    states: list[State]
    buckets: list[ContextBucket] | None = field(
        default=None, metadata={"doc": "smaller context buckets, ascending, each with its own "
                                       "copies of some functions; absent (not null) when the "
                                       "asset has none", "omit_null": True})
    decode: Function | None = field(
        default=None, metadata={"doc": "the target's one-token copy of a multi-token `main`, "
                                       "for steps that decode with the target alone: the Core "
                                       "ML function `decode` (and `decode_<context>` in each "
                                       "bucket listing it); absent when there is none",
                                "omit_null": True})
    tree: Function | None = field(
        default=None, metadata={"doc": "the target's verify of a token tree of `query_length` "
                                       "nodes (docs/trees.md): main's inputs and `tree_mask`, "
                                       "main's outputs; the Core ML function `tree` (and "
                                       "`tree_<context>` in each bucket with a `tree`); absent "
                                       "when there is none", "omit_null": True})

    def __post_init__(self) -> None:
        # A bucket lists `decode` among its functions (buckets came with it); `tree` came
        # later, so a bucket's is under its own key too.
        for name in (FunctionName.DECODE, FunctionName.TREE):
            if name in self.functions or (name == FunctionName.TREE and any(
                    name in b.functions for b in self.buckets or ())):
                raise BundleError(f"the {self.kind} asset lists `{name}` among functions; it "
                                  f"belongs under the asset's `{name}` key, which older "
                                  "readers ignore")
        main = self.functions.get(FunctionName.MAIN)
        if self.decode is not None and (main is None or self.decode != dataclasses.replace(
                main, query_length=1)):
            raise BundleError(f"the {self.kind} asset's decode is not a one-token copy of its "
                              f"main: {self.decode} against {main}")
        if self.tree is not None and (main is None or self.tree != Function(
                role=FunctionRole.TREE, query_length=self.tree.query_length,
                inputs=main.inputs + [InputName.TREE_MASK], outputs=main.outputs)
                or self.tree.query_length < 2):
            raise BundleError(f"the {self.kind} asset's tree is not main's verify with a "
                              f"tree_mask over 2 or more nodes: {self.tree} against {main}")
        contexts = [b.context for b in self.buckets or ()]
        if contexts != sorted(set(contexts)):
            raise BundleError(f"the {self.kind} asset's bucket contexts {contexts} are not "
                              "strictly ascending")
        capacity = self.context_capacity
        for bucket in self.buckets or ():
            if capacity is None or not 0 < bucket.context < capacity:
                raise BundleError(f"the {self.kind} asset's bucket of {bucket.context} slots is "
                                  f"not inside its context-sized caches' capacity ({capacity})")
            for name, function in bucket.all_functions.items():
                if self.own_functions.get(name) != function:
                    raise BundleError(
                        f"the {self.kind} asset's bucket of {bucket.context} slots has a "
                        f"function {name!s} that differs from (or is missing among) its own")

    @property
    def own_functions(self) -> dict[FunctionName, Function]:
        """The functions over the whole capacity: `functions`, and `decode` and `tree` when
        there are."""
        return (self.functions | ({FunctionName.DECODE: self.decode} if self.decode else {})
                | ({FunctionName.TREE: self.tree} if self.tree else {}))

    def function(self, name: FunctionName) -> Function:
        functions = self.own_functions
        if name not in functions:
            raise BundleError(f"the {self.kind} package has no function {name!s} "
                              f"(functions: {sorted(str(f) for f in functions)})")
        return functions[name]

    def capacity(self, kind: StateKind) -> int | None:
        """Slots of this package's states of `kind` (None when it has none)."""
        return next((s.capacity for s in self.states if s.kind == kind), None)

    @property
    def context_capacity(self) -> int | None:
        """Slots of the asset's largest states: the target's global caches, a full-attention
        drafter's ring (as long as the context). What a context bucket slices."""
        return max((s.capacity for s in self.states), default=None)

    def function_table(self) -> list[FunctionEntry]:
        """Every Core ML function of this asset: each bucket's, smallest bucket first, then
        those over the whole capacity. The one table the exporter, the engines, check-contract
        and the tests read (docs/buckets.md)."""
        rows = [FunctionEntry(bucket_function_name(name, bucket.context), name, bucket.context,
                              function)
                for bucket in self.buckets or ()
                for name, function in bucket.all_functions.items()]
        return rows + [FunctionEntry(str(name), name, None, function)
                       for name, function in self.own_functions.items()]

    def pick(self, name: FunctionName, last_position: int) -> FunctionEntry:
        """The function `name` of the smallest bucket that holds `last_position` (the call's
        last position), or the one over the whole capacity. A position past a bucketed asset's
        context-sized caches is refused: no function holds it. (An asset without buckets
        leaves positions to its ring arithmetic: a sliding ring holds any.)"""
        capacity = self.context_capacity
        if self.buckets and capacity is not None and last_position >= capacity:
            raise BundleError(f"position {last_position} is past the {capacity} slots of the "
                              f"{self.kind} package's caches; re-export with a larger "
                              "--max-context-length, or start a new conversation")
        fitting = (row for row in self.function_table()
                   if row.function == name and (row.context is None
                                                or last_position < row.context))
        row = next(fitting, None)
        if row is None:
            self.function(name)  # raises: the asset has no such function
        return row


@dataclass(frozen=True)
class DrafterSettings:
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int


@dataclass(frozen=True)
class DFlash2Settings:
    """What a DFlash2 drafter adds to DFlash (docs/dflash2.md); `draft` applies all of it."""
    conv_kernel_size: int = _doc("taps of the grouped dynamic causal convolutions over the block")
    conv_group_size: int = _doc("channels sharing one dynamic kernel weight; divides "
                                "drafter_hidden_size")
    selector_rank: int = _doc("width of the candidate selector's codebooks")
    selector_top_k: int = _doc("candidates the selector scores per drafted position")
    selector_decoding: SelectorDecoding = _doc("how `draft_tokens` is chosen")
    output_multiplier: float = _doc("scale of the draft logits before the soft cap")
    final_logit_softcapping: float | None = _doc("the drafter's own soft cap of its logits, "
                                                 "or null")


@dataclass(frozen=True)
class SpeculativeDecoding:
    drafter_kind: DrafterKind
    block_size: int = _doc("the exported block, anchor + drafted tokens (num_draft_tokens + 1): "
                          "the query length of `draft`, `inject_kv` and `main`")
    mask_token_id: int = _doc("token filling the drafted positions of a `draft` call; inside "
                              "[0, vocab_size)")
    target_layer_ids: list[int] = _doc("0-based target layers feeding the drafter's encoder")
    drafter_hidden_size: int = _doc("width of `drafter_features`")
    num_draft_tokens: int = _doc("tokens drafted per step, block_size - 1; a runtime may "
                                "propose fewer")
    shared_embeddings: bool = _doc("the drafter uses the target's embedding and lm_head")
    drafter: DrafterSettings
    dflash2: DFlash2Settings | None = _doc("drafter_kind dflash2 only, else null", default=None)


@dataclass(frozen=True)
class Source:
    checkpoint: str = _doc("absolute path of the target checkpoint, or `builtin:demo` / "
                           "`builtin:tiny` for a built-in pair")
    drafter_checkpoint: str | None = _doc("the drafter checkpoint, likewise; null without one")


@dataclass(frozen=True)
class Tokenizer:
    """The target checkpoint's tokenizer, copied into the export (Hugging Face layout)."""
    files: list[str] = _doc("relative to the export directory; `tokenizer.json` first")
    vocab_size: int = _doc("ids the tokenizer can produce, added tokens included: 0 to "
                           "vocab_size - 1. At most the bundle's vocab_size; the embedding "
                           "rows past it are padding no text encodes to")
    special_tokens: dict[str, int] = _doc("special token text -> id (the drafter's "
                                          "mask_token_id is one of them)")
    end_of_turn_ids: list[int] | None = _doc(
        "ids that end a reply: generation_config.json's eos_token_id, the tokenizer's "
        "eos_token, and the special token the chat template writes after an assistant message; "
        "null in bundles written before it existed", default=None)


class CompressionPreset(Name):
    """`--compression` presets (docs/compression.md); `none` writes no compression block."""
    EIGHT_BIT = "8bit"
    FOUR_BIT = "4bit"
    PALETTIZE_FOUR = "palettize4"


class CompressionMode(Name):
    LINEAR = "linear"  # constexpr_blockwise_shift_scale: symmetric integers x fp16 scales
    # constexpr_blockwise_shift_scale with an offset: (unsigned integers - fp16 offsets) x fp16
    # scales, each block over its own minimum to maximum (llama.cpp's Q4_1 blocks)
    AFFINE = "affine"
    PALETTIZE = "palettize"  # constexpr_lut_to_dense: indices into fp16 look-up tables
    NONE = "none"  # fp16 (a rule only)


# The Core ML op that rebuilds a weight of each mode on device, and its inputs: the data, then
# the fp16 side tensors (scale; scale and offset, each of the scale's shape; look-up table).
# linear and affine share an op: an affine op is the one with an offset.
COMPRESSION_OPS = {
    CompressionMode.LINEAR: ("constexpr_blockwise_shift_scale", "data", "scale"),
    CompressionMode.AFFINE: ("constexpr_blockwise_shift_scale", "data", "scale", "offset"),
    CompressionMode.PALETTIZE: ("constexpr_lut_to_dense", "indices", "lut"),
}


@dataclass(frozen=True)
class CompressionRule:
    """One rule: the first rule whose `match` fits a checkpoint tensor's name decides it."""
    match: str = _doc("fnmatch glob over checkpoint tensor names")
    mode: CompressionMode
    bits: int | None = _doc("4 or 8; null for mode none")
    block_size: int | None = _doc("linear, affine: elements per scale along the input axis; "
                                  "null: one scale per output channel")
    group_size: int | None = _doc("palettize: output channels sharing one look-up table")


@dataclass(frozen=True)
class StoredCount:
    tensors: int
    bytes: int = _doc("payload bytes in the package's weight file: data plus fp16 scales "
                      "(and offsets) or look-up tables")


@dataclass(frozen=True)
class CompressedGroup:
    """The weights one rule compressed alike, and what storing them costs."""
    rule: int = _doc("index in `rules` of the rule these weights matched")
    mode: CompressionMode = _doc("linear, affine or palettize")
    bits: int = _doc("bits per stored element: int4/int8 data (linear), uint4/uint8 data "
                     "(affine), uint4/uint8 indices (palettize)")
    block_size: int | None = _doc("linear, affine: elements per fp16 scale (and offset) along "
                                  "the input axis (scale shape [O, I / block_size]); null: per "
                                  "output channel (scale shape [O, 1])")
    group_size: int | None = _doc("palettize: output channels per look-up table (lut shape "
                                  "[O / group_size, 1, 2^bits, 1])")
    tensors: int = _doc("unique checkpoint weights in the group")
    bytes_before: int = _doc("their size in fp16")
    bytes_after: int = _doc("their size as stored (each counted once)")
    packages: dict[AssetRole, StoredCount] = _doc("what each package stores of them")


@dataclass(frozen=True)
class Compression:
    """How the weights are stored when not all fp16 (docs/compression.md)."""
    preset: CompressionPreset | None = _doc("null for rules from --compression-config")
    rules: list[CompressionRule]
    groups: list[CompressedGroup]
    fp16_tensors: int = _doc("streamed weights no rule compressed, kept fp16")
    fp16_bytes: int
    min_compressible_elements: int | None = _doc(
        "a weight is compressed only when it is 2-D with at least this many elements; smaller "
        "ones stay fp16 whatever the rules (null when the exporter did not record it)")


class NormForm(Name):
    """How the bundle's RMSNorms are written (docs/fp16.md)."""
    MAX_ABS = "max_abs"  # the row divided by max(max|x|, 1) first: finite in fp16 for any input
    PLAIN = "plain"  # x * rsqrt(mean(x^2) + eps): x^2 overflows fp16 above |x| = 256


class KVWrite(Name):
    """How `main` and `prefill` write the new keys and values of the target's global layers
    (docs/kv-write.md). The sliding rings and the drafter's ring are written by the blend in
    every strategy: there it costs O(window), not O(context)."""
    BLEND = "blend"  # one-hot blend over the whole layer cache: O(capacity) per call
    SLICE = "slice"  # one slice_update at the runtime position: O(query length) per call


@dataclass(frozen=True)
class LayerPeaks:
    """Peaks of one layer's activations in the fp32 range audit, before any residual scale."""
    layer: int
    residual: float = _doc("peak |x| of the residual stream inside and after the layer")
    norm_input: float = _doc("peak |x| entering any of the layer's norms")
    matmul_input: float = _doc("peak |x| entering any of the layer's projections")
    matmul_output: float = _doc("peak |x| leaving any of the layer's projections")


@dataclass(frozen=True)
class NormFold:
    """A target norm written x * (f * w) rather than (x * f) * w: beside a massive channel the
    normalised value x * f of a small one is an fp16 subnormal of a few bits, which a large
    weight then multiplies (docs/fp16.md)."""
    norm: str = _doc("the norm's module path in the target, e.g. `norm` or "
                     "`layers.3.input_layernorm`")
    unfolded_error: float = _doc("largest relative error of its output on a calibration row, "
                                 "its last two products simulated in fp16 as (x * f) * w")
    folded_error: float = _doc("the same as x * (f * w)")
    fold_bound: float = _doc("bound on |f * w| from the smallest rms seen and max |w|; below "
                             "2^15")


@dataclass(frozen=True)
class Fp16Range:
    """The export's fp16 range audit: the checkpoint run in fp32 eager on calibration
    sequences before conversion, and the residual scales chosen from it (docs/fp16.md)."""
    norm: NormForm
    calibration: str = _doc("`builtin`, or the file name given with --calibration-prompts")
    sequences: int
    tokens: int = _doc("tokens per sequence")
    target_residual_scale: float = _doc("power of two multiplying the target's residual "
                                        "stream in the bundle; 1 when the audit needed none")
    drafter_residual_scale: float | None = _doc("the same for the drafter's stream; null "
                                                "without a drafter")
    peak_after_scaling: float = _doc("largest audited |x| anywhere once the scales apply; "
                                     "below 2^15")
    drafter_feature_input: float | None = _doc("peak |x| of the target layer outputs the "
                                               "drafter's encoder reads; null without one")
    peak_tokens: list[int] = _doc("token ids whose residual peaks were the largest, largest "
                                  "first: what verify feeds")
    bos_token_id: int | None = _doc("the <bos> that led each calibration sequence, or null")
    target_layers: list[LayerPeaks]
    drafter_layers: list[LayerPeaks]
    folded_norms: list[NormFold] | None = field(
        default=None, metadata={"doc": "target norms written x * (f * w); absent (not null) "
                                       "when none is, so such a bundle's bytes are as before",
                                "omit_null": True})


@dataclass(frozen=True)
class SelfCheck:
    """The export's self-check: the converted target's `prefill` and `main` run in the numpy
    interpreter on calibration tokens against fp32 eager before publishing (docs/fp16.md)."""
    checked: bool = _doc("false with --no-self-check, or when the target was too large")
    reason: str | None = _doc("why it was not checked; null when it was", default=None)
    functions: list[str] = _doc("the functions run", default_factory=list)
    tokens: int = _doc("tokens fed through them", default=0)
    output_rel: float | None = _doc("largest relative error of an output", default=None)
    state_rel: float | None = _doc("largest relative error of a written cache", default=None)


@dataclass(frozen=True)
class Metadata:
    """`metadata.json`: the bundle's description for the app that loads it."""
    schema_version: int = _doc("major version of this contract; readers reject one they do not "
                               "know")
    generator: Generator
    model_name: str
    vocab_size: int = _doc("target vocabulary; drafter logits have the same width")
    context_length: int = _doc("capacity of the global KV caches")
    compute_precision: str = _doc("always `float16`")
    target: TargetSettings
    assets: dict[AssetRole, Asset]
    speculative_decoding: SpeculativeDecoding | None = _doc("null without a drafter")
    source: Source
    tokenizer: Tokenizer | None = _doc("null when the target checkpoint has no tokenizer.json")
    compression: Compression | None = _doc("null when every weight is fp16")
    fp16_range: Fp16Range | None = _doc("the fp16 range audit; null in bundles written "
                                        "before it existed", default=None)
    kv_write: KVWrite | None = _doc("how `main` and `prefill` write the global KV caches; "
                                    "null (bundles written before it existed) is `blend`",
                                    default=None)
    self_check: SelfCheck | None = _doc("the export's self-check; null in bundles written "
                                        "before it existed", default=None)

    def asset(self, role: AssetRole) -> Asset:
        if role not in self.assets:
            raise BundleError(f"the bundle has no {role!s} asset (assets: "
                              f"{sorted(str(r) for r in self.assets)})")
        return self.assets[role]

    @property
    def drafter_role(self) -> AssetRole | None:
        kind = self.speculative_decoding.drafter_kind if self.speculative_decoding else None
        return {DrafterKind.DFLASH: AssetRole.DFLASH_DRAFTER,
                DrafterKind.DFLASH2: AssetRole.DFLASH_DRAFTER,
                DrafterKind.RING: AssetRole.RING_DRAFTER}.get(kind)

    def package_owners(self) -> dict[str, AssetRole]:
        """Package path -> the role that owns it: the first asset, in AssetRole order, whose
        path names it. Its default function is the package's; compression counts are its."""
        owners: dict[str, AssetRole] = {}
        for role in AssetRole:
            if role in self.assets:
                owners.setdefault(self.assets[role].path, role)
        return owners

    @property
    def kv_write_strategy(self) -> KVWrite:
        return self.kv_write or KVWrite.BLEND

    def context_buckets(self, role: AssetRole = AssetRole.TARGET) -> list[int]:
        """The contexts of `role`'s functions, ascending, the whole capacity last."""
        asset = self.asset(role)
        return [b.context for b in asset.buckets or ()] + [self.context_length]

    def max_query_length(self) -> int:
        return max(f.query_length for a in self.assets.values() for f in a.functions.values())

    # --- JSON ---

    def to_json(self) -> dict[str, Any]:
        return _encode(self)

    def dumps(self) -> str:
        """The text of metadata.json (and of the embedded copy)."""
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, raw: Any) -> Metadata:
        if not isinstance(raw, dict):
            raise BundleError(f"metadata: expected an object, got {_json_type(raw)}")
        version = raw.get("schema_version")
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise BundleError(
                f"metadata: schema_version {version!r} is not supported (this reader knows "
                f"{list(SUPPORTED_SCHEMA_VERSIONS)}); re-export with this museflash or update it")
        return _decode(cls, raw, "metadata")

    @classmethod
    def read(cls, export_dir: str | Path) -> Metadata:
        path = Path(export_dir) / METADATA_FILE
        if not path.is_file():
            raise BundleError(f"{path} not found; point at a directory written by //:export")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BundleError(f"{path} is not valid JSON ({error})") from error
        try:
            return cls.from_json(raw)
        except BundleError as error:
            raise BundleError(f"{path}: {error}") from error


# --- Encoding and decoding, driven by the type hints -----------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit_null") and getattr(value, f.name) is None)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(_encode(k)): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _optional(hint: Any) -> Any | None:
    """X for `X | None`, else None."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(others) == 1:
            return others[0]
    return None


def _decode(hint: Any, raw: Any, where: str) -> Any:
    inner = _optional(hint)
    if inner is not None:
        return None if raw is None else _decode(inner, raw, where)
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(raw, dict):
            raise BundleError(f"{where}: expected an object, got {_json_type(raw)}")
        hints = _hints(hint)
        values = {}
        for f in dataclasses.fields(hint):
            if f.name not in raw and _optional(hints[f.name]) is None:
                raise BundleError(f"{where}: missing key {f.name!r}")
            values[f.name] = _decode(hints[f.name], raw.get(f.name), f"{where}.{f.name}")
        return hint(**values)  # keys this reader does not know are ignored
    if origin is list:
        if not isinstance(raw, list):
            raise BundleError(f"{where}: expected an array, got {_json_type(raw)}")
        (item,) = typing.get_args(hint)
        return [_decode(item, v, f"{where}[{i}]") for i, v in enumerate(raw)]
    if origin is dict:
        if not isinstance(raw, dict):
            raise BundleError(f"{where}: expected an object, got {_json_type(raw)}")
        key_type, value_type = typing.get_args(hint)
        return {_decode(key_type, k, f"{where} key"): _decode(value_type, v, f"{where}.{k}")
                for k, v in raw.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            raise BundleError(f"{where}: {raw!r} is not one of "
                              f"{[m.value for m in hint]}") from None
    if hint is bool:
        if not isinstance(raw, bool):
            raise BundleError(f"{where}: expected a boolean, got {_json_type(raw)}")
        return raw
    if hint is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise BundleError(f"{where}: expected an integer, got {_json_type(raw)}")
        return raw
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise BundleError(f"{where}: expected a number, got {_json_type(raw)}")
        return float(raw)
    if hint is str:
        if not isinstance(raw, str):
            raise BundleError(f"{where}: expected a string, got {_json_type(raw)}")
        return raw
    raise TypeError(f"{where}: no JSON mapping for {hint!r}")


# --- JSON Schema ---------------------------------------------------------------------------------

SCHEMA_ID = "https://museflash.invalid/metadata.schema.json"


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of metadata.json, generated from the types above."""
    definitions: dict[str, Any] = {}
    root = _schema_of(Metadata, definitions)
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "museflash metadata.json",
    }
    schema.update(definitions.pop(root["$ref"].rsplit("/", 1)[1]))
    schema["description"] = (
        f"{schema['description']} Generated from python/museflash/bundle.py: do not edit. "
        "Compatibility: schema_version is the major version and readers reject one they do "
        "not know; within a version fields may be added and readers ignore object keys they "
        "do not know (additionalProperties is true); enumerated names are closed; optional values "
        "are written as null and may also be absent.")
    schema["properties"]["schema_version"] = {
        "description": schema["properties"]["schema_version"]["description"],
        "enum": list(SUPPORTED_SCHEMA_VERSIONS)}
    schema["$defs"] = dict(sorted(definitions.items()))
    return schema


def _schema_of(hint: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    inner = _optional(hint)
    if inner is not None:
        return {"anyOf": [_schema_of(inner, definitions), {"type": "null"}]}
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        name = hint.__name__
        if name not in definitions:
            definitions[name] = {}  # reserve (recursion guard)
            hints = _hints(hint)
            properties = {}
            for f in dataclasses.fields(hint):
                entry = _schema_of(hints[f.name], definitions)
                if f.metadata.get("doc"):
                    entry = {"description": f.metadata["doc"], **entry}
                properties[f.name] = entry
            definition = {"type": "object"}
            if hint.__doc__ and not hint.__doc__.startswith(f"{name}("):
                definition["description"] = " ".join(hint.__doc__.split())
            definition.update({
                "properties": properties,
                "required": [f.name for f in dataclasses.fields(hint)
                             if _optional(hints[f.name]) is None],
                "additionalProperties": True,
            })
            definitions[name] = definition
        return {"$ref": f"#/$defs/{name}"}
    if origin is list:
        (item,) = typing.get_args(hint)
        return {"type": "array", "items": _schema_of(item, definitions)}
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        entry = {"type": "object", "additionalProperties": _schema_of(value_type, definitions)}
        if isinstance(key_type, type) and issubclass(key_type, enum.Enum):
            entry["propertyNames"] = {"enum": [m.value for m in key_type]}
        return entry
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [m.value for m in hint]}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if hint in simple:
        return {"type": simple[hint]}
    raise TypeError(f"no JSON Schema for {hint!r}")


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"


def schema_errors(raw: Any) -> list[str]:
    """Where `raw` breaks the JSON Schema, one line each (empty when it conforms)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(json_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
            for e in errors]
