"""Export a speculative-decoding bundle: fused target + DFlash (or ring) drafter + metadata.json.

`export_bundle` reads top-down, one call per stage; the stages share one `ExportRun`, and each
stage's work is done by a module of this package (in brackets):

plan      the flags checked (options), the configs read and cross-checked once, every package
          and function decided (plan)
audit     the checkpoint run in fp32 eager on calibration sequences: per-layer activation
          peaks, the residual scales that keep fp16 in range, or a refusal (fp16_range)
publish   everything is built in a staging directory that replaces the destination only at the
          end, so nothing is ever half-written (publish)
load      the modules to trace, the large weights replaced by placeholders (plan,
          placeholders); a thread starts writing the real weights, fp16 or compressed, into
          each package's weight file (weights)
convert   per function, here or in a helper process (parallel): one small entry-point view
          traced with torch.export and converted (coremltools, ML program, iOS18, fp16 states)
          into a single-function package (convert); a function with context buckets once,
          at a template span, each bucket's package written from that conversion (spans)
merge     each package's functions into one multifunction package, its consts pointed at the
          real weights (merge); each --also-export bundle gets its own weights and merge of the
          same converted functions
check     the staged target's prefill and main run in the fp16 interpreter on the
          calibration tokens against fp32 eager; a program that disagrees is refused before
          anything is published (self_check)
describe  metadata.json, embedded in every package, and the checkpoint's tokenizer files
          copied beside it (describe)
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from museflash.bundle import (
    METADATA_FILE,
    AssetRole,
    Fp16Range,
    Metadata,
    NormForm,
    SelfCheck,
    Source,
    builtin_source,
)
from museflash.checkpoint.configs import read_config
from museflash.checkpoint.gguf import is_gguf, staged_checkpoint
from museflash.checkpoint.tensor_files import WeightLocation
from museflash.compression import Scheme
from museflash.export.convert import convert_function
from museflash.export.describe import bundle_metadata, embed_metadata, stable_manifest
from museflash.export.fp16_range import (
    GraphNumerics,
    audit_checkpoint,
    bos_token_id,
    calibration_name,
    calibration_sequences,
    read_calibration_prompts,
    summary,
)
from museflash.export.merge import MergeError, merge_packages
from museflash.export.options import ExportError, ExportOptions, check_flag_rules
from museflash.export.parallel import HelperProcess, conversion_helpers, run_conversions
from museflash.export.placeholders import PlaceholderWeights
from museflash.export.plan import (
    AssetPlan,
    ExportPlan,
    FunctionPlan,
    compression_plan,
    load_modules,
    plan_export,
)
from museflash.export.progress import Progress, human_bytes, tree_bytes
from museflash.export.publish import check_destination, publish_directories
from museflash.export.self_check import self_check
from museflash.export.weights import StoredWeight, WeightsAhead


def export_bundle(options: ExportOptions, progress: Progress | None = None) -> Path:
    """Runs the whole export, one call per stage; returns the published output directory."""
    progress = progress or Progress()
    check_flag_rules(options)
    for destination in options.output_dirs:
        check_destination(destination, options.overwrite)
    with checkpoint_sources(options) as (target_dir, drafter_dir, source):
        run = ExportRun(options, progress, source, plan_export(options, target_dir, drafter_dir))
        audit(run)
        with publish(run):
            # The large weights stay on disk until the packages are written (see
            # docs/export-memory.md): only their stand-ins are traced and converted, while a
            # thread per bundle (its writer) writes the real ones into each package's weight file.
            with ExitStack() as writers:
                for each in run.bundles:
                    each.writer = writers.enter_context(
                        WeightsAhead(each.schemes, progress, each.label))
                with conversion_helpers(options, run.plan, progress, run.numerics) as helpers:
                    load(run)
                    convert(run, helpers)
                for each in run.bundles:
                    merge(each, run.parts_dir)
            for each in run.bundles:
                shutil.rmtree(each.parts_dir)
                check(each)
                describe(each)
        for directory in options.output_dirs:
            progress.say(f"[export] wrote {directory} ({human_bytes(tree_bytes(directory))}); "
                         + memory_summary(Metadata.read(directory)))
    return Path(options.output_dir)


def memory_summary(metadata: Metadata) -> str:
    """What the bundle's states take in memory beside its weights: the KV caches are allocated
    at full capacity whatever a conversation fills (docs/buckets.md)."""
    states = sum(math.prod(state.shape) * 2  # fp16
                 for asset in metadata.assets.values() for state in asset.states)
    buckets = metadata.context_buckets()
    return (f"its KV states take {human_bytes(states)} of memory at {metadata.context_length} "
            f"positions; context buckets {', '.join(map(str, buckets))}")


@dataclass
class ExportRun:
    """What the stages of one export share: made from the plan, given the staging directory by
    `publish`, the modules and the weights each package needs by `load`, and what each package
    stores by `merge`; `describe` reads it all."""
    options: ExportOptions
    progress: Progress
    source: Source
    plan: ExportPlan
    staging: Path | None = None
    placeholders: PlaceholderWeights = field(default_factory=PlaceholderWeights)
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    # Per package path, by placeholder row: the real weights it must hold.
    needed: dict[str, dict[bytes, WeightLocation]] = field(default_factory=dict)
    # Per package, under its owner's role: the real weights its merge wrote, by checkpoint key.
    stored: dict[AssetRole, dict[str, StoredWeight]] = field(default_factory=dict)
    # What the fp16 range audit found and decided, and the sequences it ran.
    fp16_range: Fp16Range | None = None
    calibration: list[list[int]] = field(default_factory=list)
    self_check: SelfCheck | None = None
    numerics: GraphNumerics = field(default_factory=GraphNumerics)
    writer: WeightsAhead | None = None  # writes the real weights while the parts convert
    # The --also-export bundles (`also_export_run`): each shares this run's conversion and has
    # its own compression, staging directory, writer and merge.
    also: list[ExportRun] = field(default_factory=list)
    label: str = ""  # what the progress lines add for an --also-export bundle: its preset

    @property
    def bundles(self) -> list[ExportRun]:
        """This run and its --also-export runs: one per bundle written."""
        return [self, *self.also]

    @property
    def schemes(self) -> Mapping[str, Scheme]:
        """Checkpoint key -> scheme of each weight stored compressed."""
        return self.plan.compression.schemes if self.plan.compression else {}

    @property
    def parts_dir(self) -> Path:
        """The single-function packages, converted inside the staging directory (and the
        weight files written ahead)."""
        return self.staging / ".parts"


def also_export_run(run: ExportRun, preset: str, directory: Path) -> ExportRun:
    """The run of one --also-export bundle: the options and plan of `run` with the preset's
    compression and the other output directory; the modules, placeholders and audit shared."""
    options = replace(run.options, output_dir=Path(directory), compression=preset,
                      compression_config=None, also_export=())
    plan = replace(run.plan, compression=compression_plan(options, run.plan.target_dir,
                                                          run.plan.drafter_dir))
    return replace(run, options=options, plan=plan, staging=None, stored={}, writer=None,
                   also=[], label=preset)


@contextmanager
def publish(run: ExportRun) -> Iterator[None]:
    """The bundle is built in a staging directory beside the destination, which replaces the
    destination only when the block ends without an error (`publish.publish_directories`):
    nothing is ever half-written. With --also-export, every bundle is staged, and none is
    published unless all are complete."""
    run.also = [also_export_run(run, preset, directory)
                for preset, directory in run.options.also_export]
    with publish_directories([each.options.output_dir for each in run.bundles],
                             run.options.overwrite) as stagings:
        for each, staging in zip(run.bundles, stagings, strict=True):
            each.staging = staging
        yield


def audit(run: ExportRun) -> None:
    """The fp16 range audit (`fp16_range.audit_checkpoint`), before anything is written: the
    peaks go into metadata.json, the residual scales into every process's modules, and a
    checkpoint that cannot fit fp16 is refused here."""
    options, plan = run.options, run.plan
    prompts, calibration = None, "builtin"
    if options.calibration_prompts is not None:
        prompts, total = read_calibration_prompts(options.calibration_prompts)
        calibration = calibration_name(options.calibration_prompts, len(prompts), total)
    config = read_config(plan.target_dir)
    with run.progress.stage("audit", "fp16 range") as info:
        run.fp16_range, run.numerics = audit_checkpoint(
            plan.target_dir, plan.drafter_dir, fused=options.fused_target,
            with_drafter=options.dflash_drafter, context=plan.context_length,
            block=plan.spec.block_size if plan.spec else 1,
            vocab_size=plan.configs.target.vocab_size, config=config, prompts=prompts,
            calibration=calibration,
            norm=NormForm.PLAIN if options.legacy_fp16 else NormForm.MAX_ABS,
            scale=not options.legacy_fp16)
        info["summary"] = summary(run.fp16_range)
    run.calibration = calibration_sequences(
        plan.target_dir, bos_token_id(plan.target_dir, config), plan.configs.target.vocab_size,
        prompts, plan.context_length)


def load(run: ExportRun) -> None:
    """The modules to trace, with placeholders standing in for the large weights (each derived
    from its tensor's name, so the helper processes make the same ones); then every bundle's
    writer starts writing the real weights of each package."""
    run.modules = load_modules(run.options, run.plan, run.progress, run.placeholders,
                               run.numerics)
    for asset in run.plan.assets:
        (run.parts_dir / asset.role).mkdir(parents=True)
    run.needed = {path: package_placeholders(assets, run.modules, run.placeholders)
                  for path, assets in run.plan.packages().items()}
    for each in run.bundles:
        # The --also-export bundles hold the same weights, stored by their own compression.
        each.modules, each.needed = run.modules, run.needed
        each.parts_dir.mkdir(parents=True, exist_ok=True)
        each.writer.start({path: (each.parts_dir / f"{path}.weights", list(rows.values()))
                           for path, rows in each.needed.items()})


def convert(run: ExportRun, helpers: list[HelperProcess]) -> None:
    """Every function traced and converted into a single-function package, here or in a
    helper process, whichever is free first."""
    jobs = [(asset, function, part_path(run.parts_dir, asset, function))
            for asset in run.plan.assets for function in asset.conversions]

    def convert_here(job) -> None:
        for each in run.bundles:  # e.g. a NaN weight: no need to go on
            each.writer.raise_failure()
        asset, function, part = job
        convert_function(run.modules[asset.module], asset, function, part, run.progress)

    run_conversions(jobs, convert_here, helpers)


def merge(run: ExportRun, functions: Path) -> None:
    """Per package, the converted functions (under `functions`) of every asset sharing it
    merged into one multifunction package (`merge.merge_packages`: identical weights are
    stored once, as save_multifunction stores them, without loading any weight back; the
    target's embedding and lm_head, which the DFlash drafter borrows, are among them), its
    placeholder consts pointed at the real weights the run's writer wrote. The first asset
    owns the package (its default function is the package's)."""
    for path, assets in run.plan.packages().items():
        written = run.writer.result(path)
        destination = run.staging / path
        detail = f"{destination.name}, {run.label}" if run.label else destination.name
        with run.progress.stage("save", detail) as info:
            parts = [(f.name, part_path(functions, asset, f))
                     for asset in assets for f in asset.functions]
            try:
                run.stored[assets[0].role] = merge_packages(
                    parts, destination, assets[0].default_function, run.placeholders,
                    set(run.needed[path]), run.schemes, written)
            except MergeError as error:
                raise ExportError(str(error)) from error
            info["bytes"] = tree_bytes(destination)


def _metadata(run: ExportRun) -> Metadata:
    return replace(bundle_metadata(run.plan, run.modules, run.source, run.plan.context_length,
                                   run.options.model_name, run.stored, run.fp16_range),
                   self_check=run.self_check)


def check(run: ExportRun) -> None:
    """The self-check (`self_check.self_check`): the staged target's prefill and main against
    fp32 eager on the calibration tokens; a program that disagrees is refused here, before
    anything is published. --no-self-check records that it was skipped."""
    if not run.options.self_check:
        run.self_check = SelfCheck(checked=False, reason="--no-self-check")
        return
    metadata = _metadata(run)
    package = run.staging / metadata.asset(AssetRole.TARGET).path
    detail = f"{package.name}, {run.label}" if run.label else package.name
    with run.progress.stage("check", detail) as info:
        run.self_check = self_check(package, metadata, run.plan.target_dir, run.plan.drafter_dir,
                                    run.calibration, dict(run.schemes))
        record = run.self_check
        info["summary"] = (f"{', '.join(record.functions)} on {record.tokens} tokens: outputs "
                           f"rel {record.output_rel:.2g}, caches rel {record.state_rel:.2g}"
                           if record.checked else f"not run: {record.reason}")


def describe(run: ExportRun) -> None:
    """metadata.json, embedded in every package too, and the checkpoint's tokenizer files
    copied beside it."""
    metadata = _metadata(run)
    for path in run.plan.packages():
        embed_metadata(run.staging / path, metadata)
        stable_manifest(run.staging / path)
    for name in metadata.tokenizer.files if metadata.tokenizer else ():
        shutil.copyfile(run.plan.target_dir / name, run.staging / name)
    (run.staging / METADATA_FILE).write_text(metadata.dumps())


@contextmanager
def checkpoint_sources(options: ExportOptions) -> Iterator[tuple[Path, Path | None, Source]]:
    """The user's checkpoints (a GGUF target staged as a Hugging Face folder), or the built-in
    pair `options.builtin` (demo_checkpoint)."""
    if options.checkpoint is not None:
        drafter = options.drafter_checkpoint
        source = Source(checkpoint=str(Path(options.checkpoint).absolute()),
                        drafter_checkpoint=str(Path(drafter).absolute()) if drafter else None)
        if is_gguf(options.checkpoint):
            # Read into the Hugging Face layout in a temporary folder (checkpoint/gguf.py).
            with staged_checkpoint(options.checkpoint) as target_dir:
                yield target_dir, drafter, source
        else:
            yield Path(options.checkpoint), drafter, source
        return
    from museflash.builtin.demo_checkpoint import builtin_checkpoints

    name = builtin_source(options.builtin)
    with builtin_checkpoints(options.builtin) as (target_dir, drafter_dir):
        yield target_dir, drafter_dir, Source(checkpoint=name, drafter_checkpoint=name)


def part_path(parts_dir: Path, asset: AssetPlan, function: FunctionPlan) -> Path:
    return Path(parts_dir) / asset.role / f"{function.name}.mlpackage"


def package_placeholders(assets: list[AssetPlan], modules: dict[str, torch.nn.Module],
                         placeholders: PlaceholderWeights) -> dict[bytes, WeightLocation]:
    """The real weights one package must hold: every placeholder its assets' modules use, by
    placeholder row, in the order of the modules' parameters (a weight two modules share, as
    the DFlash drafter borrows the target's embedding, once)."""
    rows = (placeholders.row_of(p) for asset in assets for p in modules[asset.module].parameters())
    return {row: placeholders.by_row[row] for row in rows if row is not None}
