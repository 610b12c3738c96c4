"""Load (and write) Muse Glimmer and DFlash checkpoints in the Hugging Face safetensors layout.

Loading builds the model on the `meta` device and assigns one tensor at a time, read through
safetensors memory maps and converted to the compute dtype in a single step, so peak memory is
the final model plus about one tensor. Every problem raises CheckpointError naming the file,
the key and both values. Pickle files are never read.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from museflash.bundle import TOKENIZER_FILE, TOKENIZER_FILES, DrafterKind, LayerType, Tokenizer
from museflash.compression import Rule, Scheme, compress, expand, plan_compression
from museflash.models.base import RotaryTables
from museflash.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DrafterTargetMismatchError,
    validate_drafter_against_target,
)
from museflash.models.dflash2 import DFlash2Config, DFlash2Drafter
from museflash.models.muse_glimmer import (
    MuseGlimmerConfig,
    MuseGlimmerForCausalLM,
    MuseGlimmerWithDrafterFeatures,
)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message says which file and key, and why."""


class WeightValueError(CheckpointError):
    """A tensor holds values an fp16 package cannot: NaN, inf, or beyond fp16's range."""


# --- Values an fp16 package can hold --------------------------------------------------------
# Every exported weight is fp16 on device (stored so, or rebuilt so by a constexpr op). A NaN or
# inf there turns every logit NaN; a bf16 or fp32 value beyond fp16's range becomes inf. The
# export refuses both (`unholdable` on each slice it streams).

FP16_MAX = 65504.0
# The smallest magnitude fp16 rounds to inf (round to nearest even): what it cannot hold. A
# value between FP16_MAX and this rounds to FP16_MAX, an ordinary rounding error.
FP16_OVERFLOW = 65520.0
# Bit patterns from which on a value is refused: read as unsigned integers, those of negative
# values from the lowest refused negative one (-inf and negative NaNs above it); read as signed
# integers, those of positive values from the lowest refused positive one.
_REFUSED_FROM = {np.dtype(np.float16): (np.uint16, 0xFC00, np.int16, 0x7C00),
                 np.dtype(np.float32): (np.uint32, 0xC77FF000, np.int32, 0x477FF000)}


def unholdable(values: np.ndarray) -> bool:
    """Whether `values` (non-empty, contiguous; float16, or float32 read from the checkpoint)
    hold a NaN, an inf or a value fp16 rounds to inf. Two integer maxima over the bit patterns
    (unsigned: the negative values; signed: the positive ones), which vectorize and need no
    temporary array."""
    unsigned, negative, signed, positive = _REFUSED_FROM[values.dtype]
    return bool(values.view(unsigned).max() >= negative or values.view(signed).max() >= positive)


def weight_value_error(path: Path, key: str, slices: Iterable[np.ndarray]) -> WeightValueError:
    """The one-line refusal of tensor `key` of `path`, counted over its values in float32
    (`slices`, read again: only a refused tensor pays for this)."""
    nan = inf = over = 0
    peak = 0.0
    for values in slices:
        values = np.asarray(values, np.float32)
        magnitude = np.abs(values[~np.isnan(values)])
        nan += values.size - magnitude.size
        inf += int(np.isinf(magnitude).sum())
        over += int(((magnitude >= FP16_OVERFLOW) & np.isfinite(magnitude)).sum())
        if magnitude.size:
            peak = max(peak, float(magnitude.max()))
    return WeightValueError(
        f"{path}: tensor {key!r} holds {nan + inf + over} value(s) an fp16 Core ML package "
        f"cannot hold ({nan} NaN, {inf} inf, {over} beyond fp16's {FP16_MAX:.0f}; largest "
        f"magnitude {peak:.6g}), which make the model's outputs inf or NaN on device; repair "
        "or re-download the checkpoint (NaN and inf come from a damaged file or a diverged "
        "fine-tune) or rescale that tensor into fp16's range")


def location_value_error(location: WeightLocation) -> WeightValueError:
    """weight_value_error over a streamed weight, read again a slice of rows at a time."""
    rows = location.shape[0] if location.shape else 1
    row_elements = int(np.prod(location.shape[1:])) if location.shape else 1
    step = max(1, (16 << 20) // (4 * max(1, row_elements)))
    slices = (location.read_rows(start, min(rows, start + step), torch.float32).numpy()
              for start in range(0, rows, step))
    return weight_value_error(location.path, location.key, slices)


# --- Key mapping: module parameter name <-> checkpoint key, for both models -----------------

TARGET_PREFIX = "model.language_model."
TARGET_UNPREFIXED = ("lm_head.",)
# Keys of the multimodal checkpoint that the text decoder does not use.
TARGET_IGNORED_PREFIXES = ("model.vision_", "model.multi_modal_projector.")
DRAFTER_BORROWED = ("embed_tokens.", "lm_head.")  # the target's modules, not in the drafter file
ENCODER_PREFIX = "encoder."


def target_checkpoint_key(param_name: str) -> str:
    if param_name.startswith(TARGET_UNPREFIXED):
        return param_name
    return TARGET_PREFIX + param_name


def drafter_checkpoint_key(param_name: str) -> str | None:
    """None for parameters borrowed from the target."""
    return None if param_name.startswith(DRAFTER_BORROWED) else param_name


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    return DTYPES[dtype]


# --- Reading ---------------------------------------------------------------------------------


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: config file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error


def check_safetensors_file(path: Path) -> dict[str, Any]:
    """Validates the header against the file size (before any mmap) and returns the header."""
    if not path.is_file():
        raise CheckpointError(f"{path}: safetensors file not found")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(
            f"{path}: file is {size} bytes, shorter than the 8-byte safetensors header length"
        )
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: header length field says {header_len} bytes but only {size - 8} bytes "
                "follow it (truncated or not a safetensors file)"
            )
        raw_header = handle.read(header_len)
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: header is not valid JSON ({error})") from error
    data_size = size - 8 - header_len
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        end = entry.get("data_offsets", [0, 0])[1]
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {key!r} ends at data byte {end} but the file holds only "
                f"{data_size} data bytes (truncated)"
            )
    return header


class SafetensorsReader:
    """Key -> tensor access over one file or an index of shards, through memory maps."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_FILE
        single_path = self.directory / SINGLE_FILE
        if index_path.is_file():
            self.description = str(index_path)
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_path}: no valid weight_map ({error})") from error
            files: dict[str, str] = {}
            for key, name in weight_map.items():
                files.setdefault(name, key)
            for name, example_key in files.items():
                if not (self.directory / name).is_file():
                    raise CheckpointError(
                        f"{self.directory / name}: shard listed in {index_path} (e.g. for key "
                        f"{example_key!r}) not found"
                    )
        elif single_path.is_file():
            self.description = str(single_path)
            weight_map = None
        else:
            raise CheckpointError(
                f"{self.directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found"
            )
        self._headers: dict[str, dict[str, Any]] = {}
        self._handles: dict[str, Any] = {}
        if weight_map is None:
            header = self._header(SINGLE_FILE)
            weight_map = {key: SINGLE_FILE for key in header if key != "__metadata__"}
        else:
            for key, name in weight_map.items():
                if key not in self._header(name):
                    raise CheckpointError(
                        f"{self.directory / name}: key {key!r} listed in {index_path} is "
                        "missing from the shard"
                    )
        self.weight_map: dict[str, str] = dict(weight_map)

    def _header(self, name: str) -> dict[str, Any]:
        if name not in self._headers:
            self._headers[name] = check_safetensors_file(self.directory / name)
        return self._headers[name]

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def file_of(self, key: str) -> Path:
        return self.directory / self.weight_map[key]

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self.weight_map:
            raise CheckpointError(f"{self.description}: missing key {key!r}")
        return tuple(self._header(self.weight_map[key])[key]["shape"])

    def read(self, key: str, expected_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = self.shape(key)
        if shape != tuple(expected_shape):
            raise CheckpointError(
                f"{self.file_of(key)}: key {key!r} has shape {list(shape)}, expected "
                f"{list(expected_shape)} from the config"
            )
        name = self.weight_map[key]
        file_dtype = self._headers[name][key]["dtype"]
        if file_dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{self.file_of(key)}: key {key!r} has dtype {file_dtype}, expected one of "
                f"{sorted(_SAFETENSORS_DTYPES)}"
            )
        if name not in self._handles:
            # One shard mapped at a time: the pages of finished shards leave the process.
            self._handles.clear()
            self._handles[name] = safe_open(str(self.directory / name), framework="pt")
        mapped = self._handles[name].get_tensor(key)
        # Own memory in the compute dtype, filled by a single converting copy from the map.
        loaded = torch.empty(shape, dtype=dtype)
        loaded.copy_(mapped)
        return loaded

    def locate(self, key: str) -> WeightLocation:
        """Where the key's bytes sit on disk, for readers that stream instead of mapping."""
        name = self.weight_map[key]
        header = self._header(name)
        entry = header[key]
        with (self.directory / name).open("rb") as handle:
            (data_start,) = struct.unpack("<Q", handle.read(8))  # the header's length
        begin, end = entry["data_offsets"]
        return WeightLocation(self.directory / name, 8 + data_start + begin, end - begin,
                              entry["dtype"], tuple(entry["shape"]), key)

    def close(self) -> None:
        self._handles.clear()


@dataclass(frozen=True)
class WeightLocation:
    path: Path
    offset: int  # absolute, in bytes
    nbytes: int
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]
    key: str

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in `dtype`, through one buffer of its file bytes (no memory map: mapped
        pages would stay resident until the whole shard is unmapped)."""
        return self.read_rows(0, self.shape[0] if self.shape else 0, dtype)

    def read_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, stop) of the tensor (along its first axis) in `dtype`: a large weight
        can be processed a slice at a time."""
        row_bytes = self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes
        first, count = (start * row_bytes, (stop - start) * row_bytes) if self.shape else (
            0, self.nbytes)
        raw = bytearray(count)
        with self.path.open("rb", buffering=0) as handle:
            handle.seek(self.offset + first)
            view = memoryview(raw)
            done = 0
            while done < count:
                read = handle.readinto(view[done:])
                if not read:
                    raise CheckpointError(f"{self.path}: key {self.key!r} is truncated")
                done += read
        shape = (stop - start, *self.shape[1:]) if self.shape else self.shape
        stored = torch.frombuffer(raw, dtype=_SAFETENSORS_DTYPES[self.dtype]).reshape(shape)
        return stored if stored.dtype == dtype else stored.to(dtype)


class PlaceholderWeights:
    """Stand-ins for the large weights, so a model can be traced and converted without them.

    Each placeholder is one random fp16 row broadcast over the weight's shape (a stride-0 view:
    it costs one row of memory however many rows the weight has). The row is derived from the
    weight's file and key alone, so every process that loads the same checkpoint makes the same
    row for the same weight, whatever order it loads in. Rows differ between weights, so
    constant deduplication still merges exactly the uses of the same weight, and the row
    identifies the weight again in the converted package's weight file, so the merge can point
    its const at the real values (written by `export.weights`; `export.merge`)."""

    MIN_ELEMENTS = 4096  # smaller tensors are loaded for real (inline or cheap either way)
    MIN_COLUMNS = 16  # a row this long is unique among the weights with near certainty

    def __init__(self):
        self.by_row: dict[bytes, WeightLocation] = {}
        self.by_pointer: dict[int, bytes] = {}

    @classmethod
    def wants(cls, shape: tuple[int, ...]) -> bool:
        return (len(shape) == 2 and shape[1] >= cls.MIN_COLUMNS
                and shape[0] * shape[1] >= cls.MIN_ELEMENTS)

    def make(self, location: WeightLocation, dtype: torch.dtype) -> torch.Tensor:
        rows, columns = location.shape
        row = torch.randn(columns, generator=_name_seeded(location)).to(dtype)
        key = row.numpy().tobytes()
        known = self.by_row.get(key)
        if known is not None and (known.path, known.key) != (location.path, location.key):
            raise CheckpointError(f"{location.path}: placeholder rows of {known.key!r} and "
                                  f"{location.key!r} coincide; rename one of the tensors")
        self.by_row[key] = location
        self.by_pointer[row.data_ptr()] = key
        return row.expand(rows, columns)

    def row_of(self, tensor: torch.Tensor) -> bytes | None:
        if tensor.dim() != 2 or tensor.stride(0) != 0:
            return None
        return self.by_pointer.get(tensor.data_ptr())


def _name_seeded(location: WeightLocation) -> torch.Generator:
    name = f"{Path(location.path).resolve()}\0{location.key}".encode()
    seed = int.from_bytes(hashlib.sha256(name).digest()[:8], "little")
    return torch.Generator().manual_seed(seed)


def _assign_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))


def _own_parameters(model: nn.Module, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    for name, param in model.named_parameters(remove_duplicate=True):
        if not name.startswith(skip):
            yield name, param


def compressed_value(weight: torch.Tensor, scheme: Scheme, clip: str = "mse") -> torch.Tensor:
    """The weight as a compressed export rebuilds it on device (float32): quantized or
    palettized by `scheme`, exactly as the export's merge writes it, and expanded back.
    `clip="absmax"`: linear blocks scaled by their absolute maximum instead (a baseline)."""
    values = weight.detach().to(torch.float32).numpy()
    rebuilt = expand(*compress(values, scheme, clip), scheme)
    return torch.from_numpy(np.ascontiguousarray(rebuilt, dtype=np.float32))


def streamed_weight(shape: tuple[int, ...]) -> bool:
    """Weights the export streams from the checkpoint into the packages (the only ones it
    can compress)."""
    return PlaceholderWeights.wants(tuple(shape))


def compressed_weights(rules: list[Rule], shapes: Mapping[str, tuple[int, ...]], *,
                       strict: bool) -> dict[str, Scheme]:
    """Checkpoint key -> scheme of each weight `rules` compress (compression.plan_compression)
    among those the export streams: what a compressed export stores compressed."""
    planned = plan_compression(rules, dict(shapes), strict=strict)
    return {key: scheme for key, scheme in planned.items()
            if scheme is not None and streamed_weight(shapes[key])}


def checkpoint_shapes(target_dir: Path, drafter_dir: Path | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of every tensor of both checkpoints (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for directory in (target_dir, drafter_dir):
        if directory is not None:
            reader = SafetensorsReader(directory)
            shapes.update({key: reader.shape(key) for key in reader.keys()})
            reader.close()
    return shapes


def _load_parameters(
    model: nn.Module,
    entries: list[tuple[str, str, SafetensorsReader]],
    dtype: torch.dtype,
    placeholders: PlaceholderWeights | None = None,
    compressed: Mapping[str, Scheme] | None = None,
) -> None:
    """entries: (parameter name, checkpoint key, reader), in module (layer) order. Weights
    named in `compressed` are loaded as a compressed export holds them (compressed_value)."""
    compressed = compressed or {}
    for name, key, reader in entries:
        expected = tuple(model.get_parameter(name).shape)
        if key not in reader:
            raise CheckpointError(f"{reader.description}: missing key {key!r} (for {name})")
        if placeholders is not None and placeholders.wants(expected):
            shape = reader.shape(key)
            if shape != expected:
                raise CheckpointError(
                    f"{reader.file_of(key)}: key {key!r} has shape {list(shape)}, expected "
                    f"{list(expected)} from the config"
                )
            location = reader.locate(key)
            if location.dtype not in _SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"{location.path}: key {key!r} has dtype {location.dtype}, expected one "
                    f"of {sorted(_SAFETENSORS_DTYPES)}"
                )
            _assign_parameter(model, name, placeholders.make(location, dtype))
        elif key in compressed:
            weight = reader.read(key, expected, torch.float32)
            _assign_parameter(model, name, compressed_value(weight, compressed[key]).to(dtype))
        else:
            loaded = reader.read(key, expected, dtype)
            # An export (which has placeholders) writes these into fp16 packages too.
            if (placeholders is not None and loaded.numel() and loaded.is_floating_point()
                    and unholdable(loaded.to(torch.float16).numpy())):
                raise weight_value_error(reader.file_of(key), key,
                                         [reader.read(key, expected, torch.float32).numpy()])
            _assign_parameter(model, name, loaded)


def _build_rotary_tables(model: nn.Module, dtype: torch.dtype) -> None:
    # Built at construction in the default dtype; rebuilt from float64 so the tables are
    # rounded once, straight into the compute dtype.
    for module in model.modules():
        if isinstance(module, RotaryTables):
            module.build(dtype)


def _parse_config(directory: Path, parse, raw: dict[str, Any] | None = None
                  ) -> tuple[dict[str, Any], Any]:
    """(config.json, parse(config.json)); `raw` when the caller has read it already."""
    raw = read_config(directory) if raw is None else raw
    try:
        return raw, parse(raw)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {error}") from error


def _check_unexpected_target_keys(reader: SafetensorsReader, expected: set[str]) -> None:
    unexpected = sorted(
        key
        for key in reader.keys()
        if key not in expected and not key.startswith(TARGET_IGNORED_PREFIXES)
        and (key.startswith(TARGET_PREFIX) or key.startswith(TARGET_UNPREFIXED))
    )
    if unexpected:
        raise CheckpointError(
            f"{reader.description}: unexpected keys {unexpected[:5]} (config.json describes a "
            "different model, e.g. fewer layers)"
        )


# z-lab's DFlashDraftModel layout names the encoder `fc` / `hidden_norm` where the Meta
# assistant checkpoint has `encoder.fc` / `encoder.output_norm_enc` (encoder parameter name ->
# z-lab checkpoint key).
ZLAB_ENCODER_KEYS = {"encoder.fc.weight": "fc.weight",
                     "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def encoder_key(reader: SafetensorsReader, name: str) -> str:
    """The checkpoint key of encoder parameter `name` in the drafter checkpoint's layout."""
    if "encoder.fc.weight" not in reader and "fc.weight" in reader:
        return ZLAB_ENCODER_KEYS.get(name, name)
    return name


def _check_encoder_width(
    drafter_reader: SafetensorsReader, drafter_cfg: DFlashConfig, target_cfg: MuseGlimmerConfig
) -> None:
    key = encoder_key(drafter_reader, "encoder.fc.weight")
    if key != "encoder.fc.weight" and not drafter_cfg.window_per_query:
        raise CheckpointError(
            f"{drafter_reader.description}: z-lab's weight layout (fc, hidden_norm) without "
            "`is_causal: false` in config.json: z-lab's reference then drafts causally, which "
            "this DFlash v1 drafter (bidirectional over the block) does not implement")
    if key not in drafter_reader:
        raise CheckpointError(f"{drafter_reader.description}: missing key {key!r}")
    shape = drafter_reader.shape(key)
    ids = drafter_cfg.target_layer_ids
    expected = len(ids) * target_cfg.hidden_size
    if len(shape) != 2 or shape[1] != expected:
        raise CheckpointError(
            f"{drafter_reader.file_of(key)}: {key!r} input width is "
            f"{shape[1] if len(shape) == 2 else shape}, but len(target_layer_ids {ids}) x target "
            f"hidden_size {target_cfg.hidden_size} = {expected}"
        )


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _stated_token_ids(raw: dict[str, Any], names: tuple[str, ...]) -> dict[str, list[Any]]:
    """name -> ids, for every name a config (or its text_config / dflash_config) states."""
    found: dict[str, list[Any]] = {}
    for source in (raw, raw.get("text_config") or {}, raw.get("dflash_config") or {}):
        for name in names:
            value = source.get(name)
            if value is not None:
                found.setdefault(name, []).extend(value if isinstance(value, list) else [value])
    return found


def _check_token_ids(path: Path, raw: dict[str, Any], names: tuple[str, ...],
                     vocab_size: int) -> None:
    """Every token id the config states lies in [0, vocab_size): on device the embedding
    gather does not check its index."""
    for name, ids in _stated_token_ids(raw, names).items():
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < vocab_size]
        if bad:
            raise CheckpointError(
                f"{path}: {name} {bad[0]!r} is outside the target vocabulary [0, {vocab_size}); "
                "fix the config (a token id indexes the target's embedding)")


# Drafter architectures (config.json `architectures`) this exporter implements, by model file:
# DFlash v1 (models/dflash.py), as the Meta assistant checkpoint and z-lab's DFlashDraftModel
# name it, and DFlash2 (models/dflash2.py).
DRAFTER_ARCHITECTURES = {
    "MuseGlimmerAssistantModel": DrafterKind.DFLASH,
    "DFlashDraftModel": DrafterKind.DFLASH,
    "DFlash2DraftModel": DrafterKind.DFLASH2,
}
DRAFTER_MODELS = {DrafterKind.DFLASH: (DFlashConfig, DFlashDrafter),
                  DrafterKind.DFLASH2: (DFlash2Config, DFlash2Drafter)}
# z-lab's dflash_config settings that change the draft logits or inputs; DFlash v1 here
# implements their neutral values only, DFlash2 implements output_multiplier.
_NEUTRAL_DRAFT_SETTINGS = {"output_multiplier": 1.0, "input_embedding_scale": 1.0}


def drafter_kind(config: DFlashConfig) -> DrafterKind:
    """The family of a parsed drafter config (the key of its DRAFTER_MODELS entry)."""
    return next(kind for kind, (config_class, _) in DRAFTER_MODELS.items()
                if type(config) is config_class)


def drafter_architecture(path: Path, raw: dict[str, Any]) -> DrafterKind:
    """The drafter family `architectures` names (DFlash v1 when the config names none)."""
    names = raw.get("architectures") or []
    names = [names] if isinstance(names, str) else list(names)
    known = ", ".join(DRAFTER_ARCHITECTURES)
    unknown = [n for n in names if n not in DRAFTER_ARCHITECTURES]
    if unknown:
        raise CheckpointError(
            f"{path}: architectures {names} is not a drafter this exporter knows; it exports "
            f"{known}")
    kinds = {DRAFTER_ARCHITECTURES[n] for n in names}
    if len(kinds) > 1:
        raise CheckpointError(f"{path}: architectures {names} names two drafter families; "
                              "state the one the weights are for")
    return kinds.pop() if kinds else DrafterKind.DFLASH


def check_drafter_architecture(path: Path, raw: dict[str, Any], kind: DrafterKind,
                               target_cfg: MuseGlimmerConfig) -> None:
    """The settings the drafter's config states are ones the implementation of its family
    `kind` (drafter_architecture) honours (else a one-line error naming them)."""
    settings = {**raw, **(raw.get("dflash_config") or {})}
    for name, neutral in _NEUTRAL_DRAFT_SETTINGS.items():
        if kind == DrafterKind.DFLASH2 and name == "output_multiplier":
            continue
        value = settings.get(name)
        if value is not None and float(value) != neutral:
            raise CheckpointError(
                f"{path}: {name} {value} is not supported yet (the {kind} drafter here "
                f"scales by {neutral:g}); export a drafter without it")
    softcap = settings.get("final_logit_softcapping")
    if kind == DrafterKind.DFLASH and softcap is not None and (
            target_cfg.final_logit_softcapping is None
            or float(softcap) != float(target_cfg.final_logit_softcapping)):
        raise CheckpointError(
            f"{path}: final_logit_softcapping {softcap} differs from the target's "
            f"{target_cfg.final_logit_softcapping}; the drafter's draft logits use the "
            "target's soft cap (docs/positions.md), so a different one is not supported yet")
    if kind == DrafterKind.DFLASH2 and raw.get("is_causal") is not False:
        raise CheckpointError(
            f"{path}: a DFlash2 drafter without `is_causal: false`: z-lab's reference then "
            "drafts causally, which this exporter does not implement; state is_causal false "
            "if the drafter was trained bidirectionally")
    top_k = settings.get("selector_top_k")
    if kind == DrafterKind.DFLASH2 and top_k is not None and int(top_k) > target_cfg.vocab_size:
        raise CheckpointError(
            f"{path}: selector_top_k {top_k} exceeds the target vocabulary "
            f"{target_cfg.vocab_size}; the selector keeps at most every token")
    kinds = sorted(set(raw.get("layer_types") or []) - {LayerType.SLIDING_ATTENTION.value})
    if kinds:
        raise CheckpointError(
            f"{path}: layer_types include {kinds}; the {kind} drafter here has sliding "
            "attention in every layer")
    stated = settings.get("num_target_layers")
    if stated is not None and int(stated) != target_cfg.num_hidden_layers:
        raise CheckpointError(
            f"{path}: num_target_layers {stated} but the target has "
            f"{target_cfg.num_hidden_layers} layers: the drafter was trained for another target")


def check_drafter_against_target(
    drafter_dir: Path, target_cfg: MuseGlimmerConfig, target_label: Path
) -> tuple[dict[str, Any], DFlashConfig]:
    """The one check of a drafter against its target: an architecture implemented here, shared
    settings agree, the tapped layers exist, the encoder's width fits, every stated token id
    indexes the target's vocabulary. Reads only the config and the safetensors header."""
    drafter_dir = Path(drafter_dir)
    raw = read_config(drafter_dir)
    kind = drafter_architecture(drafter_dir / CONFIG_FILE, raw)
    config_class, _ = DRAFTER_MODELS[kind]
    _, drafter_cfg = _parse_config(drafter_dir, config_class.from_dict, raw)
    check_drafter_architecture(drafter_dir / CONFIG_FILE, raw, kind, target_cfg)
    where = f"drafter {drafter_dir / CONFIG_FILE} vs target {target_label / CONFIG_FILE}"
    try:
        validate_drafter_against_target(raw, target_cfg)
    except DrafterTargetMismatchError as error:
        raise CheckpointError(f"{where}: {error}") from error
    _check_token_ids(drafter_dir / CONFIG_FILE, raw,
                     ("mask_token_id", "draft_mask_token_id") + TOKEN_ID_KEYS,
                     target_cfg.vocab_size)
    reader = SafetensorsReader(drafter_dir)
    try:
        _check_encoder_width(reader, drafter_cfg, target_cfg)
    finally:
        reader.close()
    return raw, drafter_cfg


def read_target_config(target_dir: Path) -> MuseGlimmerConfig:
    """The target's config, parsed and with its token ids checked."""
    target_dir = Path(target_dir)
    raw, config = _parse_config(target_dir, MuseGlimmerConfig.from_dict)
    _check_token_ids(target_dir / CONFIG_FILE, raw, TOKEN_ID_KEYS, config.vocab_size)
    return config


def read_tokenizer(target_dir: Path, vocab_size: int,
                   mask_token_id: int | None = None) -> Tokenizer | None:
    """The checkpoint's Hugging Face tokenizer files, when it has a tokenizer.json: its
    vocabulary must be the model's, and the drafter's mask token one of its special tokens."""
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
    if size != vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {size} tokens but config.json's vocab_size is "
            f"{vocab_size}; the bundle's logits are indexed by token id, so they must agree")
    special = {t["content"]: int(t["id"]) for t in added if t.get("special")}
    if mask_token_id is not None and mask_token_id not in special.values():
        raise CheckpointError(
            f"{path}: the drafter's mask_token_id {mask_token_id} is not one of the "
            f"tokenizer's special tokens {sorted(special.values())}; add it as a special token")
    files = [name for name in TOKENIZER_FILES if (target_dir / name).is_file()]
    return Tokenizer(files=files, vocab_size=size, special_tokens=special)


@dataclass(frozen=True)
class CheckedConfigs:
    target: MuseGlimmerConfig
    drafter: DFlashConfig | None = None
    drafter_raw: dict[str, Any] | None = None
    tokenizer: Tokenizer | None = None


def check_configs(target_dir: Path, drafter_dir: Path | None = None) -> CheckedConfigs:
    """Everything about a target (and drafter) checkpoint that can be checked before a weight
    is read; every problem is a CheckpointError naming the file, the key and both values."""
    target_cfg = read_target_config(target_dir)
    raw = drafter_cfg = None
    if drafter_dir is not None:
        raw, drafter_cfg = check_drafter_against_target(drafter_dir, target_cfg,
                                                        Path(target_dir))
    tokenizer = read_tokenizer(target_dir, target_cfg.vocab_size,
                               drafter_cfg.mask_token_id if drafter_cfg else None)
    return CheckedConfigs(target_cfg, drafter_cfg, raw, tokenizer)


def load_target(
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    *,
    dtype: str | torch.dtype = torch.float32,
    max_context: int = 4096,
    max_query_len: int = 64,
    cache_dtype: torch.dtype = torch.float16,
    placeholders: PlaceholderWeights | None = None,
    compressed: Mapping[str, Scheme] | None = None,
) -> MuseGlimmerForCausalLM:
    """The target; with `drafter_dir`, the fused target whose forward also returns drafter
    features (its encoder weights come from the drafter checkpoint). With `placeholders`, the
    large weights are stand-ins registered there instead of loaded."""
    target_dir = Path(target_dir)
    dtype = resolve_dtype(dtype)
    checked = check_configs(target_dir, Path(drafter_dir) if drafter_dir else None)
    config = checked.target
    reader = SafetensorsReader(target_dir)
    cache_kwargs = dict(max_context=max_context, max_query_len=max_query_len,
                        cache_dtype=cache_dtype)
    drafter_reader = None
    with torch.device("meta"):
        if drafter_dir is None:
            model = MuseGlimmerForCausalLM(config, **cache_kwargs)
        else:
            drafter_reader = SafetensorsReader(drafter_dir)
            model = MuseGlimmerWithDrafterFeatures(config, checked.drafter, **cache_kwargs)
    entries = []
    for name, _ in _own_parameters(model):
        if name.startswith(ENCODER_PREFIX):
            entries.append((name, encoder_key(drafter_reader, name), drafter_reader))
        else:
            entries.append((name, target_checkpoint_key(name), reader))
    _check_unexpected_target_keys(reader, {key for _, key, r in entries if r is reader})
    _load_parameters(model, entries, dtype, placeholders, compressed)
    _build_rotary_tables(model, dtype)
    reader.close()
    if drafter_reader is not None:
        drafter_reader.close()
    return model.eval()


def load_drafter(
    drafter_dir: str | Path,
    target: MuseGlimmerForCausalLM,
    *,
    target_dir: str | Path | None = None,
    dtype: str | torch.dtype = torch.float32,
    max_context: int | None = None,
    max_query_len: int = 64,
    cache_dtype: torch.dtype = torch.float16,
    ring: bool = False,
    placeholders: PlaceholderWeights | None = None,
    compressed: Mapping[str, Scheme] | None = None,
) -> DFlashDrafter:
    """The drafter (a DFlash2Drafter for a DFlash2 checkpoint), sharing `target`'s embedding
    and lm_head modules.

    max_context: positions the drafter's RoPE tables cover (default: the target's)."""
    from museflash.models.dflash import DFlashRingDrafter

    drafter_dir = Path(drafter_dir)
    dtype = resolve_dtype(dtype)
    target_label = Path(target_dir) if target_dir is not None else Path("<target>")
    _, drafter_cfg = check_drafter_against_target(drafter_dir, target.config, target_label)
    reader = SafetensorsReader(drafter_dir)
    _, cls = DRAFTER_MODELS[drafter_kind(drafter_cfg)]
    if ring and cls is not DFlashDrafter:
        raise CheckpointError(f"{drafter_dir / CONFIG_FILE}: a DFlash2 drafter drafts whole "
                              "blocks and has no ring form; export it with --dflash-drafter")
    cls = DFlashRingDrafter if ring else cls
    if max_context is None:
        max_context = target.max_context
    with torch.device("meta"):
        shell = cls(drafter_cfg, nn.Embedding(1, drafter_cfg.hidden_size), None,
                    max_context=max_context, max_query_len=max_query_len,
                    cache_dtype=cache_dtype)
    # Attach the real (already loaded) target modules after building on meta.
    shell.embed_tokens = target.embed_tokens
    shell.lm_head = target.lm_head
    shell.final_logit_softcapping = target.config.final_logit_softcapping
    entries = [
        (name, drafter_checkpoint_key(name), reader)
        for name, _ in _own_parameters(shell, skip=DRAFTER_BORROWED)
    ]
    _load_parameters(shell, entries, dtype, placeholders, compressed)
    _build_rotary_tables(shell, dtype)
    reader.close()
    return shell.eval()


# --- Writing (demo checkpoints, tests, tools) ------------------------------------------------


def target_checkpoint_tensors(model: MuseGlimmerForCausalLM) -> dict[str, torch.Tensor]:
    return {
        target_checkpoint_key(name): param
        for name, param in _own_parameters(model, skip=(ENCODER_PREFIX,))
    }


def drafter_checkpoint_tensors(
    drafter: DFlashDrafter, encoder: nn.Module
) -> dict[str, torch.Tensor]:
    tensors = {
        drafter_checkpoint_key(name): param
        for name, param in _own_parameters(drafter, skip=DRAFTER_BORROWED)
    }
    for name, param in encoder.named_parameters():
        tensors[ENCODER_PREFIX + name] = param
    return tensors


def write_safetensors(
    tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    directory: str | Path,
    config: dict[str, Any],
    *,
    dtype: str | torch.dtype = "bf16",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes config.json and model.safetensors, or shards plus an index when the tensors
    exceed max_shard_bytes. `tensors` may be a lazy iterable of (key, tensor) when sharding."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(dtype)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        items = tensors.items() if isinstance(tensors, dict) else tensors
        converted = {key: t.detach().to(dtype).contiguous() for key, t in items}
        save_file(converted, str(directory / SINGLE_FILE), metadata=metadata)
        return
    # Shards are written as they fill so only one shard is ever held converted in memory.
    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        name = f"shard-{len(written) + 1:05d}.partial"
        save_file(shard, str(directory / name), metadata=metadata)
        written.append((name, list(shard)))
        shard.clear()

    for key, tensor in tensors.items() if isinstance(tensors, dict) else tensors:
        size = tensor.numel() * dtype.itemsize
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[key] = tensor.detach().to(dtype).contiguous()
        shard_bytes += size
        total += size
    if shard:
        flush()
    weight_map = {}
    for number, (partial, keys) in enumerate(written, start=1):
        name = f"model-{number:05d}-of-{len(written):05d}.safetensors"
        (directory / partial).rename(directory / name)
        weight_map.update({key: name for key in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
