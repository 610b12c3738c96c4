"""Deliberate damage to a saved .mlpackage, for tests that must catch a broken export."""


def swap_blobs(package, pairs, functions=None):
    """Rewrites `package` in place so that, in every function (or those named in `functions`),
    each pair of weight constants (matched by a fragment of their names) reads the other's
    blob."""
    import coremltools as ct

    model_file = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = ct.utils.load_spec(str(package))
    swapped = 0
    for name, function in spec.mlProgram.functions.items():
        if functions is not None and name not in functions:
            continue
        blobs = {}
        for op in function.block_specializations[function.opset].operations:
            if op.type != "const":
                continue
            for fragment in (f for pair in pairs for f in pair):
                if fragment in op.outputs[0].name:
                    blobs[fragment] = op.attributes["val"].blobFileValue
        for first, second in pairs:
            if first in blobs and second in blobs:
                blobs[first].offset, blobs[second].offset = (blobs[second].offset,
                                                             blobs[first].offset)
                swapped += 1
    assert swapped, f"none of {pairs} found in {package}"
    model_file.write_bytes(spec.SerializeToString())


SPEC_FILE = ("Data", "com.apple.CoreML", "model.mlmodel")
WEIGHT_FILE = ("Data", "com.apple.CoreML", "weights", "weight.bin")
BLOB_SENTINEL = 0xDEADBEEF
BLOB_FP16 = 1  # MILBlob BlobDataType.Float16


def _read_spec(package):
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.ParseFromString(package.joinpath(*SPEC_FILE).read_bytes())
    return spec


def _ops(spec):
    for function_name, function in spec.mlProgram.functions.items():
        for block in function.block_specializations.values():
            for op in block.operations:
                yield function_name, op


def constexpr_weights(package):
    """Output name -> (op type, {input: (MIL dtype, shape)}) of every constexpr op of `package`'s
    program (a compressed weight), from the first function that has it."""
    found = {}
    for _, op in _ops(_read_spec(package)):
        if op.type.startswith("constexpr_") and op.outputs[0].name not in found:
            inputs = {}
            for name, argument in op.inputs.items():
                tensor = argument.arguments[0].value.type.tensorType
                inputs[name] = (tensor.dataType, [d.constant.size for d in tensor.dimensions])
            found[op.outputs[0].name] = (op.type, inputs)
    return found


def _append_blob(package, data_type, size):
    """Appends a zero-filled blob of `size` bytes to weight.bin as MILBlob writes one (64-byte
    aligned header and data, the file header's count updated); returns its header's offset."""
    import struct

    path = package.joinpath(*WEIGHT_FILE)
    data = bytearray(path.read_bytes())
    data += bytes(-len(data) % 64)
    offset = len(data)
    header = struct.pack("<IIQQ", BLOB_SENTINEL, data_type, size, offset + 64)
    data += header + bytes(64 - len(header)) + bytes(size) + bytes(-size % 64)
    struct.pack_into("<I", data, 0, struct.unpack_from("<I", data, 0)[0] + 1)
    path.write_bytes(bytes(data))
    return offset


def store_as_fp16(package, name, functions=None):
    """Rewrites `package` in place so that the compressed weight `name` (a constexpr op's output)
    is a plain fp16 `const` in every function (or those in `functions`: in a shared package the
    drafter's functions may use the same name for another tensor), reading a new zero blob of
    the right size, as if it had never been compressed. Returns how many ops were rewritten."""
    spec = _read_spec(package)
    offset = None
    rewritten = 0
    for function, op in _ops(spec):
        if functions is not None and function not in functions:
            continue
        if not (op.type.startswith("constexpr_") and op.outputs[0].name == name):
            continue
        tensor = op.outputs[0].type.tensorType
        file_name = next(iter(op.inputs.values())).arguments[0].value.blobFileValue.fileName
        if offset is None:
            elements = 1
            for dimension in tensor.dimensions:
                elements *= dimension.constant.size
            offset = _append_blob(package, BLOB_FP16, 2 * elements)
        op.type = "const"
        for key in list(op.inputs):
            del op.inputs[key]
        value = op.attributes["val"]
        value.type.tensorType.CopyFrom(tensor)
        value.blobFileValue.fileName = file_name
        value.blobFileValue.offset = offset
        rewritten += 1
    assert rewritten, f"no constexpr op {name} in {package}"
    package.joinpath(*SPEC_FILE).write_bytes(spec.SerializeToString())
    return rewritten


def set_input_shape(package, name, input_name, shape):
    """Declares `shape` for input `input_name` of the constexpr op `name` in every function; the
    blob stays as it is. Returns how many ops were changed."""
    spec = _read_spec(package)
    changed = 0
    for _, op in _ops(spec):
        if op.type.startswith("constexpr_") and op.outputs[0].name == name:
            tensor = op.inputs[input_name].arguments[0].value.type.tensorType
            del tensor.dimensions[:]
            for size in shape:
                tensor.dimensions.add().constant.size = size
            tensor.rank = len(shape)
            changed += 1
    assert changed, f"no constexpr op {name} in {package}"
    package.joinpath(*SPEC_FILE).write_bytes(spec.SerializeToString())
    return changed


def set_embedded_metadata(package, text):
    """Replaces the metadata.json text `package` embeds (user-defined `museflash.metadata`)."""
    spec = _read_spec(package)
    spec.description.metadata.userDefined["museflash.metadata"] = text
    package.joinpath(*SPEC_FILE).write_bytes(spec.SerializeToString())


def negate_fp16_blob(package, fragment):
    """Rewrites, in place in weight.bin, the fp16 data of the first `const` whose name holds
    `fragment` with every value's sign flipped; the program itself is left as it was."""
    import struct

    import coremltools as ct
    import numpy as np

    spec = ct.utils.load_spec(str(package))
    offset = next(op.attributes["val"].blobFileValue.offset
                  for function in spec.mlProgram.functions.values()
                  for op in function.block_specializations[function.opset].operations
                  if op.type == "const" and fragment in op.outputs[0].name)
    path = package.joinpath(*WEIGHT_FILE)
    data = bytearray(path.read_bytes())
    sentinel, data_type, size, start = struct.unpack_from("<IIQQ", data, offset)
    assert (sentinel, data_type) == (BLOB_SENTINEL, BLOB_FP16), (fragment, sentinel, data_type)
    flipped = np.frombuffer(bytes(data[start:start + size]), np.uint16) ^ np.uint16(0x8000)
    data[start:start + size] = flipped.tobytes()
    path.write_bytes(bytes(data))
