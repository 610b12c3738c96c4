"""Before an exported package is run: it exists, its spec reads, it has the functions, inputs,
outputs and states metadata.json lists, and every blob its program references lies inside its
weight file with a valid header and exactly its tensor's bytes.

`//:verify`, `//:generate` and `//:demo_figures` check each package this way first, so a
truncated or damaged weight file, a missing package or metadata.json of another export is one
line naming the file (`PackageError`), not a traceback from coremltools' blob reader or the
interpreter. Only the spec and the 64-byte blob headers are read, never the weights.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from museflash.bundle import Metadata

_MODEL_PATH = "@model_path/"
_SENTINEL = 0xDEADBEEF
_RECORD = struct.Struct("<IIQQ")  # sentinel, blob dtype, payload bytes, payload offset
_RECORD_BYTES = 64
# MIL.proto DataType -> bits per element; blob dtype (MILBlob BlobDataType) -> MIL DataType.
_MIL_BITS = {10: 16, 11: 32, 12: 64, 13: 16, 21: 8, 22: 16, 23: 32, 24: 64, 25: 4, 35: 4,
             31: 8, 32: 16, 33: 32}
_BLOB_TO_MIL = {1: 10, 2: 11, 3: 31, 4: 21, 5: 13, 6: 22, 7: 32, 8: 25, 11: 35, 14: 23, 15: 33}
_FIX = ("re-export it with //:export (or restore it from where it was copied) and point "
        "--export-dir at the whole export")


class PackageError(ValueError):
    """An exported package cannot be run as metadata.json describes it; one line naming the
    file and the fix."""


def check_packages(export_dir: str | Path, metadata: Metadata) -> None:
    """check_package for every package metadata.json lists, each once."""
    for path in metadata.package_owners():
        check_package(Path(export_dir), metadata, path)


def check_package(export_dir: Path, metadata: Metadata, path: str) -> None:
    package = Path(export_dir) / path
    if not package.is_dir():
        listing = Path(export_dir) / "metadata.json"
        raise PackageError(f"{package}: package not found, though {listing} lists it; {_FIX}")
    spec = _read_spec(package)
    _check_interface(package, spec, metadata, path)
    _check_blobs(package, spec)


def _read_spec(package: Path) -> Any:
    from coremltools.proto import Model_pb2

    manifest = package / "Manifest.json"
    model = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    for required in (manifest, model):
        if not required.is_file():
            raise PackageError(f"{required}: missing from the package; {_FIX}")
    spec = Model_pb2.Model()
    try:
        spec.ParseFromString(model.read_bytes())
    except Exception as error:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise PackageError(f"{model}: not a readable Core ML model spec ({error}); "
                           f"{_FIX}") from error
    if spec.WhichOneof("Type") != "mlProgram":
        raise PackageError(f"{model}: holds no ML program; {_FIX}")
    return spec


def _names(features) -> list[str]:
    return [feature.name for feature in features]


def _check_interface(package: Path, spec: Any, metadata: Metadata, path: str) -> None:
    """The functions, their input and output names and their states' shapes are those the
    assets stored in this package list."""
    described = {f.name: f for f in spec.description.functions}
    if not described:  # a single-function package
        single = spec.description
        described = {next(iter(spec.mlProgram.functions), "main"): single}
    where = f"{package} does not match {Path(package).parent / 'metadata.json'}"
    fix = "the metadata.json beside it must be the one exported with it; re-export or copy both"
    for role, asset in metadata.assets.items():
        if asset.path != path:
            continue
        for row in asset.function_table():
            name, function = row.name, row.spec
            found = described.get(name)
            if found is None:
                raise PackageError(f"{where}: no function {name} (the {role} lists it; the "
                                   f"package has {sorted(described)}); {fix}")
            for kind, listed, present in (("inputs", function.inputs, found.input),
                                          ("outputs", function.outputs, found.output)):
                if sorted(map(str, listed)) != sorted(_names(present)):
                    raise PackageError(f"{where}: function {name} has {kind} "
                                       f"{_names(present)}, metadata.json lists "
                                       f"{[str(n) for n in listed]}; {fix}")
            shapes = {s.name: list(s.type.stateType.arrayType.shape) for s in found.state}
            for state in asset.states:
                shape = shapes.get(str(state.name))
                if shape != list(state.shape):
                    raise PackageError(f"{where}: function {name} has state {state.name} of "
                                       f"shape {shape}, metadata.json says {state.shape} "
                                       f"(context_length {metadata.context_length}); {fix}")


def _blob_values(spec: Any):
    """(function, op output, blob file name, offset, MIL dtype, shape) of every blob value."""
    def values(operation):
        yield from operation.attributes.values()
        for argument in operation.inputs.values():
            for binding in argument.arguments:
                if binding.WhichOneof("binding") == "value":
                    yield binding.value

    def operations(block):
        for operation in block.operations:
            yield operation
            for inner in operation.blocks:
                yield from operations(inner)

    for function_name, function in spec.mlProgram.functions.items():
        for block in function.block_specializations.values():
            for operation in operations(block):
                label = operation.outputs[0].name if operation.outputs else operation.type
                for value in values(operation):
                    if value.WhichOneof("value") != "blobFileValue":
                        continue
                    tensor = value.type.tensorType
                    shape = [d.constant.size for d in tensor.dimensions]
                    yield (function_name, label, value.blobFileValue.fileName,
                           value.blobFileValue.offset, tensor.dataType, shape)


def _check_blobs(package: Path, spec: Any) -> None:
    model_dir = package / "Data" / "com.apple.CoreML"
    files: dict[str, tuple[Path, int, Any]] = {}
    try:
        for function, label, file_name, offset, data_type, shape in _blob_values(spec):
            if not file_name.startswith(_MODEL_PATH) or ".." in file_name.split("/"):
                raise PackageError(f"{package}: {function}.{label} names weight file "
                                   f"{file_name!r}, not one inside the package; {_FIX}")
            if file_name not in files:
                path = model_dir / file_name[len(_MODEL_PATH):]
                if not path.is_file():
                    raise PackageError(f"{path}: weight file not found ({function}.{label} "
                                       f"reads it); {_FIX}")
                handle = path.open("rb")
                files[file_name] = (path, path.stat().st_size, handle)
            path, size, handle = files[file_name]
            problem = _blob_problem(handle, size, offset, data_type, shape)
            if problem:
                raise PackageError(f"{path}: damaged or truncated weight file ({size} bytes): "
                                   f"the blob of {function}.{label} at offset {offset} {problem}; "
                                   f"{_FIX}")
    finally:
        for _, _, handle in files.values():
            handle.close()


def _blob_problem(handle, size: int, offset: int, data_type: int, shape: list[int]) -> str | None:
    if offset % _RECORD_BYTES or offset + _RECORD_BYTES > size:
        return "lies beyond the end of the file" if offset + _RECORD_BYTES > size else (
            "is not 64-byte aligned")
    handle.seek(offset)
    sentinel, blob_type, nbytes, data_offset = _RECORD.unpack(handle.read(_RECORD.size))
    if sentinel != _SENTINEL:
        return f"has no blob header (sentinel {sentinel:#x}, expected {_SENTINEL:#x})"
    if data_offset < offset + _RECORD_BYTES or data_offset + nbytes > size:
        return f"has {nbytes} payload bytes at {data_offset}, beyond the end of the file"
    bits = _MIL_BITS.get(data_type)
    if bits is not None and _BLOB_TO_MIL.get(blob_type) == data_type:
        elements = 1
        for dimension in shape:
            elements *= dimension
        if nbytes != (elements * bits + 7) // 8:
            return (f"holds {nbytes} bytes, its tensor {shape} takes "
                    f"{(elements * bits + 7) // 8}")
    elif bits is not None:
        return f"stores blob dtype {blob_type}, which is not the op's MIL dtype {data_type}"
    return None
