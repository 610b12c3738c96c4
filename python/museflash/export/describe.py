"""Describe the bundle: metadata.json from the plan, written beside the packages and embedded
in each of them (`museflash.bundle` owns every name and field)."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import torch

from museflash import __version__
from museflash.bundle import (
    COMPUTE_PRECISION,
    EMBEDDED_METADATA_KEY,
    NO_SLIDING_WINDOW,
    PACKAGE_SPEC,
    SCHEMA_VERSION,
    STATE_DTYPE,
    Asset,
    AssetRole,
    CompressedGroup,
    Compression,
    CompressionMode,
    CompressionPreset,
    CompressionRule,
    ContextBucket,
    Fp16Range,
    Function,
    FunctionName,
    Generator,
    LayerType,
    Metadata,
    Source,
    State,
    StateName,
    StoredCount,
    TargetSettings,
    builtin_pair,
    schema_errors,
)
from museflash.checkpoint.gguf import is_gguf
from museflash.compression import MIN_ELEMENTS, first_matching_rule
from museflash.export.options import ExportError
from museflash.export.plan import AssetPlan, CompressionPlan, ExportPlan
from museflash.export.weights import StoredWeight
from museflash.models.families import TargetConfig


def state_entries(module: torch.nn.Module, names: tuple[StateName, ...]) -> list[State]:
    entries = []
    for name in names:
        shape = [int(d) for d in getattr(module, name).shape]
        entries.append(State(name=name, kind=name.kind, role=name.role, shape=shape,
                             dtype=STATE_DTYPE, layers=shape[-4], kv_heads=shape[-3],
                             capacity=shape[-2], head_dim=shape[-1]))
    return entries


def asset(plan: AssetPlan, module: torch.nn.Module) -> Asset:
    def entries(context: int | None) -> dict[FunctionName, Function]:
        return {f.function: Function(role=f.role, query_length=f.query_length,
                                     inputs=f.input_names, outputs=list(f.outputs))
                for f in plan.functions if f.bucket == context}

    def bucket(context: int) -> ContextBucket:
        functions = entries(context)
        tree = functions.pop(FunctionName.TREE, None)
        return ContextBucket(context, functions, tree=tree)

    whole = entries(None)
    return Asset(
        path=plan.path,
        kind=plan.kind,
        default_function=plan.default_function,
        functions={name: f for name, f in whole.items()
                   if name not in (FunctionName.DECODE, FunctionName.TREE)},
        states=state_entries(module, plan.states),
        buckets=[bucket(b) for b in plan.buckets] or None,
        decode=whole.get(FunctionName.DECODE),
        tree=whole.get(FunctionName.TREE),
    )


def target_settings(cfg: TargetConfig) -> TargetSettings:
    return TargetSettings(
        num_hidden_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        sliding_window=(cfg.sliding_window if LayerType.SLIDING_ATTENTION in cfg.layer_types
                        else NO_SLIDING_WINDOW),
        layer_types=[LayerType(t) for t in cfg.layer_types],
        final_logit_softcapping=cfg.final_logit_softcapping,
    )


def compression_block(plan: CompressionPlan | None,
                      stored: dict[AssetRole, dict[str, StoredWeight]]) -> Compression | None:
    """What the rules did: per group of weights compressed alike (rule and scheme), how many
    there are, their bytes before and after, and what each package stores of them (`stored`
    is keyed by each package's owner role)."""
    if plan is None:
        return None
    groups: dict[tuple, dict] = {}
    fp16: dict[str, int] = {}
    for role, weights in stored.items():
        for key, weight in weights.items():
            if weight.scheme is None:
                fp16[key] = weight.bytes
                continue
            scheme = weight.scheme
            rule = first_matching_rule(plan.rules, key)
            group = groups.setdefault(
                (rule, scheme.mode, scheme.bits, scheme.block_size, scheme.group_size),
                {"unique": {}, "packages": {}})
            elements = weight.shape[0] * weight.shape[1]
            group["unique"][key] = (2 * elements, weight.bytes)
            tensors, size = group["packages"].get(role, (0, 0))
            group["packages"][role] = (tensors + 1, size + weight.bytes)
    return Compression(
        preset=CompressionPreset(plan.preset) if plan.preset else None,
        rules=[CompressionRule(match=r.match, mode=CompressionMode(r.mode), bits=r.bits,
                               block_size=r.block_size, group_size=r.group_size)
               for r in plan.rules],
        groups=[CompressedGroup(
            rule=rule, mode=CompressionMode(mode), bits=bits, block_size=block,
            group_size=group_size, tensors=len(g["unique"]),
            bytes_before=sum(b for b, _ in g["unique"].values()),
            bytes_after=sum(a for _, a in g["unique"].values()),
            packages={role: StoredCount(tensors=n, bytes=size)
                      for role, (n, size) in g["packages"].items()})
            for (rule, mode, bits, block, group_size), g in sorted(
                groups.items(), key=lambda item: item[0][0])],
        fp16_tensors=len(fp16), fp16_bytes=sum(fp16.values()),
        min_compressible_elements=MIN_ELEMENTS)


def bundle_metadata(plan: ExportPlan, modules: dict[str, torch.nn.Module], source: Source,
                    context_length: int, model_name: str | None,
                    stored: dict[AssetRole, dict[str, StoredWeight]] | None = None,
                    fp16_range: Fp16Range | None = None) -> Metadata:
    """The bundle's metadata, checked against the JSON Schema every reader relies on.
    `stored`: per package, the weights its merge wrote (for the compression block);
    `fp16_range`: the export's range audit."""
    metadata = Metadata(
        schema_version=SCHEMA_VERSION,
        generator=Generator(name="museflash", version=__version__),
        model_name=model_name or default_model_name(source),
        vocab_size=plan.target_cfg.vocab_size,
        context_length=context_length,
        compute_precision=COMPUTE_PRECISION,
        target=target_settings(plan.target_cfg),
        assets={p.role: asset(p, modules[p.module]) for p in plan.assets},
        speculative_decoding=plan.spec,
        source=source,
        tokenizer=plan.configs.tokenizer,
        compression=compression_block(plan.compression, stored or {}),
        fp16_range=fp16_range,
        kv_write=plan.kv_write,
    )
    problems = schema_errors(metadata.to_json())
    if problems:
        raise ExportError(f"the export's own metadata breaks docs/metadata.schema.json at "
                          f"{problems[0]}; this is a museflash bug, please report it")
    return metadata


def default_model_name(source: Source) -> str:
    pair = builtin_pair(source.checkpoint)
    if pair is not None:
        return {"demo": "muse-glimmer-demo", "smollm2": "smollm2-135m-instruct",
                "tiny-qwen3": "qwen3-tiny-random",
                "tiny-llama": "llama-3.1-tiny-random"}.get(pair, "muse-glimmer-tiny-demo")
    return Path(source.checkpoint).stem if is_gguf(source.checkpoint) else Path(
        source.checkpoint).name


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
    # Deterministic: map fields (the functions, each op's attributes) in key order, so the same
    # export writes the same bytes.
    spec_path.write_bytes(spec.SerializeToString(deterministic=True))


def stable_manifest(package: Path) -> None:
    """Names the package's items by UUIDs derived from their paths. coremltools draws random
    ones, so two exports of the same model differed in Manifest.json alone; with these, equal
    inputs give byte-identical bundles (and Bazel can tell an unchanged export)."""
    path = package / "Manifest.json"
    manifest = json.loads(path.read_text())
    renamed = {old: str(uuid.UUID(bytes=hashlib.sha256(
                   f"museflash:{item['path']}".encode()).digest()[:16], version=4))
               for old, item in manifest["itemInfoEntries"].items()}
    manifest["itemInfoEntries"] = {renamed[old]: item
                                   for old, item in manifest["itemInfoEntries"].items()}
    manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    path.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")
