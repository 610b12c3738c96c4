"""Export a speculative-decoding bundle: fused target + DFlash (or ring) drafter + metadata.json.

`export_bundle` reads top-down, one stage per module of this package:
options (flags checked) -> plan (configs read and cross-checked once, every package and function
decided) -> load (safetensors, large weights replaced by placeholders) -> convert, per function,
possibly in a helper process (parallel): trace one small entry-point view with torch.export and
convert it (coremltools, ML program, iOS18, fp16 states) into a single-function package ->
merge (the functions of a package into one multifunction package, real weights streamed in) ->
describe (metadata.json, embedded in every package; the checkpoint's tokenizer files copied
beside it) -> publish (the staging directory replaces
the destination only at the end; nothing is half-written).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from museflash.bundle import BUILTIN_PREFIX, METADATA_FILE, Source
from museflash.checkpoint import PlaceholderWeights
from museflash.compression import Scheme
from museflash.export.convert import convert_function
from museflash.export.describe import bundle_metadata, embed_metadata
from museflash.export.merge import MergeError, StoredWeight, merge_packages
from museflash.export.options import ExportError, ExportOptions, check_flag_rules
from museflash.export.parallel import conversion_helpers, run_conversions
from museflash.export.plan import FunctionPlan, PackagePlan, load_modules, plan_export
from museflash.export.progress import Progress, human_bytes, tree_bytes
from museflash.export.publish import check_destination, publish_directory


def export_bundle(options: ExportOptions, progress: Progress | None = None) -> Path:
    """Runs the whole export; returns the published output directory."""
    progress = progress or Progress()
    check_flag_rules(options)
    check_destination(options.output_dir, options.overwrite)
    with checkpoint_sources(options) as (target_dir, drafter_dir, source):
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
                    (parts_dir / package.role).mkdir(parents=True)

                def convert_here(job) -> None:
                    package, function, part = job
                    convert_function(modules[package.module], package, function, part, progress)

                run_conversions(jobs, convert_here, helpers)
            schemes = plan.compression.schemes if plan.compression else {}
            stored = {package.role: save_package(package, parts_dir,
                                                 staging / package.file_name, modules,
                                                 placeholders, progress, schemes)
                      for package in plan.packages}
            shutil.rmtree(parts_dir)
            metadata = bundle_metadata(plan, modules, source, plan.context_length,
                                       options.model_name, stored)
            for package in plan.packages:
                embed_metadata(staging / package.file_name, metadata)
            for name in metadata.tokenizer.files if metadata.tokenizer else ():
                shutil.copyfile(plan.target_dir / name, staging / name)
            (staging / METADATA_FILE).write_text(metadata.dumps())
        progress.say(f"[export] wrote {options.output_dir} "
                     f"({human_bytes(tree_bytes(options.output_dir))})")
    return Path(options.output_dir)


@contextmanager
def checkpoint_sources(options: ExportOptions) -> Iterator[tuple[Path, Path | None, Source]]:
    """The user's checkpoints, or the built-in pair `options.builtin` (demo_checkpoint)."""
    if options.checkpoint is not None:
        drafter = options.drafter_checkpoint
        yield Path(options.checkpoint), drafter, Source(
            checkpoint=str(Path(options.checkpoint).absolute()),
            drafter_checkpoint=str(Path(drafter).absolute()) if drafter else None)
        return
    from museflash.demo_checkpoint import builtin_checkpoints

    name = BUILTIN_PREFIX + options.builtin
    with builtin_checkpoints(options.builtin) as (target_dir, drafter_dir):
        yield target_dir, drafter_dir, Source(checkpoint=name, drafter_checkpoint=name)


def part_path(parts_dir: Path, package: PackagePlan, function: FunctionPlan) -> Path:
    return Path(parts_dir) / package.role / f"{function.name}.mlpackage"


def save_package(package: PackagePlan, parts_dir: Path, destination: Path,
                 modules: dict[str, torch.nn.Module], placeholders: PlaceholderWeights,
                 progress: Progress,
                 schemes: Mapping[str, Scheme] | None = None) -> dict[str, StoredWeight]:
    """Merges the package's converted functions into one multifunction package
    (`merge.merge_packages`: identical weights are stored once, as save_multifunction
    stores them, without loading any weight back); the placeholders' real values are read from
    the checkpoint into its weight file one tensor at a time, compressed when `schemes` names
    them. Returns the real weights written, by checkpoint key."""
    with progress.stage("save", package.file_name) as info:
        module = modules[package.module]
        expected = {placeholders.row_of(p) for p in module.parameters()} - {None}
        parts = [(f.name, part_path(parts_dir, package, f)) for f in package.functions]
        stored: dict[str, StoredWeight] = {}
        try:
            merge_packages(parts, destination, package.default_function, placeholders,
                           expected, schemes, stored)
        except MergeError as error:
            raise ExportError(str(error)) from error
        info["bytes"] = tree_bytes(destination)
    return stored
