"""Deliberate damage to a saved .mlpackage, for tests that must catch a broken export."""


def swap_blobs(package, pairs):
    """Rewrites `package` in place so that, in every function, each pair of weight constants
    (matched by a fragment of their names) reads the other's blob."""
    import coremltools as ct

    model_file = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = ct.utils.load_spec(str(package))
    swapped = 0
    for function in spec.mlProgram.functions.values():
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
