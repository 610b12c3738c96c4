"""The tiny Qwen3 and Llama 3.1 bundles (//tests/runtime:qwen3_bundle, :llama_bundle), and
the real SmolLM2 pair (:smollm2_bundle, :smollm2_compressed_bundle; MUSEFLASH_BUNDLES names
them): the contract in both languages, and //:verify's parity, lossless loop (also on a chat
prompt, where the bundle has a template) and copying steps."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from museflash.bundle import AssetRole, LayerType, Metadata, StateName
from museflash.checks.verify import VerifyOptions, run_verify
from museflash.runtime.package_check import check_packages

BUNDLES = [Path(p) for p in os.environ.get(
    "MUSEFLASH_BUNDLES", "tests/runtime/qwen3_bundle,tests/runtime/llama_bundle"
).split(",")]
CHECKER = Path(os.environ.get("MUSEFLASH_CHECK_CONTRACT", "swift/check-contract"))
# Tokens each of verify's decoding runs generates (the real pair's bundles take fewer: the numpy
# interpreter runs a 135M-parameter call in seconds).
NEW_TOKENS = int(os.environ.get("MUSEFLASH_VERIFY_NEW_TOKENS", "24"))


@pytest.fixture(params=BUNDLES, ids=lambda p: p.name)
def bundle(request):
    return request.param


def test_the_target_has_only_the_global_state_pair(bundle):
    metadata = Metadata.read(bundle)
    assert set(metadata.target.layer_types) == {LayerType.FULL_ATTENTION}
    assert metadata.target.sliding_window == 0
    target = metadata.asset(AssetRole.TARGET)
    assert [s.name for s in target.states] == [StateName.GLOBAL_KEY_CACHE,
                                               StateName.GLOBAL_VALUE_CACHE]
    assert all(s.capacity == metadata.context_length for s in target.states)
    # The full-attention drafter's ring spans the whole context.
    drafter = metadata.asset(AssetRole.DFLASH_DRAFTER)
    assert all(s.capacity >= metadata.context_length for s in drafter.states)
    assert metadata.speculative_decoding.drafter.sliding_window == metadata.context_length


def test_python_package_check_and_swift_check_contract_pass(bundle):
    metadata = Metadata.read(bundle)
    check_packages(bundle, metadata)
    result = subprocess.run([str(CHECKER), "--export-dir", str(bundle)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    passed = [line for line in result.stdout.splitlines() if line.startswith("PASS ")]
    assert failed == [] and any(" target.states" in line for line in passed)


def test_verify_passes_parity_the_lossless_loop_and_copying(bundle):
    lines = []
    options = VerifyOptions(export_dir=bundle, new_tokens=NEW_TOKENS, echo=lines.append)
    assert run_verify(options) == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert "lossless: speculative == target-only greedy" in text
    assert "steps copied from the context" in text
    if (bundle / "tokenizer_config.json").is_file() and "chat_template" in json.loads(
            (bundle / "tokenizer_config.json").read_text()):
        assert "chat template prompt" in text


def test_the_tokenizer_leaves_padding_rows_only_where_the_family_does(bundle):
    metadata = Metadata.read(bundle)
    tokenizer = json.loads((bundle / "tokenizer.json").read_text())
    ids = len(tokenizer["model"]["vocab"]) + len(
        {t["id"] for t in tokenizer["added_tokens"]} - set(tokenizer["model"]["vocab"].values()))
    assert metadata.tokenizer.vocab_size == ids <= metadata.vocab_size
    if metadata.model_name.startswith("qwen3"):
        assert metadata.vocab_size % 64 == 0 and ids < metadata.vocab_size
    else:
        assert ids == metadata.vocab_size
