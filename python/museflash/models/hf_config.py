"""Reading a `config.json` as transformers writes it, for the targets in its own layouts
(models/qwen3.py, models/llama.py).

Only what changes the computed function is checked: a field the model code does not implement
is refused by name (`UnsupportedConfigError`), never silently ignored. Fields that change
nothing here (dtype, use_cache, initializer_range, token ids, ...) are left alone.

RoPE settings come in two spellings. transformers 5 writes `rope_parameters` (a dict with
`rope_type`, `rope_theta` and the scaling parameters); older files, among them the published
Qwen3 and Llama 3.1 ones, have a top-level `rope_theta` and a `rope_scaling` dict (or null)
whose type sits under `rope_type` or the older `type`. `rope_parameters` reads either, with
transformers' precedence: a non-empty `rope_scaling` is the RoPE dict; `rope_theta` inside it
wins over the top-level one; the theta defaults to 10000 and the type to "default".
"""

from __future__ import annotations

from typing import Any

from museflash.bundle import LayerType

DEFAULT_ROPE_THETA = 10_000.0


class UnsupportedConfigError(ValueError):
    """A config value the model code does not implement; the message names the field, its
    value and what is supported."""


def refuse(field_name: str, value: Any, supported: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(
        f"config field {field_name} is {value!r}, which museflash does not implement "
        f"(supported: {supported})"
    )


def require_fields(config: dict[str, Any], names: tuple[str, ...], family: str) -> None:
    missing = [name for name in names if config.get(name) is None]
    if missing:
        raise ValueError(f"{family} config is missing {missing}")


def check_identity(config: dict[str, Any], *, model_type: str, architecture: str) -> None:
    """`model_type` and `architectures`, when present, name exactly this family."""
    found = config.get("model_type")
    if found is not None and found != model_type:
        raise refuse("model_type", found, repr(model_type))
    architectures = config.get("architectures")
    if architectures is not None and list(architectures) != [architecture]:
        raise refuse("architectures", architectures, repr([architecture]))


def check_values(config: dict[str, Any], required: dict[str, Any]) -> None:
    """Each field of `required` is absent or null (transformers' default, which is the value
    given) or equal to the value given."""
    for name, value in required.items():
        found = config.get(name)
        if found is not None and found != value:
            raise refuse(name, found, repr(value))


def check_absent(config: dict[str, Any], names: tuple[str, ...]) -> None:
    """Fields whose every non-null value asks for something not implemented."""
    for name in names:
        if config.get(name) is not None:
            raise refuse(name, config[name], "null or absent")


def check_full_attention(config: dict[str, Any]) -> None:
    """`layer_types`, when present, says every layer is a full-attention one."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return
    other = sorted({kind for kind in layer_types if kind != LayerType.FULL_ATTENTION})
    if other:
        raise refuse("layer_types", other, f"'{LayerType.FULL_ATTENTION}' in every layer")
    if len(layer_types) != config.get("num_hidden_layers", len(layer_types)):
        raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers "
                         f"is {config['num_hidden_layers']}")


def rope_parameters(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(rope field name for messages, the RoPE dict with `rope_type` and `rope_theta` set)."""
    scaling = config.get("rope_scaling")
    if scaling:
        where, rope = "rope_scaling", dict(scaling)
    else:
        where, rope = "rope_parameters", dict(config.get("rope_parameters") or {})
    if not isinstance(rope, dict):
        raise refuse(where, rope, "a dict")
    theta = config.get("rope_theta")
    rope.setdefault("rope_theta", DEFAULT_ROPE_THETA if theta is None else theta)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "type" in rope and rope["type"] != rope["rope_type"]:
        raise ValueError(f"{where} has rope_type {rope['rope_type']!r} but type {rope['type']!r}")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise refuse(f"{where}.partial_rotary_factor", partial, "1.0 (RoPE on the whole head)")
    return where, rope
