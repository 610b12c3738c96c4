"""Overflow-proof RMSNorm candidates side by side (docs/fp16.md): each one converted alone to
an fp16 ML program, then run by the numpy interpreter on rows an fp16 norm must survive.

Per candidate: ops per norm in the saved program, ms per call at the given width, whether
every intermediate stayed finite, and the largest error against float64 on each kind of row
(on the "1e-2 beside 4e4" rows, of the channels beside the massive one, against their own
largest value).
The candidates:
- plain: x * rsqrt(mean(x^2) + eps), today's graph (x^2 overflows above |x| = 256);
- max_abs: the row divided by max(max|x|, 1) to find 1 / rms, eps by its square, and x
  itself multiplied by that factor (the default);
- l2_floor: x / max(reduce_l2_norm(x / sqrt(d)), sqrt(eps)), one reduction, eps as a floor;
- layer_norm_pair: layer_norm over [x, -x] (mean 0, variance mean(x^2)), Anemll's form.
The interpreter computes each op in fp32 or better and stores fp16, so it shows what each
form does under that rule; how a device accumulates inside one reduction or layer_norm op is
not documented, and only max_abs keeps every op's own result bounded whatever it does.

A second table holds the weighted max_abs norm's two ways of keeping small channels beside a
massive one (issue: fp16 small channels; docs/fp16.md), on rows of that class (channels near
1e-3 beside one of 1e4 to 3e4, the weight 1e4 on them and 0 on the massive one, as
`tiny-small-channels`' input norms): today's order (x * f) * w, the weight folded in first
x * (f * w), and the two products kept in fp32 by coremltools' per-op compute precision.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from museflash.bundle import NormForm
from museflash.models.base import RMSNorm

EPS = 1e-6
CANDIDATES = ("plain", "max_abs", "l2_floor", "layer_norm_pair")


class _L2Floor(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        x32 = x.float()
        rms = torch.linalg.vector_norm(x32 * (1.0 / self.dim ** 0.5), dim=-1, keepdim=True)
        return (x32 / torch.clamp(rms, min=EPS ** 0.5)).to(x.dtype)


class _LayerNormPair(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        pair = torch.cat([x, -x], dim=-1).float()
        normed = nn.functional.layer_norm(pair, (2 * self.dim,), eps=EPS)
        return normed[..., :self.dim].to(x.dtype)


def candidate(name: str, dim: int) -> nn.Module:
    if name in (NormForm.PLAIN, NormForm.MAX_ABS):
        norm = RMSNorm(dim, EPS, unit_offset=False, with_weight=False)
        norm.form = NormForm(name)
        return norm
    return {"l2_floor": _L2Floor, "layer_norm_pair": _LayerNormPair}[name](dim)


MASSIVE_CHANNEL = 3
# The kind whose error is measured on the channels beside the massive one, against their own
# largest value: what a final norm that mutes the massive channel passes on (docs/fp16.md).
BESIDE_MASSIVE = "1e-2 beside 4e4"


def hard_rows(dim: int, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """fp16 rows [1, rows, dim] by kind: ordinary, one massive channel (the audit's kind),
    channels of 1e-2 beside one of 4e4, dense large values, fp16's largest value, and
    tiny values (where eps matters)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((1, rows, dim))
    massive = base.copy()
    massive[..., MASSIVE_CHANNEL] = np.linspace(300.0, 65504.0, rows)
    beside = base * 1e-2
    beside[..., MASSIVE_CHANNEL] = 4e4
    largest = 65504.0 * np.sign(rng.standard_normal((1, rows, dim)))
    return {"ordinary": base, "massive channel": massive, BESIDE_MASSIVE: beside,
            "dense 3e3": base * 3000.0, "all 65504": largest, "tiny 1e-4": base * 1e-4}


def convert(module: nn.Module, dim: int, rows: int, directory: Path, precision=None):
    """`module` as an fp16 ML program (or under `precision`): its interpreter, the number of
    its ops (constants apart) and their types."""
    import coremltools as ct

    from museflash.runtime.interpreter import Interpreter, load_program

    example = torch.zeros(1, rows, dim, dtype=torch.float16)
    program = torch.export.export(module.eval().half(), (example,)).run_decompositions({})
    model = ct.convert(program, convert_to="mlprogram", skip_model_load=True,
                       minimum_deployment_target=ct.target.iOS18,
                       compute_precision=precision or ct.precision.FLOAT16)
    path = directory / "norm.mlpackage"
    model.save(str(path))
    loaded = load_program(path)
    types = [op.op_type for op in loaded.functions["main"].operations
             if op.op_type != "const" and not op.op_type.startswith("constexpr_")]
    return Interpreter(loaded), len(types), types


def measure(name: str, dim: int, rows: int, repeats: int) -> dict:
    from museflash.runtime.interpreter import NonFiniteError

    reference = RMSNorm(dim, EPS, unit_offset=False, with_weight=False)
    reference.form = NormForm.PLAIN
    with tempfile.TemporaryDirectory() as scratch:
        interpreter, ops, _ = convert(candidate(name, dim), dim, rows, Path(scratch))
    (input_name,) = interpreter.input_specs
    errors: dict[str, float | None] = {}
    for kind, values in hard_rows(dim, rows).items():
        x = values.astype(np.float16)
        with torch.no_grad():
            expected = reference(torch.from_numpy(x.astype(np.float64))).numpy()
        try:
            (out,) = interpreter.run({input_name: x}).values()
        except NonFiniteError:
            errors[kind] = None
            continue
        error = np.abs(out.astype(np.float64) - expected)
        if kind == BESIDE_MASSIVE:
            kept = np.arange(dim) != MASSIVE_CHANNEL
            error, expected = error[..., kept], expected[..., kept]
        errors[kind] = float(np.max(error) / np.max(np.abs(expected)))
    x = hard_rows(dim, rows)["ordinary"].astype(np.float16)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        interpreter.run({input_name: x})
        times.append(time.perf_counter() - began)
    return {"candidate": name, "ops": ops, "ms": 1000 * float(np.median(times)),
            "errors": errors}


WEIGHTED_FORMS = ("today", "folded", "fp32 products")
SMALL_CHANNEL_WEIGHT = 1e4


def small_channel_rows(dim: int, rows: int, seed: int = 0) -> np.ndarray:
    """[1, rows, dim]: channels near 1e-3 beside one of 1e4 to 3e4 (MASSIVE_CHANNEL)."""
    x = np.random.default_rng(seed).standard_normal((1, rows, dim)) * 1e-3
    x[..., MASSIVE_CHANNEL] = np.linspace(1e4, 3e4, rows)
    return x


def weighted_norm(dim: int, fold: bool) -> RMSNorm:
    """The max_abs norm whose weight mutes the massive channel and lifts the others."""
    norm = RMSNorm(dim, EPS, unit_offset=False)
    with torch.no_grad():
        norm.weight.fill_(SMALL_CHANNEL_WEIGHT)
        norm.weight[MASSIVE_CHANNEL] = 0.0
    norm.fold = fold
    return norm


def _fp32_products(op) -> bool:
    """coremltools' op_selector: True (fp16) for every op but the norm's two products, x * f
    (reading the input, through its cast) and * w (giving the output, through its cast)."""
    if op.op_type != "mul":
        return True
    block = op.enclosing_block
    outputs = {var.name for var in block.outputs}

    def from_input(var) -> bool:
        source = var.op
        return var.name in block.inputs or (
            source is not None and source.op_type == "cast" and source.x.name in block.inputs)

    reads_input = from_input(op.x) or from_input(op.y)
    gives_output = op.outputs[0].name in outputs or any(
        child.op_type == "cast" and child.outputs[0].name in outputs
        for child in op.outputs[0].child_ops)
    return not (reads_input or gives_output)


def measure_weighted(form: str, dim: int, rows: int, repeats: int) -> dict:
    """One weighted form on small_channel_rows: ops, of which cast, ms per call, and the largest
    error of a row's small channels against float64 relative to that row's largest."""
    import coremltools as ct

    x = small_channel_rows(dim, rows).astype(np.float16)
    precision = (ct.transform.FP16ComputePrecision(op_selector=_fp32_products)
                 if form == "fp32 products" else ct.precision.FLOAT16)
    with tempfile.TemporaryDirectory() as scratch:
        interpreter, ops, types = convert(weighted_norm(dim, form == "folded"), dim, rows,
                                          Path(scratch), precision)
    (input_name,) = interpreter.input_specs
    (out,) = interpreter.run({input_name: x}).values()
    exact = x.astype(np.float64)
    exact = (exact / np.sqrt(np.mean(exact ** 2, axis=-1, keepdims=True) + EPS)
             * weighted_norm(dim, False).weight.double().numpy())
    kept = np.arange(dim) != MASSIVE_CHANNEL
    error = np.abs(out.astype(np.float64) - exact)[..., kept]
    relative = np.max(error.max(axis=-1) / np.abs(exact[..., kept]).max(axis=-1))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        interpreter.run({input_name: x})
        times.append(time.perf_counter() - began)
    return {"form": form, "ops": ops, "casts": types.count("cast"), "ms": 1000 * float(
        np.median(times)), "error": float(relative)}


def report(dim: int, rows: int, repeats: int) -> list[str]:
    results = [measure(name, dim, rows, repeats) for name in CANDIDATES]
    kinds = list(results[0]["errors"])
    lines = [f"norm candidates at width {dim}, {rows} rows, numpy interpreter (fp16 storage); "
             "error: max |out - float64| / max |float64|, 'inf' where an op went non-finite",
             "| candidate | ops | ms per call | " + " | ".join(kinds) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in kinds) + " |"]
    for r in results:
        cells = ["inf" if e is None else f"{e:.1e}" for e in r["errors"].values()]
        lines.append(f"| {r['candidate']} | {r['ops']} | {r['ms']:.3f} | "
                     + " | ".join(cells) + " |")
    weighted = [measure_weighted(form, dim, rows, repeats) for form in WEIGHTED_FORMS]
    lines += ["", f"the weighted norm on small channels beside a massive one (width {dim}, "
              f"{rows} rows); error: max over rows of the small channels' "
              "max |out - float64| / their max |float64|",
              "| form | ops | of which cast | ms per call | error |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['form']} | {r['ops']} | {r['casts']} | {r['ms']:.3f} | {r['error']:.1e} |"
              for r in weighted]
    return lines
