"""A bucketed function converted once (export/spans.py): the template span, the package each
bucket gets written from the template, and the templates the export refuses to write from.

One tiny `main` is converted three times here: at the template span, at a bucket of 160 slots
and at 224. The bundle-level proof is in the matrix: the bucketed rows of
tests/runtime/bundles.bzl are written from templates, and the tests hold them to their
unbucketed twins' tokens, accepted drafts and call trace (test_buckets, the runtime goldens)."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.bundle import PACKAGE_SPEC, PACKAGE_WEIGHT_FILE
from museflash.export import blobfile
from museflash.export.convert import convert_function
from museflash.export.merge import blob_constants, read_spec
from museflash.export.options import ExportOptions
from museflash.export.placeholders import PlaceholderWeights
from museflash.export.plan import load_modules, plan_export
from museflash.export.progress import Progress
from museflash.export.spans import SpanError, SpanSites, integers_of, template_span

CAPACITY = 256
BUCKETS = (160, 224)


def test_the_template_span_is_a_prime_no_dimension_takes_longer_than_every_call():
    span = template_span(8192, 32, {576, 49152})
    assert span == 6143  # the largest prime at most 3/4 of the capacity
    assert template_span(8192, 32, {6143}) == 6133  # the next prime down
    assert template_span(256, 32, set()) == 191
    # Longer than the longest call and at least 100 slots, or none: then buckets convert.
    assert template_span(256, 200, set()) is None
    assert template_span(128, 8, set()) is None


def test_the_dimensions_a_template_span_avoids_are_every_integer_of_the_configs():
    @dataclass
    class Inner:
        sizes: list[int]
        on: bool = True

    @dataclass
    class Outer:
        hidden: int
        inner: Inner
        name: str = "x"

    assert integers_of(Outer(576, Inner([3, 30])), None) == {576, 3, 30}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny target's `main` converted at the template span and at each bucket."""
    root = tmp_path_factory.mktemp("spans")
    options = ExportOptions(output_dir=root / "unused", builtin="tiny", fused_target=True,
                            dflash_drafter=True, max_context_length=CAPACITY,
                            context_buckets=BUCKETS)
    with builtin_checkpoints("tiny") as (target_dir, drafter_dir):
        plan = plan_export(options, target_dir, drafter_dir)
        modules = load_modules(options, plan, Progress(echo=lambda _: None),
                               PlaceholderWeights())
        asset = plan.asset("target")
        template = next(t for t in asset.templates if t.function == "main")
        assert template.written == (("main_160", 160), ("main_224", 224), ("main", CAPACITY))
        converted = {}
        for function in [dataclasses.replace(template, written=())] + [
                asset.function(f"main_{b}") for b in BUCKETS]:
            converted[function.name] = root / f"{function.name}.mlpackage"
            convert_function(modules["target"], asset, function, converted[function.name],
                             Progress(echo=lambda _: None))
    return root, template.bucket, converted, asset, template


def test_a_bucket_written_from_the_template_is_the_converted_bucket(parts):
    root, span, converted, *_ = parts
    sites = SpanSites(converted["main_template"], span)
    # The slice ends, shapes and types of each global layer's read and blend, and the one
    # arange of slot ids; nothing else of the program holds the span.
    assert len(sites.integers) > 10 and len(sites.aranges) == 1
    for bucket in BUCKETS:
        written = root / f"written_{bucket}.mlpackage"
        sites.write_part(bucket, written)
        assert read_spec(written) == read_spec(converted[f"main_{bucket}"])
        assert ((written / PACKAGE_WEIGHT_FILE).read_bytes()
                == (converted[f"main_{bucket}"] / PACKAGE_WEIGHT_FILE).read_bytes())
    # Writing leaves the template as it was, so each bucket is written from the same program.
    assert read_spec(converted["main_template"]) == sites.spec


def _damaged(template: Path, into: Path, damage) -> Path:
    copy = shutil.copytree(template, into)
    spec = read_spec(copy)
    damage(spec, copy)
    (copy / PACKAGE_SPEC).write_bytes(spec.SerializeToString())
    return copy


def _ops(spec):
    function = next(iter(spec.mlProgram.functions.values()))
    return next(iter(function.block_specializations.values())).operations


def _span_dimension(spec, span):
    return next(d for op in _ops(spec) for output in op.outputs
                for d in output.type.tensorType.dimensions if d.constant.size == span)


def test_a_template_whose_span_cannot_be_told_by_value_is_refused(parts, tmp_path):
    root, span, converted, *_ = parts
    template = converted["main_template"]

    def doubled(spec, _):  # a dimension merged with the span
        _span_dimension(spec, span).constant.size = 2 * span

    def arange_changed(spec, package):  # a span-long constant that is not arange(span)
        arange = next(b for b in blob_constants(next(iter(spec.mlProgram.functions.values())))
                      if span in b.shape)
        weights = bytearray((package / PACKAGE_WEIGHT_FILE).read_bytes())
        start = blobfile.read_record(weights, arange.offset)[3]
        weights[start:start + 4] = np.int32(7).tobytes()
        (package / PACKAGE_WEIGHT_FILE).write_bytes(bytes(weights))

    def float_span(spec, _):
        op = next(op for op in _ops(spec) if op.type == "const"
                  and op.attributes["val"].immediateValue.tensor.floats.values)
        op.attributes["val"].immediateValue.tensor.floats.values[0] = float(span)

    for name, damage, problem in [("doubled", doubled, "is a multiple of the template span"),
                                  ("arange", arange_changed, "is not an arange of it"),
                                  ("float", float_span, "a float equals the template span")]:
        with pytest.raises(SpanError, match=problem):
            SpanSites(_damaged(template, tmp_path / name, damage), span)
    with pytest.raises(SpanError, match="no integer equals the template span"):
        SpanSites(template, span + 2)


def test_a_template_refused_gets_each_of_its_functions_converted(parts, tmp_path, monkeypatch):
    import museflash.export.convert as convert

    root, span, converted, asset, template = parts
    part = shutil.copytree(converted["main_template"], tmp_path / "main_template.mlpackage")
    converting: list[str] = []

    def refused(*_):
        raise SpanError("planted")

    def convert_one(_module, _asset, function, into, _progress, _where=""):
        converting.append(function.name)
        into.mkdir()

    monkeypatch.setattr(convert, "SpanSites", refused)
    monkeypatch.setattr(convert, "_convert_one", convert_one)
    said: list[str] = []
    convert._write_spans(None, asset, template, part, Progress(echo=said.append), "")
    assert not part.exists()  # a template is not a function of the bundle
    assert converting == ["main_160", "main_224", "main"]
    assert all((tmp_path / f"{name}.mlpackage").is_dir() for name in converting)
    assert "planted: converting them one by one" in said[0]
