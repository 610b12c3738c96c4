"""The target architectures museflash exports, and which one a `config.json` names.

Each family is one model file (models/muse_glimmer.py, models/qwen3.py, models/llama.py) with its
config dataclass, checkpoint-key mapping and the fused variant that also emits DFlash drafter
features; the entry points and that variant's encoder are models/causal_lm.py's, as is the whole
causal-LM wrapper of Qwen3 and Llama. This module only lists them. A config names its family by
`model_type` and `architectures`, as transformers writes them; one that names none is a Muse Glimmer
config (the layout museflash read before it had other families). A config naming another
architecture is refused by name, listing the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from museflash.models import llama, muse_glimmer, qwen3


class TargetConfig(Protocol):
    """What the exporter, the checks and the bundle description read of a target's config,
    whichever family parsed it (MuseGlimmerConfig, Qwen3Config, LlamaConfig): the geometry,
    the layer kinds and the logits' softcap (None for a family without one). A family with
    sliding layers also has `sliding_window`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    raw: dict[str, Any]

    @property
    def layer_types(self) -> list[str]: ...

    @property
    def global_layer_ids(self) -> list[int]: ...

    @property
    def final_logit_softcapping(self) -> float | None: ...


@dataclass(frozen=True)
class TargetFamily:
    name: str  # as messages name it
    model_type: str
    architecture: str
    config_class: type
    model_class: type  # logits only
    fused_class: type  # logits and drafter features
    checkpoint_key: Callable[[str], str]
    prefix: str  # checkpoint keys of the decoder start with this
    unprefixed: tuple[str, ...]  # ... or with one of these
    ignored_prefixes: tuple[str, ...]  # keys of modules the export does not use
    # Other model_type spellings of the family (a flat Muse Glimmer config is its text part's).
    model_type_aliases: tuple[str, ...] = ()


MUSE_GLIMMER = TargetFamily(
    "Muse Glimmer", "muse_glimmer", "MuseGlimmerForConditionalGeneration",
    muse_glimmer.MuseGlimmerConfig, muse_glimmer.MuseGlimmerForCausalLM,
    muse_glimmer.MuseGlimmerWithDrafterFeatures, muse_glimmer.target_checkpoint_key,
    muse_glimmer.TARGET_PREFIX, muse_glimmer.TARGET_UNPREFIXED,
    muse_glimmer.TARGET_IGNORED_PREFIXES, ("muse_glimmer_text",))
QWEN3 = TargetFamily(
    "Qwen3", qwen3.MODEL_TYPE, qwen3.ARCHITECTURE, qwen3.Qwen3Config, qwen3.Qwen3ForCausalLM,
    qwen3.Qwen3WithDrafterFeatures, qwen3.target_checkpoint_key, qwen3.TARGET_PREFIX,
    qwen3.TARGET_UNPREFIXED, ())
LLAMA = TargetFamily(
    "Llama", llama.MODEL_TYPE, llama.ARCHITECTURE, llama.LlamaConfig, llama.LlamaForCausalLM,
    llama.LlamaWithDrafterFeatures, llama.target_checkpoint_key, llama.TARGET_PREFIX,
    llama.TARGET_UNPREFIXED, ())
TARGET_FAMILIES = (MUSE_GLIMMER, QWEN3, LLAMA)


class UnknownArchitectureError(ValueError):
    """A config naming an architecture no family here implements."""


def supported() -> str:
    return ", ".join(f"{f.model_type} ({f.architecture})" for f in TARGET_FAMILIES)


def target_family(config: dict[str, Any]) -> TargetFamily:
    """The family `config.json` names by `model_type` (else by `architectures`); Muse Glimmer
    when it names neither. The family's own config parser checks that both agree."""
    model_type = config.get("model_type")
    names = config.get("architectures") or []
    names = [names] if isinstance(names, str) else list(names)
    for family in TARGET_FAMILIES:
        if model_type in (family.model_type, *family.model_type_aliases) or (
                model_type is None
                                               and family.architecture in names):
            return family
    if model_type is None and not names:
        return MUSE_GLIMMER
    stated = f"model_type {model_type!r}" if model_type is not None else (
        f"architectures {names}")
    raise UnknownArchitectureError(
        f"{stated} is not a target architecture museflash exports; it exports {supported()}")


def family_of(config: Any) -> TargetFamily:
    """The family of a parsed target config (an instance of one family's config class)."""
    return next(f for f in TARGET_FAMILIES if type(config) is f.config_class)
