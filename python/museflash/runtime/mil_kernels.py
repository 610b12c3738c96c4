"""The numpy interpreter's kernels: one function per MIL op type (`KERNELS`), and the error
they raise. `museflash.runtime.interpreter` runs programs with them; see its docstring for the
numerics every kernel follows (fp32 compute, float64 for sums and transcendentals, results
stored in the declared dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Kernel = Callable[[dict[str, Any]], Any]


class InterpreterError(RuntimeError):
    """An op failed or produced a value inconsistent with the program's declared types."""

# Kernels. Each takes the op's inputs by parameter name (numpy arrays, Python lists for tuple
# inputs, None for absent optional inputs) and returns a value or a tuple of values; the
# interpreter then casts each to the output's declared dtype.


def _f32(x: np.ndarray) -> np.ndarray:
    """Floats compute in fp32 (fp16 storage is restored by the output cast)."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _int_list(x: Any) -> list[int]:
    return [int(v) for v in np.asarray(x).reshape(-1)]


def _flag(x: Any, default: bool = False) -> bool:
    # Loaded scalar flags are numpy bools; numpy 2 APIs want a real bool.
    return default if x is None else bool(np.asarray(x))


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Kernel:
    return lambda a: fn(_f32(a["x"]), _f32(a["y"]))


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Kernel:
    return lambda a: fn(_f32(a["x"]))


def _f64(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """`fn` evaluated in float64 and rounded once to fp32 (for float inputs)."""
    def wrapped(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            return fn(x)
        return fn(x.astype(np.float64)).astype(np.float32)

    return wrapped


def _exp32(x: np.ndarray) -> np.ndarray:
    return _f64(np.exp)(x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so exp never overflows for large |x|.
    e = _exp32(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _round_half_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _real_div(a: dict[str, Any]) -> np.ndarray:
    x, y = _f32(a["x"]), _f32(a["y"])
    if not np.issubdtype(np.result_type(x, y), np.floating):
        x = x.astype(np.float32)
    return x / y


def _with_epsilon(fn: Callable[[np.ndarray], np.ndarray], default: float) -> Kernel:
    def kernel(a: dict[str, Any]) -> np.ndarray:
        eps = default if a.get("epsilon") is None else float(np.asarray(a["epsilon"]))
        return fn(_f32(a["x"]) + np.float32(eps))

    return kernel


def _pow(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if not np.issubdtype(np.result_type(x, y), np.floating):
        return np.power(x, y)
    # x * x for y = 2 is exact in float64 (two 24-bit significands), so rounding gives fp32's x*x.
    return np.power(np.asarray(x, np.float64), np.asarray(y, np.float64)).astype(np.float32)


def _clip(a: dict[str, Any]) -> np.ndarray:
    return np.clip(_f32(a["x"]), _f32(a["alpha"]), _f32(a["beta"]))


def _cast(a: dict[str, Any]) -> np.ndarray:
    # The output cast does the conversion; float -> int truncates like astype.
    return np.asarray(a["x"])


def _sum32(x: np.ndarray, **kwargs: Any) -> np.ndarray:
    """A sum in float64, rounded once to fp32 (integers sum as integers)."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        return np.sum(x, **kwargs)
    return np.sum(x, dtype=np.float64, **kwargs).astype(np.float32)


def _mean32(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    total = _sum32(x, axis=axis, keepdims=keepdims)
    count = np.asarray(x).size // max(1, np.asarray(total).size)
    return total / np.float32(count)


def _l2_norm32(x: np.ndarray, **kwargs: Any) -> np.ndarray:
    return np.sqrt(np.sum(np.asarray(x, np.float64) ** 2, **kwargs)).astype(np.float32)


def _layer_norm(a: dict[str, Any]) -> np.ndarray:
    """MIL layer_norm over `axes`, statistics in float64 (no bundle uses it; the norm figures
    measure it as a candidate, docs/fp16.md)."""
    x = np.asarray(a["x"], np.float64)
    axes = tuple(_int_list(a["axes"])) if a.get("axes") is not None else (-1,)
    centred = x - x.mean(axis=axes, keepdims=True)
    epsilon = float(np.asarray(a["epsilon"])) if a.get("epsilon") is not None else 1e-5
    out = centred / np.sqrt((centred ** 2).mean(axis=axes, keepdims=True) + epsilon)
    if a.get("gamma") is not None:
        out = out * np.asarray(a["gamma"], np.float64)
    if a.get("beta") is not None:
        out = out + np.asarray(a["beta"], np.float64)
    return out.astype(np.float32)


def _softmax(a: dict[str, Any]) -> np.ndarray:
    x = _f32(a["x"])
    axis = int(np.asarray(a["axis"])) if a.get("axis") is not None else -1
    shifted = _exp32(x - x.max(axis=axis, keepdims=True))
    return shifted / _sum32(shifted, axis=axis, keepdims=True)


def _matmul64(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Products summed in float64, rounded once to fp32."""
    return np.matmul(np.asarray(x, np.float64), np.asarray(y, np.float64)).astype(np.float32)


def _linear(a: dict[str, Any]) -> np.ndarray:
    out = _matmul64(_f32(a["x"]), _f32(a["weight"]).T)
    if a.get("bias") is not None:
        out = out + _f32(a["bias"])
    return out


def _matmul(a: dict[str, Any]) -> np.ndarray:
    x, y = _f32(a["x"]), _f32(a["y"])
    if _flag(a.get("transpose_x")) and x.ndim >= 2:
        x = np.swapaxes(x, -1, -2)
    if _flag(a.get("transpose_y")) and y.ndim >= 2:
        y = np.swapaxes(y, -1, -2)
    return _matmul64(x, y)


def _reduction(fn: Callable[..., np.ndarray]) -> Kernel:
    def kernel(a: dict[str, Any]) -> np.ndarray:
        x = _f32(a["x"])
        axes = None if a.get("axes") is None else tuple(_int_list(a["axes"]))
        return fn(x, axis=axes, keepdims=_flag(a.get("keep_dims")))

    return kernel


def _log_sum_exp(x: np.ndarray, axis: Any, keepdims: bool) -> np.ndarray:
    peak = np.max(x, axis=axis, keepdims=True)
    total = _f64(np.log)(_sum32(_exp32(x - peak), axis=axis, keepdims=True)) + peak
    return total if keepdims else np.squeeze(total, axis=axis)


def _arg_reduction(fn: Callable[..., np.ndarray]) -> Kernel:
    def kernel(a: dict[str, Any]) -> np.ndarray:
        axis = int(np.asarray(a["axis"])) if a.get("axis") is not None else -1
        out = fn(_f32(a["x"]), axis=axis)
        return np.expand_dims(out, axis) if _flag(a.get("keep_dims")) else out

    return kernel


def _topk(a: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(values, indices) of the k largest (smallest if ascending) along `axis`; ties keep the
    lower index first. Indices are cast to `output_indices_dtype` as Core ML would, so a 16-bit
    index type wraps here exactly as it would on device."""
    x = np.asarray(a["x"])
    k = int(np.asarray(a["k"]))
    axis = int(np.asarray(a.get("axis", -1)))
    ascending = _flag(a.get("ascending"))
    order = np.argsort(x if ascending else -x.astype(np.float64), axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    values = np.take_along_axis(x, indices, axis=axis)
    dtype = a.get("output_indices_dtype") or "int32"
    return values, indices.astype(_INDEX_DTYPES[str(dtype)])


_INDEX_DTYPES = {"int32": np.int32, "int16": np.int16, "uint16": np.uint16}


def _concat(a: dict[str, Any]) -> np.ndarray:
    values = [np.asarray(v) for v in a["values"]]
    axis = int(np.asarray(a["axis"]))
    if not _flag(a.get("interleave")):
        return np.concatenate(values, axis=axis)
    axis %= values[0].ndim
    stacked = np.stack(values, axis=axis + 1)
    shape = list(values[0].shape)
    shape[axis] *= len(values)
    return stacked.reshape(shape)


def _reshape(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    shape = _int_list(a["shape"])
    # iOS17 semantics: a 0 copies the input dim aligned from the right (1 if there is none).
    for i, dim in enumerate(shape):
        if dim == 0:
            j = x.ndim - (len(shape) - i)
            shape[i] = x.shape[j] if j >= 0 else 1
    return x.reshape(shape)


def _expand_dims(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    axes = _int_list(a["axes"])
    rank = x.ndim + len(axes)
    for axis in sorted(ax % rank for ax in axes):
        x = np.expand_dims(x, axis)
    return x


def _squeeze(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    if a.get("axes") is None:
        return np.squeeze(x)
    return np.squeeze(x, axis=tuple(_int_list(a["axes"])))


def _slice_index(shape: tuple[int, ...], a: dict[str, Any]) -> tuple[Any, ...]:
    """numpy index equivalent to slice_by_index / slice_update's begin/end/stride/masks."""
    rank = len(shape)

    def per_axis(name: str, fill: Any) -> list[Any]:
        return [fill] * rank if a.get(name) is None else list(np.asarray(a[name]).reshape(-1))

    begin, end = _int_list(a["begin"]), _int_list(a["end"])
    stride = [int(s) for s in per_axis("stride", 1)]
    begin_mask = [bool(m) for m in per_axis("begin_mask", False)]
    end_mask = [bool(m) for m in per_axis("end_mask", False)]
    squeeze_mask = [bool(m) for m in per_axis("squeeze_mask", False)]
    index: list[Any] = []
    for axis in range(rank):
        if squeeze_mask[axis]:
            index.append(begin[axis])
            continue
        start = None if begin_mask[axis] else begin[axis]
        stop = None if end_mask[axis] else end[axis]
        index.append(slice(start, stop, stride[axis]))
    return tuple(index)


def _slice_by_index(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    return x[_slice_index(x.shape, a)]


def _slice_by_size(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    index = []
    for start, size, dim in zip(_int_list(a["begin"]), _int_list(a["size"]), x.shape,
                                strict=True):
        start %= dim
        index.append(slice(start, dim if size == -1 else start + size))
    return x[tuple(index)]


def _slice_update(a: dict[str, Any]) -> np.ndarray:
    return slice_update_into(np.array(a["x"], copy=True), a)


def slice_update_into(out: np.ndarray, a: dict[str, Any]) -> np.ndarray:
    """slice_update writing into `out` (x itself, when nothing else reads it: Interpreter)."""
    index = _slice_index(out.shape, a)
    target_shape = out[index].shape
    out[index] = np.asarray(a["update"]).astype(out.dtype).reshape(target_shape)
    return out


def _transpose(a: dict[str, Any]) -> np.ndarray:
    return np.transpose(np.asarray(a["x"]), _int_list(a["perm"]))


def _tile(a: dict[str, Any]) -> np.ndarray:
    return np.tile(np.asarray(a["x"]), _int_list(a["reps"]))


def _checked_indices(indices: np.ndarray, size: int, op: str) -> np.ndarray:
    indices = np.asarray(indices).astype(np.int64)
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise InterpreterError(
            f"{op}: index out of range [{-size}, {size}): min {indices.min()}, "
            f"max {indices.max()}"
        )
    return np.where(indices < 0, indices + size, indices)


def _gather(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    axis = int(np.asarray(a["axis"])) if a.get("axis") is not None else 0
    batch_dims = int(np.asarray(a["batch_dims"])) if a.get("batch_dims") is not None else 0
    return _gather_batched(x, np.asarray(a["indices"]), axis % x.ndim, batch_dims)


def _gather_batched(x: np.ndarray, indices: np.ndarray, axis: int, batch_dims: int):
    if batch_dims == 0:
        return np.take(x, _checked_indices(indices, x.shape[axis], "gather"), axis=axis)
    return np.stack([
        _gather_batched(x[i], indices[i], axis - 1, batch_dims - 1) for i in range(x.shape[0])
    ])


def _gather_along_axis(a: dict[str, Any]) -> np.ndarray:
    x = np.asarray(a["x"])
    axis = int(np.asarray(a["axis"])) % x.ndim
    indices = _checked_indices(a["indices"], x.shape[axis], "gather_along_axis")
    return np.take_along_axis(x, indices, axis=axis)


def _gather_nd(a: dict[str, Any]) -> np.ndarray:
    if a.get("batch_dims") is not None and int(np.asarray(a["batch_dims"])) != 0:
        raise InterpreterError("gather_nd with batch_dims != 0 is not supported")
    x, indices = np.asarray(a["x"]), np.asarray(a["indices"])
    depth = indices.shape[-1]
    index = tuple(
        _checked_indices(indices[..., k], x.shape[k], "gather_nd") for k in range(depth)
    )
    return x[index]


_SCATTER_MODES: dict[str, Callable[[np.ndarray, tuple, np.ndarray], None]] = {
    "add": lambda out, idx, upd: np.add.at(out, idx, upd),
    "sub": lambda out, idx, upd: np.subtract.at(out, idx, upd),
    "mul": lambda out, idx, upd: np.multiply.at(out, idx, upd),
    "div": lambda out, idx, upd: np.divide.at(out, idx, upd),
    "max": lambda out, idx, upd: np.maximum.at(out, idx, upd),
    "min": lambda out, idx, upd: np.minimum.at(out, idx, upd),
}


def _scatter_into(out: np.ndarray, index: tuple, updates: np.ndarray, mode: str) -> None:
    if mode == "update":
        # Sequential assignment so that, for repeated indices, the last update wins.
        flat = np.broadcast_to(updates, out[index].shape)
        for position in np.ndindex(*index[0].shape):
            out[tuple(component[position] for component in index)] = flat[position]
        return
    if mode not in _SCATTER_MODES:
        raise InterpreterError(f"scatter mode {mode!r} is not supported")
    _SCATTER_MODES[mode](out, index, updates)


def _scatter_nd(a: dict[str, Any]) -> np.ndarray:
    out = np.array(_f32(a["data"]), copy=True)
    indices = np.asarray(a["indices"])
    depth = indices.shape[-1]
    index = tuple(
        _checked_indices(indices[..., k], out.shape[k], "scatter_nd") for k in range(depth)
    )
    _scatter_into(out, index, _f32(a["updates"]), str(a.get("mode") or "update"))
    return out


def _scatter(a: dict[str, Any]) -> np.ndarray:
    data = np.array(_f32(a["data"]), copy=True)
    axis = int(np.asarray(a["axis"])) % data.ndim
    moved = np.moveaxis(data, axis, 0)  # a view: writes land in `data`
    indices = _checked_indices(np.asarray(a["indices"]).reshape(-1), moved.shape[0], "scatter")
    updates = np.moveaxis(_f32(a["updates"]), axis, 0)
    _scatter_into(moved, (indices,), updates, str(a.get("mode") or "update"))
    return data


def _scatter_along_axis(a: dict[str, Any]) -> np.ndarray:
    data = np.array(_f32(a["data"]), copy=True)
    axis = int(np.asarray(a["axis"])) % data.ndim
    indices = _checked_indices(a["indices"], data.shape[axis], "scatter_along_axis")
    grid = list(np.indices(indices.shape, sparse=False))
    grid[axis] = indices
    _scatter_into(data, tuple(grid), _f32(a["updates"]), str(a.get("mode") or "update"))
    return data


def _select(a: dict[str, Any]) -> np.ndarray:
    # No fp32 round trip: picking values computes nothing, and the output cast stores them in
    # the declared dtype (for the KV blend, a whole cache per write).
    return np.where(np.asarray(a["cond"]).astype(bool), a["a"], a["b"])


def _fill_like(a: dict[str, Any]) -> np.ndarray:
    value = 0.0 if a.get("value") is None else np.asarray(a["value"])
    return np.full(np.shape(a["ref_tensor"]), value)


def _fill(a: dict[str, Any]) -> np.ndarray:
    value = 0.0 if a.get("value") is None else np.asarray(a["value"])
    return np.full(_int_list(a["shape"]), value)


def _range_1d(a: dict[str, Any]) -> np.ndarray:
    return np.arange(np.asarray(a["start"]), np.asarray(a["end"]), np.asarray(a["step"]))


def _split(a: dict[str, Any]) -> tuple[np.ndarray, ...]:
    x = np.asarray(a["x"])
    axis = int(np.asarray(a["axis"])) % x.ndim
    if a.get("split_sizes") is not None:
        bounds = np.cumsum(_int_list(a["split_sizes"]))[:-1]
        return tuple(np.split(x, bounds, axis=axis))
    return tuple(np.split(x, int(np.asarray(a["num_splits"])), axis=axis))


def _stack(a: dict[str, Any]) -> np.ndarray:
    return np.stack([np.asarray(v) for v in a["values"]], axis=int(np.asarray(a["axis"])))


def _read_state(a: dict[str, Any]) -> np.ndarray:
    # A snapshot: later in-place writes to the state must not change values already read.
    return np.array(a["input"], copy=True)


def _update_state(a: dict[str, Any]) -> np.ndarray:
    state = a["state"]
    state[...] = np.asarray(a["value"]).astype(state.dtype)
    return np.array(state, copy=True)


KERNELS: dict[str, Kernel] = {
    # elementwise binary
    "add": _binary(np.add),
    "sub": _binary(np.subtract),
    "mul": _binary(np.multiply),
    "real_div": _real_div,
    "floor_div": _binary(np.floor_divide),
    "mod": _binary(np.mod),
    "pow": lambda a: _pow(_f32(a["x"]), _f32(a["y"])),
    "maximum": _binary(np.maximum),
    "minimum": _binary(np.minimum),
    "equal": _binary(np.equal),
    "not_equal": _binary(np.not_equal),
    "less": _binary(np.less),
    "less_equal": _binary(np.less_equal),
    "greater": _binary(np.greater),
    "greater_equal": _binary(np.greater_equal),
    "logical_and": _binary(np.logical_and),
    "logical_or": _binary(np.logical_or),
    "logical_xor": _binary(np.logical_xor),
    # elementwise unary
    "abs": _unary(np.abs),
    "ceil": _unary(np.ceil),
    "floor": _unary(np.floor),
    "round": _unary(_round_half_away),
    "sign": _unary(np.sign),
    "square": _unary(np.square),
    "sqrt": _unary(np.sqrt),
    "exp": _unary(_f64(np.exp)),
    "exp2": _unary(_f64(np.exp2)),
    "sin": _unary(_f64(np.sin)),
    "cos": _unary(_f64(np.cos)),
    "tan": _unary(_f64(np.tan)),
    "tanh": _unary(_f64(np.tanh)),
    "logical_not": _unary(np.logical_not),
    "rsqrt": _with_epsilon(lambda x: 1.0 / np.sqrt(x), 1e-12),
    "inverse": _with_epsilon(lambda x: 1.0 / x, 1e-4),
    "log": _with_epsilon(_f64(np.log), 1e-45),
    "clip": _clip,
    "cast": _cast,
    "identity": lambda a: np.asarray(a["x"]),
    # activations
    "relu": _unary(lambda x: np.maximum(x, 0)),
    "sigmoid": _unary(_sigmoid),
    "silu": _unary(lambda x: x * _sigmoid(x)),
    "softplus": _unary(_f64(lambda x: np.logaddexp(0, x))),
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    # linear algebra
    "linear": _linear,
    "matmul": _matmul,
    # reductions
    "reduce_sum": _reduction(_sum32),
    "reduce_mean": _reduction(_mean32),
    "reduce_max": _reduction(np.max),
    "reduce_min": _reduction(np.min),
    "reduce_prod": _reduction(np.prod),
    "reduce_sum_square": _reduction(lambda x, **k: _sum32(np.asarray(x, np.float64) ** 2, **k)),
    "reduce_l1_norm": _reduction(lambda x, **k: _sum32(np.abs(x), **k)),
    "reduce_l2_norm": _reduction(_l2_norm32),
    "reduce_log_sum": _reduction(lambda x, **k: np.log(np.sum(x, **k))),
    "reduce_log_sum_exp": _reduction(_log_sum_exp),
    "reduce_argmax": _arg_reduction(np.argmax),
    "reduce_argmin": _arg_reduction(np.argmin),
    "topk": _topk,
    # shape and data movement
    "concat": _concat,
    "stack": _stack,
    "split": _split,
    "reshape": _reshape,
    "transpose": _transpose,
    "expand_dims": _expand_dims,
    "squeeze": _squeeze,
    "tile": _tile,
    "slice_by_index": _slice_by_index,
    "slice_by_size": _slice_by_size,
    "slice_update": _slice_update,
    "gather": _gather,
    "gather_along_axis": _gather_along_axis,
    "gather_nd": _gather_nd,
    "scatter": _scatter,
    "scatter_nd": _scatter_nd,
    "scatter_along_axis": _scatter_along_axis,
    "select": _select,
    "fill": _fill,
    "fill_like": _fill_like,
    "range_1d": _range_1d,
    "shape": lambda a: np.array(np.shape(a["x"]), dtype=np.int32),
    # states
    "read_state": _read_state,
    "coreml_update_state": _update_state,
}

SUPPORTED_OP_TYPES = frozenset(KERNELS) | {"const"}

# Ops whose results hold only values of their inputs (moved, selected or copied, not computed):
# their results are finite when their inputs are, so the interpreter checks neither.
DATA_MOVEMENT_OPS = frozenset({
    "concat", "stack", "split", "reshape", "transpose", "expand_dims", "squeeze", "tile",
    "slice_by_index", "slice_by_size", "slice_update", "gather", "gather_along_axis",
    "gather_nd", "select", "identity", "read_state", "coreml_update_state"})
