"""KV traffic: the first-order bytes each function of an exported bundle moves per call.

Counted from the saved program's own types (each op's input and output `Var`s as the package
stores them, loaded with `runtime.interpreter.load_program`), never from the model code, so it
works on any bundle whatever its KV write pattern. The model, in short (docs/traffic.md):

- a `const` or `constexpr_*` op of at least WEIGHT_MIN_BYTES is a weight, read once at its
  stored size (a constexpr's: the bytes of the consts it decompresses); smaller ones are
  immediates and count nothing; no consumer counts a constant input again;
- VIEW_OPS move nothing; their consumer reads the viewed bytes;
- a `slice_update` whose `x` is a state's value and whose result reaches `coreml_update_state`
  of that state, through a chain of such updates, is in place: it moves its `update` only (read
  and written), and that `coreml_update_state` moves nothing;
- every other op reads its inputs and writes its outputs.

Ops are grouped into three parts: STATE_SIZED (an op moving a tensor at least one layer of a
state and having that state's capacity among its dimensions), WEIGHTS and REST. The floor is
every weight read once plus every state read once.

This is a model, not a device measurement: no cache, fusion or tiling is modelled.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from museflash.bundle import FunctionName, KVWrite, Metadata

STATE_SIZED, WEIGHTS, REST = "state-sized", "weights", "rest"
PARTS = (STATE_SIZED, WEIGHTS, REST)
WEIGHT_MIN_BYTES = 1024
# Ops that only re-address their `x` (read_state: its `input`, the state).
VIEW_OPS = frozenset({"reshape", "squeeze", "expand_dims", "slice_by_index", "slice_by_size",
                      "identity", "read_state"})
TOP_TYPES = 8

# The 52-layer test geometry: the benchmark's `scaled` synthetic checkpoints at 10.5 GB
# (52 layers [S,S,S,G] x 13, hidden 2560, 20 query heads, 2 KV heads of 128, window 64), with a
# `main` of 8 tokens.
GEOMETRY_WEIGHT_BYTES = 10.5e9
GEOMETRY_DRAFT_TOKENS = 7
LAYER_GROUP = 4  # the geometry's layers come in [S,S,S,G] groups


class TrafficError(ValueError):
    """The bundle or the request cannot be counted; the message names the problem and fix."""


@dataclass(frozen=True)
class OpTraffic:
    """One op's first-order bytes per call."""
    name: str
    op_type: str
    part: str
    bytes_in: int
    bytes_out: int
    in_place: bool = False

    @property
    def total(self) -> int:
        return self.bytes_in + self.bytes_out


@dataclass(frozen=True)
class Summary:
    """A function's traffic, aggregated: what the report prints and the geometry extrapolates."""
    label: str
    parts: dict[str, tuple[int, int, int]]  # part -> (bytes in, bytes out, ops)
    types: dict[str, tuple[int, int]]  # op type -> (bytes in + out, ops)
    state_bytes: int
    views: int
    note: str = ""

    def total(self, part: str | None = None) -> int:
        chosen = [part] if part else PARTS
        return sum(self.parts[p][0] + self.parts[p][1] for p in chosen)

    @property
    def floor(self) -> int:
        return self.total(WEIGHTS) + self.state_bytes


@dataclass
class FunctionTraffic:
    """Every op of one function, counted."""
    package: str
    function: str
    ops: list[OpTraffic] = field(default_factory=list)
    state_bytes: int = 0
    views: int = 0

    def summary(self) -> Summary:
        parts = {p: (0, 0, 0) for p in PARTS}
        types: dict[str, tuple[int, int]] = {}
        for op in self.ops:
            b_in, b_out, count = parts[op.part]
            parts[op.part] = (b_in + op.bytes_in, b_out + op.bytes_out, count + 1)
            total, count = types.get(op.op_type, (0, 0))
            types[op.op_type] = (total + op.total, count + 1)
        return Summary(f"{self.package} {self.function}", parts, types, self.state_bytes,
                       self.views)


# --- Counting one function --------------------------------------------------------------------


def _types():
    from coremltools.converters.mil.mil import types

    return types


def _is_state(var: Any) -> bool:
    return _types().is_state(var.sym_type)


def _shape(var: Any) -> tuple[int, ...]:
    if _is_state(var):
        return tuple(int(d) for d in var.sym_type.wrapped_type().get_shape())
    shape = var.shape if var.shape is not None else ()
    if not all(isinstance(d, int) or hasattr(d, "__index__") for d in shape):
        raise TrafficError(f"{var.name} has a symbolic shape {shape}; the traffic model needs "
                           "static shapes, which every museflash export has: re-export it")
    return tuple(int(d) for d in shape)


def var_bytes(var: Any) -> int:
    """Bytes of one tensor or scalar as stored: elements x bit width (sub-byte types packed,
    bool one byte), rounded up to a whole byte."""
    types = _types()
    dtype = var.sym_type.wrapped_type().get_primitive() if _is_state(var) else var.dtype
    if dtype == types.str:
        return 0
    bits = dtype.get_bitwidth() if hasattr(dtype, "get_bitwidth") else None
    return -(-math.prod(_shape(var)) * (bits or 8) // 8)


def _values(op: Any) -> list[Any]:
    """The op's input vars, list inputs (concat's `values`) flattened."""
    found = []
    for value in op.inputs.values():
        found.extend(value if isinstance(value, (list, tuple)) else [value])
    return found


def _is_constant(op: Any) -> bool:
    return op is not None and (op.op_type == "const" or op.op_type.startswith("constexpr_"))


def _in_place_updates(ops: list[Any]) -> set[str]:
    """Names of the slice_update ops that update a state in place: `x` holds the state's value
    (a read_state, an in-place slice_update or a coreml_update_state result), and the chain of
    such updates ends in coreml_update_state of the same state."""
    holds: dict[str, str] = {}  # var name -> the state whose value it is
    chained: dict[str, Any] = {}  # slice_update output name -> its op
    written: list[tuple[str, Any]] = []
    for op in ops:
        if op.op_type == "read_state":
            holds[op.outputs[0].name] = op.inputs["input"].name
        elif op.op_type == "slice_update" and op.inputs["x"].name in holds:
            holds[op.outputs[0].name] = holds[op.inputs["x"].name]
            chained[op.outputs[0].name] = op
        elif op.op_type == "coreml_update_state":
            written.append((op.inputs["state"].name, op.inputs["value"]))
            holds[op.outputs[0].name] = op.inputs["state"].name
    in_place: set[str] = set()
    for state, value in written:
        link = chained.get(value.name)
        while link is not None and holds[link.outputs[0].name] == state:
            in_place.add(link.name)
            link = chained.get(link.inputs["x"].name)
    return in_place


def _state_sized(shapes: Iterable[tuple[int, ...]],
                 layers: list[tuple[int, int]]) -> bool:
    """A tensor is state-sized when it has at least one layer's elements of some state and
    that state's capacity among its dims (`layers`: (elements of a layer, capacity))."""
    return any(math.prod(shape) >= elements and capacity in shape
               for shape in shapes for elements, capacity in layers)


def function_traffic(function: Any, package: str = "", name: str = "") -> FunctionTraffic:
    """Counts one MIL function (`program.functions[name]`) under the model above."""
    result = FunctionTraffic(package, name)
    layers = []
    for var in function.inputs.values():
        if _is_state(var):
            shape = _shape(var)
            result.state_bytes += var_bytes(var)
            layers.append((math.prod(shape[-3:]), shape[-2]))
    ops = list(function.operations)
    for op in ops:
        if op.blocks:
            raise TrafficError(f"{op.op_type} (op {op.name!r}) has nested blocks, which the "
                               "traffic model does not count; museflash exports have none")
    in_place = _in_place_updates(ops)
    constant: set[str] = set()  # vars that are (views of) constants: no consumer counts them
    for op in ops:
        if _is_constant(op) or (op.op_type in VIEW_OPS and "x" in op.inputs
                                and op.inputs["x"].name in constant):
            constant.update(v.name for v in op.outputs)
    # A constant that only feeds constexpr ops is stored inside them.
    stored: dict[str, int] = {}
    for op in ops:
        if _is_constant(op):
            stored[op.name] = (sum(stored.get(v.op.name, 0) for v in _values(op)
                                   if _is_constant(v.op))
                               if op.op_type.startswith("constexpr_")
                               else sum(var_bytes(v) for v in op.outputs))

    def moved(var: Any) -> int:
        return 0 if var.name in constant or _is_state(var) else var_bytes(var)

    for op in ops:
        if _is_constant(op):
            if not any(v.child_ops for v in op.outputs):
                continue  # never read
            feeds_only_constexpr = all(
                child.op_type.startswith("constexpr_")
                for v in op.outputs for child in v.child_ops)
            if not feeds_only_constexpr and stored[op.name] >= WEIGHT_MIN_BYTES:
                result.ops.append(OpTraffic(op.name, op.op_type, WEIGHTS, stored[op.name], 0))
            continue
        if op.op_type in VIEW_OPS:
            result.views += 1
            continue
        if op.name in in_place:
            update = op.inputs["update"]
            tensors = [update]
            b_in, b_out = moved(update), var_bytes(update)
        elif op.op_type == "coreml_update_state" and (
                producer := op.inputs["value"].op) is not None and (
                producer.name in in_place or producer.op_type == "read_state"):
            tensors, b_in, b_out = [], 0, 0
            in_place.add(op.name)
        else:
            tensors = [v for v in _values(op) if moved(v)] + list(op.outputs)
            b_in = sum(moved(v) for v in _values(op))
            b_out = sum(var_bytes(v) for v in op.outputs)
        part = STATE_SIZED if _state_sized((_shape(v) for v in tensors), layers) else REST
        result.ops.append(OpTraffic(op.name, op.op_type, part, b_in, b_out,
                                    in_place=op.name in in_place))
    return result


# --- A bundle ---------------------------------------------------------------------------------


def bundle_functions(export_dir: Path) -> list[tuple[str, str]]:
    """(package path, function) of every Core ML function the bundle's metadata lists (each
    asset's function table: every context bucket's too, and the one-token decode), the
    target's first, then the drafter's."""
    from museflash.bundle import BundleError

    try:
        metadata = Metadata.read(export_dir)
    except BundleError as error:
        raise TrafficError(str(error)) from error
    found: list[tuple[str, str]] = []
    for role in sorted(metadata.assets, key=lambda r: r != "target"):
        asset = metadata.assets[role]
        found += [(asset.path, row.name) for row in asset.function_table()
                  if (asset.path, row.name) not in found]
    return found


def bundle_traffic(export_dir: str | Path, function: str | None = None) -> list[FunctionTraffic]:
    """Every function of the bundle (or the ones named `function`), counted."""
    from museflash.runtime.interpreter import load_program

    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise TrafficError(f"--export-dir {export_dir} is not a directory; point it at an "
                           "export (the directory holding metadata.json)")
    listed = bundle_functions(export_dir)
    chosen = [f for f in listed if function is None or f[1] == function]
    if not chosen:
        names = sorted({name for _, name in listed})
        raise TrafficError(f"--function {function!r} is not a function of this bundle; choose "
                           f"one of {names}, or leave it out for all")
    counted = []
    for path, name in chosen:
        program = load_program(export_dir / path, name)
        counted.append(function_traffic(program.functions[name], path, name))
    return counted


# --- The report -------------------------------------------------------------------------------


def _mb(count: float) -> str:
    return f"{count / 1e6:,.3f}"


def format_summary(summary: Summary) -> list[str]:
    """One table: part, bytes in / out / total (MB, 10^6 bytes), ratio to the floor, ops; then
    the top op types by bytes."""
    floor = summary.floor
    states = summary.state_bytes
    by_state = (f"{summary.total(STATE_SIZED) / states:.2f}x the states" if states
                else "no states")
    lines = [summary.label + (f" ({summary.note})" if summary.note else ""),
             f"  floor {_mb(floor)} MB = weights {_mb(summary.total(WEIGHTS))} MB + states "
             f"read once {_mb(states)} MB; state-sized ops move {by_state}; {summary.views} "
             "view ops move nothing",
             f"  {'part':<12} {'in MB':>12} {'out MB':>12} {'total MB':>12} {'x floor':>9} "
             f"{'ops':>7}"]
    rows = [(p, *summary.parts[p]) for p in PARTS]
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows),
                 sum(r[3] for r in rows)))
    for part, b_in, b_out, count in rows:
        ratio = (b_in + b_out) / floor if floor else float("nan")
        lines.append(f"  {part:<12} {_mb(b_in):>12} {_mb(b_out):>12} {_mb(b_in + b_out):>12} "
                     f"{ratio:>9.2f} {count:>7}")
    ranked = sorted(summary.types.items(), key=lambda item: (-item[1][0], item[0]))[:TOP_TYPES]
    lines.append("  top op types by bytes: " + ", ".join(
        f"{t} {_mb(b)} MB ({n})" for t, (b, n) in ranked))
    return lines


def format_report(summaries: list[Summary], header: str) -> list[str]:
    lines = [header]
    for summary in summaries:
        lines += ["", *format_summary(summary)]
    return lines


# --- Geometry mode ----------------------------------------------------------------------------


def geometry_configs(layers: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The 52-layer geometry's target and drafter configs, cut to `layers` (whole groups)."""
    from museflash.tools.benchmark import synthetic_configs

    target, drafter = synthetic_configs(GEOMETRY_WEIGHT_BYTES, "scaled")
    full = target["text_config"]["num_hidden_layers"]
    layers = full if layers is None else layers
    if layers < LAYER_GROUP or layers % LAYER_GROUP or layers > full:
        raise TrafficError(f"--layers {layers} must be a multiple of {LAYER_GROUP} (the "
                           f"geometry's [S,S,S,G] groups) between {LAYER_GROUP} and {full}")
    target, drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    text = target["text_config"]
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    text["layer_rope_theta"] = text["layer_rope_theta"][:layers]
    drafter["target_layer_ids"] = [1, layers // 2, layers - 2]
    drafter["block_size"] = GEOMETRY_DRAFT_TOKENS + 1
    return target, drafter


def export_geometry(checkpoints: Path, output: Path, context: int,
                    echo: Callable[[str], None], kv_write: str = KVWrite.BLEND.value) -> Path:
    """Exports the synthetic checkpoints at `context` (fused target + DFlash drafter, a main
    of GEOMETRY_DRAFT_TOKENS + 1), writing the global caches with `kv_write` (`--kv-write`)."""
    from museflash.export.options import ExportOptions
    from museflash.export.pipeline import export_bundle
    from museflash.export.progress import Progress

    return export_bundle(ExportOptions(
        output_dir=output, overwrite=True, fused_target=True, dflash_drafter=True,
        checkpoint=checkpoints / "target", drafter_checkpoint=checkpoints / "drafter",
        max_context_length=context, num_draft_tokens=GEOMETRY_DRAFT_TOKENS,
        kv_write=kv_write),
        Progress(echo=echo))


def extrapolate(low: Summary, high: Summary, low_layers: int, high_layers: int,
                layers: int) -> Summary:
    """Every figure of `low` and `high` (the same function at two depths) carried linearly to
    `layers`: exact when each layer group adds the same ops, as in this geometry."""
    step = (layers - low_layers) / (high_layers - low_layers)

    def carry(a: int, b: int) -> int:
        return round(a + (b - a) * step)

    def carry_all(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(carry(x, y) for x, y in zip(a, b, strict=True))

    zero = (0, 0)
    types = {t: carry_all(low.types.get(t, zero), high.types.get(t, zero))
             for t in sorted(set(low.types) | set(high.types))}
    return replace(low, parts={p: carry_all(low.parts[p], high.parts[p]) for p in PARTS},
                   types=types, state_bytes=carry(low.state_bytes, high.state_bytes),
                   views=carry(low.views, high.views),
                   note=f"extrapolated linearly to {layers} layers from exports of "
                        f"{low_layers} and {high_layers}")


def geometry_report(contexts: list[int], layers: int | None, function: str | None,
                    work_dir: Path | None, echo: Callable[[str], None],
                    kv_write: str = KVWrite.BLEND.value) -> dict[int, list[Summary]]:
    """Per context, the geometry exported (synthetic weights, deleted afterwards) and counted;
    with `layers` below the full depth, exported at `layers` and `layers` + one group and
    extrapolated to the full depth."""
    from museflash.tools.benchmark import write_synthetic_checkpoints

    for context in contexts:
        if context < 32 or context % 32:
            raise TrafficError(f"--geometry-context {context} must be a multiple of 32 (the "
                               "export's rule for the global cache) of at least 32; use "
                               f"{max(32, -(-context // 32) * 32)}")
    full = geometry_configs()[0]["text_config"]["num_hidden_layers"]
    depths = [full] if layers in (None, full) else [layers, min(full, layers + LAYER_GROUP)]
    geometry_configs(depths[0])  # refuses a bad --layers before any work
    if kv_write not in set(KVWrite):
        raise TrafficError(f"--kv-write {kv_write!r} is not a strategy; choose one of "
                           f"{[str(k) for k in KVWrite]} (docs/kv-write.md)")
    if function is not None and function not in set(FunctionName):
        raise TrafficError(f"--function {function!r} is not a function of the geometry's "
                           f"bundle; choose one of {sorted(str(f) for f in FunctionName)}, or "
                           "leave it out for all")
    counted: dict[int, list[list[Summary]]] = {context: [] for context in contexts}
    work = Path(tempfile.mkdtemp(prefix="traffic-", dir=work_dir))
    try:
        for depth in depths:
            checkpoints = work / f"checkpoints-{depth}"
            echo(f"[traffic] writing synthetic checkpoints of {depth} layers")
            write_synthetic_checkpoints(checkpoints, 0, configs=geometry_configs(depth))
            for context in contexts:
                bundle = export_geometry(checkpoints, work / "bundle", context, echo, kv_write)
                counted[context].append([f.summary() for f in bundle_traffic(bundle, function)])
                shutil.rmtree(bundle)
            shutil.rmtree(checkpoints)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(depths) == 1:
        return {context: runs[0] for context, runs in counted.items()}
    return {context: [extrapolate(a, b, depths[0], depths[1], full)
                      for a, b in zip(*runs, strict=True)]
            for context, runs in counted.items()}
