"""Both interpreters stop at the same op where an old-graph bundle overflows fp16.

The bundle is today's graph before the fp16 work (plain norms, no residual scaling) of the pair
with planted massive activations (docs/fp16.md), exported by the build; the same <bos>-led
prompt is decoded by the Python reference loop (numpy interpreter) and by //:swift-generate
(Swift interpreter), and each must name the same function, op and nearest weight.
"""

import os
import re
from pathlib import Path

import pytest
from swift_generate_support import run

from museflash.builtin.demo_checkpoint import PLANTED_TOKENS
from museflash.bundle import Metadata
from museflash.runtime.interpreter import NonFiniteError
from museflash.runtime.speculative import ExportedDrafter, ExportedTarget, speculative_generate

PROMPT = [PLANTED_TOKENS[0], 50, 60, PLANTED_TOKENS[1], 70, 80, 90, PLANTED_TOKENS[2], 100]
# function, op type, op name, layer (when the nearest weight names one), nearest weight; the
# numpy interpreter quotes names, the Swift one does not.
FAILURE = re.compile(r"function '?(\w+)'?: (\w+) \(op '?([^')]+)'?\) is the first op whose result "
                     r"is not finite(?: in layer (\d+))? \(nearest weight (\w+)\)")


@pytest.fixture(scope="module", params=[False, True], ids=["old-graph", "new-graph"])
def bundle(request) -> tuple[Path, bool]:
    """tiny-massive as the build exported it (//tests/runtime:fp16_massive_bundle and its
    old-graph twin fp16_massive_old_bundle), with the fp16 tests' small settings."""
    variable = ("MUSEFLASH_FP16_MASSIVE_BUNDLE" if request.param
                else "MUSEFLASH_FP16_MASSIVE_OLD_BUNDLE")
    if not os.environ.get(variable):
        raise RuntimeError(f"{variable} is not set: run this test through Bazel")
    return Path(os.environ[variable]), request.param


def _python(export_dir: Path) -> str | None:
    metadata = Metadata.read(export_dir)
    spec = metadata.speculative_decoding
    try:
        speculative_generate(ExportedTarget(export_dir, metadata),
                             ExportedDrafter(export_dir, metadata), PROMPT, 4,
                             mask_token_id=spec.mask_token_id,
                             context_length=metadata.context_length)
    except NonFiniteError as error:
        return str(error)
    return None


def test_both_interpreters_name_the_same_first_non_finite_op(bundle):
    export_dir, new_graph = bundle
    swift = run("--export-dir", export_dir, "--prompt-ids", ",".join(map(str, PROMPT)),
                "--max-new-tokens", 4, "--backend", "interpreter")
    python = _python(export_dir)
    if new_graph:
        assert python is None
        assert swift.returncode == 0, swift.stderr
        return
    assert python is not None and swift.returncode == 1, (python, swift.stderr)
    expected = FAILURE.search(python)
    found = FAILURE.search(swift.stderr)
    assert expected and found, (python, swift.stderr)
    assert found.groups() == expected.groups()
    assert expected.group(2) == "pow"  # the plain norm's x^2
