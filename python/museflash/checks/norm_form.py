"""Which form a converted graph writes its RMSNorms in (bundle.NormForm), read off the ops.

Every RMSNorm of a museflash graph ends in `rsqrt(mean(y * y) + e)` (or `pow(y, 2)`). In the
max_abs form `y` is `real_div(x, maximum(reduce_max(abs(x)), 1))`; in the plain form `y` is
the norm's input itself. `metadata.json`'s `fp16_range.norm` must say what the graph does:
verify compares the two, so a bundle whose record claims another form is refused.

A norm the fp16 range audit folds (`fp16_range.folded_norms`) multiplies the row's factor
`f = rsqrt(...) / m` by its constant weight before `x`: `x * (f * w)`. Unfolded, `f` meets `x`
first. `folded_norm_count` counts the first kind; verify holds it to the record.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from museflash.bundle import NormForm


def _producer(op: Any, *names: str) -> Any | None:
    """The op that makes the first of `names` among `op`'s inputs, or None."""
    for name in names:
        var = op.inputs.get(name)
        if var is not None and not isinstance(var, (list, tuple)):
            return var.op
    return None


def _through_mean(rsqrt: Any) -> Any | None:
    """The `y` that rsqrt(mean(y^2) + e) squares, as the op that made it."""
    node = _producer(rsqrt, "x")
    if node is not None and node.op_type == "add":
        node = next((p for p in (_producer(node, "x"), _producer(node, "y"))
                     if p is not None and p.op_type == "reduce_mean"), None)
    if node is None or node.op_type != "reduce_mean":
        return None
    square = _producer(node, "x")
    if square is None or square.op_type not in ("pow", "mul"):
        return None
    return _producer(square, "x")


def norm_forms(function: Any) -> Counter:
    """How many of `function`'s norms are written in each form (NormForm values), and
    "unknown" for an rsqrt that matches neither pattern."""
    forms: Counter = Counter()
    for op in function.operations:
        if op.op_type != "rsqrt":
            continue
        y = _through_mean(op)
        if y is None:
            forms["unknown"] += 1
            continue
        divisor = _producer(y, "y") if y.op_type == "real_div" else None
        peak = divisor is not None and divisor.op_type == "maximum" and any(
            p is not None and p.op_type == "reduce_max"
            for p in (_producer(divisor, "x"), _producer(divisor, "y")))
        forms[NormForm.MAX_ABS.value if peak else NormForm.PLAIN.value] += 1
    return forms


def _times_constant(var: Any) -> bool:
    """Whether `var` is multiplied by a constant: the other input of a `mul` it feeds has a
    value."""
    return any(child.op_type == "mul" and any(
        other is not var and getattr(other, "val", None) is not None
        for other in (child.inputs.get("x"), child.inputs.get("y")))
        for child in var.child_ops)


def folded_norm_count(function: Any) -> int:
    """How many of `function`'s norms multiply the row's factor `rsqrt(...) / m` by a
    constant (their weight) before the input: the fold (models/base.py RMSNorm.fold), which
    only the max_abs form writes."""
    return sum(1 for op in function.operations if op.op_type == "rsqrt"
               and any(child.op_type == "real_div" and _times_constant(child.outputs[0])
                       for child in op.outputs[0].child_ops))


def graph_norm_form(function: Any) -> str:
    """The single form every norm of `function` is written in; "mixed" or "none" otherwise."""
    forms = norm_forms(function)
    if not forms:
        return "none"
    return next(iter(forms)) if len(forms) == 1 else "mixed"
