"""Export a speculative-decoding bundle: fused target + DFlash (or ring) drafter + metadata.json.

Pipeline: plan (configs cross-checked, every package and function decided) -> load (safetensors,
large weights replaced by placeholders) -> per function, possibly in a helper process: trace
(torch.export of one small entry-point view) -> convert (coremltools, ML program, iOS18, fp16
states) into a single-function package -> save (the functions merged into one multifunction
package per asset, real weights streamed in, metadata embedded). Everything is validated before
any work and written into a staging directory that replaces the destination only at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from museflash import __version__
from museflash.atomic_output import check_destination, publish_directory
from museflash.checkpoint import (
    CheckpointError,
    PlaceholderWeights,
    load_drafter,
    load_target,
    read_config,
)
from museflash.models.dflash import DFlashConfig, validate_drafter_against_target
from museflash.models.muse_glimmer import MuseGlimmerConfig
from museflash.multifunction import MergeError, merge_packages
from museflash.parallel_conversion import conversion_helpers, run_conversions

METADATA_SCHEMA_VERSION = 1
METADATA_FILE = "metadata.json"
EMBEDDED_METADATA_KEY = "museflash.metadata"
BUILTIN_DEMO = "builtin:demo"

TARGET_STATES = ("globalKeyCache", "globalValueCache", "slidingKeyCache", "slidingValueCache")
DRAFTER_STATES = ("slidingKeyCache", "slidingValueCache")

# Core ML has no bfloat16: weights are converted to fp16 once, while loading.
TRACE_DTYPE = torch.float16
DISABLE_BF16_CAST_ENV = "DISABLE_BFLOAT16_CAST_FOR_LOGITS"


class ExportError(ValueError):
    """The export cannot proceed; the message names the problem and the fix."""


@dataclass
class ExportOptions:
    output_dir: Path
    checkpoint: Path | None = None
    drafter_checkpoint: Path | None = None
    overwrite: bool = False
    fused_target: bool = False
    dflash_drafter: bool = False
    with_drafter: bool = False
    num_draft_tokens: int | None = None
    max_context_length: int = 512
    prefill_length: int = 32
    decode_length: int | None = None
    model_name: str | None = None
    # Processes converting functions at once, this one included; None: up to 2 (CPU count).
    conversion_processes: int | None = None


# --- Validation (runs before any work) -----------------------------------------------------


def check_flag_rules(options: ExportOptions) -> None:
    if options.dflash_drafter and options.with_drafter:
        raise ExportError(
            "--dflash-drafter and --with-drafter are mutually exclusive: pick the DFlash drafter "
            "or the older ring drafter"
        )
    if options.dflash_drafter and not options.fused_target:
        raise ExportError(
            "--dflash-drafter requires --fused-target (the drafter reads the target's "
            "drafter_features output)"
        )
    if options.drafter_checkpoint is not None and not (
        options.dflash_drafter or options.with_drafter or options.fused_target
    ):
        raise ExportError(
            "--drafter-checkpoint is only used with --fused-target, --dflash-drafter or "
            "--with-drafter"
        )
    if (options.checkpoint is None) != (options.drafter_checkpoint is None) and (
        options.fused_target or options.dflash_drafter or options.with_drafter
    ):
        raise ExportError(
            "give both --checkpoint and --drafter-checkpoint, or neither (the built-in demo "
            "pair); a target and a drafter from different sources would be mixed"
        )
    if options.conversion_processes is not None and options.conversion_processes < 1:
        raise ExportError(f"--conversion-processes {options.conversion_processes} must be at "
                          "least 1 (1 converts every function in this process)")
    for name in ("max_context_length", "prefill_length"):
        if getattr(options, name) < 1:
            raise ExportError(f"--{name.replace('_', '-')} must be at least 1")
    if options.max_context_length % 32:
        suggestion = -(-options.max_context_length // 32) * 32
        raise ExportError(
            f"--max-context-length {options.max_context_length} is not a multiple of 32 (the "
            f"global KV cache is a Core ML state and the Neural Engine wants state dimensions "
            f"in multiples of 32); use {suggestion}"
        )
    if options.prefill_length > options.max_context_length:
        raise ExportError(
            f"--prefill-length {options.prefill_length} exceeds --max-context-length "
            f"{options.max_context_length}"
        )
    for flag, path in (("--checkpoint", options.checkpoint),
                       ("--drafter-checkpoint", options.drafter_checkpoint)):
        if path is not None and not Path(path).is_dir():
            raise ExportError(f"{flag} {path} is not a directory; point it at the checkpoint "
                              "folder that holds config.json and the safetensors files")


def wants_drafter(options: ExportOptions) -> bool:
    return options.fused_target or options.dflash_drafter or options.with_drafter


def speculative_decoding_block(
    drafter_raw: dict[str, Any],
    drafter_cfg: DFlashConfig,
    kind: str,
    num_draft_tokens: int | None,
) -> dict[str, Any]:
    """Structural values come from the drafter's config.json, explicitly; runtime knobs from the
    command line override them."""
    sources = [drafter_raw, drafter_raw.get("dflash_config") or {}]

    def stated(*names: str) -> Any:
        for source in sources:
            for name in names:
                if source.get(name) is not None:
                    return source[name]
        raise ExportError(f"drafter config.json states none of {list(names)}; add it")

    block_size = int(stated("block_size"))
    hidden = drafter_raw.get("drafter_hidden_size", drafter_raw.get("hidden_size"))
    if hidden is None:
        raise ExportError("drafter config.json states neither drafter_hidden_size nor hidden_size")
    draft_tokens = num_draft_tokens if num_draft_tokens is not None else block_size - 1
    if not 1 <= draft_tokens <= block_size - 1:
        raise ExportError(
            f"--num-draft-tokens {draft_tokens} must be between 1 and block_size - 1 = "
            f"{block_size - 1} (the block is the anchor plus the drafted tokens)"
        )
    return {
        "drafter_kind": kind,
        "block_size": block_size,
        "mask_token_id": int(stated("mask_token_id", "draft_mask_token_id")),
        "target_layer_ids": [int(i) for i in stated("target_layer_ids")],
        "drafter_hidden_size": int(hidden),
        "num_draft_tokens": int(draft_tokens),
        "shared_embeddings": True,
        "drafter": {
            "num_hidden_layers": drafter_cfg.num_hidden_layers,
            "num_attention_heads": drafter_cfg.num_attention_heads,
            "num_key_value_heads": drafter_cfg.num_key_value_heads,
            "head_dim": drafter_cfg.head_dim,
            "sliding_window": drafter_cfg.sliding_window,
        },
    }


# --- Progress --------------------------------------------------------------------------------


class Progress:
    """One line per stage with elapsed time and bytes, on stdout."""

    def __init__(self, echo=print):
        self.echo = echo
        self.start = time.monotonic()
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        """Echoes one line whole, also when helper threads report at the same time."""
        with self._lock:
            self.echo(line)

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[dict[str, Any]]:
        began = time.monotonic()
        info: dict[str, Any] = {}
        yield info
        took = time.monotonic() - began
        size = f", {_human_bytes(info['bytes'])}" if "bytes" in info else ""
        extra = f" ({detail})" if detail else ""
        self.say(f"[export] {name}{extra}: {took:.1f} s{size} "
                  f"[total {time.monotonic() - self.start:.1f} s]")


def _human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError("unreachable")


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def module_weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# --- Tracing and conversion ------------------------------------------------------------------


def _cast_bf16_outputs(_module, _inputs, output):
    """bf16 graph outputs become fp16 (Core ML has no bf16 I/O), every element of tuple and
    list outputs included; DISABLE_BFLOAT16_CAST_FOR_LOGITS=1 leaves them alone."""
    if os.environ.get(DISABLE_BF16_CAST_ENV) == "1":
        return output

    def cast(value):
        if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
            return value.to(torch.float16)
        if isinstance(value, (tuple, list)):
            return type(value)(cast(v) for v in value)
        return value

    return cast(output)


def trace(module: torch.nn.Module, example_args: tuple) -> torch.export.ExportedProgram:
    # A forward hook, not a wrapper module: a wrapper would rename the buffers ("m.x") and
    # with them the Core ML state names.
    handle = module.register_forward_hook(_cast_bf16_outputs)
    try:
        with torch.no_grad():
            return torch.export.export(module, example_args).run_decompositions({})
    finally:
        handle.remove()


def check_no_data_dependent_scalars(program: torch.export.ExportedProgram) -> None:
    """The position contract promises no tensor-to-scalar reads in the graph."""
    banned = {"aten._local_scalar_dense", "aten.item"}
    found = sorted({str(node.target) for node in program.graph.nodes
                    if node.op == "call_function"
                    and any(str(node.target).startswith(b) for b in banned)})
    if found:
        raise ExportError(f"exported graph contains data-dependent scalar reads {found}")


def convert(
    program: torch.export.ExportedProgram,
    inputs: list,
    outputs: list[str],
    module: torch.nn.Module,
    state_names: tuple[str, ...],
    validate_every_pass: bool = False,
):
    import coremltools as ct

    mutated = set(program.graph_signature.buffers_to_mutate.values())
    if mutated != set(state_names):
        raise ExportError(
            f"entry point writes caches {sorted(mutated)} but the package declares states "
            f"{sorted(state_names)}; every function must write every shared cache"
        )
    states = [
        ct.StateType(
            wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16),
            name=n,
        )
        for n in state_names
    ]
    with nullcontext() if validate_every_pass else validated_once_per_pipeline():
        return ct.convert(
            program,
            inputs=list(inputs),  # ct.convert appends the states to the list it is given
            outputs=[ct.TensorType(name=n, dtype=_output_dtype(n)) for n in outputs],
            states=states,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16,
            skip_model_load=True,
        )


@contextmanager
def validated_once_per_pipeline() -> Iterator[None]:
    """coremltools validates the whole program after every graph pass (~110 per function);
    measured, that is a third of conversion time, and it grows with ops x fan-out. The checks
    have no side effects, so inside this block they run once after each pipeline instead: an
    invalid program still fails, only later. The output is unchanged
    (the benchmark compares it with a plain conversion)."""
    from coremltools.converters.mil.mil.passes import pass_pipeline
    from coremltools.converters.mil.mil.program import Program

    manager = pass_pipeline.PassPipelineManager
    original_apply = manager.apply_pipeline
    original_validate = Program.validate

    def apply_validating_at_the_ends(prog, pipeline):
        Program.validate = lambda self, check_essential_scope=False: None
        try:
            original_apply(prog, pipeline)
        finally:
            Program.validate = original_validate
        prog.validate(check_essential_scope=True)

    manager.apply_pipeline = staticmethod(apply_validating_at_the_ends)
    try:
        yield
    finally:
        manager.apply_pipeline = staticmethod(original_apply)


def _output_dtype(name: str):
    return np.int32 if name == "last_injected_position" else np.float16


def _int_inputs(first: str, length: int) -> list:
    import coremltools as ct

    return [
        ct.TensorType(name=first, shape=(1, length), dtype=np.int32),
        ct.TensorType(name="position_ids", shape=(length,), dtype=np.int32),
    ]


def _features_inputs(length: int, width: int) -> list:
    import coremltools as ct

    return [
        ct.TensorType(name="features", shape=(1, length, width), dtype=np.float16),
        ct.TensorType(name="position_ids", shape=(length,), dtype=np.int32),
    ]


def _example_ids(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, length, dtype=torch.int32), torch.arange(length, dtype=torch.int32)


@dataclass
class FunctionPlan:
    name: str  # Core ML function name
    role: str
    entry_point: str  # module entry point
    inputs: list
    input_names: list[str]
    outputs: list[str]
    example_args: tuple
    query_length: int


@dataclass
class PackagePlan:
    asset: str  # key in metadata["assets"]; the package is f"{asset}.mlpackage"
    kind: str  # metadata asset kind
    module: str  # "target" or "drafter"
    states: tuple[str, ...]
    default_function: str
    functions: list[FunctionPlan]

    @property
    def file_name(self) -> str:
        return f"{self.asset}.mlpackage"

    def function(self, name: str) -> FunctionPlan:
        return next(f for f in self.functions if f.name == name)


@dataclass
class ExportPlan:
    """Everything decided from the options and configs before any weight is read."""
    target_dir: Path
    drafter_dir: Path | None
    target_cfg: MuseGlimmerConfig
    spec: dict[str, Any] | None  # the speculative_decoding block
    max_query: int
    packages: list[PackagePlan]

    def package(self, asset: str) -> PackagePlan:
        return next(p for p in self.packages if p.asset == asset)


def plan_export(options: ExportOptions, target_dir: Path, drafter_dir: Path | None) -> ExportPlan:
    use_drafter = wants_drafter(options)
    target_cfg, drafter_raw, drafter_cfg = prepare(
        options, target_dir, drafter_dir if use_drafter else None
    )
    spec = None
    if use_drafter:
        kind = "ring" if options.with_drafter else "dflash"
        spec = speculative_decoding_block(drafter_raw, drafter_cfg, kind,
                                          options.num_draft_tokens)
    block = spec["block_size"] if spec else 1
    decode_length = options.decode_length or block
    if decode_length > options.max_context_length:
        raise ExportError(f"decode length {decode_length} exceeds --max-context-length "
                          f"{options.max_context_length}")
    max_query = max(options.prefill_length, decode_length, block)
    return ExportPlan(Path(target_dir), Path(drafter_dir) if drafter_dir else None, target_cfg,
                      spec, max_query, _package_plans(options, spec, decode_length))


def _package_plans(options: ExportOptions, spec: dict[str, Any] | None,
                   decode_length: int) -> list[PackagePlan]:
    fused = options.fused_target
    target_outputs = ["logits", "drafter_features"] if fused else ["logits"]
    packages = [PackagePlan("target", "fused_target" if fused else "target", "target",
                            TARGET_STATES, "main", [
        FunctionPlan("main", "decode", "forward", _int_inputs("input_ids", decode_length),
                     ["input_ids", "position_ids"], target_outputs,
                     _example_ids(decode_length), decode_length),
        FunctionPlan("prefill", "prefill", "prefill",
                     _int_inputs("input_ids", options.prefill_length),
                     ["input_ids", "position_ids"], target_outputs,
                     _example_ids(options.prefill_length), options.prefill_length),
    ])]
    if options.dflash_drafter:
        block = spec["block_size"]
        width = spec["drafter_hidden_size"]
        packages.append(PackagePlan("dflash_drafter", "dflash_drafter", "drafter",
                                    DRAFTER_STATES, "draft", [
            FunctionPlan("inject_kv", "inject_kv", "inject_kv", _features_inputs(block, width),
                         ["features", "position_ids"], ["last_injected_position"],
                         (torch.zeros(1, block, width, dtype=TRACE_DTYPE),
                          torch.arange(block, dtype=torch.int32)), block),
            FunctionPlan("draft", "draft", "draft", _int_inputs("input_ids", block),
                         ["input_ids", "position_ids"], ["logits"], _example_ids(block), block),
        ]))
    elif options.with_drafter:
        packages.append(PackagePlan("ring_drafter", "ring_drafter", "drafter", DRAFTER_STATES,
                                    "main", [
            FunctionPlan("main", "decode", "decode", _int_inputs("input_ids", 1),
                         ["input_ids", "position_ids"], ["logits"], _example_ids(1), 1),
        ]))
    return packages


def load_modules(options: ExportOptions, plan: ExportPlan, progress: Progress,
                 placeholders: PlaceholderWeights | None) -> dict[str, torch.nn.Module]:
    """The modules to trace, with `placeholders` standing in for the large weights. Every
    process that converts part of the export loads them the same way, in the same order, so
    its placeholders are the same rows."""
    with progress.stage("load", "target") as info:
        target = load_target(
            plan.target_dir,
            plan.drafter_dir if options.fused_target else None,
            dtype=TRACE_DTYPE,
            max_context=options.max_context_length,
            max_query_len=plan.max_query,
            placeholders=placeholders,
        )
        info["bytes"] = module_weight_bytes(target)
    modules = {"target": target}
    if options.dflash_drafter or options.with_drafter:
        with progress.stage("load", "drafter") as info:
            modules["drafter"] = load_drafter(
                plan.drafter_dir, target, target_dir=plan.target_dir, dtype=TRACE_DTYPE,
                max_context=options.max_context_length, max_query_len=plan.max_query,
                ring=options.with_drafter, placeholders=placeholders)
            info["bytes"] = module_weight_bytes(modules["drafter"]) - module_weight_bytes(
                target.embed_tokens) - (module_weight_bytes(target.lm_head)
                                        if target.lm_head is not None else 0)
    return modules


def convert_function(module: torch.nn.Module, package: PackagePlan, function: FunctionPlan,
                     part: Path, progress: Progress, where: str = "") -> None:
    """Traces and converts one entry point into the single-function package `part`."""
    label = f"{package.asset}.{function.name}" + (f", {where}" if where else "")
    view = module.with_entry_point(function.entry_point)
    with progress.stage("trace", label):
        program = trace(view, function.example_args)
        check_no_data_dependent_scalars(program)
    with progress.stage("convert", label) as info:
        model = convert(program, function.inputs, function.outputs, module, package.states)
        del program
        # coremltools wrote the package to a temporary directory; keep it instead of copying.
        shutil.move(model.package_path, part)
        model.is_temp_package = False
        del model
        info["bytes"] = tree_bytes(part)


def part_path(parts_dir: Path, package: PackagePlan, function: FunctionPlan) -> Path:
    return Path(parts_dir) / package.asset / f"{function.name}.mlpackage"


def save_package(package: PackagePlan, parts_dir: Path, destination: Path,
                 modules: dict[str, torch.nn.Module], placeholders: PlaceholderWeights,
                 progress: Progress) -> None:
    """Merges the package's converted functions into one multifunction package
    (`multifunction.merge_packages`: identical weights are stored once, as save_multifunction
    stores them, without loading any weight back); the placeholders' real values are read from
    the checkpoint into its weight file one tensor at a time."""
    with progress.stage("save", package.file_name) as info:
        module = modules[package.module]
        expected = {placeholders.row_of(p) for p in module.parameters()} - {None}
        parts = [(f.name, part_path(parts_dir, package, f)) for f in package.functions]
        try:
            merge_packages(parts, destination, package.default_function, placeholders,
                           expected)
        except MergeError as error:
            raise ExportError(str(error)) from error
        info["bytes"] = tree_bytes(destination)


def embed_metadata(package: Path, metadata: dict[str, Any]) -> None:
    """save_multifunction drops user-defined metadata; write it into the spec directly (the
    weights are untouched, and the package is never re-saved onto its own path)."""
    from coremltools.proto import Model_pb2

    spec_path = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_path.read_bytes())
    described = spec.description.metadata
    described.shortDescription = f"{metadata['model_name']} exported by museflash"
    described.versionString = metadata["generator"]["version"]
    described.userDefined[EMBEDDED_METADATA_KEY] = json.dumps(metadata, sort_keys=True)
    spec_path.write_bytes(spec.SerializeToString())


# --- The bundle ------------------------------------------------------------------------------


def _state_entries(module: torch.nn.Module, names: tuple[str, ...], ring: set[str]):
    entries = []
    for name in names:
        shape = list(getattr(module, name).shape)
        entries.append({
            "name": name,
            "kind": "sliding_kv" if name in ring else "global_kv",
            "role": "key" if "Key" in name else "value",
            "shape": shape,
            "dtype": "float16",
            "layers": shape[-4],
            "kv_heads": shape[-3],
            "capacity": shape[-2],
            "head_dim": shape[-1],
        })
    return entries


def _asset(path: str, kind: str, default: str, plans: list[FunctionPlan], states) -> dict:
    return {
        "path": path,
        "kind": kind,
        "default_function": default,
        "functions": {
            p.name: {"role": p.role, "query_length": p.query_length,
                     "inputs": p.input_names, "outputs": p.outputs}
            for p in plans
        },
        "states": states,
    }


def _target_settings(cfg: MuseGlimmerConfig) -> dict[str, Any]:
    return {
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "final_logit_softcapping": cfg.final_logit_softcapping,
    }


@contextmanager
def _checkpoint_sources(options: ExportOptions) -> Iterator[tuple[Path, Path | None, dict]]:
    """The user's checkpoints, or the built-in demo pair written to a temporary directory in
    the real on-disk layout (so the demo goes through the same loader)."""
    if options.checkpoint is not None:
        drafter = options.drafter_checkpoint
        yield Path(options.checkpoint), drafter, {
            "checkpoint": str(Path(options.checkpoint).absolute()),
            "drafter_checkpoint": str(Path(drafter).absolute()) if drafter else None,
        }
        return
    from museflash.demo_checkpoint import write_demo_checkpoints

    with tempfile.TemporaryDirectory(prefix="museflash-demo-") as scratch:
        target_dir, drafter_dir = write_demo_checkpoints(scratch)
        yield target_dir, drafter_dir, {"checkpoint": BUILTIN_DEMO,
                                        "drafter_checkpoint": BUILTIN_DEMO}


def prepare(options: ExportOptions, target_dir: Path, drafter_dir: Path | None):
    """Reads and cross-checks both configs; returns (target_cfg, drafter_raw, drafter_cfg)."""
    try:
        target_cfg = MuseGlimmerConfig.from_dict(read_config(target_dir))
    except CheckpointError:
        raise
    except ValueError as error:
        raise ExportError(f"target {target_dir / 'config.json'}: {error}") from error
    if drafter_dir is None:
        return target_cfg, None, None
    drafter_raw = read_config(drafter_dir)
    validate_drafter_against_target(drafter_raw, target_cfg)
    try:
        drafter_cfg = DFlashConfig.from_dict(drafter_raw)
    except ValueError as error:
        raise ExportError(f"drafter {drafter_dir / 'config.json'}: {error}") from error
    return target_cfg, drafter_raw, drafter_cfg


def export_bundle(options: ExportOptions, progress: Progress | None = None) -> Path:
    """Runs the whole export; returns the published output directory."""
    progress = progress or Progress()
    check_flag_rules(options)
    check_destination(options.output_dir, options.overwrite)
    with _checkpoint_sources(options) as (target_dir, drafter_dir, source):
        plan = plan_export(options, target_dir, drafter_dir)
        with publish_directory(options.output_dir, options.overwrite) as staging:
            parts_dir = staging / ".parts"
            with conversion_helpers(options, plan, progress) as helpers:
                # The large weights stay on disk until the packages are written (see
                # docs/export-memory.md); only their stand-ins are traced and converted.
                placeholders = PlaceholderWeights()
                modules = load_modules(options, plan, progress, placeholders)
                jobs = [(package, function, part_path(parts_dir, package, function))
                        for package in plan.packages for function in package.functions]
                for package in plan.packages:
                    (parts_dir / package.asset).mkdir(parents=True)

                def convert_here(job) -> None:
                    package, function, part = job
                    convert_function(modules[package.module], package, function, part, progress)

                run_conversions(jobs, convert_here, helpers)
            for package in plan.packages:
                save_package(package, parts_dir, staging / package.file_name, modules,
                             placeholders, progress)
            shutil.rmtree(parts_dir)
            metadata = _metadata(options, plan, modules, source)
            for asset in metadata["assets"].values():
                embed_metadata(staging / asset["path"], metadata)
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        progress.say(f"[export] wrote {options.output_dir} "
                      f"({_human_bytes(tree_bytes(options.output_dir))})")
    return Path(options.output_dir)


def _metadata(options: ExportOptions, plan: ExportPlan, modules: dict[str, torch.nn.Module],
              source: dict[str, Any]) -> dict[str, Any]:
    ring_names = {"slidingKeyCache", "slidingValueCache"}
    assets = {
        package.asset: _asset(package.file_name, package.kind, package.default_function,
                              package.functions,
                              _state_entries(modules[package.module], package.states,
                                             ring_names))
        for package in plan.packages
    }
    return {
        "schema_version": METADATA_SCHEMA_VERSION,
        "generator": {"name": "museflash", "version": __version__},
        "model_name": options.model_name or _default_model_name(source),
        "vocab_size": plan.target_cfg.vocab_size,
        "context_length": options.max_context_length,
        "compute_precision": "float16",
        "target": _target_settings(plan.target_cfg),
        "assets": assets,
        "speculative_decoding": plan.spec,
        "source": source,
    }


def _default_model_name(source: dict[str, Any]) -> str:
    if source["checkpoint"] == BUILTIN_DEMO:
        return "muse-glimmer-demo"
    return Path(source["checkpoint"]).name

