"""A KV write that leaves a rejected slot stale fails the cross-language check.

The check: the Swift engine (//:swift-generate) decoding a bundle must give the tokens the
Python reference loop gave on the blend bundle of the same pair (its goldens,
//tests/runtime:dflash2_goldens). The mutant is a `--kv-write slice` export whose write skips
each call's first row, so the slot of its first query keeps what it held. After a rejection
that is a rejected draft's keys and values: the cycle's rule that the next call overwrites
rejected slots (docs/positions.md) is broken. The real slice bundle passes the same check."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from swift_generate_support import run

GOLDENS = Path(os.environ.get("MUSEFLASH_DFLASH2_GOLDENS", "tests/runtime/dflash2_goldens.json"))
SLICE_BUNDLE = Path(os.environ.get("MUSEFLASH_DFLASH2_SLICE_BUNDLE",
                                   "tests/runtime/dflash2_slice_bundle"))


def speculative_cases():
    cases = json.loads(GOLDENS.read_text())["cases"]
    return [case for case in cases if "skipped" not in case and case["mode"] != "target_only"]


def mismatches(bundle: Path) -> list[str]:
    """The golden cases whose Swift tokens differ from the Python loop's on the blend bundle
    (compared over the tokens Swift produced: it stops at the end-of-sequence token)."""
    found = []
    for case in speculative_cases():
        result = run("--export-dir", bundle, "--format", "json", "--no-compare",
                     "--prompt-ids", ",".join(map(str, case["prompt_ids"])),
                     "--max-new-tokens", case["max_new_tokens"],
                     "--lookup-min-match", case["lookup_min_match"],
                     *(["--tree-budget", case["tree_budget"]] if "tree_budget" in case
                       else ["--no-tree"]))
        assert result.returncode == 0, result.stderr
        tokens = json.loads(result.stdout)["tokens"]
        if not tokens or tokens != case["tokens"][:len(tokens)]:
            found.append(case["name"])
    return found


@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    """tiny-dflash2 exported as the goldens' bundle was, --kv-write slice, with the slice
    write converted to skip the first of its T rows."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    from museflash.export import kv_ops
    from museflash.export.options import ExportOptions
    from museflash.export.pipeline import export_bundle
    from museflash.export.progress import Progress

    def skip_first_row(context, node):
        cache, layer, start, values = _get_inputs(context, node, expected=4)
        kv_heads, length, head_dim = values.shape
        first = kv_ops.first_slot(start, cache.shape[2], length)
        rest = mb.slice_by_index(x=values, begin=[0, 1, 0], end=[kv_heads, length, head_dim])
        later = mb.add(x=first, y=np.int32(1))
        context.add(kv_ops.write_rows(cache, int(layer.val), later, rest, node.name))

    registry = _TORCH_OPS_REGISTRY.name_to_func_mapping
    original = registry[kv_ops.OP_NAME]
    registry[kv_ops.OP_NAME] = skip_first_row
    try:
        output = tmp_path_factory.mktemp("mutant") / "export"
        # One process: the converter swapped here is not the helpers'. The export's self-check
        # refuses the mutant (its prefill's logits are off); publishing it is the point here.
        export_bundle(ExportOptions(output_dir=output, builtin="tiny-dflash2", fused_target=True,
                                    dflash_drafter=True, max_context_length=256,
                                    kv_write="slice", conversion_processes=1,
                                    self_check=False),
                      Progress(echo=lambda _line: None))
    finally:
        registry[kv_ops.OP_NAME] = original
    return output


def test_the_slice_bundle_passes_the_cross_language_check():
    assert mismatches(SLICE_BUNDLE) == []


def test_a_slice_write_leaving_a_rejected_slot_stale_fails_it(mutant):
    failing = mismatches(mutant)
    assert failing, "the check passed a bundle whose writes leave rejected slots stale"
