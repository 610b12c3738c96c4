"""Compressed exports (--compression / --compression-config): what the packages hold, that it is
the checkpoint's weights quantized or palettized as planned, that verify passes on it, and the
one-line errors for bad input.

The trained demo pair (demo/) compressed by rules giving every mode, as the build exported it
once (//tests/integration:compressed_bundle); the tiny random pair has no weight large enough
(2^16 elements) to compress.
"""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from prebuilt import COMPRESSED_BUNDLE, COMPRESSION_RULES, prebuilt_bundle

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.bundle import COMPRESSION_OPS, PACKAGE_WEIGHT_FILE, AssetRole, Metadata
from museflash.checkpoint.tensor_files import SafetensorsReader
from museflash.checks.verify import VerifyOptions, run_verify
from museflash.compression import MIN_ELEMENTS, palettize, quantize_affine, quantize_linear
from museflash.export.blobfile import read_record
from museflash.export.merge import read_spec
from museflash.export.options import ExportError, ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress
from museflash.runtime.interpreter import DECOMPRESSORS, load_program

ct = pytest.importorskip("coremltools")

RULES = json.loads(Path(os.environ[COMPRESSION_RULES]).read_text())
SMALL = {"max_context_length": 64, "prefill_length": 8}


def _export(out: Path, **options) -> Path:
    return export_bundle(ExportOptions(output_dir=out, builtin="demo", **SMALL, **options),
                         Progress(echo=lambda _: None))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return prebuilt_bundle(tmp_path_factory.mktemp("compressed"), COMPRESSED_BUNDLE)


def _constexpr_ops(package: Path) -> dict[str, list]:
    """function -> its constexpr ops (protos)."""
    functions = read_spec(package).mlProgram.functions
    return {name: [op for block in f.block_specializations.values() for op in block.operations
                   if op.type.startswith("constexpr_")] for name, f in functions.items()}


def _fp16_matrix_consts(package: Path) -> set[str]:
    names = set()
    for function in read_spec(package).mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                value = op.attributes["val"] if op.type == "const" else None
                if value is None or value.WhichOneof("value") != "blobFileValue":
                    continue
                dims = [d.constant.size for d in value.type.tensorType.dimensions]
                if len(dims) == 2 and dims[0] * dims[1] >= MIN_ELEMENTS:
                    names.add(op.outputs[0].name)
    return names


def test_each_package_stores_what_its_metadata_declares(mixed):
    metadata = Metadata.read(mixed)
    compression = metadata.compression
    assert compression.preset is None and len(compression.rules) == len(RULES)
    owners = metadata.package_owners()
    assert owners == {"target.mlpackage": AssetRole.TARGET}  # the drafter's functions too
    for path, role in owners.items():
        ops = _constexpr_ops(mixed / path)
        found: dict[tuple, set[int]] = {}
        for function_ops in ops.values():
            for op in function_ops:
                data_input = COMPRESSION_OPS[_mode_of(op)][1]
                value = op.inputs[data_input].arguments[0].value
                key = (_mode_of(op), value.type.tensorType.dataType)
                found.setdefault(key, set()).add(value.blobFileValue.offset)
        declared: dict[tuple, int] = {}
        for group in compression.groups:
            stored = group.packages.get(role)
            if stored:
                key = (group.mode, _data_type(group.mode, group.bits))
                declared[key] = declared.get(key, 0) + stored.tensors
        assert {k: len(v) for k, v in found.items()} == declared, role
        # The size below which metadata says nothing is compressed holds for every weight the
        # package rebuilds from a constexpr op.
        assert compression.min_compressible_elements == MIN_ELEMENTS
        sizes = [math.prod(d.constant.size for d in op.outputs[0].type.tensorType.dimensions)
                 for function_ops in ops.values() for op in function_ops]
        assert sizes and min(sizes) >= compression.min_compressible_elements
        # Every function of the target reads its weights through the same constexpr ops, and
        # the drafter's draft reads the embedding and lm_head through the target's.
        main, prefill = ({op.outputs[0].name for op in ops[f]} for f in ("main", "prefill"))
        assert main == prefill and main
        offsets = {f: {op.inputs[COMPRESSION_OPS[_mode_of(op)][1]].arguments[0].value
                       .blobFileValue.offset for op in ops[f]} for f in ("main", "draft")}
        assert len(offsets["draft"] & offsets["main"]) == 2  # embedding and lm_head
    # Layer 0's MLP kept fp16 by the 'none' rule (down_proj matched the palettize rule first).
    target_fp16 = _fp16_matrix_consts(mixed / "target.mlpackage")
    assert {n for n in target_fp16 if "layers_0_mlp" in n} == {
        "p_layers_0_mlp_gate_proj_weight", "p_layers_0_mlp_up_proj_weight"}


def _mode_of(op):
    """The mode of a constexpr op (proto): linear and affine share an op, affine has an offset."""
    return next(mode for mode, (name, *inputs) in COMPRESSION_OPS.items()
                if name == op.type and set(op.inputs) == set(inputs))


def _data_type(mode, bits: int) -> int:
    from coremltools.proto import MIL_pb2

    kinds = MIL_pb2.DataType
    signed = str(mode) == "linear"
    return {(True, 4): kinds.INT4, (True, 8): kinds.INT8,
            (False, 4): kinds.UINT4, (False, 8): kinds.UINT8}[(signed, bits)]


def _checkpoint_weight(key: str) -> np.ndarray:
    with builtin_checkpoints("demo") as (target_dir, _):
        reader = SafetensorsReader(target_dir)
        return reader.read(key, reader.shape(key), torch.float32).numpy()


def test_stored_data_is_the_checkpoint_compressed_as_planned(mixed):
    """The streamed packing (row slices, sub-byte data written by coremltools' blob writer)
    holds exactly what quantize_linear / quantize_affine / palettize give for the whole weight,
    and coremltools' own reading of the constexpr ops equals the interpreter's."""
    program = load_program(mixed / "target.mlpackage", "main")
    ops = {op.outputs[0].name: op for op in program.functions["main"].operations}
    checks = {
        "p_embed_tokens_weight": ("model.language_model.embed_tokens.weight", 8, None),
        "p_layers_1_mlp_up_proj_weight": ("model.language_model.layers.1.mlp.up_proj.weight", 4,
                                          32),
    }
    for name, (key, bits, block) in checks.items():
        op = ops[name]
        assert op.op_type == "constexpr_blockwise_shift_scale"
        data, scale = quantize_linear(_checkpoint_weight(key), bits, block)
        np.testing.assert_array_equal(op.data.val.astype(np.int8), data)
        np.testing.assert_array_equal(op.scale.val, scale)
        assert op.offset is None or op.offset.val is None
    affine = ops["p_layers_1_mlp_gate_proj_weight"]
    assert affine.op_type == "constexpr_blockwise_shift_scale"
    data, scale, offset = quantize_affine(
        _checkpoint_weight("model.language_model.layers.1.mlp.gate_proj.weight"), 4, 32)
    np.testing.assert_array_equal(affine.data.val.astype(np.uint8), data)
    np.testing.assert_array_equal(affine.scale.val, scale)
    np.testing.assert_array_equal(affine.offset.val, offset)
    op = ops["p_layers_2_mlp_down_proj_weight"]
    assert op.op_type == "constexpr_lut_to_dense"
    indices, lut = palettize(
        _checkpoint_weight("model.language_model.layers.2.mlp.down_proj.weight"), 4, 32)
    np.testing.assert_array_equal(op.indices.val, indices)
    np.testing.assert_array_equal(op.lut.val, lut)
    for op in (ops["p_embed_tokens_weight"], affine, ops["p_layers_2_mlp_down_proj_weight"]):
        ours = DECOMPRESSORS[op.op_type](op).astype(np.float16)
        np.testing.assert_array_equal(ours, op.materialized_val_inference())


def test_weight_bytes_are_what_the_metadata_declares(mixed):
    metadata = Metadata.read(mixed)
    for path, role in metadata.package_owners().items():
        declared = sum(g.packages[role].bytes for g in metadata.compression.groups
                       if role in g.packages)
        stored = _constexpr_payload_bytes(mixed / path)
        assert stored == declared, role
    for group in metadata.compression.groups:
        # 16 bits an element in fp16 against 4 + 16/32 (linear int4 in blocks of 32), 4 + 2 *
        # 16/32 (affine: a scale and an offset a block), 8 + 16/I (int8 per output channel).
        shrink = 3.1 if group.mode == "affine" else 3.5 if group.bits == 4 else 1.9
        assert group.bytes_after < group.bytes_before / shrink


def _constexpr_payload_bytes(package: Path) -> int:

    data = (package / PACKAGE_WEIGHT_FILE).read_bytes()
    offsets = set()
    for function_ops in _constexpr_ops(package).values():
        for op in function_ops:
            for argument in op.inputs.values():
                offsets.add(argument.arguments[0].value.blobFileValue.offset)
    return sum(read_record(data, offset)[2] for offset in offsets)


def test_verify_passes_on_the_compressed_export_and_reports_quality(mixed):
    lines = []
    status = run_verify(VerifyOptions(export_dir=mixed, echo=lines.append, new_tokens=16))
    print("\n".join(lines))
    assert status == 0
    assert any(line.startswith("lossless: speculative == ") for line in lines)
    quality = [line for line in lines if line.startswith("compression (informational")]
    assert len(quality) == 1 and "top-1 agreement" in quality[0]


@pytest.mark.parametrize("options, rules, named", [
    ({"compression": "3bit"}, None, "--compression '3bit'"),
    ({"compression": "4bit"}, [], "exclusive"),
    ({}, "{not json", "rules.json"),
    ({}, [{"match": "*nothing_like_this*", "mode": "linear", "bits": 8}], "nothing_like_this"),
    ({}, [{"match": "*", "mode": "linear", "bits": 3}], "bits"),
    ({}, [{"match": "*mlp.up_proj*", "mode": "linear", "bits": 4, "block_size": 48}],
     "up_proj"),
    ({}, [{"match": "*mlp.down_proj*", "mode": "palettize", "bits": 4, "group_size": 48}],
     "down_proj"),
])
def test_bad_compression_input_is_one_line_and_writes_nothing(tmp_path, options, rules, named):
    if rules is not None:
        path = tmp_path / "rules.json"
        path.write_text(rules if isinstance(rules, str) else json.dumps(rules))
        options = {**options, "compression_config": path}
    out = tmp_path / "out"
    with pytest.raises(ExportError) as error:
        _export(out, **options)
    assert named in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


def test_an_unreadable_rules_file_is_named(tmp_path):
    with pytest.raises(ExportError, match="missing.json"):
        _export(tmp_path / "out", compression_config=tmp_path / "missing.json")
    assert not (tmp_path / "out").exists()
