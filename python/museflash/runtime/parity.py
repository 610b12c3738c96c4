"""Compare an exported Core ML function (run by the numpy interpreter) with eager PyTorch.

A parity step feeds the same inputs to the interpreter and to the torch module (an entry point
view such as `drafter.with_entry_point("draft")`) and compares every output and every cache.
Caches are not re-synchronised between steps: after `sync_states` both sides evolve on their
own, so a wrong cache write shows up in later steps as well as in the cache comparison.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from museflash.runtime.interpreter import Interpreter


class ParityError(AssertionError):
    """An exported function disagrees with eager PyTorch beyond the tolerance."""


@dataclass(frozen=True)
class Tolerance:
    """Passes when max|actual - reference| <= abs_tol + rel_tol * max|reference|.

    Relative error is taken against the tensor's scale (its largest magnitude), not per
    element, because per-element ratios blow up on entries that happen to be near zero.
    """

    rel_tol: float
    abs_tol: float = 0.0


# Relative to each tensor's largest magnitude (parity.Tolerance). The packages keep every
# activation, weight and cache entry in fp16 (unit roundoff ~4.9e-4) while the reference
# computes in fp32; the roundings accumulate through the residual stream of the 8 demo layers
# to a few 1e-3 at positions below ~100 (RoPE angles are also formed in fp16). A real defect
# (swapped or wrong weights, a mis-addressed cache slot) moves outputs by O(1) of scale.
OUTPUT_TOLERANCE = Tolerance(rel_tol=3e-2)
STATE_TOLERANCE = Tolerance(rel_tol=2e-2)


@dataclass(frozen=True)
class Discrepancy:
    name: str
    max_abs: float
    scale: float
    mismatched_shape: bool = False
    exact: bool = False  # integer and bool outputs (positions, ids) must match exactly

    @property
    def max_rel(self) -> float:
        return self.max_abs / self.scale if self.scale > 0 else float(self.max_abs > 0)

    def within(self, tolerance: Tolerance) -> bool:
        if self.mismatched_shape or not np.isfinite(self.max_abs):
            return False
        if self.exact:
            return self.max_abs == 0
        return self.max_abs <= tolerance.abs_tol + tolerance.rel_tol * self.scale

    def __str__(self) -> str:
        if self.mismatched_shape:
            return f"{self.name}: shape mismatch"
        return f"{self.name}: max abs {self.max_abs:.3g}, rel {self.max_rel:.3g}"


def discrepancy(name: str, actual: np.ndarray, reference: np.ndarray) -> Discrepancy:
    actual, reference = np.asarray(actual), np.asarray(reference)
    if actual.shape != reference.shape:
        return Discrepancy(name, float("inf"), 0.0, mismatched_shape=True)
    a, r = actual.astype(np.float64), reference.astype(np.float64)
    max_abs = float(np.max(np.abs(a - r))) if a.size else 0.0
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    exact = not np.issubdtype(reference.dtype, np.floating)
    return Discrepancy(name, max_abs, scale, exact=exact)


@dataclass
class ParityReport:
    """Discrepancies of one step, keyed by the package's output and state names."""

    function_name: str
    outputs: dict[str, Discrepancy] = field(default_factory=dict)
    states: dict[str, Discrepancy] = field(default_factory=dict)
    actual: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # package outputs

    def failures(self, outputs: Tolerance, states: Tolerance) -> list[Discrepancy]:
        bad = [d for d in self.outputs.values() if not d.within(outputs)]
        return bad + [d for d in self.states.values() if not d.within(states)]

    def check(self, outputs: Tolerance, states: Tolerance) -> None:
        bad = self.failures(outputs, states)
        if bad:
            raise ParityError(
                f"{self.function_name}: " + "; ".join(str(d) for d in bad)
                + f" (tolerances: outputs {outputs}, states {states})"
            )

    def __str__(self) -> str:
        parts = [str(d) for d in self.outputs.values()]
        parts += [f"state {d}" for d in self.states.values()]
        return f"{self.function_name}: " + "; ".join(parts)


def module_states(module: torch.nn.Module, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Copies of the module's cache buffers, as the fp16 arrays the interpreter takes."""
    return {n: getattr(module, n).detach().to(torch.float16).numpy().copy() for n in names}


def sync_states(module: torch.nn.Module, states: Mapping[str, np.ndarray]) -> None:
    """Makes the module's cache buffers equal to `states` (the starting point of a run)."""
    with torch.no_grad():
        for name, value in states.items():
            buffer = getattr(module, name)
            buffer.copy_(torch.from_numpy(np.asarray(value)).to(buffer.dtype))


def _torch_outputs(result: object) -> list[np.ndarray]:
    tensors = list(result) if isinstance(result, (tuple, list)) else [result]
    return [t.detach().numpy() if t.dtype != torch.float16 else t.float().numpy()
            for t in tensors]


def parity_step(
    interpreter: Interpreter,
    module: torch.nn.Module,
    inputs: Mapping[str, np.ndarray],
    states: dict[str, np.ndarray],
) -> ParityReport:
    """Runs one call on both sides and compares outputs and caches.

    `module(*args)` receives the inputs in the package function's input order (the order they
    were declared at conversion, which is the torch signature's); torch outputs are matched to
    the package outputs by position. `states` is updated in place by the interpreter, the
    module's buffers by torch.
    """
    actual = interpreter.run(inputs, states)
    args = [torch.from_numpy(np.asarray(inputs[name])) for name in interpreter.input_specs]
    with torch.no_grad():
        reference = _torch_outputs(module(*args))
    if len(reference) != len(interpreter.output_names):
        raise ParityError(
            f"{interpreter.function_name}: package has outputs {interpreter.output_names} but "
            f"torch returned {len(reference)} values"
        )
    report = ParityReport(interpreter.function_name, actual=dict(actual))
    for name, ref in zip(interpreter.output_names, reference, strict=True):
        report.outputs[name] = discrepancy(name, actual[name], ref)
    for name in interpreter.state_specs:
        ref = getattr(module, name).detach().float().numpy()
        report.states[name] = discrepancy(name, states[name], ref)
    return report
