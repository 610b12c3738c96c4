"""Describe the bundle: metadata.json from the plan, written beside the packages and embedded
in each of them (`museflash.bundle` owns every name and field)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from museflash import __version__
from museflash.bundle import (
    BUILTIN_PREFIX,
    COMPUTE_PRECISION,
    EMBEDDED_METADATA_KEY,
    PACKAGE_SPEC,
    SCHEMA_VERSION,
    STATE_DTYPE,
    Asset,
    Function,
    Generator,
    LayerType,
    Metadata,
    Source,
    State,
    StateName,
    TargetSettings,
    schema_errors,
)
from museflash.export.options import ExportError
from museflash.export.plan import ExportPlan, PackagePlan
from museflash.models.muse_glimmer import MuseGlimmerConfig


def state_entries(module: torch.nn.Module, names: tuple[StateName, ...]) -> list[State]:
    entries = []
    for name in names:
        shape = [int(d) for d in getattr(module, name).shape]
        entries.append(State(name=name, kind=name.kind, role=name.role, shape=shape,
                             dtype=STATE_DTYPE, layers=shape[-4], kv_heads=shape[-3],
                             capacity=shape[-2], head_dim=shape[-1]))
    return entries


def asset(package: PackagePlan, module: torch.nn.Module) -> Asset:
    return Asset(
        path=package.file_name,
        kind=package.kind,
        default_function=package.default_function,
        functions={f.name: Function(role=f.role, query_length=f.query_length,
                                    inputs=f.input_names, outputs=list(f.outputs))
                   for f in package.functions},
        states=state_entries(module, package.states),
    )


def target_settings(cfg: MuseGlimmerConfig) -> TargetSettings:
    return TargetSettings(
        num_hidden_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        layer_types=[LayerType(t) for t in cfg.layer_types],
        final_logit_softcapping=cfg.final_logit_softcapping,
    )


def bundle_metadata(plan: ExportPlan, modules: dict[str, torch.nn.Module], source: Source,
                    context_length: int, model_name: str | None) -> Metadata:
    """The bundle's metadata, checked against the JSON Schema every reader relies on."""
    metadata = Metadata(
        schema_version=SCHEMA_VERSION,
        generator=Generator(name="museflash", version=__version__),
        model_name=model_name or default_model_name(source),
        vocab_size=plan.target_cfg.vocab_size,
        context_length=context_length,
        compute_precision=COMPUTE_PRECISION,
        target=target_settings(plan.target_cfg),
        assets={p.role: asset(p, modules[p.module]) for p in plan.packages},
        speculative_decoding=plan.spec,
        source=source,
        tokenizer=plan.configs.tokenizer,
    )
    problems = schema_errors(metadata.to_json())
    if problems:
        raise ExportError(f"the export's own metadata breaks docs/metadata.schema.json at "
                          f"{problems[0]}; this is a museflash bug, please report it")
    return metadata


def default_model_name(source: Source) -> str:
    if source.checkpoint.startswith(BUILTIN_PREFIX):
        return {"demo": "muse-glimmer-demo"}.get(source.checkpoint[len(BUILTIN_PREFIX):],
                                                 "muse-glimmer-tiny-demo")
    return Path(source.checkpoint).name


def embed_metadata(package: Path, metadata: Metadata) -> None:
    """save_multifunction drops user-defined metadata; write it into the spec directly (the
    weights are untouched, and the package is never re-saved onto its own path)."""
    from coremltools.proto import Model_pb2

    spec_path = package / PACKAGE_SPEC
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    described = spec.description.metadata
    described.shortDescription = f"{metadata.model_name} exported by museflash"
    described.versionString = metadata.generator.version
    described.userDefined[EMBEDDED_METADATA_KEY] = json.dumps(metadata.to_json(), sort_keys=True)
    spec_path.write_bytes(spec.SerializeToString())
