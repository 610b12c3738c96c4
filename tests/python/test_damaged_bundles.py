"""//:verify and //:generate on a damaged export (issue 25): a weight file cut short or
zero-filled, a missing package, or metadata.json that does not match the package each end in
one line naming the file (exit status 2, unusable input), not a traceback; //:demo_figures
exports such a bundle again instead of reusing it."""

import json
import shutil

import pytest
from prebuilt import prebuilt_bundle

from museflash.bundle import Metadata
from museflash.checks.verify import VerifyOptions, run_verify
from museflash.runtime.generate import GenerateError, GenerateOptions, generate
from museflash.runtime.package_check import PackageError, check_packages
from museflash.tools import demo_figures

pytest.importorskip("coremltools")

WEIGHTS = "target.mlpackage/Data/com.apple.CoreML/weights/weight.bin"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return prebuilt_bundle(tmp_path_factory.mktemp("damaged"))


def _cut_to_a_third(bundle):
    path = bundle / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 3])
    return "weight.bin"


def _last_bytes_cut(bundle):
    path = bundle / WEIGHTS
    path.write_bytes(path.read_bytes()[:-10])
    return "weight.bin"


def _zero_filled(bundle):
    path = bundle / WEIGHTS
    path.write_bytes(bytes(path.stat().st_size))
    return "weight.bin"


def _package_removed(bundle):
    shutil.rmtree(bundle / "target.mlpackage")
    return "target.mlpackage"


def _metadata_of_a_longer_context(bundle):
    """metadata.json as an export with --max-context-length=128 would write it."""
    path = bundle / "metadata.json"
    raw = json.loads(path.read_text())
    raw["context_length"] = 128
    for asset in raw["assets"].values():
        for state in asset["states"]:
            if state["kind"] == "global_kv":
                state["capacity"] = 128
                state["shape"][-2] = 128
    path.write_text(json.dumps(raw, indent=2) + "\n")
    return "target.mlpackage"


DAMAGES = [_cut_to_a_third, _last_bytes_cut, _zero_filled, _package_removed,
           _metadata_of_a_longer_context]


@pytest.fixture(params=DAMAGES, ids=[d.__name__.strip("_") for d in DAMAGES])
def damaged(request, exported, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(exported, copy)
    named = request.param(copy)
    return copy, named


def test_the_package_check_passes_the_intact_export(exported):
    check_packages(exported, Metadata.read(exported))


def test_the_package_check_names_the_damaged_file(damaged):
    bundle, named = damaged
    with pytest.raises(PackageError) as caught:
        check_packages(bundle, Metadata.read(bundle))
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_verify_says_one_line_naming_the_file(damaged):
    bundle, named = damaged
    lines = []
    status = run_verify(VerifyOptions(export_dir=bundle, new_tokens=4, echo=lines.append))
    assert status == 2, lines
    assert lines[-1].startswith("verify: error: ") and named in lines[-1]


def test_generate_says_one_line_naming_the_file(damaged):
    bundle, named = damaged
    with pytest.raises(GenerateError, match=named):
        generate(GenerateOptions(export_dir=bundle, prompt="w1 w2", max_new_tokens=4,
                                 compare=False), lambda _text: None, lambda _line: None)


def test_demo_figures_exports_a_damaged_work_dir_bundle_again(damaged, monkeypatch):
    """demo_figures makes its own exports; one left damaged in --work-dir is not reused."""
    from museflash.export import pipeline

    bundle, _named = damaged
    settings = demo_figures.export_settings("tiny", 3)
    (bundle.parent / f"{bundle.name}.settings.json").write_text(
        json.dumps(settings, sort_keys=True))
    exported = []
    monkeypatch.setattr(pipeline, "export_bundle", lambda options, _p: exported.append(options))
    demo_figures.ensure_export(bundle.parent, bundle.name, settings, log=lambda _line: None)
    assert [options.output_dir for options in exported] == [bundle]
