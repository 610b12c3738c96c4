"""Export memory and speed benchmark: the streaming export against a naive conversion.

For each size (GB of fp16 weights) a synthetic target + DFlash drafter checkpoint pair is
written in the real layout (bf16 safetensors, sharded, [S,S,S,G] layers), then each path
exports the fused target and the drafter in its own process while this process samples the
child's memory. Writes benchmark.json and benchmark.png and prints a table.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from museflash.builtin.demo_checkpoint import TINY_DRAFTER_CONFIG, TINY_TARGET_CONFIG
from museflash.bundle import PACKAGE_SPEC, PACKAGE_WEIGHT_FILE, AssetRole, LayerType
from museflash.export.progress import tree_bytes
from museflash.tools.family_geometry import (
    EXPORT_CONTEXT,
    FAMILY_GEOMETRIES,
    STATE_CONTEXTS,
    state_bytes,
    write_family_checkpoints,
)

PATHS = ("naive", "streaming")
# The streaming export with a compression preset: path -> preset.
COMPRESSED_PATHS = {"streaming-8bit": "8bit", "streaming-4bit": "4bit",
                    "streaming-palettize4": "palettize4"}
ALL_PATHS = PATHS + tuple(COMPRESSED_PATHS)
# Measured peak RSS of the naive path per fp16 weight byte (docs/benchmark.json: 4.2-5.5x);
# it is skipped where that would not fit in this machine's memory.
NAIVE_PEAK_PER_WEIGHT_BYTE = 4.2
STREAMING_FUNCTIONS = 4  # target main + prefill, drafter inject_kv + draft
GB = 10**9
SAMPLE_INTERVAL_S = 0.05
EXPORT_ARGS = dict(max_context_length=256, prefill_length=16)

_S, _G = LayerType.SLIDING_ATTENTION.value, LayerType.FULL_ATTENTION.value


# --- Synthetic checkpoints -------------------------------------------------------------------


# The fused target and the DFlash drafter share one package (schema 3).
PACKAGES = (AssetRole.TARGET.package,)


# Geometries of the synthetic checkpoints (--geometry):
#   scaled     width grows with the cube root of the size and depth takes the rest, so both
#              scale (the claim under test is that memory stops growing with depth);
#   muse-30b   the layers of Muse Glimmer 30B (hidden 6656, intermediate 19968, 32 query heads
#              of 128, 8 KV heads: the public drafter config's, whose hidden size the target
#              shares), about 0.93 GB of fp16 each; size sets the depth. The vocabulary stays
#              8192, so the rows measure the layers, which are what the 30B is made of.
#   qwen3-4b, qwen3-8b, llama3.1-8b
#              the published models at their real geometry in transformers' layout, with
#              z-lab-shaped drafters (tools/family_geometry.py); size is ignored, exported at a
#              context of 4096, and the report adds the states' bytes at 4K and 32K.
GEOMETRIES = ("scaled", "muse-30b", *FAMILY_GEOMETRIES)
MUSE_30B_LAYER = {"hidden": 6656, "intermediate": 19968, "heads": 32, "kv_heads": 8}


def synthetic_configs(weight_bytes: float,
                      geometry: str = "scaled") -> tuple[dict[str, Any], dict[str, Any]]:
    """Target and drafter configs whose fp16 weights total about `weight_bytes` (GEOMETRIES)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"unknown geometry {geometry!r}; choose one of {list(GEOMETRIES)}")
    head_dim = 64 if weight_bytes < 0.05 * GB else 128
    heads = max(2, 2 * round(3 * (max(weight_bytes, 1) / (0.25 * GB)) ** (1 / 3)))
    if weight_bytes < 0.05 * GB:
        heads = 2
    hidden = heads * head_dim
    vocab = 8192 if weight_bytes >= 0.05 * GB else 2048
    intermediate = 4 * hidden
    kv_heads = 2
    if geometry == "muse-30b":
        head_dim, vocab = 128, 8192
        hidden, intermediate = MUSE_30B_LAYER["hidden"], MUSE_30B_LAYER["intermediate"]
        heads, kv_heads = MUSE_30B_LAYER["heads"], MUSE_30B_LAYER["kv_heads"]
    per_layer = 2 * (hidden * heads * head_dim * 3 + 2 * hidden * kv_heads * head_dim
                     + 3 * hidden * intermediate + 4 * hidden)
    drafter_layers = 1
    fixed = 2 * (2 * vocab * hidden + 3 * hidden * hidden + hidden)
    fixed += drafter_layers * per_layer
    groups = max(1, round((weight_bytes - fixed) / per_layer / 4))
    layers = 4 * groups
    text = copy.deepcopy(TINY_TARGET_CONFIG["text_config"])
    text.update({
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "layer_types": [_S, _S, _S, _G] * groups,
        "layer_rope_theta": [10000.0, 10000.0, 10000.0, 0.0] * groups,
        "sliding_window": 64,
    })
    target = copy.deepcopy(TINY_TARGET_CONFIG)
    target["text_config"] = text
    drafter = copy.deepcopy(TINY_DRAFTER_CONFIG)
    drafter.update({
        "hidden_size": hidden,
        "num_hidden_layers": drafter_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "mask_token_id": vocab - 1,
        "target_layer_ids": [1, layers // 2, layers - 2],
        "sliding_window": 64,
    })
    return target, drafter


def _synthetic_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator):
    # Values that keep activations O(1), like the demo checkpoint, generated one tensor at a
    # time so writing a large checkpoint needs no more than one shard of memory.
    noise = torch.randn(shape, generator=generator)
    if "norm" in name:
        return 0.1 * noise
    if len(shape) == 2 and "embed" not in name:
        return noise.mul_(1 / math.sqrt(shape[1]))
    return noise


def write_synthetic_checkpoints(directory: Path, weight_bytes: float, seed: int = 0,
                                max_shard_bytes: int = 500_000_000,
                                geometry: str = "scaled",
                                configs: tuple[dict[str, Any], dict[str, Any]] | None = None
                                ) -> tuple[Path, Path]:
    """Writes directory/target and directory/drafter (bf16, sharded); returns both paths.
    `configs` (target, drafter) replaces the ones `synthetic_configs` would choose."""
    from museflash.checkpoint.tensor_files import write_safetensors
    from museflash.models.dflash import (
        DRAFTER_BORROWED,
        ENCODER_PREFIX,
        DFlashConfig,
        DFlashDrafter,
    )
    from museflash.models.muse_glimmer import (
        MuseGlimmerConfig,
        MuseGlimmerWithDrafterFeatures,
        target_checkpoint_key,
    )

    target_config, drafter_config = configs or synthetic_configs(weight_bytes, geometry)
    drafter_cfg = DFlashConfig.from_dict(drafter_config)
    with torch.device("meta"):
        target = MuseGlimmerWithDrafterFeatures(MuseGlimmerConfig.from_dict(target_config),
                                                drafter_cfg, max_context=8, max_query_len=8)
        drafter = DFlashDrafter.for_target(drafter_cfg, target, max_query_len=8)
    generator = torch.Generator().manual_seed(seed)
    target_items = (
        (target_checkpoint_key(name), _synthetic_tensor(name, tuple(p.shape), generator))
        for name, p in target.named_parameters() if not name.startswith(ENCODER_PREFIX)
    )
    write_safetensors(target_items, directory / "target", target_config,
                      max_shard_bytes=max_shard_bytes)
    drafter_items = [
        (name, p.shape) for name, p in drafter.named_parameters()
        if not name.startswith(DRAFTER_BORROWED)
    ] + [(ENCODER_PREFIX + name, p.shape) for name, p in target.encoder.named_parameters()]
    write_safetensors(
        ((name, _synthetic_tensor(name, tuple(shape), generator)) for name, shape in
         drafter_items),
        directory / "drafter", drafter_config, max_shard_bytes=max_shard_bytes)
    return directory / "target", directory / "drafter"


# --- One export per process ------------------------------------------------------------------


def _export_options(checkpoints: Path, output: Path, context: int | None = None):
    from museflash.export.options import ExportOptions

    args = dict(EXPORT_ARGS, **({"max_context_length": context} if context else {}))
    return ExportOptions(output_dir=output, overwrite=True, fused_target=True,
                         dflash_drafter=True, checkpoint=checkpoints / "target",
                         drafter_checkpoint=checkpoints / "drafter", **args)


def naive_export(checkpoints: Path, output: Path, context: int | None = None) -> None:
    """What one writes without care: the whole model in memory (fp16, the dtype the export
    converts), one plain ct.convert per function, save_multifunction to merge. Same plan
    (functions, inputs, states) as the export, so the two outputs can be compared exactly."""
    import coremltools as ct

    from museflash.export.convert import convert
    from museflash.export.plan import load_modules, plan_export
    from museflash.export.progress import Progress

    options = _export_options(checkpoints, output, context)
    plan = plan_export(options, options.checkpoint, options.drafter_checkpoint)
    modules = load_modules(options, plan, Progress(echo=lambda _line: None), None)
    output.mkdir(parents=True, exist_ok=True)
    for path, assets in plan.packages().items():
        descriptor = ct.utils.MultiFunctionDescriptor()
        for asset in assets:
            module = modules[asset.module]
            for function in asset.functions:
                program = torch.export.export(module.with_entry_point(function.entry_point),
                                              function.example_args)
                model = convert(_without_metadata_asserts(program.run_decompositions({})),
                                function.inputs, function.outputs, module, asset.states,
                                plain_passes=True, compact_placeholders=False)
                part = output / f"{function.name}.part.mlpackage"
                model.save(str(part))
                descriptor.add_function(str(part), src_function_name="main",
                                        target_function_name=function.name)
        descriptor.default_function_name = assets[0].default_function
        ct.utils.save_multifunction(descriptor, str(output / path))
        for asset in assets:
            for function in asset.functions:
                shutil.rmtree(output / f"{function.name}.part.mlpackage")


def _without_metadata_asserts(program: torch.export.ExportedProgram):
    """The program without the no-op `_assert_tensor_metadata` checks that the second of the
    public two passes leaves in. The export's one-pass trace (convert._one_pass_export) never
    makes them; converted, they only use up coremltools' counter of constant names, so the two
    programs would differ in a few names and in nothing else."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and "_assert_tensor_metadata" in str(node.target):
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


def streaming_export(checkpoints: Path, output: Path, compression: str | None = None,
                     context: int | None = None) -> None:
    from museflash.export.pipeline import export_bundle
    from museflash.export.progress import Progress

    options = _export_options(checkpoints, output, context)
    options.compression = compression
    export_bundle(options, Progress(echo=lambda _line: None))


def copy_rate(checkpoints: Path, destination: Path) -> tuple[float, int]:
    """(seconds, bytes) to copy the checkpoint files and fsync them: the machine's plain
    file-copy rate, the ceiling of an export that reads and writes every weight once."""
    files = [f for f in sorted(checkpoints.rglob("*.safetensors"))]
    total = 0
    began = time.monotonic()
    for source in files:
        target = destination / source.relative_to(checkpoints)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        with target.open("rb+") as handle:
            os.fsync(handle.fileno())
        total += source.stat().st_size
    seconds = time.monotonic() - began
    shutil.rmtree(destination, ignore_errors=True)
    return seconds, total


def memory_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _process_tree(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pending.extend(int(c) for c in (task / "children").read_text().split())
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


class TreeSampler:
    """Samples VmHWM and RssAnon of a process and its children every SAMPLE_INTERVAL_S."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak_rss = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            tree = _process_tree(self.pid)
            self.peak_rss = max(self.peak_rss, sum(_status_kib(p, "VmHWM") for p in tree) * 1024)
            self.peak_anon = max(self.peak_anon,
                                 sum(_status_kib(p, "RssAnon") for p in tree) * 1024)
            self._stop.wait(SAMPLE_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Record:
    path: str
    size_gb: float
    weight_bytes: int
    num_hidden_layers: int
    hidden_size: int
    wall_s: float
    peak_rss_bytes: int
    peak_anon_bytes: int
    output_bytes: int
    baseline_rss_bytes: int  # the interpreter with torch and coremltools imported, no export
    processes: int  # converting at once; peak RSS sums every process's own peak

    @property
    def mb_per_s(self) -> float:
        return self.weight_bytes / 1e6 / self.wall_s


def checkpoint_weight_bytes(checkpoints: Path) -> int:
    """fp16 bytes of every tensor the export uses (the vision tower's are not exported)."""
    from museflash.checkpoint.tensor_files import SafetensorsReader

    total = 0
    for name in ("target", "drafter"):
        reader = SafetensorsReader(checkpoints / name)
        total += sum(2 * math.prod(reader.shape(k)) for k in reader.keys()
                     if not k.startswith("model.vision_"))
    return total


def run_one(path: str, checkpoints: Path, output: Path,
            context: int | None = None) -> tuple[float, int, int]:
    """(wall seconds, peak RSS, peak anonymous RSS) of one export in a fresh process;
    `context`: its --max-context-length (default EXPORT_ARGS')."""
    command = [sys.executable, "-m", "museflash.tools.benchmark", path, str(checkpoints),
               str(output)] + ([str(context)] if context else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # Output goes to files, not pipes: nothing reads a pipe while the child runs, and
    # coremltools' progress bars alone can fill one and stall the child.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        began = time.monotonic()
        child = subprocess.Popen(command, env=env, stdout=out, stderr=err)
        sampler = TreeSampler(child.pid)
        child.wait()
        wall = time.monotonic() - began
        sampler.stop()
        out.seek(0)
        err.seek(0)
        child_stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if child.returncode != 0:
        raise RuntimeError(f"{path} export failed ({child.returncode}):\n{stderr[-3000:]}")
    # Not ru_maxrss: Linux carries the pre-exec high-water mark into it, so it reports this
    # (benchmark) process's RSS at spawn time. The child's own VmHWM, read as it finishes,
    # covers the moments between the sampler's last sample and exit.
    own_peak = _reported_peak(child_stdout)
    return wall, max(sampler.peak_rss, own_peak), sampler.peak_anon


CHILD_PEAK_PREFIX = "museflash-benchmark-child-peak-bytes "


def _reported_peak(stdout: str) -> int:
    for line in stdout.splitlines():
        if line.startswith(CHILD_PEAK_PREFIX):
            return int(line[len(CHILD_PEAK_PREFIX):])
    raise RuntimeError("the export child did not report its peak memory")


def baseline_rss() -> int:
    code = ("import coremltools, torch, museflash.export.pipeline; "
            "print(open('/proc/self/status').read())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


# --- Same model from both paths --------------------------------------------------------------


def compare_exports(naive: Path, streaming: Path) -> list[str]:
    """Differences between the two exports' packages: the specs (without the embedded metadata,
    which only the real export writes, and without the blobs' offsets: the export writes the
    real weights first in the weight file) and every weight constant, by value. Returns
    (problems, notes): problems are real differences; notes list the label-only differences
    that were set aside."""
    from coremltools.proto import Model_pb2

    problems, notes = [], []
    for package in PACKAGES:
        specs = []
        for root in (naive, streaming):
            spec = Model_pb2.Model()
            spec.ParseFromString((root / package / PACKAGE_SPEC).read_bytes())
            spec.description.ClearField("metadata")
            specs.append(spec)
        debug_names = _state_op_debug_names(specs[0]) != _state_op_debug_names(specs[1])
        if debug_names:
            # coremltools numbers the `name` attribute of the read_state/write_state ops it
            # lowers from state updates with a per-process counter, so a function converted in
            # another process, or after other functions, carries other numbers. The attribute
            # is a label (no input or output refers to it); compare everything else exactly,
            # and say so.
            specs = [_without_state_op_debug_names(spec) for spec in specs]
        const_names = (_without_blob_offsets(specs[0]) != _without_blob_offsets(specs[1])
                       and _immediate_const_names(specs[0]) != _immediate_const_names(specs[1]))
        if const_names:
            # Each small constant is stored once (export/coreml_patches.py), under the name of
            # its first use; the one-pass trace numbers a few lifted constants differently
            # (export/convert.py), so the name kept can differ. Names are labels: compare the
            # rest exactly, with each such constant named by its place, and say so.
            specs = [_with_immediate_consts_numbered(spec) for spec in specs]
        if _without_blob_offsets(specs[0]) != _without_blob_offsets(specs[1]):
            ops = [_op_counts(spec) for spec in specs]
            changed = {k: (ops[0].get(k, 0), ops[1].get(k, 0)) for k in set(ops[0]) | set(ops[1])
                       if ops[0].get(k, 0) != ops[1].get(k, 0)}
            problems.append(f"{package}: specs differ (op counts naive vs streaming: "
                            f"{dict(sorted(changed.items()))})")
        weights = [_const_values(root / package, spec) for root, spec in
                   zip((naive, streaming), specs, strict=True)]
        if set(weights[0]) != set(weights[1]):
            problems.append(f"{package}: weight constants differ in name "
                            f"({len(set(weights[0]) ^ set(weights[1]))} unmatched)")
            continue
        differing = sorted(name for name in weights[0] if weights[0][name] != weights[1][name])
        if differing:
            problems.append(f"{package}: {len(differing)} of {len(weights[0])} weight constants "
                            f"differ in value, e.g. {differing[:3]}")
        if debug_names:
            notes.append(f"{package}: state ops' debug names differ (labels only)")
        if const_names:
            notes.append(f"{package}: the names kept for merged small constants differ "
                         "(labels only)")
    return problems, notes


def _immediate_consts(spec):
    for function, op in _all_ops(spec):
        if op.type == "const" and "val" in op.attributes and \
                op.attributes["val"].WhichOneof("value") == "immediateValue":
            yield function, op


def _immediate_const_names(spec) -> list[str]:
    return [op.outputs[0].name for _, op in _immediate_consts(spec)]


def _with_immediate_consts_numbered(spec):
    """A copy with every immediate-valued const renamed by its place in its function, and
    every reference to it."""
    from coremltools.proto import Model_pb2

    copy_ = Model_pb2.Model()
    copy_.CopyFrom(spec)
    renamed: dict[tuple[str, str], str] = {}
    counts: dict[str, int] = {}
    for function, op in _immediate_consts(copy_):
        counts[function] = counts.get(function, -1) + 1
        renamed[function, op.outputs[0].name] = f"immediate_const_{counts[function]}"
    for function, op in _all_ops(copy_):
        for binding in op.inputs.values():
            for argument in binding.arguments:
                if argument.HasField("name") and (function, argument.name) in renamed:
                    argument.name = renamed[function, argument.name]
        for output in op.outputs:
            if (function, output.name) in renamed:
                new = renamed[function, output.name]
                output.name = new
                if "name" in op.attributes:
                    del op.attributes["name"].immediateValue.tensor.strings.values[:]
                    op.attributes["name"].immediateValue.tensor.strings.values.append(new)
    return copy_


def _state_ops(spec):
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                if op.type in ("read_state", "write_state"):
                    yield op


def _state_op_debug_names(spec) -> list[str]:
    return [list(op.attributes["name"].immediateValue.tensor.strings.values)
            for op in _state_ops(spec) if "name" in op.attributes]


def _without_state_op_debug_names(spec):
    from coremltools.proto import Model_pb2

    copy_ = Model_pb2.Model()
    copy_.CopyFrom(spec)
    for op in _state_ops(copy_):
        if "name" in op.attributes:
            del op.attributes["name"]
    return copy_


def _without_blob_offsets(spec):
    from coremltools.proto import Model_pb2

    copy_ = Model_pb2.Model()
    copy_.CopyFrom(spec)
    for _, op in _all_ops(copy_):
        values = [op.attributes[name] for name in op.attributes]
        values += [argument.value for binding in op.inputs.values()
                   for argument in binding.arguments if argument.HasField("value")]
        for value in values:
            if value.WhichOneof("value") == "blobFileValue":
                value.blobFileValue.offset = 0
    return copy_


def _all_ops(spec):
    """(function name, op) for every op of every function, those of nested blocks first."""
    def visit(function: str, block):
        for op in block.operations:
            for nested in op.blocks:
                yield from visit(function, nested)
            yield function, op

    for name, function in spec.mlProgram.functions.items():
        for block in function.block_specializations.values():
            yield from visit(name, block)


def _op_counts(spec) -> dict[str, int]:
    counts: dict[str, int] = {}
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                counts[op.type] = counts.get(op.type, 0) + 1
    return counts


def _const_values(package: Path, spec) -> dict[str, bytes]:
    """(function, const name) -> the stored bytes, for every const in the weight file."""
    from museflash.export.blobfile import read_record

    blob = (package / PACKAGE_WEIGHT_FILE).read_bytes()
    values = {}
    for function, op in _all_ops(spec):
        if op.type == "const" and "val" in op.attributes and \
                op.attributes["val"].WhichOneof("value") == "blobFileValue":
            offset = op.attributes["val"].blobFileValue.offset
            _, _, size, start = read_record(blob, offset)
            values[f"{function}:{op.outputs[0].name}"] = blob[start:start + size]
    return values


# --- The benchmark ---------------------------------------------------------------------------


def run_benchmark(sizes_gb: list[float], output_dir: Path, work_dir: Path | None = None,
                  paths: tuple[str, ...] = PATHS, echo=print,
                  geometry: str = "scaled") -> list[Record]:
    output_dir.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else output_dir / "work"
    baseline = baseline_rss()
    records: list[Record] = []
    # (size GB, bytes, seconds, when): each checkpoint is copied before and after its exports,
    # since a disk's write rate can drift by 2x within minutes.
    copies: list[tuple[float, int, float, str]] = []
    skipped: list[str] = []
    checked = False
    family = geometry in FAMILY_GEOMETRIES
    context = EXPORT_CONTEXT if family else None
    states: list[dict[str, Any]] = []
    for size in [0.0] if family else sizes_gb:
        checkpoints = work / f"checkpoints-{size:g}gb"
        shutil.rmtree(checkpoints, ignore_errors=True)
        if family:
            write_family_checkpoints(geometry, checkpoints)
        else:
            write_synthetic_checkpoints(checkpoints, size * GB, geometry=geometry)
        weight_bytes = checkpoint_weight_bytes(checkpoints)
        if family:
            size = round(weight_bytes / GB, 2)
            states = _family_states(checkpoints, echo)
        text = json.loads((checkpoints / "target" / "config.json").read_text())
        text = text.get("text_config", text)
        outputs = {}
        copies.append(_measured_copy(size, checkpoints, work, "before", echo))
        for path in paths:
            needed = NAIVE_PEAK_PER_WEIGHT_BYTE * weight_bytes
            if path == "naive" and needed > 0.8 * memory_total():
                skipped.append(f"naive at {size:g} GB skipped: it would need about "
                               f"{needed / 1e9:.0f} GB ({NAIVE_PEAK_PER_WEIGHT_BYTE}x the "
                               f"weights), this machine has {memory_total() / 1e9:.0f} GB")
                echo(f"[benchmark] {skipped[-1]}")
                continue
            out = work / f"export-{size:g}gb-{path}"
            shutil.rmtree(out, ignore_errors=True)
            wall, peak, anon = run_one(path, checkpoints, out, context)
            if family:
                _check_spec_states(out, states, echo)
            record = Record(path, size, weight_bytes, text["num_hidden_layers"],
                            text["hidden_size"], round(wall, 2), peak, anon,
                            sum(tree_bytes(out / p) for p in PACKAGES), baseline,
                            _processes(path))
            records.append(record)
            if not checked and path in PATHS:
                outputs[path] = out  # kept for the equivalence check below
            else:
                # Gone before the next export, so that its pages cannot crowd the checkpoint
                # out of the page cache (at 9.3 GB on 24 GB, the 4-bit export that followed the
                # fp16 one's 9.3 GB output took 33.9 s in one run and 44.5 s in the next).
                shutil.rmtree(out, ignore_errors=True)
            echo(f"[benchmark] {size:g} GB {path}: {wall:.1f} s, peak RSS "
                 f"{peak / 1e9:.2f} GB, peak anon {anon / 1e9:.2f} GB")
        if not checked and set(PATHS) <= set(outputs):
            problems, notes = compare_exports(outputs["naive"], outputs["streaming"])
            verdict = "; ".join(problems) or "specs and every weight constant equal"
            if notes and not problems:
                verdict += " (set aside: " + "; ".join(notes) + ")"
            (output_dir / "equivalence.txt").write_text(f"size {size:g} GB: {verdict}\n")
            echo(f"[benchmark] equivalence at {size:g} GB: {verdict}")
            checked = True
        for out in outputs.values():
            shutil.rmtree(out, ignore_errors=True)
        copies.append(_measured_copy(size, checkpoints, work, "after", echo))
        shutil.rmtree(checkpoints, ignore_errors=True)
        write_results(records, output_dir, copies, skipped, states)
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    echo(format_table(records, copies, skipped))
    return records


def _family_states(checkpoints: Path, echo) -> list[dict[str, Any]]:
    """Per context of STATE_CONTEXTS, the bytes of each state the pair's bundle declares."""
    rows = []
    for context in STATE_CONTEXTS:
        each = state_bytes(checkpoints / "target", checkpoints / "drafter", context)
        target = sum(v for k, v in each.items() if k.startswith("target."))
        rows.append({"path": "states", "context": context, "target_bytes": target,
                     "drafter_bytes": sum(each.values()) - target, "states": each})
        echo(f"[benchmark] states at context {context}: target {target / 1e9:.3f} GB, "
             f"drafter {rows[-1]['drafter_bytes'] / 1e9:.3f} GB")
    return rows


def _check_spec_states(bundle: Path, states: list[dict[str, Any]], echo) -> None:
    """The exported package declares exactly the states `state_bytes` counts at its context."""
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.ParseFromString((bundle / PACKAGES[0] / PACKAGE_SPEC).read_bytes())
    declared = {}
    for function in spec.description.functions:
        for state in function.state:
            shape = state.type.stateType.arrayType.shape
            declared[state.name] = 2 * math.prod(shape)
    expected = next(r for r in states if r["context"] == EXPORT_CONTEXT)["states"]
    counted = {k.split(".", 1)[1]: v for k, v in expected.items()}
    if declared != counted:
        raise RuntimeError(f"{bundle}: the package declares states {declared}, the modules "
                           f"counted {counted}")
    echo(f"[benchmark] package states at {EXPORT_CONTEXT} equal the count: "
         f"{sum(declared.values()) / 1e9:.3f} GB")


def _measured_copy(size: float, checkpoints: Path, work: Path, when: str,
                   echo) -> tuple[float, int, float, str]:
    """(size GB, bytes, seconds, when) of one fsync'd copy of the checkpoints."""
    seconds, copied = copy_rate(checkpoints, work / "copy")
    echo(f"[benchmark] {size:g} GB plain file copy ({when} the exports): "
         f"{copied / 1e6 / seconds:.1f} MB/s")
    return size, copied, seconds, when


def _processes(path: str) -> int:
    from museflash.export.parallel import process_count

    return 1 if path == "naive" else process_count(None, STREAMING_FUNCTIONS)


def write_results(records: list[Record], output_dir: Path,
                  copies: list[tuple[float, int, float, str]] | None = None,
                  skipped: list[str] | None = None,
                  states: list[dict[str, Any]] | None = None) -> None:
    rows = [dict(asdict(r), mb_per_s=round(r.mb_per_s, 2)) for r in records]
    rows += [{"path": "file copy", "size_gb": size, "bytes": copied, "wall_s": round(seconds, 2),
              "mb_per_s": round(copied / 1e6 / seconds, 2), "when": when}
             for size, copied, seconds, when in copies or []]
    rows += [{"path": "skipped", "note": note} for note in skipped or []]
    rows += states or []
    (output_dir / "benchmark.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(records, output_dir / "benchmark.png")


def marginal_mb_per_s(records: list[Record], path: str) -> float | None:
    """Throughput between the two largest sizes of `path`: the fixed start-up cost cancels."""
    rows = sorted((r for r in records if r.path == path), key=lambda r: r.weight_bytes)
    if len(rows) < 2 or rows[-1].wall_s <= rows[-2].wall_s:
        return None
    return ((rows[-1].weight_bytes - rows[-2].weight_bytes) / 1e6
            / (rows[-1].wall_s - rows[-2].wall_s))


def slope(records: list[Record], path: str) -> float | None:
    points = [(r.weight_bytes, r.peak_rss_bytes) for r in records if r.path == path]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else None


def format_table(records: list[Record],
                 copies: list[tuple[float, int, float, str]] | None = None,
                 skipped: list[str] | None = None) -> str:
    lines = [f"{'path':<10} {'procs':>5} {'weights GB':>10} {'layers':>6} {'wall s':>8} "
             f"{'MB/s':>7} {'peak RSS GB':>11} {'x weights':>9} {'peak anon GB':>12} "
             f"{'output GB':>9}"]
    for r in records:
        lines.append(f"{r.path:<10} {r.processes:>5} {r.weight_bytes / 1e9:>10.3f} "
                     f"{r.num_hidden_layers:>6} "
                     f"{r.wall_s:>8.1f} {r.mb_per_s:>7.1f} {r.peak_rss_bytes / 1e9:>11.2f} "
                     f"{r.peak_rss_bytes / r.weight_bytes:>9.2f} "
                     f"{r.peak_anon_bytes / 1e9:>12.2f} {r.output_bytes / 1e9:>9.3f}")
    for path in ALL_PATHS:
        value = slope(records, path)
        if value is not None:
            lines.append(f"slope of peak RSS over weight bytes ({path}): {value:.3f}")
        marginal = marginal_mb_per_s(records, path)
        if marginal is not None and path != "naive":
            lines.append(f"marginal throughput between the two largest sizes ({path}): "
                         f"{marginal:.1f} MB/s")
    for size, copied, seconds, when in copies or []:
        lines.append(f"plain file copy of the {size:g} GB checkpoint (fsync'd, {when} its "
                     f"exports): {copied / 1e6 / seconds:.1f} MB/s")
    lines += skipped or []
    if records:
        largest = max(r.weight_bytes for r in records)
        at = {r.path: r for r in records if r.weight_bytes == largest}
        if set(PATHS) <= set(at):
            lines.append(f"throughput at the largest size: streaming/naive = "
                         f"{at['streaming'].mb_per_s / at['naive'].mb_per_s:.2f}x")
    lines.append(f"baseline RSS (interpreter + imports): {records[0].baseline_rss_bytes / 1e9:.2f}"
                 " GB" if records else "")
    return "\n".join(lines)


def plot(records: list[Record], destination: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (memory, speed) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    colours = ("tab:red", "tab:blue", "tab:olive", "tab:green", "tab:purple")
    for path, colour in zip(ALL_PATHS, colours, strict=True):
        rows = sorted((r for r in records if r.path == path), key=lambda r: r.weight_bytes)
        if not rows:
            continue
        x = [r.weight_bytes / 1e9 for r in rows]
        memory.plot(x, [r.peak_rss_bytes / 1e9 for r in rows], "o-", color=colour,
                    label=f"{path} peak RSS")
        memory.plot(x, [r.peak_anon_bytes / 1e9 for r in rows], "s--", color=colour,
                    label=f"{path} peak anonymous")
        speed.plot(x, [r.wall_s for r in rows], "o-", color=colour, label=path)
    top = max((r.weight_bytes / 1e9 for r in records), default=1)
    memory.plot([0, top], [0, top], ":", color="grey", label="1x weight bytes")
    memory.set(xlabel="fp16 weight bytes (GB)", ylabel="GB", title="Peak memory per export")
    speed.set(xlabel="fp16 weight bytes (GB)", ylabel="seconds", title="Export wall time")
    memory.legend(fontsize=8)
    speed.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(destination, dpi=100)
    pyplot.close(figure)


def _child_main(argv: list[str]) -> None:
    """One export of `run_one`'s child process: argv is [path, checkpoints, output], as
    run_one passes them (a process protocol, not a command line)."""
    import logging

    path, checkpoints, output, *context = argv
    if path not in ALL_PATHS:
        raise SystemExit(f"benchmark: no export path {path!r}; choose from {list(ALL_PATHS)}")
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    context = int(context[0]) if context else None
    if path == "naive":
        naive_export(Path(checkpoints), Path(output), context)
    else:
        streaming_export(Path(checkpoints), Path(output), COMPRESSED_PATHS.get(path), context)
    print(CHILD_PEAK_PREFIX + str(_status_kib(os.getpid(), "VmHWM") * 1024), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
