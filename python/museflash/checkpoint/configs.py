"""Checkpoint configs: parsed into the models' config dataclasses and checked, once.

`check_configs` is the one validation pass over a target (and drafter) checkpoint, done before
any weight is read; the loaders and the export call it. Every problem is a CheckpointError
naming the file, the key and both values:
- the target's config names an architecture implemented here (models/families.py: Muse
  Glimmer, Qwen3, Llama) and parses into that family's config;
- the drafter's `architectures` names a family implemented here (DRAFTER_ARCHITECTURES: DFlash
  v1 in models/dflash.py, DFlash2 in models/dflash2.py), its config parses, and the settings
  it states are ones that implementation honours;
- the drafter against the target: shared settings agree, the tapped layers exist, the
  encoder's input width (from the safetensors header) fits;
- every token id either config states indexes the target's vocabulary;
- the tokenizer, when the target has one (checkpoint/tokenizer.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from museflash.bundle import DrafterKind, LayerType, Tokenizer
from museflash.checkpoint.tensor_files import CONFIG_FILE, CheckpointError, SafetensorsReader
from museflash.checkpoint.tokenizer import read_tokenizer
from museflash.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DrafterTargetMismatchError,
    encoder_key,
    first_present,
)
from museflash.models.dflash2 import DFlash2Config, DFlash2Drafter
from museflash.models.families import TargetConfig, UnknownArchitectureError, target_family
from museflash.models.hf_config import rope_parameters


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: config file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from error
    check_numbers(path, raw)
    return raw


# Fields that must be positive where a config states them (a norm's eps under a square root,
# a soft cap that divides the logits); the check applies at any depth (text_config, ...).
_POSITIVE_FIELDS = ("rms_norm_eps", "post_norm_eps", "layer_norm_eps", "final_logit_softcapping",
                    "attn_logit_softcapping")


def check_numbers(path: Path, raw: Any, where: str = "") -> None:
    """Every number in a config is finite (JSON parsers accept NaN and Infinity, and a NaN eps
    or scale turns the whole graph NaN), and the _POSITIVE_FIELDS stated are above 0."""
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(
        raw, list) else ()
    for key, value in items:
        name = f"{where}.{key}" if where else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"{path}: {name} is {value}; a config number must be finite "
                                  "(fix or re-download config.json)")
        if (key in _POSITIVE_FIELDS and isinstance(value, (int, float))
                and not isinstance(value, bool) and value <= 0):
            raise CheckpointError(
                f"{path}: {name} is {value}; it must be above 0 (null turns a soft cap off)")
        if isinstance(value, (dict, list)):
            check_numbers(path, value, name)


def _parse_config(directory: Path, parse, raw: dict[str, Any] | None = None
                  ) -> tuple[dict[str, Any], Any]:
    """(config.json, parse(config.json)); `raw` when the caller has read it already."""
    raw = read_config(directory) if raw is None else raw
    try:
        return raw, parse(raw)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{directory / CONFIG_FILE}: {error}") from error


def read_target_config(target_dir: Path) -> TargetConfig:
    """The target's config, parsed by the family it names (models/families.py) and with its
    token ids checked."""
    target_dir = Path(target_dir)
    raw = read_config(target_dir)
    try:
        family = target_family(raw)
    except UnknownArchitectureError as error:
        raise CheckpointError(f"{target_dir / CONFIG_FILE}: {error}") from error
    raw, config = _parse_config(target_dir, family.config_class.from_dict, raw)
    _check_token_ids(target_dir / CONFIG_FILE, raw, TOKEN_ID_KEYS, config.vocab_size)
    return config


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
                               target_cfg: TargetConfig) -> None:
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
    block = settings.get("block_size")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                              or block < 2):
        raise CheckpointError(
            f"{path}: block_size {block!r} must be a whole number of at least 2 (the anchor "
            "and at least one drafted token); z-lab's drafters use 16")
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
    kinds = sorted(set(raw.get("layer_types") or []))
    if len(kinds) > 1 or not set(kinds) <= {t.value for t in LayerType}:
        raise CheckpointError(
            f"{path}: layer_types include {kinds}; the {kind} drafter here has the same "
            f"attention in every layer, {LayerType.SLIDING_ATTENTION} or "
            f"{LayerType.FULL_ATTENTION}")
    try:
        where, rope = rope_parameters(raw)
    except ValueError as error:
        raise CheckpointError(f"{path}: {error}") from error
    if rope["rope_type"] != "default":
        raise CheckpointError(
            f"{path}: {where}.rope_type {rope['rope_type']!r} is not supported for the drafter "
            "(it implements plain RoPE, 'default'); export a drafter without rope scaling")
    stated = settings.get("num_target_layers")
    if stated is not None and int(stated) != target_cfg.num_hidden_layers:
        raise CheckpointError(
            f"{path}: num_target_layers {stated} but the target has "
            f"{target_cfg.num_hidden_layers} layers: the drafter was trained for another target")


# --- The drafter against its target ----------------------------------------------------------

# Settings that must agree whenever both configs state them. vocab_size and hidden_size follow
# from the borrowed embedding and lm_head; head geometry is checked so a drafter trained for
# another model family fails here rather than on device. num_key_value_heads is deliberately
# not compared: the released drafter has 8 KV heads against the target's 2, and its KV heads
# only address its own caches.
SHARED_WITH_TARGET = ("vocab_size", "hidden_size", "head_dim", "num_attention_heads")


def _target_settings(target_cfg: Any) -> dict[str, Any]:
    if isinstance(target_cfg, dict):
        return dict(target_cfg.get("text_config") or target_cfg)
    return {name: getattr(target_cfg, name) for name in vars(target_cfg) if name != "raw"}


def validate_drafter_against_target(drafter_cfg_dict: dict[str, Any], target_cfg: Any) -> None:
    """Raises DrafterTargetMismatchError when the drafter cannot run on the target.

    target_cfg: a TargetConfig or a target config.json dict.
    """
    target = _target_settings(target_cfg)
    for name in SHARED_WITH_TARGET:
        drafter_value, target_value = drafter_cfg_dict.get(name), target.get(name)
        if drafter_value is not None and target_value is not None:
            if drafter_value != target_value:
                raise DrafterTargetMismatchError(
                    f"{name}: drafter has {drafter_value} but target has {target_value}"
                )
    depth = target.get("num_hidden_layers")
    sources = [drafter_cfg_dict, drafter_cfg_dict.get("dflash_config") or {}]
    layer_ids = first_present(sources, ("target_layer_ids",)) or []
    outside = [i for i in layer_ids if depth is not None and not 0 <= int(i) < depth]
    if outside:
        raise DrafterTargetMismatchError(
            f"target_layer_ids: drafter uses {list(layer_ids)} but target has "
            f"num_hidden_layers {depth} (ids {outside} out of range)"
        )


def _check_encoder_width(
    drafter_reader: SafetensorsReader, drafter_cfg: DFlashConfig, target_cfg: TargetConfig
) -> None:
    key = encoder_key(drafter_reader, "encoder.fc.weight")
    # z-lab's reference drafts causally when is_causal says so, and by default in sliding
    # layers only (a full-attention drafter is bidirectional unless it states otherwise).
    stated = drafter_cfg.raw.get("is_causal")
    causal = bool(stated) if stated is not None else drafter_cfg.sliding_window is not None
    if key != "encoder.fc.weight" and causal:
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


def check_drafter_against_target(
    drafter_dir: Path, target_cfg: TargetConfig, target_label: Path
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


@dataclass(frozen=True)
class CheckedConfigs:
    target: TargetConfig
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
