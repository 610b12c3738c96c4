"""Tree verification in the Python loop (docs/trees.md): greedy tree decoding gives exactly the
target's own greedy tokens, through every context bucket, with the rings wrapping and across a
chat session; a chain through the `tree` function is `main`; and a wrong mask or a missed
compaction is caught by that comparison.

The bundles: //tests/runtime:compressed_bundle (the trained demo pair in 4-bit at capacity 256
with buckets 64 and 128, its drafter accepted often enough that tree paths leave the first
child, so rows are moved) and //tests/runtime:dflash2_bundle (the tiny target with a random
DFlash2 drafter)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from prebuilt import DFLASH2_BUNDLE

from museflash.bundle import StateKind
from museflash.runtime import speculative, tree
from museflash.runtime.speculative import (
    DecodeSession,
    load_exported_pair,
    speculative_generate,
    target_only_generate,
)
from museflash.runtime.tree import TokenTree, TreeError

DEMO_BUNDLE = "MUSEFLASH_DEMO_4BIT_BUNDLE"


@pytest.fixture(scope="module")
def demo():
    return load_exported_pair(os.environ[DEMO_BUNDLE])


@pytest.fixture(scope="module")
def dflash2():
    return load_exported_pair(os.environ[DFLASH2_BUNDLE])


def demo_prompt(metadata, length: int) -> list[int]:
    """Ids of the demo's own kind of text: the tokenizer over Python source, so the drafter's
    drafts are accepted at realistic rates."""
    from tokenizers import Tokenizer

    from museflash.tools.runtime_goldens import PROMPT_TEXT

    path = os.path.join(os.environ[DEMO_BUNDLE], "tokenizer.json")
    ids = Tokenizer.from_file(path).encode(PROMPT_TEXT * 4).ids
    return ids[:length]


def decode(pair, prompt, new_tokens, budget, **kwargs):
    target, drafter, metadata = pair
    return speculative_generate(target, drafter, prompt, new_tokens,
                                mask_token_id=metadata.speculative_decoding.mask_token_id,
                                context_length=metadata.context_length, tree_budget=budget,
                                **kwargs)


def test_tree_decoding_is_the_targets_greedy_output(demo):
    """Prompts in each bucket, one decoding past the sliding ring's capacity; budgets from the
    tree function's size down to 2; lookup candidates merged in."""
    target, _, metadata = demo
    ring = target.package.asset.capacity(StateKind.SLIDING_KV)
    moved = gained = 0
    for length, new_tokens in ((9, 40), (70, 50), (130, 110)):
        prompt = demo_prompt(metadata, length)
        expected = target_only_generate(target, prompt, new_tokens).tokens
        for budget in (target.tree_length, 3):
            result = decode(demo, prompt, new_tokens, budget)
            assert result.tokens == expected, (length, budget)
            assert result.tree_calls > 0 and result.verify_calls <= 1  # 1: a short prompt
            moved += result.moved_rows
            gained += result.tokens_per_verify_call > 1.5
    assert 130 + 110 > ring  # the last decodes wrapped the ring
    assert moved > 0, "no accepted path left the first child: compaction went unexercised"
    assert gained >= 4, "drafts were rarely accepted: the comparison saw little of the tree"
    ran = set(target.package.ran)
    assert {"tree_64", "tree_128", "tree"} <= ran


def test_tree_decoding_with_a_dflash2_drafter(dflash2):
    target, _, metadata = dflash2
    prompt = list(np.random.default_rng(5).integers(0, metadata.vocab_size, 60))
    expected = target_only_generate(target, prompt, 40).tokens
    assert decode(dflash2, prompt, 40, target.tree_length).tokens == expected


def test_a_chat_session_keeps_its_caches_through_tree_steps(demo):
    target, drafter, metadata = demo
    session = DecodeSession(target, drafter,
                            mask_token_id=metadata.speculative_decoding.mask_token_id,
                            context_length=metadata.context_length,
                            tree_budget=target.tree_length)
    history = demo_prompt(metadata, 20)
    for turn in range(3):
        result = session.generate(history, 24)
        assert result.reused_tokens == (0 if turn == 0 else len(history) - 4 - 1)
        assert result.tokens == target_only_generate(target, history, 24).tokens
        history = history + result.tokens + demo_prompt(metadata, 4)


def test_a_chain_through_tree_is_main(demo):
    """Width 1: the tree function with a chain's mask computes main's logits, features and
    cache rows, bit for bit in the interpreter."""
    target, _, metadata = demo
    prompt = demo_prompt(metadata, 40)
    target_only_generate(target, prompt, 4)
    saved = {name: state.copy() for name, state in target.package.states.items()}
    ids = np.array(prompt[:target.verify_length], np.int32)
    positions = np.arange(44, 44 + target.verify_length, dtype=np.int32)
    logits, features = target.verify(ids, positions)
    after_main = {name: state.copy() for name, state in target.package.states.items()}
    for name, state in saved.items():
        target.package.states[name][...] = state
    chain = TokenTree.chain(int(ids[0]), ids[1:].tolist())
    assert target.tree_length == target.verify_length
    tree_logits, tree_features = target.verify_tree(ids, positions,
                                                    chain.ancestor_mask().astype(np.int32))
    np.testing.assert_array_equal(tree_logits, logits)
    np.testing.assert_array_equal(tree_features, features)
    for name, state in after_main.items():
        np.testing.assert_array_equal(target.package.states[name], state, err_msg=name)


def _differs_somewhere(pair, budget) -> bool:
    target, _, metadata = pair
    for length, new_tokens in ((9, 40), (70, 50)):
        prompt = demo_prompt(metadata, length)
        expected = target_only_generate(target, prompt, new_tokens).tokens
        if decode(pair, prompt, new_tokens, budget).tokens != expected:
            return True
    return False


def test_a_mask_that_lets_a_node_see_its_sibling_is_caught(demo, monkeypatch):
    real = speculative.tree_call_inputs

    def seeing_siblings(tree_, nodes, base, pad):
        # The causal mask of a chain over the tree's nodes: each node sees every earlier one,
        # its elder siblings and their subtrees among them.
        ids, positions, mask = real(tree_, nodes, base, pad)
        count = len(tree_)
        mask[:count, :count] = np.tril(np.ones((count, count), np.int32))
        return ids, positions, mask

    monkeypatch.setattr(speculative, "tree_call_inputs", seeing_siblings)
    monkeypatch.setattr(speculative, "check_ancestor_mask", lambda mask: None)
    assert _differs_somewhere(demo, demo[0].tree_length)


def test_a_path_copied_one_slot_off_is_caught(demo, monkeypatch):
    real = tree.compact_tree_rows

    def one_off(states, base, path):
        real(states, base + 1, path)

    monkeypatch.setattr(speculative, "compact_tree_rows", one_off)
    assert _differs_somewhere(demo, demo[0].tree_length)


def test_a_missed_compaction_is_caught(demo, monkeypatch):
    monkeypatch.setattr(speculative, "compact_tree_rows", lambda states, base, path: None)
    assert _differs_somewhere(demo, demo[0].tree_length)


def test_tree_budgets_a_bundle_cannot_take_are_refused(demo, dflash2):
    target, drafter, metadata = demo
    with pytest.raises(ValueError, match=f"takes {target.tree_length} nodes"):
        decode(demo, [1, 2, 3], 4, target.tree_length + 1)
    from museflash.runtime.sampling import Sampling

    # Sampled trees run on the exported functions (their distribution: test_sampling.py).
    sampled = decode(demo, [1, 2, 3], 12, 3, sampling=Sampling(temperature=0.8),
                     rng=np.random.default_rng(0))
    assert len(sampled.tokens) == 12 and sampled.tree_calls == len(sampled.accepted) > 0
    untreed = speculative.EagerTarget(None, 8, 8)
    with pytest.raises(ValueError, match="--dflash-drafter adds one"):
        speculative.check_tree_budget(4, untreed, drafter, False)
    nodes = target.tree_length
    parents = np.array([-1, 0, 0, 2] + [0] * (nodes - 4), np.int32)
    bad = TokenTree(np.zeros(nodes, np.int32), parents, np.zeros(nodes, np.int8)) \
        .ancestor_mask().astype(np.int32)
    bad[3, 1] = 1  # node 3 (below node 2) also sees node 2's sibling
    with pytest.raises(TreeError, match="row 3 sees nodes its parent, 2, does not"):
        target.verify_tree(np.zeros(nodes, np.int32), np.arange(nodes, dtype=np.int32), bad)
