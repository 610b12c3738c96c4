"""Plan an export: read and check both configs once, then decide every package, function,
input, output and state before any weight is read; load the modules the plan traces."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from museflash.bundle import (
    DRAFTER_STATES,
    RING_DRAFTER_STATES,
    AssetKind,
    AssetRole,
    DFlash2Settings,
    DrafterKind,
    DrafterSettings,
    FunctionName,
    FunctionRole,
    InputName,
    KVWrite,
    OutputName,
    SelectorDecoding,
    SpeculativeDecoding,
    StateName,
    bucket_function_name,
    target_states,
)
from museflash.checkpoint.configs import CheckedConfigs, check_configs, drafter_kind, read_config
from museflash.checkpoint.load import load_drafter, load_target
from museflash.checkpoint.tensor_files import SafetensorsReader
from museflash.compression import CompressionError, Rule, Scheme, preset_rules, read_rules
from museflash.export.fp16_range import GraphNumerics
from museflash.export.options import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_NUM_DRAFT_TOKENS,
    MAX_DEFAULT_CONTEXT_LENGTH,
    ExportError,
    ExportOptions,
    check_context_buckets,
    check_context_length,
    default_context_buckets,
)
from museflash.export.placeholders import PlaceholderWeights, compressed_weights
from museflash.export.progress import Progress
from museflash.export.spans import integers_of, template_span
from museflash.models.base import fold_norm_weights
from museflash.models.dflash import ENCODER_PREFIX, ZLAB_ENCODER_KEYS, DFlashConfig
from museflash.models.dflash2 import DFlash2Config
from museflash.models.families import TARGET_FAMILIES, TargetConfig

# Core ML has no bfloat16: weights are converted to fp16 once, while loading.
TRACE_DTYPE = torch.float16


@dataclass(frozen=True)
class InputPlan:
    name: InputName
    shape: tuple[int, ...]
    dtype: type  # numpy scalar type


@dataclass
class FunctionPlan:
    name: str  # Core ML function name: the function's own, or bucket_function_name's
    role: FunctionRole
    entry_point: str  # module entry point
    inputs: list[InputPlan]
    outputs: list[OutputName]
    example_args: tuple
    query_length: int
    function: FunctionName | None = None  # what it computes; None: `name` itself
    bucket: int | None = None  # the global cache slots it attends to; None: all of them
    # A template (export/spans.py): the functions, (name, span) each, written from its one
    # conversion at the template span `bucket`.
    written: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        self.function = FunctionName(self.function or self.name)

    @property
    def input_names(self) -> list[InputName]:
        return [i.name for i in self.inputs]

    def in_bucket(self, context: int) -> FunctionPlan:
        """The same function attending to the global caches' first `context` slots only."""
        return dataclasses.replace(self, name=bucket_function_name(self.function, context),
                                   bucket=context)


@dataclass
class AssetPlan:
    """One asset of the bundle: its functions, traced from one module, and its states."""
    role: AssetRole
    kind: AssetKind
    module: str  # "target" or "drafter"
    states: tuple[StateName, ...]
    default_function: FunctionName
    functions: list[FunctionPlan]
    # The package holding the functions; several assets may share one (docs/metadata.md).
    path: str = ""
    # The context buckets below the capacity (docs/buckets.md); `functions` has each one's.
    buckets: tuple[int, ...] = ()
    # What is converted instead of `functions` when they are written from templates
    # (export/spans.py): one template per function of the whole capacity.
    templates: list[FunctionPlan] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.path = self.path or AssetRole(self.role).package

    def function(self, name: str) -> FunctionPlan:
        return next(f for f in self.functions + self.templates if f.name == name)

    @property
    def conversions(self) -> list[FunctionPlan]:
        """The functions traced and converted: the templates, or else every function."""
        return self.templates or self.functions


@dataclass(frozen=True)
class CompressionPlan:
    """The compression rules (a preset's or the user's) and what they give each weight."""
    preset: str | None  # None: the rules came from --compression-config
    rules: list[Rule]
    schemes: dict[str, Scheme]  # checkpoint key -> scheme, for the weights stored compressed


@dataclass
class ExportPlan:
    """Everything decided from the options and configs before any weight is read."""
    target_dir: Path
    drafter_dir: Path | None
    configs: CheckedConfigs
    spec: SpeculativeDecoding | None
    max_query: int
    assets: list[AssetPlan]
    compression: CompressionPlan | None = None
    context_length: int = DEFAULT_CONTEXT_LENGTH  # capacity of the global KV caches
    kv_write: KVWrite = KVWrite.BLEND  # how main and prefill write the global caches

    @property
    def target_cfg(self) -> TargetConfig:
        return self.configs.target

    def asset(self, role: str) -> AssetPlan:
        return next(p for p in self.assets if p.role == role)

    def packages(self) -> dict[str, list[AssetPlan]]:
        """Package path -> the assets it holds, its owner (whose default function is the
        package's) first."""
        grouped: dict[str, list[AssetPlan]] = {}
        for asset in self.assets:
            grouped.setdefault(asset.path, []).append(asset)
        return grouped


def plan_export(options: ExportOptions, target_dir: Path, drafter_dir: Path | None) -> ExportPlan:
    """The export's one validation pass over the checkpoints (`checkpoint.configs.check_configs`:
    configs, drafter against target, token ids, encoder width), then the plan."""
    configs = check_configs(target_dir, drafter_dir if options.wants_drafter else None)
    context = context_length(options, Path(target_dir))
    spec = None
    if options.dflash_drafter or options.with_drafter:
        kind = DrafterKind.RING if options.with_drafter else DrafterKind.DFLASH
        if drafter_kind(configs.drafter) == DrafterKind.DFLASH2:
            if options.with_drafter:
                raise ExportError("--with-drafter: a DFlash2 drafter drafts whole blocks and "
                                  "has no ring form; export it with --dflash-drafter")
            kind = DrafterKind.DFLASH2
        spec = speculative_decoding(configs.drafter_raw, configs.drafter, kind,
                                    options.num_draft_tokens, context)
    block = spec.block_size if spec else 1
    decode_length = options.decode_length or block
    if options.dflash_drafter and decode_length != block:
        raise ExportError(
            f"--decode-length {decode_length} differs from the drafter's block of {block}; "
            "one main call verifies one block, so drop --decode-length (set the block with "
            "--num-draft-tokens)")
    if decode_length > context:
        raise ExportError(f"decode length {decode_length} exceeds --max-context-length "
                          f"{context}")
    tree_nodes = tree_node_count(options, block, context)
    max_query = max(options.prefill_length, decode_length, block, tree_nodes)
    buckets = context_buckets(options, context, max_query, configs.target)
    assets = _asset_plans(options, spec, decode_length, configs.target.layer_types, buckets,
                          tree_nodes, drafter_buckets=(
                              buckets if options.dflash_drafter
                              and configs.drafter.sliding_window is None else ()))
    if buckets and options.span_templates:
        span = template_span(context, max_query,
                             integers_of(configs.target, configs.drafter, spec))
        for asset in assets:
            if asset.buckets and span is not None:
                asset.templates = span_templates(asset, span, context)
    return ExportPlan(Path(target_dir), Path(drafter_dir) if drafter_dir else None, configs,
                      spec, max_query, assets,
                      compression_plan(options, Path(target_dir),
                                       Path(drafter_dir) if drafter_dir else None),
                      context, kv_write_strategy(options, configs.target))


def span_templates(asset: AssetPlan, span: int, capacity: int) -> list[FunctionPlan]:
    """One template per whole-capacity function of a bucketed asset, converted at `span`;
    each bucket's function and the whole-capacity one (its span the capacity) are written
    from it (export/spans.py)."""
    templates = []
    for whole in (f for f in asset.functions if f.bucket is None):
        written = tuple((bucket_function_name(whole.function, b), b) for b in asset.buckets)
        templates.append(dataclasses.replace(
            whole, name=f"{whole.function}_template", bucket=span,
            written=written + ((whole.name, capacity),)))
    return templates


def tree_node_count(options: ExportOptions, block: int, context: int) -> int:
    """Nodes of the target's `tree` function: --tree-nodes, by default the block of a DFlash
    export (a tree as wide as main costs what main costs); 0: none."""
    if not options.dflash_drafter:
        return 0
    nodes = block if options.tree_nodes is None else options.tree_nodes
    if nodes > context:
        raise ExportError(f"--tree-nodes {nodes} exceeds --max-context-length {context}")
    return nodes


def kv_write_strategy(options: ExportOptions, target: TargetConfig) -> KVWrite:
    """--kv-write, checked against the target: `slice` writes the global layers by position,
    so a target without global layers has nothing it could apply to."""
    strategy = KVWrite(options.kv_write)  # the value itself: options.check_flag_rules
    if strategy == KVWrite.SLICE and not target.global_layer_ids:
        raise ExportError(
            f"--kv-write {strategy}: this target has no global (full-attention) layers, only "
            f"sliding ones, which every strategy writes with the blend; use --kv-write "
            f"{KVWrite.BLEND}")
    return strategy


def context_buckets(options: ExportOptions, context: int, max_query: int,
                    target: TargetConfig) -> tuple[int, ...]:
    """The context buckets below the capacity `context` (docs/buckets.md): --context-buckets,
    or by default DEFAULT_BUCKETS contexts spaced evenly in log scale from
    SMALLEST_DEFAULT_BUCKET up to the capacity (doubling, for SmolLM2's 8192), rounded down to
    multiples of 32. A target without global layers has no context-sized cache to bucket."""
    if options.context_buckets is not None:
        check_context_buckets(options.context_buckets, context, max_query)
        chosen = tuple(b for b in options.context_buckets if b < context)
    else:
        chosen = default_context_buckets(context, max_query)
    if chosen and not target.global_layer_ids:
        if options.context_buckets is not None:
            raise ExportError("--context-buckets: this target has no global (full-attention) "
                              "layers, only sliding rings, whose cost does not grow with the "
                              "context; drop --context-buckets")
        return ()
    return chosen


def context_length(options: ExportOptions, target_dir: Path) -> int:
    """--max-context-length, or by default the positions the model was trained for
    (`max_position_embeddings`, rounded down to a multiple of 32) up to
    MAX_DEFAULT_CONTEXT_LENGTH, or DEFAULT_CONTEXT_LENGTH when the config does not say; an
    explicit length beyond them is refused (RoPE would be asked for angles it never saw)."""
    raw = read_config(target_dir)
    trained = (raw.get("text_config") or {}).get("max_position_embeddings",
                                                 raw.get("max_position_embeddings"))
    trained = trained if isinstance(trained, int) and trained > 0 else None
    if options.max_context_length is None:
        context = DEFAULT_CONTEXT_LENGTH
        if trained is not None:
            context = max(32, min(trained, MAX_DEFAULT_CONTEXT_LENGTH) // 32 * 32)
    else:
        context = options.max_context_length
        if trained is not None and context > trained:
            raise ExportError(
                f"--max-context-length {context} exceeds the model's max_position_embeddings "
                f"{trained} (the positions it was trained for); use at most "
                f"{max(32, trained // 32 * 32)}")
    check_context_length(context, options.prefill_length)
    return context


def exported_weight_shapes(options: ExportOptions, target_dir: Path,
                           drafter_dir: Path | None) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of every tensor the export stores (read from the safetensors
    headers): the target's text decoder, and of the drafter checkpoint the encoder (fused
    target) and the drafter's own layers (with a drafter)."""
    reader = SafetensorsReader(target_dir)
    ignored = tuple(p for family in TARGET_FAMILIES for p in family.ignored_prefixes)
    shapes = {key: reader.shape(key) for key in reader.keys() if not key.startswith(ignored)}
    if drafter_dir is not None and options.wants_drafter:
        reader = SafetensorsReader(drafter_dir)
        whole = options.dflash_drafter or options.with_drafter
        shapes.update({key: reader.shape(key) for key in reader.keys()
                       if whole or key.startswith(ENCODER_PREFIX)
                       or key in ZLAB_ENCODER_KEYS.values()})
    return shapes


def compression_plan(options: ExportOptions, target_dir: Path,
                     drafter_dir: Path | None) -> CompressionPlan | None:
    """None for an uncompressed export (--compression none, or neither flag)."""
    if options.compression_config is None and options.compression in (None, "none"):
        return None
    try:
        if options.compression_config is not None:
            preset, rules = None, read_rules(options.compression_config)
        else:
            preset, rules = options.compression, preset_rules(options.compression)
        schemes = compressed_weights(
            rules, exported_weight_shapes(options, target_dir, drafter_dir),
            strict=preset is None)
    except CompressionError as error:
        raise ExportError(str(error)) from error
    return CompressionPlan(preset, rules, schemes)


def speculative_decoding(
    drafter_raw: dict[str, Any],
    drafter_cfg: DFlashConfig,
    kind: DrafterKind,
    num_draft_tokens: int | None,
    context_length: int | None = None,
) -> SpeculativeDecoding:
    """Structural values come from the drafter's config (DFlashConfig reads them explicitly,
    flat or under dflash_config); runtime knobs from the command line override them.

    The exported block is the anchor plus `--num-draft-tokens` k (default:
    DEFAULT_NUM_DRAFT_TOKENS, or the config's block_size - 1 when that is smaller):
    `inject_kv`, `draft` and the target's `main` all take k + 1 tokens, so a short draft is
    verified by a short `main` call, not by a block_size one. k is at most the config's
    block_size - 1, the longest block the drafter was trained for. A full-attention drafter
    (no sliding_window) is written with the window `context_length`, the whole context its ring
    spans (models/dflash.py DFlashDrafter.window)."""
    trained_block = drafter_cfg.block_size
    hidden = drafter_raw.get("drafter_hidden_size", drafter_cfg.hidden_size)
    draft_tokens = (num_draft_tokens if num_draft_tokens is not None
                    else min(DEFAULT_NUM_DRAFT_TOKENS, trained_block - 1))
    if not 1 <= draft_tokens <= trained_block - 1:
        raise ExportError(
            f"--num-draft-tokens {draft_tokens} must be between 1 and the drafter's "
            f"block_size - 1 = {trained_block - 1} (the block is the anchor plus the drafted "
            "tokens)"
        )
    block_size = draft_tokens + 1
    if kind == DrafterKind.DFLASH2 and block_size < drafter_cfg.conv_kernel_size:
        raise ExportError(
            f"--num-draft-tokens {draft_tokens} makes a block of {block_size}, shorter than "
            f"the DFlash2 convolution kernel ({drafter_cfg.conv_kernel_size}); use at least "
            f"{drafter_cfg.conv_kernel_size - 1}")
    return SpeculativeDecoding(
        drafter_kind=kind,
        block_size=block_size,
        mask_token_id=drafter_cfg.mask_token_id,
        target_layer_ids=list(drafter_cfg.target_layer_ids),
        drafter_hidden_size=int(hidden),
        num_draft_tokens=int(draft_tokens),
        shared_embeddings=True,
        drafter=DrafterSettings(
            num_hidden_layers=drafter_cfg.num_hidden_layers,
            num_attention_heads=drafter_cfg.num_attention_heads,
            num_key_value_heads=drafter_cfg.num_key_value_heads,
            head_dim=drafter_cfg.head_dim,
            sliding_window=(drafter_cfg.sliding_window if drafter_cfg.sliding_window is not None
                            else context_length),
        ),
        dflash2=_dflash2_settings(drafter_cfg) if kind == DrafterKind.DFLASH2 else None,
    )


def _dflash2_settings(cfg: DFlash2Config) -> DFlash2Settings:
    return DFlash2Settings(
        conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
        selector_decoding=SelectorDecoding.GREEDY, output_multiplier=cfg.output_multiplier,
        final_logit_softcapping=cfg.final_logit_softcapping)


def _ids_function(name: FunctionName, role: FunctionRole, entry_point: str, length: int,
                  outputs: list[OutputName]) -> FunctionPlan:
    import numpy as np

    return FunctionPlan(
        name, role, entry_point,
        [InputPlan(InputName.INPUT_IDS, (1, length), np.int32),
         InputPlan(InputName.POSITION_IDS, (length,), np.int32)],
        outputs,
        (torch.zeros(1, length, dtype=torch.int32), torch.arange(length, dtype=torch.int32)),
        length)


def _tree_function(nodes: int, outputs: list[OutputName]) -> FunctionPlan:
    import numpy as np

    chain = torch.tril(torch.ones(nodes, nodes, dtype=torch.int32))
    return FunctionPlan(
        FunctionName.TREE, FunctionRole.TREE, "forward",
        [InputPlan(InputName.INPUT_IDS, (1, nodes), np.int32),
         InputPlan(InputName.POSITION_IDS, (nodes,), np.int32),
         InputPlan(InputName.TREE_MASK, (nodes, nodes), np.int32)],
        outputs,
        (torch.zeros(1, nodes, dtype=torch.int32), torch.arange(nodes, dtype=torch.int32), chain),
        nodes)


def _inject_function(block: int, width: int) -> FunctionPlan:
    import numpy as np

    return FunctionPlan(
        FunctionName.INJECT_KV, FunctionRole.INJECT_KV, "inject_kv",
        [InputPlan(InputName.FEATURES, (1, block, width), np.float16),
         InputPlan(InputName.POSITION_IDS, (block,), np.int32)],
        [OutputName.LAST_INJECTED_POSITION],
        (torch.zeros(1, block, width, dtype=TRACE_DTYPE), torch.arange(block, dtype=torch.int32)),
        block)


def _asset_plans(options: ExportOptions, spec: SpeculativeDecoding | None,
                 decode_length: int, layer_types: list[str],
                 buckets: tuple[int, ...] = (), tree_nodes: int = 0,
                 drafter_buckets: tuple[int, ...] = ()) -> list[AssetPlan]:
    """The assets' functions, each bucket's smallest first (as bundle.Asset.function_table
    lists them). A full-attention DFlash drafter's ring is as long as the context, so its
    functions get the target's buckets (`drafter_buckets`); a sliding ring's cost is fixed."""
    fused = options.fused_target
    target_outputs = [OutputName.LOGITS] + ([OutputName.DRAFTER_FEATURES] if fused else [])
    whole = [
        _ids_function(FunctionName.MAIN, FunctionRole.DECODE, "forward", decode_length,
                      target_outputs),
        _ids_function(FunctionName.PREFILL, FunctionRole.PREFILL, "prefill",
                      options.prefill_length, target_outputs),
    ]
    if decode_length > 1:
        # Target-alone steps (--no-draft) in one token's cost, not a verify block's.
        whole.append(_ids_function(FunctionName.DECODE, FunctionRole.DECODE, "forward", 1,
                                   target_outputs))
    if tree_nodes:
        # The verify of a token tree (docs/trees.md), beside the chain's main.
        whole.append(_tree_function(tree_nodes, target_outputs))
    # Smallest bucket first, as bundle.Asset.function_table lists them.
    assets = [AssetPlan(
        AssetRole.TARGET, AssetKind.FUSED_TARGET if fused else AssetKind.TARGET, "target",
        target_states(layer_types), FunctionName.MAIN,
        [f.in_bucket(b) for b in buckets for f in whole] + whole, buckets=buckets)]
    if options.dflash_drafter:
        draft_outputs = [OutputName.LOGITS] + (
            [OutputName.DRAFT_TOKENS] if spec.drafter_kind == DrafterKind.DFLASH2 else [])
        drafter = [
            _inject_function(spec.block_size, spec.drafter_hidden_size),
            _ids_function(FunctionName.DRAFT, FunctionRole.DRAFT, "draft", spec.block_size,
                          draft_outputs),
        ]
        # In the target's package: the borrowed embedding and lm_head are stored once.
        assets.append(AssetPlan(
            AssetRole.DFLASH_DRAFTER, AssetKind.DFLASH_DRAFTER, "drafter", DRAFTER_STATES,
            FunctionName.DRAFT,
            [f.in_bucket(b) for b in drafter_buckets for f in drafter] + drafter,
            path=AssetRole.TARGET.package, buckets=drafter_buckets))
    elif options.with_drafter:
        assets.append(AssetPlan(
            AssetRole.RING_DRAFTER, AssetKind.RING_DRAFTER, "drafter", RING_DRAFTER_STATES,
            FunctionName.MAIN, [
                _ids_function(FunctionName.MAIN, FunctionRole.DECODE, "decode", 1,
                              [OutputName.LOGITS]),
            ]))
    return assets


def module_weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def load_modules(options: ExportOptions, plan: ExportPlan, progress: Progress,
                 placeholders: PlaceholderWeights | None,
                 numerics: GraphNumerics | None = None) -> dict[str, torch.nn.Module]:
    """The modules to trace, with `placeholders` standing in for the large weights (each
    placeholder is derived from its tensor's name, so every process makes the same ones), their
    norms and residual scales as the fp16 range audit chose (`numerics`; export.fp16_range)."""
    numerics = numerics or GraphNumerics()
    with progress.stage("load", "target") as info:
        target = load_target(
            plan.target_dir,
            plan.drafter_dir if options.fused_target else None,
            dtype=TRACE_DTYPE,
            max_context=plan.context_length,
            max_query_len=plan.max_query,
            placeholders=placeholders,
            kv_write=plan.kv_write,
            norm_form=numerics.norm,
            residual_scale=numerics.target_residual_scale,
        )
        fold_norm_weights(target, numerics.folded_norms)
        info["bytes"] = module_weight_bytes(target)
    modules = {"target": target}
    if options.dflash_drafter or options.with_drafter:
        with progress.stage("load", "drafter") as info:
            modules["drafter"] = load_drafter(
                plan.drafter_dir, target, target_dir=plan.target_dir, dtype=TRACE_DTYPE,
                max_context=plan.context_length, max_query_len=plan.max_query,
                ring=options.with_drafter, placeholders=placeholders, norm_form=numerics.norm,
                residual_scale=numerics.drafter_residual_scale)
            borrowed = [target.embed_tokens] + ([target.lm_head] if target.lm_head else [])
            info["bytes"] = module_weight_bytes(modules["drafter"]) - sum(
                module_weight_bytes(m) for m in borrowed)
    return modules

