"""Load the target and the drafter from their checkpoints.

Loading checks the configs first (checkpoint/configs.py), builds the model on the `meta`
device and assigns one tensor at a time, read through safetensors memory maps and converted to
the compute dtype in a single step (checkpoint/tensor_files.py), so peak memory is the final
model plus about one tensor. Which checkpoint key each parameter comes from is the model's own
mapping (models/muse_glimmer.py, models/dflash.py). The export loads the large weights as
stand-ins instead (`placeholders`: export/placeholders.py), or as a compressed export rebuilds
them (`compressed`).

The inverse, a model's parameters under their checkpoint keys, is here too
(`target_checkpoint_tensors`, `drafter_checkpoint_tensors`), for writing checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from museflash.bundle import KVWrite, NormForm
from museflash.checkpoint.configs import (
    DRAFTER_MODELS,
    check_configs,
    check_drafter_against_target,
    drafter_kind,
)
from museflash.checkpoint.tensor_files import (
    CONFIG_FILE,
    SAFETENSORS_DTYPES,
    CheckpointError,
    SafetensorsReader,
    WeightLocation,
    resolve_dtype,
)
from museflash.checkpoint.weight_values import unholdable, weight_value_error
from museflash.compression import Scheme, compress, expand
from museflash.models.base import RotaryTables, set_norm_form
from museflash.models.causal_lm import CausalLM
from museflash.models.dflash import (
    DRAFTER_BORROWED,
    ENCODER_PREFIX,
    DFlashDrafter,
    DFlashRingDrafter,
    drafter_checkpoint_key,
    encoder_key,
)
from museflash.models.families import TargetFamily, family_of


class StandIns(Protocol):
    """What the loaders ask of `placeholders` (export/placeholders.py's PlaceholderWeights):
    whether a weight of this shape gets a stand-in, and the stand-in for the tensor at
    `location`."""

    def wants(self, shape: tuple[int, ...]) -> bool: ...

    def make(self, location: WeightLocation, dtype: torch.dtype) -> torch.Tensor: ...


def load_target(
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    *,
    dtype: str | torch.dtype = torch.float32,
    max_context: int = 4096,
    max_query_len: int = 64,
    cache_dtype: torch.dtype = torch.float16,
    placeholders: StandIns | None = None,
    compressed: Mapping[str, Scheme] | None = None,
    kv_write: KVWrite = KVWrite.BLEND,
    norm_form: NormForm = NormForm.MAX_ABS,
    residual_scale: float = 1.0,
) -> CausalLM:
    """The target; with `drafter_dir`, the fused target whose forward also returns drafter
    features (its encoder weights come from the drafter checkpoint). With `placeholders`, the
    large weights are stand-ins registered there instead of loaded.

    The graph's form, as the export's fp16 audit chose it (export/fp16_range.py): how the
    caches are written (`kv_write`, docs/kv-write.md), how every RMSNorm is written
    (`norm_form`), and the factor the residual stream is multiplied by (`residual_scale`,
    docs/fp16.md). The defaults are the eager reference's."""
    target_dir = Path(target_dir)
    dtype = resolve_dtype(dtype)
    checked = check_configs(target_dir, Path(drafter_dir) if drafter_dir else None)
    config = checked.target
    family = family_of(config)
    reader = SafetensorsReader(target_dir)
    build_kwargs = dict(max_context=max_context, max_query_len=max_query_len,
                        cache_dtype=cache_dtype, kv_write=kv_write)
    drafter_reader = None
    with torch.device("meta"):
        if drafter_dir is None:
            model = family.model_class(config, **build_kwargs)
        else:
            drafter_reader = SafetensorsReader(drafter_dir)
            model = family.fused_class(config, checked.drafter, **build_kwargs)
    entries = []
    for name, _ in _own_parameters(model):
        if name.startswith(ENCODER_PREFIX):
            entries.append((name, encoder_key(drafter_reader, name), drafter_reader))
        else:
            entries.append((name, family.checkpoint_key(name), reader))
    _check_unexpected_target_keys(reader, {key for _, key, r in entries if r is reader},
                                  family)
    _load_parameters(model, entries, dtype, placeholders, compressed)
    _build_rotary_tables(model, dtype)
    reader.close()
    if drafter_reader is not None:
        drafter_reader.close()
    model.scale_residual(residual_scale)
    set_norm_form(model, norm_form)
    return model.eval()


def load_drafter(
    drafter_dir: str | Path,
    target: CausalLM,
    *,
    target_dir: str | Path | None = None,
    dtype: str | torch.dtype = torch.float32,
    max_context: int | None = None,
    max_query_len: int = 64,
    cache_dtype: torch.dtype = torch.float16,
    ring: bool = False,
    placeholders: StandIns | None = None,
    compressed: Mapping[str, Scheme] | None = None,
    norm_form: NormForm = NormForm.MAX_ABS,
    residual_scale: float = 1.0,
) -> DFlashDrafter:
    """The drafter (a DFlash2Drafter for a DFlash2 checkpoint), sharing `target`'s embedding
    and lm_head modules.

    max_context: positions the drafter's RoPE tables cover (default: the target's).
    norm_form, residual_scale: the graph's form, as `load_target`'s."""
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
    shell.scale_residual(residual_scale)
    set_norm_form(shell, norm_form)
    return shell.eval()


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
    rebuilt = expand(compress(values, scheme, clip), scheme)
    return torch.from_numpy(np.ascontiguousarray(rebuilt, dtype=np.float32))


def _load_parameters(
    model: nn.Module,
    entries: list[tuple[str, str, SafetensorsReader]],
    dtype: torch.dtype,
    placeholders: StandIns | None = None,
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
            if location.dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"{location.path}: key {key!r} has dtype {location.dtype}, expected one "
                    f"of {sorted(SAFETENSORS_DTYPES)}"
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


def _check_unexpected_target_keys(reader: SafetensorsReader, expected: set[str],
                                  family: TargetFamily) -> None:
    unexpected = sorted(
        key
        for key in reader.keys()
        if key not in expected and not key.startswith(family.ignored_prefixes)
        and (key.startswith(family.prefix) or key.startswith(family.unprefixed))
    )
    if unexpected:
        raise CheckpointError(
            f"{reader.description}: unexpected keys {unexpected[:5]} (config.json describes a "
            "different model, e.g. fewer layers)"
        )


# --- Writing: a model's parameters under their checkpoint keys -------------------------------


def target_checkpoint_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    key = family_of(model.config).checkpoint_key
    return {
        key(name): param
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
