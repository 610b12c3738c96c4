"""The runtime golden files the Swift engine and interpreter tests read, checked on the real
files Bazel built (//tests/runtime:{demo,dflash2,compressed}_goldens) against the bundles they
were made from: the trace agrees with the loop's own counts, speculative decoding is lossless,
decoding starts with prefill over the prompt, rings wrap, and every parity record is
reproduced by running the numpy interpreter on its inputs and states."""

import base64
import json
import os
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from museflash.runtime.interpreter import Interpreter, load_program

# name -> (golden file, bundle directory), runfiles paths
GOLDENS = {
    name: (Path(os.environ.get(f"MUSEFLASH_{name.upper()}_GOLDENS",
                               f"tests/runtime/{name}_goldens.json")),
           Path(os.environ.get(f"MUSEFLASH_{name.upper()}_BUNDLE",
                               f"tests/runtime/{name}_bundle")))
    for name in ("demo", "dflash2", "compressed")
}
FUNCTIONS = ("prefill", "main", "inject_kv", "draft")
DEMO_LENGTHS = (1, 7, 31, 33, 200)


def decode_tensor(tensor):
    """A golden tensor: little-endian raw bytes in C order (decoded here, apart from the tool's
    encoder, as the Swift side decodes them)."""
    dtype = np.dtype({"float16": "<f2", "float32": "<f4", "int32": "<i4"}[tensor["dtype"]])
    values = np.frombuffer(base64.b64decode(tensor["base64"]), dtype)
    return values.astype(dtype.newbyteorder("="), copy=True).reshape(tensor["shape"])


@cache
def goldens(name):
    return json.loads(GOLDENS[name][0].read_text())


def run_cases(name):
    return [case for case in goldens(name)["cases"] if "skipped" not in case]


def query_lengths(golden):
    """Function -> tokens per call, the target's one-token decode among them."""
    lengths = {function: spec["query_length"] for asset in golden["metadata"]["assets"].values()
               for function, spec in asset["functions"].items()}
    for extra in ("decode", "tree"):  # listed beside the target's functions
        if extra in golden["metadata"]["assets"]["target"]:
            lengths[extra] = golden["metadata"]["assets"]["target"][extra]["query_length"]
    return lengths


def block_size(golden):
    return golden["metadata"]["speculative_decoding"]["block_size"]


@pytest.fixture(params=list(GOLDENS))
def name(request):
    return request.param


def test_format_and_metadata(name):
    golden = goldens(name)
    assert golden["format"] == 1
    bundle_metadata = json.loads((GOLDENS[name][1] / "metadata.json").read_text())
    assert golden["metadata"] == bundle_metadata
    assert run_cases(name), "every case was skipped"


def test_demo_covers_every_prompt_length():
    lengths = {len(case["prompt_ids"]) for case in run_cases("demo")}
    assert lengths == set(DEMO_LENGTHS)
    assert "tokenizer" in goldens("demo")["prompt"]["source"]


def test_cases_fit_the_context(name):
    golden = goldens(name)
    context = golden["metadata"]["context_length"]
    vocab = golden["metadata"]["vocab_size"]
    for case in run_cases(name):
        prompt, new = len(case["prompt_ids"]), case["max_new_tokens"]
        assert prompt + new + block_size(golden) - 1 <= context, case["name"]
        assert len(case["tokens"]) == new, case["name"]
        assert all(0 <= t < vocab for t in case["prompt_ids"] + case["tokens"]), case["name"]
        every_position = [p for call in case["trace"]
                          for p in range(call["first_position"],
                                         call["first_position"] + call["length"])]
        assert max(every_position) < context, case["name"]


def test_trace_counts_equal_the_loops_counts(name):
    for case in run_cases(name):
        counted = Counter(call["function"] for call in case["trace"])
        # Target-alone steps run the one-token decode where the bundle has one; tree steps
        # the tree function.
        functions = FUNCTIONS + tuple(f for f in ("decode", "tree") if f in counted)
        assert {f: counted.get(f, 0) for f in functions} == case["calls"], case["name"]
        lengths = query_lengths(goldens(name))
        assert all(call["length"] == lengths[call["function"]] for call in case["trace"])


def test_speculative_decoding_is_lossless(name):
    cases = {case["name"]: case for case in run_cases(name)}
    speculative = [case for case in cases.values() if case["mode"] != "target_only"]
    assert {case["mode"] for case in speculative} - {"speculative-tree"} == {
        "speculative", "speculative-lookup"}
    for case in speculative:
        alone = cases[case["name"].replace(case["mode"], "target_only", 1)]
        assert alone["mode"] == "target_only" and alone["accepted"] == []
        assert alone["prompt_ids"] == case["prompt_ids"]
        assert alone["tokens"] == case["tokens"], case["name"]
        # Each step emits its accepted drafts and the target's token (the last step cut to
        # the requested length); the first token comes from prefill.
        # A chain step either drafts or copies from the context (never with lookup_min_match
        # 0); a tree step drafts and merges the copy in.
        copies = 0 if case["mode"] == "speculative-tree" else case["lookup_steps"]
        assert len(case["accepted"]) == case["calls"]["draft"] + copies
        assert case["lookup_steps"] == 0 or case["lookup_min_match"] > 0
        assert 1 + sum(a + 1 for a in case["accepted"]) >= len(case["tokens"])
        assert all(0 <= a <= case["num_draft_tokens"] for a in case["accepted"])


def test_some_steps_copy_from_the_context(name):
    """The goldens' prompts repeat a source text, so the lookup cases do copy: the Swift
    engine's copy of the rule is exercised in its decoding, not only in `lookups`."""
    copied = [case["lookup_steps"] for case in run_cases(name)
              if case["mode"] == "speculative-lookup"]
    assert copied and sum(copied) > 0
    drafted = [case["lookup_steps"] for case in run_cases(name) if case["mode"] == "speculative"]
    assert drafted and not any(drafted)


def test_the_demo_drafter_accepts_varying_numbers_of_drafts():
    accepted = [a for case in run_cases("demo") for a in case["accepted"]]
    assert len(set(accepted)) >= 3, accepted


def test_trace_starts_with_prefill_over_the_prompt(name):
    for case in run_cases(name):
        trace = case["trace"]
        leading = next(i for i, call in enumerate(trace) if call["function"] != "prefill")
        assert leading >= 1, case["name"]
        assert all(call["function"] != "prefill" for call in trace[leading:]), case["name"]
        covered = set()
        for call in trace[:leading]:
            covered.update(range(call["first_position"], call["first_position"] + call["length"]))
        assert trace[0]["first_position"] == 0
        assert set(range(len(case["prompt_ids"]))) <= covered, case["name"]


def test_rings_wrap_while_decoding(name):
    """Some case starts decode calls beyond every ring's capacity, from a prompt shorter than
    it, so both the target's sliding ring and the drafter's ring wrap while decoding."""
    golden = goldens(name)
    rings = {function: state["capacity"]
             for asset in golden["metadata"]["assets"].values()
             for state in asset["states"] if state["kind"] == "sliding_kv"
             for function in asset["functions"]}
    for function in ("main", "draft"):
        assert any(len(case["prompt_ids"]) < rings[function]
                   and any(call["function"] == function
                           and call["first_position"] >= rings[function]
                           for call in case["trace"])
                   for case in run_cases(name) if case["mode"] == "speculative"), function


def test_parity_records_cover_every_function(name):
    golden = goldens(name)
    counted = Counter(record["function"] for record in golden["parity"])
    assert all(counted[f] >= 2 for f in FUNCTIONS), counted
    cases = {case["name"]: case for case in run_cases(name)}
    assets = golden["metadata"]["assets"]
    for record in golden["parity"]:
        call = cases[record["case"]]["trace"][record["trace_index"]]
        assert call["function"] == record["function"]
        positions = decode_tensor(record["inputs"]["position_ids"])
        assert [int(positions[0]), positions.size] == [call["first_position"], call["length"]]
        asset = next(a for a in assets.values() if record["function"] in a["functions"])
        spec = asset["functions"][record["function"]]
        assert sorted(record["inputs"]) == sorted(spec["inputs"])
        assert set(spec["outputs"]) <= set(record["outputs"])
        assert sorted(record["states_before"]) == sorted(s["name"] for s in asset["states"])
        assert sorted(record["states_after"]) == sorted(record["states_before"])
    # At least one record per function starts from states something has written.
    for function in FUNCTIONS:
        assert any(any(decode_tensor(t).any() for t in r["states_before"].values())
                   for r in golden["parity"] if r["function"] == function), function


@cache
def interpreters(name):
    golden = goldens(name)
    path = GOLDENS[name][1] / golden["metadata"]["assets"]["target"]["path"]
    program = load_program(path)
    return {function: Interpreter(program, function) for function in FUNCTIONS}


def test_parity_records_reproduce_with_the_interpreter(name):
    # Bitwise. The BUILD runs this with the goldens' own OpenBLAS thread count: an interpreter
    # accumulating in fp32 gives results that depend on it in the last fp16 bit.
    made_with = goldens(name)["environment"]["OPENBLAS_NUM_THREADS"]
    threads = f"(goldens made with OPENBLAS_NUM_THREADS={made_with}, run with " \
              f"{os.environ.get('OPENBLAS_NUM_THREADS')})"
    for record in goldens(name)["parity"]:
        states = {k: decode_tensor(v) for k, v in record["states_before"].items()}
        inputs = {k: decode_tensor(v) for k, v in record["inputs"].items()}
        outputs = interpreters(name)[record["function"]].run(inputs, states)
        assert sorted(outputs) == sorted(record["outputs"]), record["label"]
        for key, tensor in record["outputs"].items():
            expected = decode_tensor(tensor)
            assert outputs[key].dtype == expected.dtype, (record["label"], key)
            np.testing.assert_array_equal(outputs[key], expected,
                                          err_msg=f"{record['label']} {threads}")
        for key, tensor in record["states_after"].items():
            np.testing.assert_array_equal(states[key], decode_tensor(tensor),
                                          err_msg=f"{record['label']} state {key} {threads}")


# --- The --kv-write slice bundles against the blend bundles' goldens -------------------------

SLICE_BUNDLES = {name: Path(os.environ.get(f"MUSEFLASH_{name.upper()}_SLICE_BUNDLE",
                                           f"tests/runtime/{name}_slice_bundle"))
                 for name in GOLDENS}


def position_indexed_writes(program, function):
    """slice_update ops of `function` whose begin is computed at run time."""
    return [op for op in program.functions[function].operations
            if op.op_type == "slice_update" and op.begin.val is None]


def test_slice_bundles_write_the_global_caches_by_position(name):
    blend = load_program(GOLDENS[name][1] / "target.mlpackage")
    sliced = load_program(SLICE_BUNDLES[name] / "target.mlpackage")
    metadata = json.loads((SLICE_BUNDLES[name] / "metadata.json").read_text())
    assert metadata["kv_write"] == "slice" and goldens(name)["metadata"]["kv_write"] == "blend"
    global_layers = metadata["target"]["layer_types"].count("full_attention")
    for function in ("main", "prefill"):
        assert not position_indexed_writes(blend, function)
        writes = position_indexed_writes(sliced, function)
        assert len(writes) == 2 * global_layers, function
        # Each writes one layer's T new rows, not a whole cache.
        length = query_lengths(goldens(name))[function]
        assert all(op.update.shape[2] == length for op in writes), function


def test_slice_bundles_reproduce_the_blend_parity_records(name):
    """Every function of the slice bundle gives the blend bundle's outputs and written states,
    bit for bit, on the inputs and states of every parity record."""
    program = load_program(SLICE_BUNDLES[name] / "target.mlpackage")
    runners = {function: Interpreter(program, function) for function in FUNCTIONS}
    for record in goldens(name)["parity"]:
        states = {k: decode_tensor(v) for k, v in record["states_before"].items()}
        inputs = {k: decode_tensor(v) for k, v in record["inputs"].items()}
        outputs = runners[record["function"]].run(inputs, states)
        for key, tensor in record["outputs"].items():
            np.testing.assert_array_equal(outputs[key], decode_tensor(tensor),
                                          err_msg=f"slice bundle: {record['label']} {key}")
        for key, tensor in record["states_after"].items():
            np.testing.assert_array_equal(states[key], decode_tensor(tensor),
                                          err_msg=f"slice bundle: {record['label']} {key}")


def test_slice_bundles_decode_the_blend_goldens_tokens(name):
    """The Python loop on the slice bundle: the ring-wrapping speculative cases (drafting,
    copying from the context, and tree steps) give the blend bundle's tokens, accepted drafts
    and call trace."""
    from museflash.runtime.speculative import (
        DEFAULT_LOOKUP_MIN_MATCH,
        load_exported_pair,
        speculative_generate,
    )
    from museflash.tools.runtime_goldens import Recorder

    golden = goldens(name)
    target, drafter, metadata = load_exported_pair(SLICE_BUNDLES[name])
    spec = metadata.speculative_decoding
    wrapping = max(len(case["prompt_ids"]) + case["max_new_tokens"] for case in run_cases(name)
                   if case["mode"] == "speculative")
    chosen = [case for case in run_cases(name) if case["mode"] != "target_only"
              and len(case["prompt_ids"]) + case["max_new_tokens"] == wrapping]
    assert {case["mode"] for case in chosen} == {"speculative", "speculative-lookup",
                                                 "speculative-tree"}
    recorder = Recorder([target.package, drafter.package])
    try:
        for case in chosen:
            recorder.start(capture=False)
            lookup = case["lookup_min_match"]
            assert lookup == (0 if case["mode"] == "speculative" else DEFAULT_LOOKUP_MIN_MATCH)
            result = speculative_generate(
                target, drafter, case["prompt_ids"], case["max_new_tokens"],
                mask_token_id=spec.mask_token_id, num_draft_tokens=spec.num_draft_tokens,
                context_length=metadata.context_length,
                pad_token_id=golden["prompt"]["pad_token_id"], lookup_min_match=lookup,
                tree_budget=case.get("tree_budget"))
            assert result.tokens == case["tokens"], case["name"]
            assert result.accepted == case["accepted"], case["name"]
            assert recorder.trace == case["trace"], case["name"]
    finally:
        recorder.close()
