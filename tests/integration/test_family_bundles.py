"""The tiny Qwen3 and Llama 3.1 bundles (//tests/runtime:qwen3_bundle, :llama_bundle), and
the real SmolLM2 pair (:smollm2_bundle, :smollm2_compressed_bundle; MUSEFLASH_BUNDLES names
them): the contract in both languages, //:verify's parity, lossless loop (also on a chat
prompt, where the bundle has a template) and copying steps, and a bucketed bundle's decoding
through its buckets against its whole-capacity functions."""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from museflash.bundle import AssetRole, LayerType, Metadata, StateName
from museflash.checks.verify import VerifyOptions, run_verify
from museflash.runtime.package_check import check_packages
from museflash.runtime.speculative import DecodeSession, load_exported_pair
from museflash.tools.runtime_goldens import Recorder

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


# Prose the real pair's drafter partly predicts (random ids would accept no draft), 84 of
# SmolLM2's tokens: its prefill chunks run in the 64 and 128 buckets, and 60 new tokens take
# the verify blocks across 128 into the whole capacity of 256.
PROSE = ("The history of the bicycle begins in the early nineteenth century, when inventors in "
         "Europe built wooden machines that riders pushed along with their feet. Pedals came "
         "later, then chains, gears and air-filled tyres. Today people ride bicycles to work, "
         "to school and for sport, and many cities build lanes for them. Here is a short list "
         "of the most important parts of a bicycle and what each of them does:")


def test_a_bucketed_bundle_decodes_through_its_buckets_as_through_its_whole_functions(bundle):
    """The same tokens, accepted drafts and call trace whichever function a call runs in. The
    whole-capacity functions are the bundle's own, so the real pair, which has no unbucketed
    twin in the matrix, is held to them. A 4-bit bundle's functions are its fp16 bundle's
    conversion (--also-export), so it is skipped."""
    from tokenizers import Tokenizer

    metadata = Metadata.read(bundle)
    if not metadata.asset(AssetRole.TARGET).buckets or metadata.compression:
        pytest.skip("no buckets, or a 4-bit bundle (its fp16 twin's functions)")
    target, drafter, _ = load_exported_pair(bundle)
    ids = Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(
        PROSE, add_special_tokens=False).ids[:84]

    def decode():
        session = DecodeSession(target, drafter,
                                mask_token_id=metadata.speculative_decoding.mask_token_id,
                                context_length=metadata.context_length, lookup_min_match=0)
        session.reset()
        target.package.ran.clear()
        recorder = Recorder([target.package, drafter.package])
        recorder.start()
        try:
            result = session.generate(ids, 60)
        finally:
            recorder.close()
        return (result.tokens, result.accepted, list(recorder.trace)), list(target.package.ran)

    bucketed, ran = decode()
    for package in (target.package, drafter.package):
        package.asset = dataclasses.replace(package.asset, buckets=None)
    whole, whole_ran = decode()
    assert bucketed == whole
    assert {"prefill_64", "prefill_128", "main_128", "main"} <= set(ran)
    if metadata.model_name.startswith("smollm2"):  # the tiny pairs' random drafters accept none
        assert sum(bucketed[1]) > 0, "some drafts were accepted"
    assert set(whole_ran) <= {"main", "prefill", "decode"}
