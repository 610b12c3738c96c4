"""Numpy reference interpreter for the ML programs inside saved Core ML `.mlpackage` files.

There is no Core ML runtime on Linux, so this is how we check that an exported package
computes what the PyTorch model computes:

    program = load_program("drafter.mlpackage", "draft")
    outputs = Interpreter(program, "draft").run(inputs, states)

Numerics: every tensor is stored in the dtype the program declares for it (so fp16 values are
rounded to fp16 after every op, as on device), while each op computes in fp32. Sums of products
(linear, matmul), reductions that add (sum, mean, softmax's denominator) and transcendental
functions (exp, tanh, log, sin, ...) are computed in float64 and rounded once to fp32: the fp32
value is then the correctly rounded one in all but a vanishing fraction of cases, whatever the
summation order or the library, so this interpreter and the Swift one (MILInterpreter) agree bit
for bit, and neither depends on the BLAS build or its thread count. Float results therefore
reflect fp16 storage but not any particular device's accumulation order.

States are numpy arrays owned by the caller; `coreml_update_state` writes into them in place,
so functions of one multifunction package (e.g. `inject_kv` and `draft`) can share a dict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from museflash.bundle import COMPRESSION_OPS, PACKAGE_WEIGHTS_DIR, CompressionMode
from museflash.compression import depalettize, dequantize_affine, dequantize_linear
from museflash.runtime.mil_kernels import (  # noqa: F401 (SUPPORTED_OP_TYPES: re-exported)
    DATA_MOVEMENT_OPS,
    KERNELS,
    SUPPORTED_OP_TYPES,
    InterpreterError,
    Kernel,
    slice_update_into,
)


class NonFiniteError(InterpreterError):
    """An op's fp16 or fp32 result holds inf or NaN: the first non-finite intermediate, by op,
    function and (from the nearest weight's name) layer."""

    def __init__(self, function_name: str, op_type: str, op_name: str, near: str | None):
        function_name = str(function_name)
        self.function_name, self.op_type, self.op_name, self.near = (function_name, op_type,
                                                                     op_name, near)
        match = re.search(r"layers_(\d+)_", near or "")
        where = (f" in layer {match.group(1)}" if match else "") + (
            f" (nearest weight {near})" if near else "")
        super().__init__(
            f"function {function_name!r}: {op_type} (op {op_name!r}) is the first op whose "
            f"result is not finite{where}; the bundle overflows fp16 here, re-export it with "
            "this museflash (docs/fp16.md)")


class UnsupportedOpError(InterpreterError):
    """The program contains op types this interpreter has no kernel for."""

    def __init__(self, function_name: str, ops: list[tuple[str, str]]):
        self.ops = ops
        listed = ", ".join(f"{op_type} (op {op_name!r})" for op_type, op_name in ops)
        super().__init__(
            f"function {function_name!r} uses op types the numpy interpreter does not "
            f"support: {listed}"
        )


def _coremltools():
    import coremltools

    return coremltools


def _mil_types():
    from coremltools.converters.mil.mil import types

    return types


def list_functions(package_path: str | Path) -> tuple[list[str], str]:
    """Names of the functions in a package, and the one Core ML runs by default."""
    spec = _coremltools().utils.load_spec(str(package_path))
    names = list(spec.mlProgram.functions)
    return names, _default_function(spec, names)


def _default_function(spec: Any, names: list[str]) -> str:
    declared = spec.description.defaultFunctionName
    if declared and declared in names:
        return declared
    if len(names) == 1:
        return names[0]
    return "main"


# Programs loaded lately, by the bytes they were loaded from (the program and _weights_digest):
# a process that loads one package again (a chat turn, each command of a test) gets the same
# Program back.
_LOADED: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_LOADED_KEEP = 2


def _weights_digest(weights_dir: Path) -> tuple[Any, ...] | None:
    """The package's weight files by their bytes (path, then name and SHA-1 of each file), so a
    file rewritten in place, even at the same size and time, is never mistaken for the one a
    constant was read from."""
    if not weights_dir.is_dir():
        return None
    files = []
    for entry in sorted(os.scandir(weights_dir), key=lambda e: e.name):
        digest = hashlib.sha1()
        with open(entry.path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        files.append((entry.name, digest.digest()))
    return (str(weights_dir.resolve()), tuple(files))


def load_program(package_path: str | Path,
                 function_name: str | Sequence[str] | None = None) -> Any:
    """Loads the ML program of a saved `.mlpackage` as a coremltools MIL `Program`.

    With `function_name` (a name or several), only those functions are loaded (faster for big
    multifunction packages); otherwise all of them. `program.default_function_name` is set to
    the function Core ML would run by default (or the one named), which `Interpreter` uses when
    given no name. The last few programs loaded are kept: loading the same functions of a
    package whose bytes have not changed returns the same Program, which callers only read.
    """
    ct = _coremltools()

    package_path = Path(package_path)
    if not package_path.is_dir():
        raise FileNotFoundError(f"{package_path} is not an .mlpackage directory")
    spec = ct.utils.load_spec(str(package_path))
    wanted = [function_name] if isinstance(function_name, str) else function_name
    weights = _weights_digest(package_path / PACKAGE_WEIGHTS_DIR)
    key = (str(package_path.resolve()), tuple(wanted) if wanted is not None else None,
           hashlib.sha1(spec.SerializeToString(deterministic=True)).digest(), weights)
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    program = _load_spec_program(package_path, spec, function_name, weights)
    _LOADED[key] = program
    while len(_LOADED) > _LOADED_KEEP:
        _LOADED.popitem(last=False)
    return program


def _load_spec_program(package_path: Path, spec: Any, function_name: str | Sequence[str] | None,
                       weights: tuple[Any, ...] | None) -> Any:
    from coremltools.converters.mil.frontend.milproto import load as milproto_load

    if spec.WhichOneof("Type") != "mlProgram":
        raise ValueError(f"{package_path} holds a {spec.WhichOneof('Type')}, not an ML program")
    names = list(spec.mlProgram.functions)
    default = _default_function(spec, names)
    wanted = [function_name] if isinstance(function_name, str) else function_name
    if wanted is not None:
        for name in wanted:
            if name not in names:
                raise KeyError(f"{package_path} has no function {name!r}; it has {sorted(names)}")
        for other in [n for n in names if n not in wanted]:
            del spec.mlProgram.functions[other]
        if isinstance(function_name, str) or default not in wanted:
            default = wanted[0]
    weights_dir = package_path / PACKAGE_WEIGHTS_DIR
    program = milproto_load.load(
        spec,
        specification_version=spec.specificationVersion,
        file_weights_dir=str(weights_dir),
    )
    program.default_function_name = default
    # What lets Interpreters of this program's functions share their constants (see
    # Interpreter): the stored bytes each constant is made from, and the files they are in.
    program.storage_keys = {name: _storage_keys(spec.mlProgram.functions[name])
                            for name in spec.mlProgram.functions}
    program.weights_identity = weights
    return program


class LazyInterpreters(Mapping[str, "Interpreter"]):
    """Interpreters of some functions of one package, each loaded when a call first asks for
    it. A bundle with context buckets has dozens of functions (SmolLM2 exported with the
    default buckets: 30, 43 s and 7.4 GB to load all of them here) and a conversation runs the
    few of the buckets it reaches. Functions loaded apart still share their constants while
    they live (`Interpreter`). The package must hold every name (checked here, so a missing
    function is refused before the first call)."""

    def __init__(self, package_path: str | Path, function_names: Iterable[str]):
        self.path = Path(package_path)
        self.names = list(function_names)
        held, _ = list_functions(self.path)
        missing = [name for name in self.names if name not in held]
        if missing:
            raise KeyError(f"{self.path} has no function {missing[0]!r}; it has {sorted(held)}")
        self._loaded: dict[str, Interpreter] = {}

    def __getitem__(self, name: str) -> Interpreter:
        if name not in self._loaded:
            if name not in self.names:
                raise KeyError(name)
            self._loaded[name] = Interpreter(load_program(self.path, name), name)
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def loaded(self) -> list[str]:
        """The functions loaded so far, in the order they were."""
        return list(self._loaded)


def load_interpreters(package_path: str | Path,
                      function_names: Iterable[str]) -> dict[str, Interpreter]:
    """Interpreters of some functions of one package, loaded together: the package is parsed
    once, and while they live, functions reading the same stored weights share them."""
    names = list(function_names)
    program = load_program(package_path, names)
    return {name: Interpreter(program, name) for name in names}


def _storage_keys(function_spec: Any) -> dict[str, bytes]:
    """Each constant's storage key in one function: its op serialized without its own names,
    and with the names it reads replaced by their keys. Equal keys in one package are the same
    op over the same stored bytes (a blob file value is a file name and an offset), so they
    give the same value; `main` and `prefill` of a multifunction package read every weight from
    one place, and so share it."""
    keys: dict[str, bytes] = {}
    block = function_spec.block_specializations[function_spec.opset]
    for op in block.operations:
        if op.type != "const" and not op.type.startswith("constexpr_"):
            continue
        op = type(op).FromString(op.SerializeToString())
        readable = True
        for argument in op.inputs.values():
            for binding in argument.arguments:
                if binding.WhichOneof("binding") == "name":
                    if binding.name not in keys:
                        readable = False
                        break
                    binding.name = keys[binding.name].hex()
        if not readable:
            continue
        del op.attributes["name"]
        names = [output.name for output in op.outputs]
        for output in op.outputs:
            output.name = ""
        key = op.SerializeToString(deterministic=True)
        for index, name in enumerate(names):
            keys[name] = key + b"#%d" % index
    return keys


# Constants (and linear's float64 weights) that live Interpreters of the same package share, by
# (weights identity, storage key, form). Entries go when the last Interpreter holding them does.
_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], np.ndarray] = (
    weakref.WeakValueDictionary())


def _shared(key: tuple[Any, ...] | None, make) -> np.ndarray:
    """make(), or the array an Interpreter already made under `key`; read-only either way, so
    no kernel can change a constant another function reads."""
    if key is not None:
        found = _SHARED.get(key)
        if found is not None:
            return found
    value = make()
    value.flags.writeable = False
    if key is not None:
        _SHARED[key] = value
    return value




# --------------------------------------------------------------------------------------------


def _numpy_dtype(builtin: Any) -> np.dtype:
    types = _mil_types()
    if builtin == types.str:
        return np.dtype(object)
    return np.dtype(types.nptype_from_builtin(builtin))


def _static_shape(var: Any) -> tuple[int, ...] | None:
    shape = var.shape
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _blockwise_shift_scale(op: Any) -> np.ndarray:
    """iOS18 constexpr_blockwise_shift_scale: (data - offset) * scale, each scale (and offset)
    covering a block of data dim / scale dim elements along every axis."""
    data, scale = np.asarray(op.data.val), np.asarray(op.scale.val)
    offset = getattr(op, "offset", None)
    if offset is not None and offset.val is not None:
        return dequantize_affine(data, scale, np.asarray(offset.val))
    return dequantize_linear(data, scale)


def _lut_to_dense(op: Any) -> np.ndarray:
    """iOS18 constexpr_lut_to_dense with scalar tables (vector size 1): each index is read in
    the table of its group (lut shape [groups per axis..., 2^bits, 1])."""
    lut = np.asarray(op.lut.val)
    if lut.shape[-1] != 1:
        raise InterpreterError(f"constexpr_lut_to_dense (op {op.name!r}): vector "
                               f"palettization (vector size {lut.shape[-1]}) is not supported")
    return depalettize(np.asarray(op.indices.val), lut)


# The numpy interpreter's own decompression (museflash.compression), not coremltools'.
# linear and affine weights share constexpr_blockwise_shift_scale.
DECOMPRESSORS = {COMPRESSION_OPS[CompressionMode.LINEAR][0]: _blockwise_shift_scale,
                 COMPRESSION_OPS[CompressionMode.AFFINE][0]: _blockwise_shift_scale,
                 COMPRESSION_OPS[CompressionMode.PALETTIZE][0]: _lut_to_dense}


# Elements of `linear` weights an Interpreter keeps in float64 (8 bytes each): 2 GB, enough for
# every linear of a 135M-parameter model. Functions of one package share them (see _shared).
LINEAR_CACHE_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class _Step:
    """One op of a function, resolved for `Interpreter.run`."""

    op: Any
    kernel: Kernel
    inputs: tuple[tuple[str, Any, bool], ...]  # (param, var name or names, is a list)
    fixed: dict[str, np.ndarray]  # params bound at load time (linear's float64 weight)
    outputs: tuple[tuple[str, np.dtype, tuple[int, ...] | None], ...]
    frees: tuple[str, ...] = ()  # inputs no later step reads (and no output of the function)


def _all_finite(value: np.ndarray) -> bool:
    """No inf or NaN in a float array (other dtypes are finite). fp16 is read as its bits, an
    all-ones exponent being inf or NaN: numpy's isfinite on fp16 took ten times as long, and a
    KV cache's slice_update result is checked on every write."""
    if value.dtype.kind != "f" or value.size == 0:
        return True
    if value.dtype == np.float16 and value.size > 1024:
        return int((value.view(np.uint16) & 0x7C00).max()) != 0x7C00
    return bool(np.isfinite(value).all())


class Interpreter:
    """Runs one function of a loaded ML program with numpy."""

    def __init__(self, program: Any, function_name: str | None = None):
        name = function_name or getattr(program, "default_function_name", "main")
        if name not in program.functions:
            raise KeyError(
                f"program has no function {name!r}; it has {sorted(program.functions)}"
            )
        self.function_name = name
        self.function = program.functions[name]
        types = _mil_types()
        self.input_specs: dict[str, tuple[tuple[int, ...] | None, np.dtype]] = {}
        self.state_specs: dict[str, tuple[tuple[int, ...] | None, np.dtype]] = {}
        for input_name, var in self.function.inputs.items():
            if types.is_state(var.sym_type):
                wrapped = var.sym_type.wrapped_type()
                shape = tuple(int(d) for d in wrapped.get_shape())
                self.state_specs[input_name] = (shape, _numpy_dtype(wrapped.get_primitive()))
            else:
                self.input_specs[input_name] = (_static_shape(var), _numpy_dtype(var.dtype))
        self.output_names = [var.name for var in self.function.outputs]
        identity = getattr(program, "weights_identity", None)
        keys = getattr(program, "storage_keys", {}).get(name, {}) if identity else {}
        # (weights identity, storage key) per constant this Interpreter may share.
        self._shared_keys = {var: (identity, key) for var, key in keys.items()}
        self.constants: dict[str, Any] = {}
        ops: list[Any] = []
        unsupported: list[tuple[str, str]] = []
        for op in self.function.operations:
            if op.op_type == "const" or op.op_type.startswith("constexpr_"):
                self._load_constant(op)
            elif op.op_type in KERNELS:
                ops.append(op)
            else:
                unsupported.append((op.op_type, op.name))
        if unsupported:
            raise UnsupportedOpError(name, unsupported)
        # Each op's kernel, inputs and declared outputs, looked up once: reading types and
        # shapes through coremltools' Var on every call cost more than most kernels.
        # `linear` sums in float64, so its constant weights are converted once here, not on
        # every call (the same values in the same memory order: the same bits out), up to
        # LINEAR_CACHE_ELEMENTS per function (a weight two linears share is converted once,
        # and so is one that another function of the package already converted); a bigger
        # program converts the rest per call.
        self._plan: list[_Step] = []
        float64_weights: dict[str, np.ndarray] = {}
        budget = LINEAR_CACHE_ELEMENTS
        for op in ops:
            fixed: dict[str, np.ndarray] = {}
            weight = op.inputs.get("weight") if op.op_type == "linear" else None
            value = self.constants.get(weight.name) if weight is not None else None
            if weight is not None and weight.name in float64_weights:
                fixed["weight"] = float64_weights[weight.name]
            elif isinstance(value, np.ndarray) and value.size <= budget:
                key = self._shared_keys.get(weight.name)
                fixed["weight"] = float64_weights[weight.name] = _shared(
                    key and key + ("float64",), lambda v=value: np.asarray(v, np.float64))
                budget -= value.size
            inputs = tuple((param, tuple(v.name for v in var), True)
                           if isinstance(var, (list, tuple)) else (param, var.name, False)
                           for param, var in op.inputs.items() if param not in fixed)
            outputs = tuple((var.name, _numpy_dtype(var.dtype), _static_shape(var))
                            for var in op.outputs)
            self._plan.append(_Step(op, KERNELS[op.op_type], inputs, fixed, outputs))
        self._free_dead_values()

    def _free_dead_values(self) -> None:
        """Marks each value at the last step that reads it, so `_run_plan` lets it go there:
        a KV cache's blend makes one whole-capacity value per layer, and holding them all
        held the cache once per layer."""
        kept = {var.name for var in self.function.outputs}
        last: dict[str, int] = {}
        for index, step in enumerate(self._plan):
            for _, names, many in step.inputs:
                for name in names if many else (names,):
                    last[name] = index
        frees: dict[int, list[str]] = {}
        for name, index in last.items():
            if name not in kept:
                frees.setdefault(index, []).append(name)
        self._plan = [dataclasses.replace(step, frees=tuple(frees.get(index, ())))
                      for index, step in enumerate(self._plan)]

    def _load_constant(self, op: Any) -> None:
        keys = [self._shared_keys.get(var.name) for var in op.outputs]
        found = [_SHARED.get(key) if key is not None else None for key in keys]
        if all(value is not None for value in found):
            for var, value in zip(op.outputs, found, strict=True):
                self.constants[var.name] = value
            return
        if op.op_type == "const":
            values = [op.outputs[0].val]
        elif op.op_type in DECOMPRESSORS:
            values = [DECOMPRESSORS[op.op_type](op)]
        elif hasattr(op, "materialized_val_inference"):
            values = op.materialized_val_inference()
            values = list(values) if isinstance(values, (tuple, list)) else [values]
        else:
            raise UnsupportedOpError(self.function_name, [(op.op_type, op.name)])
        for var, value, key in zip(op.outputs, values, keys, strict=True):
            if isinstance(value, str):
                self.constants[var.name] = value
            else:
                dtype = _numpy_dtype(var.dtype)
                self.constants[var.name] = _shared(
                    key, lambda v=value, t=dtype: np.asarray(v).astype(t))

    def run(
        self, inputs: Mapping[str, np.ndarray], states: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Executes the function. `states` arrays are updated in place by state writes."""
        env: dict[str, Any] = dict(self.constants)
        env.update(self._bind_inputs(inputs))
        env.update(self._bind_states(states or {}))
        with np.errstate(over="ignore"):  # an overflow is reported by op (NonFiniteError)
            self._run_plan(env)
        return {var.name: env[var.name] for var in self.function.outputs}

    def _run_plan(self, env: dict[str, Any]) -> None:
        for step in self._plan:
            args = dict(step.fixed)
            for param, name, many in step.inputs:
                args[param] = [env[n] for n in name] if many else env[name]
            kernel = step.kernel
            if step.op.op_type == "slice_update" and self._writable(env, step, args["x"]):
                # x is read by nothing after this op: write into it rather than copy it (a
                # KV cache's blend updates the whole-capacity cache once per layer).
                def kernel(a, x=args["x"]):
                    return slice_update_into(x, a)
            try:
                result = kernel(args)
            except InterpreterError:
                raise
            except Exception as error:
                op = step.op
                raise InterpreterError(
                    f"{op.op_type} (op {op.name!r}) failed: {type(error).__name__}: {error}"
                ) from error
            results = result if isinstance(result, tuple) else (result,)
            if len(results) != len(step.outputs):
                raise InterpreterError(
                    f"{step.op.op_type} (op {step.op.name!r}) produced {len(results)} values "
                    f"for {len(step.outputs)} outputs"
                )
            for (name, dtype, expected), value in zip(step.outputs, results, strict=True):
                env[name] = self._conform(step.op, name, dtype, expected, value)
                if step.op.op_type not in DATA_MOVEMENT_OPS and not _all_finite(env[name]):
                    raise NonFiniteError(self.function_name, step.op.op_type, step.op.name,
                                         self._nearest_weight(step))
            for name in step.frees:
                env.pop(name, None)

    def _writable(self, env: dict[str, Any], step: _Step, x: Any) -> bool:
        """Whether a slice_update may write into its `x`: a value this run made (not a
        constant, input or state), read by no later step, sharing memory with no other value
        still held."""
        name = next(n for param, n, _ in step.inputs if param == "x")
        if (name not in step.frees or name in self.constants or name in self.input_specs
                or name in self.state_specs or not isinstance(x, np.ndarray)
                or not x.flags.writeable or not x.flags.owndata):
            return False
        return not any(other is not x and isinstance(other, np.ndarray)
                       and np.may_share_memory(other, x)
                       for key, other in env.items() if key not in self.constants)

    def _nearest_weight(self, failed: _Step) -> str | None:
        """The name of the named weight (`p_...`, as torch.export names parameters) that the
        op nearest to `failed` in program order reads, earlier ops first on a tie."""
        index = self._plan.index(failed)
        order = sorted(range(len(self._plan)), key=lambda i: (abs(i - index), i))
        for i in order:
            for _, names, many in self._plan[i].inputs:
                for name in names if many else (names,):
                    if name.startswith("p_") and name in self.constants:
                        return name
            weight = self._plan[i].op.inputs.get("weight")
            if weight is not None and weight.name.startswith("p_"):
                return weight.name
        return None

    @staticmethod
    def _conform(op: Any, name: str, dtype: np.dtype, expected: tuple[int, ...] | None,
                 value: Any) -> np.ndarray:
        """Stores the value in its declared dtype (this is where fp16 rounding happens) and
        checks the declared static shape, which catches kernel mistakes early. An array of the
        declared dtype is kept as it is (astype, even without a copy, costs a call per op)."""
        if type(value) is not np.ndarray or value.dtype != dtype:
            value = np.asarray(value).astype(dtype, copy=False)
        if expected is not None and value.shape != expected:
            raise InterpreterError(
                f"{op.op_type} (op {op.name!r}) produced shape {value.shape} for output "
                f"{name!r}, but the program declares {expected}"
            )
        return value

    def _bind_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = sorted(set(self.input_specs) - set(inputs))
        unknown = sorted(set(inputs) - set(self.input_specs))
        if missing or unknown:
            raise ValueError(
                f"function {self.function_name!r} takes inputs {sorted(self.input_specs)}; "
                f"missing {missing}, unknown {unknown}"
            )
        bound = {}
        for name, (shape, dtype) in self.input_specs.items():
            value = np.asarray(inputs[name])
            if shape is not None and value.shape != shape:
                raise ValueError(f"input {name!r} has shape {value.shape}, expected {shape}")
            bound[name] = value.astype(dtype)
        return bound

    def _bind_states(self, states: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = sorted(set(self.state_specs) - set(states))
        if missing:
            raise ValueError(
                f"function {self.function_name!r} needs states {sorted(self.state_specs)}; "
                f"missing {missing}"
            )
        bound = {}
        for name, (shape, dtype) in self.state_specs.items():
            value = states[name]
            # Writes must land in the caller's array, so no conversion is allowed here.
            if not isinstance(value, np.ndarray) or value.shape != shape or value.dtype != dtype:
                raise ValueError(
                    f"state {name!r} must be a numpy array of shape {shape} and dtype {dtype}; "
                    f"got {type(value).__name__} {getattr(value, 'shape', None)} "
                    f"{getattr(value, 'dtype', None)}"
                )
            bound[name] = value
        return bound

    def zero_states(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.state_specs.items()}


__all__ = [
    "KERNELS",
    "SUPPORTED_OP_TYPES",
    "Interpreter",
    "InterpreterError",
    "NonFiniteError",
    "UnsupportedOpError",
    "list_functions",
    "load_interpreters",
    "load_program",
]

