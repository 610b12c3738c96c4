"""Greedy speculative decoding over an exported bundle is lossless.

The module exports the tiny target once, over its first four layers (losslessness does not
depend on depth), with a drafter fitted (a short self-distillation run of
training/train_demo_drafter on these prompts' own target continuations) so that drafts are
actually accepted, partly and fully, and the rollback paths of the loop are exercised. The
untrained demo drafter accepts almost nothing, which would make "lossless" vacuous. The
exported pair is loaded once (`pair`): every decode starts from zeroed states.
"""

import shutil

import numpy as np
import pytest
import torch
from package_surgery import swap_blobs

from museflash.builtin.demo_checkpoint import shallow_tiny_pair_configs, write_tiny_checkpoints
from museflash.bundle import FunctionName, Metadata
from museflash.checkpoint.load import load_target
from museflash.checks.verify import check_target, load_reference_models
from museflash.export.options import ExportOptions
from museflash.export.pipeline import export_bundle
from museflash.export.progress import Progress
from museflash.runtime.speculative import (
    chunk_starts,
    eager_greedy_generate,
    greedy_generate,
    load_exported_pair,
    speculative_generate,
)
from museflash.training import distil_corpus as distil
from museflash.training import train_demo_drafter as trainer

ct = pytest.importorskip("coremltools")

NEW_TOKENS = 20
FITTED_LENGTH = 30
PROMPT_LENGTHS = (8, 13, 21)  # one prefill chunk exactly, an overlapping last chunk, three


def _prompts():
    rng = np.random.default_rng(11)
    prompts = []
    for length in PROMPT_LENGTHS:
        tokens = rng.integers(0, 511, length)  # 511 is the mask token
        prompts.append(tokens.tolist())
    return prompts


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    work = tmp_path_factory.mktemp("speculative")
    target_config, drafter_config = shallow_tiny_pair_configs()
    target_dir, drafter_dir = write_tiny_checkpoints(work / "demo", target_config=target_config,
                                                     drafter_config=drafter_config)
    torch.manual_seed(0)
    target, drafter = distil.load_pair(target_dir, drafter_dir)
    # Continuations fitted only up to position 30: the longer prompts run past what the drafter
    # memorised, so rejections follow full acceptances.
    corpus = distil.generate_corpus(target, _prompts(), FITTED_LENGTH)
    trainer.train(target, drafter, corpus, steps=150, seconds=None, batch=32, log=lambda _: None)
    fitted = trainer.write_drafter(target, drafter, drafter_dir, work / "fitted", block_size=4)
    out = work / "bundle"
    export_bundle(ExportOptions(output_dir=out, checkpoint=target_dir, drafter_checkpoint=fitted,
                                fused_target=True, dflash_drafter=True, max_context_length=64,
                                prefill_length=8, conversion_processes=1),
                  Progress(echo=lambda _: None))
    return {"dir": out, "work": work, "target_dir": target_dir, "drafter_dir": fitted}


@pytest.fixture(scope="module")
def pair(bundle):
    """The bundle's exported target and drafter, loaded once: loading a package costs seconds,
    and speculative_generate and greedy_generate each start from zeroed states."""
    return load_exported_pair(bundle["dir"])


def _run(pair, prompt):
    target, drafter, metadata = pair
    spec = metadata.speculative_decoding
    speculative = speculative_generate(target, drafter, prompt, NEW_TOKENS,
                                       mask_token_id=spec.mask_token_id,
                                       num_draft_tokens=spec.num_draft_tokens,
                                       context_length=metadata.context_length)
    plain = greedy_generate(target, prompt, NEW_TOKENS, context_length=metadata.context_length)
    return speculative, plain


def test_chunk_starts_overlap_instead_of_running_past_the_end():
    assert chunk_starts(8, 8) == [0]
    assert chunk_starts(13, 8) == [0, 5]
    assert chunk_starts(21, 4) == [0, 4, 8, 12, 16, 17]
    with pytest.raises(ValueError, match="cannot fill"):
        chunk_starts(3, 4)


def test_speculative_equals_target_only_greedy(bundle, pair):
    eager_target = load_target(bundle["target_dir"], dtype=torch.float32, max_context=64,
                               max_query_len=32, cache_dtype=torch.float32)
    accepted = []
    for prompt in _prompts():
        speculative, plain = _run(pair, prompt)
        assert speculative.tokens == plain.tokens, (len(prompt), speculative.tokens, plain.tokens)
        assert len(speculative.tokens) == NEW_TOKENS
        # The target alone steps one token a call through decode.
        assert speculative.verify_calls < plain.decode_calls and plain.verify_calls <= 1
        accepted.extend(speculative.accepted)
        eager = eager_greedy_generate(eager_target, prompt, NEW_TOKENS)
        same = sum(a == b for a, b in zip(eager, plain.tokens, strict=True))
        print(f"prompt {len(prompt)}: {speculative.summary()}; eager fp32 greedy agrees on "
              f"{same}/{NEW_TOKENS} tokens (informational)")
    print(f"accepted per step: {accepted}")
    # Full acceptances and rejections both happened, so the rollback path ran.
    assert max(accepted) == 3 and min(accepted) < 3, accepted


def test_broken_drafter_is_still_lossless_but_accepts_less(bundle, pair, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(bundle["dir"], broken)
    # The drafter's functions only: the package is the target's too.
    swap_blobs(broken / "target.mlpackage",
               [(f"layers_{i}_self_attn_k_proj_weight", f"layers_{i}_self_attn_v_proj_weight")
                for i in (0, 1)] + [("layers_0_mlp_gate_proj_weight",
                                     "layers_0_mlp_up_proj_weight")],
               functions=("inject_kv", "draft"))
    broken_pair = load_exported_pair(broken)
    good_total = broken_total = 0
    for prompt in _prompts():
        good, _ = _run(pair, prompt)
        bad, plain = _run(broken_pair, prompt)
        assert bad.tokens == plain.tokens
        good_total += sum(good.accepted)
        broken_total += sum(bad.accepted)
        print(f"prompt {len(prompt)}: fitted {good.acceptance_rate:.2f}, "
              f"broken {bad.acceptance_rate:.2f}")
    assert broken_total < good_total / 2, (broken_total, good_total)


def test_broken_target_export_is_caught_by_parity(bundle, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(bundle["dir"], broken)
    swap_blobs(broken / "target.mlpackage",
                [("layers_1_self_attn_k_proj_weight", "layers_1_self_attn_v_proj_weight")])

    metadata = Metadata.read(broken)
    target, _ = load_reference_models(metadata, bundle["target_dir"], bundle["drafter_dir"])
    intact = check_target(bundle["dir"], metadata, target, FunctionName.MAIN, "forward", seed=1)
    assert intact.ok, intact.line()
    result = check_target(broken, metadata, target, FunctionName.MAIN, "forward", seed=1)
    print(result.line())
    assert not result.ok
    assert result.outputs["logits"].max_rel > 0.1


# Top-two logit gaps below this are near-ties: about five fp16 ulps at the random pair's logit
# scale of 2 (a gap of 0.0025 once flipped the fourth token of a 4-token prompt).
NEAR_TIE = 1e-2


def _eager_greedy_with_margins(target, prompt: list[int], count: int):
    """fp32 greedy tokens from a full forward per step, and each step's top-two logit gap."""
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(count):
            top = torch.topk(target.batch_logits(torch.tensor([ids]))[0, -1].double(), 2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], margins


def test_prompts_shorter_than_a_chunk_or_a_block_decode_exactly(bundle, pair):
    """Prompts of 1 to 7 tokens (prefill chunk 8, block 4): the padded prefill and the
    placeholder inject rows must not change a single token."""
    eager_target = load_target(bundle["target_dir"], dtype=torch.float32, max_context=64,
                               max_query_len=32, cache_dtype=torch.float32)
    rng = np.random.default_rng(5)
    for length in (1, 3, 4, 7):
        prompt = rng.integers(0, 511, length).tolist()
        speculative, plain = _run(pair, prompt)
        assert speculative.tokens == plain.tokens, (length, speculative.tokens, plain.tokens)
        assert len(plain.tokens) == NEW_TOKENS
        eager, margins = _eager_greedy_with_margins(eager_target, prompt, 4)
        # fp16 export against fp32 eager: the first tokens agree whatever the prompt length
        # (a wrong position or a pad row leaking into attention changes them at once), up to
        # the first near-tie of fp32's top two logits, which fp16 cannot resolve.
        exact = next((i for i, margin in enumerate(margins) if margin < NEAR_TIE), len(eager))
        assert exact >= 2, (length, margins)
        assert plain.tokens[:exact] == eager[:exact], (length, plain.tokens, eager)


def test_empty_and_too_long_prompts_are_refused(pair):
    target, drafter, _ = pair
    with pytest.raises(ValueError, match="the prompt is empty"):
        speculative_generate(target, drafter, [], 4, mask_token_id=511)
    with pytest.raises(ValueError, match="context_length 64"):
        speculative_generate(target, drafter, list(range(40)), 30, mask_token_id=511,
                             context_length=64)
