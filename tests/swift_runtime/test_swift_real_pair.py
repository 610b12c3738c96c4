"""The Swift engine against the Python loop on the real pair (SmolLM2-135M-Instruct and its
DFlash drafter, fp16 and 4-bit): //:swift-generate decodes each golden case's prompt ids and
must give the same tokens and the same accepted drafts per step as the Python reference loop
over the numpy interpreter (tools/runtime_goldens.py) gave on the same bundle."""

import json
import os
from pathlib import Path

import pytest
from swift_generate_support import run as swift

PAIRS = [tuple(item.split("=", 1)) for item in os.environ["MUSEFLASH_REAL_PAIRS"].split(",")]


def _cases():
    for bundle, goldens in PAIRS:
        cases = json.loads(Path(goldens).read_text())["cases"]
        for case in cases:
            if "skipped" in case:
                continue
            name = f"{Path(bundle).name}-{case['name']}"
            yield pytest.param(bundle, case, "interpreter", id=name)
            # The Core ML stand-in runs the tree cases of the runtime goldens' bundles
            # (RuntimeGoldenTests); on the real pair it costs a minute a case.
            if case["mode"] == "speculative":
                yield pytest.param(bundle, case, "coreml", id=f"{name}-coreml")


@pytest.mark.parametrize("bundle, case, backend", list(_cases()))
def test_swift_decodes_as_the_python_loop(bundle, case, backend, tmp_path):
    args = ["--export-dir", bundle, "--prompt-ids", ",".join(map(str, case["prompt_ids"])),
            "--max-new-tokens", case["max_new_tokens"], "--lookup-min-match",
            case["lookup_min_match"], "--format", "json", "--no-compare", "--backend", backend]
    if backend == "coreml":
        args += ["--model-cache", tmp_path / "cache"]
    if case["mode"] == "target_only":
        args.append("--no-draft")
    if "tree_budget" in case:
        args += ["--tree-budget", case["tree_budget"]]
    elif case["mode"] != "target_only":
        args.append("--no-tree")  # the loop's chain, not the engine's own choice of steps
    done = swift(*args, timeout=1200)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == case["tokens"]
    assert report["accepted"] == case["accepted"]
    assert len(case["tokens"]) == case["max_new_tokens"] > 0
