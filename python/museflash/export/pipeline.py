"""Export a speculative-decoding bundle: fused target + DFlash (or ring) drafter + metadata.json.

`export_bundle` reads top-down, one stage per module of this package:
options (flags checked) -> plan (configs read and cross-checked once, every package and function
decided) -> load (safetensors, large weights replaced by placeholders) -> convert, per function,
possibly in a helper process (parallel): trace one small entry-point view with torch.export and
convert it (coremltools, ML program, iOS18, fp16 states) into a single-function package, while
a thread writes the real weights, fp16 or compressed, into each package's weight file
(weights) -> merge (the functions of a package into one multifunction package, its consts
pointed at the real weights) ->
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

from museflash.bundle import METADATA_FILE, Source, builtin_source
from museflash.checkpoint.tensor_files import WeightLocation
from museflash.compression import Scheme
from museflash.export.convert import convert_function
from museflash.export.describe import bundle_metadata, embed_metadata
from museflash.export.merge import MergeError, merge_packages
from museflash.export.options import ExportError, ExportOptions, check_flag_rules
from museflash.export.parallel import conversion_helpers, run_conversions
from museflash.export.placeholders import PlaceholderWeights
from museflash.export.plan import AssetPlan, FunctionPlan, load_modules, plan_export
from museflash.export.progress import Progress, human_bytes, tree_bytes
from museflash.export.publish import check_destination, publish_directory
from museflash.export.weights import StoredWeight, WeightsAhead, WrittenWeights


def export_bundle(options: ExportOptions, progress: Progress | None = None) -> Path:
    """Runs the whole export; returns the published output directory."""
    progress = progress or Progress()
    check_flag_rules(options)
    check_destination(options.output_dir, options.overwrite)
    with checkpoint_sources(options) as (target_dir, drafter_dir, source):
        plan = plan_export(options, target_dir, drafter_dir)
        with publish_directory(options.output_dir, options.overwrite) as staging:
            parts_dir = staging / ".parts"
            schemes = plan.compression.schemes if plan.compression else {}
            with WeightsAhead(schemes, progress) as ahead:
                with conversion_helpers(options, plan, progress) as helpers:
                    # The large weights stay on disk until the packages are written (see
                    # docs/export-memory.md); only their stand-ins are traced and converted,
                    # while a thread writes the real ones into each package's weight file.
                    placeholders = PlaceholderWeights()
                    modules = load_modules(options, plan, progress, placeholders)
                    for asset in plan.assets:
                        (parts_dir / asset.role).mkdir(parents=True)
                    # Per package, by placeholder row: the real weights it must hold.
                    needed = {path: package_placeholders(assets, modules, placeholders)
                              for path, assets in plan.packages().items()}
                    ahead.start({path: (parts_dir / f"{path}.weights", list(rows.values()))
                                 for path, rows in needed.items()})
                    jobs = [(asset, function, part_path(parts_dir, asset, function))
                            for asset in plan.assets for function in asset.functions]

                    def convert_here(job) -> None:
                        ahead.raise_failure()  # e.g. a NaN weight: no need to go on
                        asset, function, part = job
                        convert_function(modules[asset.module], asset, function, part, progress)

                    run_conversions(jobs, convert_here, helpers)
                # Per package, under its owner's role: what its merge wrote.
                stored = {assets[0].role: save_package(assets, parts_dir, staging / path,
                                                       placeholders, set(needed[path]), progress,
                                                       schemes, ahead.result(path))
                          for path, assets in plan.packages().items()}
            shutil.rmtree(parts_dir)
            metadata = bundle_metadata(plan, modules, source, plan.context_length,
                                       options.model_name, stored)
            for path in plan.packages():
                embed_metadata(staging / path, metadata)
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


def save_package(assets: list[AssetPlan], parts_dir: Path, destination: Path,
                 placeholders: PlaceholderWeights, expected: set[bytes], progress: Progress,
                 schemes: Mapping[str, Scheme] | None = None,
                 written: WrittenWeights | None = None) -> dict[str, StoredWeight]:
    """Merges the converted functions of every asset sharing the package `destination` into
    one multifunction package (`merge.merge_packages`: identical weights are stored once, as
    save_multifunction stores them, without loading any weight back; the target's embedding
    and lm_head, which the DFlash drafter borrows, are among them); the placeholders' real
    values, one per placeholder row in `expected` (`package_placeholders`), are those
    `written` holds (`weights.WeightsAhead`), or without it are read from the checkpoint into
    its weight file one tensor at a time, compressed when `schemes` names them. The first asset
    owns the package (its default function is the package's). Returns the real weights
    written, by checkpoint key."""
    with progress.stage("save", destination.name) as info:
        parts = [(f.name, part_path(parts_dir, asset, f))
                 for asset in assets for f in asset.functions]
        stored: dict[str, StoredWeight] = {}
        try:
            merge_packages(parts, destination, assets[0].default_function, placeholders,
                           expected, schemes, stored, written)
        except MergeError as error:
            raise ExportError(str(error)) from error
        info["bytes"] = tree_bytes(destination)
    return stored
