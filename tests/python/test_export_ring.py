"""--with-drafter: the older ring drafter, exported beside a plain (logits-only) target."""

import json

import pytest

from museflash.builtin.demo_checkpoint import (
    TINY_DRAFTER_CONFIG,
    TINY_TARGET_CONFIG,
    shallow_tiny_pair_configs,
    write_tiny_checkpoints,
)
from museflash.bundle import StateName
from museflash.export.options import ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress

ct = pytest.importorskip("coremltools")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The tiny pair over the target's first four layers (three sliding, one global; the ring
    drafter and the plain target do not depend on depth), with the built-in pair's tokenizer,
    converted in this one process (a helper's start-up costs about what it saves here)."""
    root = tmp_path_factory.mktemp("ring")
    target_config, drafter_config = shallow_tiny_pair_configs()
    target_dir, drafter_dir = write_tiny_checkpoints(root / "pair", target_config=target_config,
                                                     drafter_config=drafter_config,
                                                     tokenizer=True)
    out = root / "bundle"
    export_bundle(ExportOptions(output_dir=out, checkpoint=target_dir,
                                drafter_checkpoint=drafter_dir, with_drafter=True,
                                max_context_length=32, prefill_length=4, conversion_processes=1),
                  Progress(echo=lambda _line: None))
    return out


def test_ring_bundle_layout(bundle):
    assert sorted(p.name for p in bundle.iterdir()) == [
        "metadata.json", "ring_drafter.mlpackage", "target.mlpackage", "tokenizer.json",
        "tokenizer_config.json"]


def test_ring_drafter_signature_and_states(bundle):
    spec = ct.utils.load_spec(str(bundle / "ring_drafter.mlpackage"))
    (function,) = spec.description.functions
    assert function.name == "main"
    assert [f.name for f in function.input] == ["input_ids", "position_ids"]
    (logits,) = function.output
    vocab = TINY_TARGET_CONFIG["text_config"]["vocab_size"]
    assert list(logits.type.multiArrayType.shape) == [1, 1, vocab]
    shapes = {s.name: list(s.type.stateType.arrayType.shape) for s in function.state}
    layers = TINY_DRAFTER_CONFIG["num_hidden_layers"]
    assert sorted(shapes) == [StateName.SLIDING_KEY_CACHE, StateName.SLIDING_VALUE_CACHE]
    assert all(shape[0] == layers for shape in shapes.values())


def test_plain_target_has_no_drafter_features(bundle):
    spec = ct.utils.load_spec(str(bundle / "target.mlpackage"))
    for function in spec.description.functions:
        assert [o.name for o in function.output] == ["logits"]


def test_ring_metadata(bundle):
    metadata = json.loads((bundle / "metadata.json").read_text())
    assert metadata["speculative_decoding"]["drafter_kind"] == "ring"
    assert metadata["assets"]["target"]["kind"] == "target"
    assert metadata["assets"]["ring_drafter"]["functions"]["main"]["query_length"] == 1


def test_ring_bundle_verifies_against_its_checkpoints(bundle):
    """verify's ring-drafter branch: parity of the plain target and the ring drafter (positions
    that wrap the drafter's ring) and the lossless loop, against the checkpoints it recorded."""
    from museflash.checks.verify import VerifyOptions, run_verify

    lines = []
    status = run_verify(VerifyOptions(export_dir=bundle, echo=lines.append, new_tokens=8))
    print("\n".join(lines))
    assert status == 0
    parity = [line for line in lines if line.startswith("parity ")]
    assert any(line.startswith("parity ring_drafter.main") and " OK" in line
               for line in parity), parity
    assert lines[-1].startswith("verify: OK")
