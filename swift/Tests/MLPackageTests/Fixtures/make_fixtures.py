"""Generate the tiny .mlpackage fixtures used by the Swift MLPackage tests.

Regenerate (from the repo root, with a venv holding coremltools 9.0 and torch):

    python swift/Tests/MLPackageTests/Fixtures/make_fixtures.py

The script rewrites every *.mlpackage in this directory plus expected.json.
expected.json is computed here from coremltools' own protobuf parser, so the
Swift tests compare the Swift wire decoder against an independent reading of
the same bytes. Models are deliberately minuscule so the fixtures stay a few KB.
"""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import coremltools as ct
from coremltools.proto import FeatureTypes_pb2

FIXTURES_DIR = Path(__file__).resolve().parent
VOCAB_SIZE = 16
HIDDEN_SIZE = 4
CACHE_LENGTH = 4

torch.manual_seed(0)


class TokenScorer(nn.Module):
    """Stateless: token ids -> logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, HIDDEN_SIZE)
        self.head = nn.Linear(HIDDEN_SIZE, VOCAB_SIZE, bias=False)

    def forward(self, inputIds):
        return self.head(self.embed(inputIds))


class CacheWriter(nn.Module):
    """Stateful: writes one token's embedding into a key cache at a position.

    The write is a one-hot torch.where blend because coremltools 9.0 cannot
    convert slice assignment (aten.alias) or index_copy.
    """

    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.embed = nn.Embedding(VOCAB_SIZE, HIDDEN_SIZE)
        self.register_buffer(
            "keyCache", torch.zeros(1, CACHE_LENGTH, HIDDEN_SIZE, dtype=torch.float16)
        )

    def forward(self, inputIds, position):
        token = (self.embed(inputIds) * self.scale).to(torch.float16)  # (1, 1, H)
        slots = torch.arange(CACHE_LENGTH, dtype=torch.int32).reshape(1, CACHE_LENGTH, 1)
        mask = slots == position.reshape(1, 1, 1)
        self.keyCache.copy_(torch.where(mask, token, self.keyCache))
        return self.keyCache.sum(dim=1)


def export(model, args, dynamic_shapes=None):
    model.eval()
    return torch.export.export(model, args, dynamic_shapes=dynamic_shapes).run_decompositions({})


def convert_token_scorer(input_shape, name="inputIds"):
    # Flexible Core ML shapes need a matching symbolic dimension in the export.
    sequence = torch.export.Dim("sequence", min=1, max=8)
    ep = export(
        TokenScorer(),
        (torch.zeros(1, 3, dtype=torch.int32),),
        dynamic_shapes={"inputIds": {1: sequence}},
    )
    return ct.convert(
        ep,
        inputs=[ct.TensorType(name=name, shape=input_shape, dtype=np.int32)],
        outputs=[ct.TensorType(name="logits")],
        minimum_deployment_target=ct.target.iOS18,
        skip_model_load=True,
    )


def convert_cache_writer(scale):
    ep = export(
        CacheWriter(scale),
        (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)),
    )
    return ct.convert(
        ep,
        inputs=[
            ct.TensorType(name="inputIds", shape=(1, 1), dtype=np.int32),
            ct.TensorType(name="position", shape=(1,), dtype=np.int32),
        ],
        outputs=[ct.TensorType(name="summary", dtype=np.float16)],
        states=[
            ct.StateType(
                wrapped_type=ct.TensorType(
                    shape=(1, CACHE_LENGTH, HIDDEN_SIZE), dtype=np.float16
                ),
                name="keyCache",
            )
        ],
        minimum_deployment_target=ct.target.iOS18,
        skip_model_load=True,
    )


def set_metadata(mlmodel, tag):
    mlmodel.author = "museflash fixtures"
    mlmodel.license = "MIT"
    mlmodel.short_description = f"{tag} fixture for the Swift MLPackage reader"
    mlmodel.version = "0.1.0"
    mlmodel.user_defined_metadata["museflash.fixture"] = tag
    mlmodel.user_defined_metadata["museflash.cacheLength"] = str(CACHE_LENGTH)


def make_reproducible(mlmodel):
    # The conversion date would make every regeneration a diff for no reason.
    mlmodel.user_defined_metadata.pop("com.github.apple.coremltools.conversion_date", None)


def prune(package):
    # Debug side files are not part of the manifest and only add bytes.
    for extra in package.glob("*.json"):
        if extra.name != "Manifest.json":
            extra.unlink()


def save(mlmodel, name):
    out = FIXTURES_DIR / name
    if out.exists():
        shutil.rmtree(out)
    make_reproducible(mlmodel)
    mlmodel.save(str(out))
    prune(out)
    return out


# --- expected.json: an independent reading of each saved spec --------------

DATA_TYPE_NAMES = {
    v.number: v.name
    for v in FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.DESCRIPTOR.values
}


def describe_array(array):
    result = {
        "shape": list(array.shape),
        "dataType": DATA_TYPE_NAMES[array.dataType],
    }
    flexibility = array.WhichOneof("ShapeFlexibility")
    if flexibility == "shapeRange":
        result["shapeRange"] = [
            [r.lowerBound, r.upperBound] for r in array.shapeRange.sizeRanges
        ]
    elif flexibility == "enumeratedShapes":
        result["enumeratedShapes"] = [
            list(s.shape) for s in array.enumeratedShapes.shapes
        ]
    return result


def describe_type(feature_type):
    kind = feature_type.WhichOneof("Type")
    if kind == "multiArrayType":
        return {"kind": "multiArray", **describe_array(feature_type.multiArrayType)}
    if kind == "stateType":
        return {"kind": "state", **describe_array(feature_type.stateType.arrayType)}
    if kind in ("int64Type", "doubleType", "stringType"):
        return {"kind": kind[: -len("Type")]}
    return {"kind": "unknown"}


def describe_features(features):
    return [{"name": f.name, "type": describe_type(f.type)} for f in features]


def describe_spec(spec):
    d = spec.description
    return {
        "specificationVersion": spec.specificationVersion,
        "inputs": describe_features(d.input),
        "outputs": describe_features(d.output),
        "states": describe_features(d.state),
        "functions": [
            {
                "name": fn.name,
                "inputs": describe_features(fn.input),
                "outputs": describe_features(fn.output),
                "states": describe_features(fn.state),
            }
            for fn in d.functions
        ],
        "defaultFunctionName": d.defaultFunctionName,
        "metadata": {
            "shortDescription": d.metadata.shortDescription,
            "versionString": d.metadata.versionString,
            "author": d.metadata.author,
            "license": d.metadata.license,
            "userDefined": dict(d.metadata.userDefined),
        },
    }


def load_spec(package_path):
    from coremltools.models.utils import load_spec as ct_load_spec

    return ct_load_spec(str(package_path))


def main():
    outputs = []

    scorer = convert_token_scorer((1, ct.RangeDim(lower_bound=1, upper_bound=8, default=3)))
    set_metadata(scorer, "ranged")
    outputs.append(save(scorer, "Ranged.mlpackage"))

    enumerated = convert_token_scorer(ct.EnumeratedShapes(shapes=[(1, 2), (1, 3), (1, 5)], default=(1, 3)))
    set_metadata(enumerated, "enumerated")
    outputs.append(save(enumerated, "Enumerated.mlpackage"))

    stateful = convert_cache_writer(1.0)
    set_metadata(stateful, "stateful")
    outputs.append(save(stateful, "Stateful.mlpackage"))

    with tempfile.TemporaryDirectory() as tmp:
        path_a = str(Path(tmp) / "inject.mlpackage")
        path_b = str(Path(tmp) / "draft.mlpackage")
        convert_cache_writer(1.0).save(path_a)
        convert_cache_writer(0.5).save(path_b)
        desc = ct.utils.MultiFunctionDescriptor()
        desc.add_function(path_a, src_function_name="main", target_function_name="inject_kv")
        desc.add_function(path_b, src_function_name="main", target_function_name="draft")
        desc.default_function_name = "draft"
        out = FIXTURES_DIR / "MultiFunction.mlpackage"
        if out.exists():
            shutil.rmtree(out)
        ct.utils.save_multifunction(desc, str(out))
        # save_multifunction writes fresh metadata, so set ours on the result.
        multi = ct.models.MLModel(str(out), skip_model_load=True)
        set_metadata(multi, "multifunction")
        staged = Path(tmp) / "multi.mlpackage"
        make_reproducible(multi)
        multi.save(str(staged))
        shutil.rmtree(out)
        shutil.copytree(staged, out)
        prune(out)
        outputs.append(out)

    expected = {p.name: describe_spec(load_spec(p)) for p in outputs}
    (FIXTURES_DIR / "expected.json").write_text(
        json.dumps(expected, indent=2, sort_keys=True) + "\n"
    )
    for p in outputs:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        print(f"{p.name}: {size} bytes")


if __name__ == "__main__":
    main()
