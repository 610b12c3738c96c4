"""Steps that copy from the context (runtime/speculative.py's `lookup_proposal`).

The rule is checked against a plain re-statement of it on seeded contexts over small
vocabularies (many repeats, many ties), and the loop that uses it is checked where it matters:
on the README's example over the trained demo pair, where the target loops over a word it
invented and the drafter alone accepts little, copying must raise the tokens per `main` call
and replace drafts, while the output stays the target's own greedy output.
"""

import numpy as np
import pytest
import torch

from museflash.builtin.demo_checkpoint import TRAINED_DEMO_DIR
from museflash.runtime.speculative import (
    DEFAULT_LOOKUP_MIN_MATCH,
    LOOKUP_MAX_MATCH,
    LOOKUP_WINDOW,
    EagerDrafter,
    EagerTarget,
    eager_greedy_generate,
    lookup_proposal,
    speculative_generate,
)
from museflash.training import train_demo, train_demo_drafter

torch.set_num_threads(1)


def _reference(context, count, min_match):
    """The rule read literally: every earlier end position in the window, newest first, its
    match length with the context's end counted token by token; the first longest wins."""
    best, best_end = 0, None
    for end in range(len(context) - 2, max(-1, len(context) - 2 - LOOKUP_WINDOW), -1):
        length = 0
        while (length < LOOKUP_MAX_MATCH and end - length >= 0
               and context[end - length] == context[len(context) - 1 - length]):
            length += 1
        if length > best:
            best, best_end = length, end
    if best < min_match:
        return None
    out = list(context)
    for index in range(count):
        out.append(out[best_end + 1 + index])
    return out[len(context):]


@pytest.mark.parametrize("vocab", [2, 3, 8, 50])
@pytest.mark.parametrize("min_match", [1, 2, 3, 5])
def test_the_proposal_follows_the_rule_on_seeded_contexts(vocab, min_match):
    rng = np.random.default_rng(vocab * 10 + min_match)
    found = 0
    for _ in range(200):
        context = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        if rng.random() < 0.5:  # end on a copy of an earlier piece, as a loop does
            start = int(rng.integers(0, len(context)))
            context += context[start:start + int(rng.integers(1, 12))]
        count = int(rng.integers(1, 12))
        expected = _reference(context, count, min_match)
        assert lookup_proposal(context, count, min_match) == expected, (context, count)
        found += expected is not None
    assert found > 20  # the contexts do repeat


def test_ids_whose_bytes_overlap_are_matched_as_whole_ids():
    """lookup_proposal searches the ids' bytes; ids whose 8-byte encodings hold each other's
    bytes at other offsets (0, 1, 256, 2^48, ...) must still match id for id."""
    rng = np.random.default_rng(12)
    ids = [0, 1, 256, 257, 65536, 1 << 48, 1 << 56]
    found = 0
    for _ in range(400):
        context = [ids[i] for i in rng.integers(0, len(ids), int(rng.integers(2, 60)))]
        for min_match in (1, 2, 4):
            expected = _reference(context, 3, min_match)
            assert lookup_proposal(context, 3, min_match) == expected, (context, min_match)
            found += expected is not None
    assert found > 100


def test_the_proposal_follows_the_rule_beyond_the_window():
    """Contexts longer than the window: occurrences before its newest LOOKUP_WINDOW positions
    are not looked at, whatever they match."""
    rng = np.random.default_rng(11)
    found = 0
    for _ in range(40):
        context = rng.integers(0, 4, int(rng.integers(LOOKUP_WINDOW, 2 * LOOKUP_WINDOW))).tolist()
        for min_match in (1, 3, 6):
            expected = _reference(context, 5, min_match)
            assert lookup_proposal(context, 5, min_match) == expected
            found += expected is not None
    assert found > 40


def test_a_loop_repeats_with_its_period_and_the_latest_longest_match_wins():
    # "a b c" loops; the proposal continues it past the end of the context.
    assert lookup_proposal([9, 1, 2, 3, 1, 2, 3, 1, 2], 7, 2) == [3, 1, 2, 3, 1, 2, 3]
    # Two earlier "5 6": the one after "4 5 6" matches three tokens, so it wins over the
    # newer one (two tokens), and its continuation 7 is proposed.
    assert lookup_proposal([4, 5, 6, 7, 0, 5, 6, 8, 4, 5, 6], 1, 2) == [7]
    # Equally long matches: the newest one's continuation.
    assert lookup_proposal([5, 6, 1, 5, 6, 2, 5, 6], 1, 2) == [2]
    # Nothing seen before, or too short a match.
    assert lookup_proposal([1, 2, 3, 4], 3, 1) is None
    assert lookup_proposal([1, 2, 3, 9, 2, 3], 3, 3) is None
    assert lookup_proposal([1, 2, 3, 9, 2, 3], 3, 2) == [9, 2, 3]
    assert lookup_proposal([7], 2, 1) is None


def test_occurrences_older_than_the_window_are_not_looked_at():
    head = [1, 2, 3, 4]
    filler = list(range(10, 10 + LOOKUP_WINDOW))  # no repeats in the window
    assert lookup_proposal(head + filler[:-5] + [1, 2, 3], 1, 3) == [4]
    assert lookup_proposal(head + filler + [1, 2, 3], 1, 3) is None


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="min_match >= 1"):
        lookup_proposal([1, 1, 1], 2, 0)
    with pytest.raises(ValueError, match="count >= 1"):
        lookup_proposal([1, 1, 1], 0, 2)


@pytest.fixture(scope="module")
def demo_pair():
    target, drafter = train_demo_drafter.load_pair(TRAINED_DEMO_DIR / "target",
                                                    TRAINED_DEMO_DIR / "drafter",
                                                    max_context=256)
    tokenizer = train_demo.load_tokenizer(TRAINED_DEMO_DIR / "target")
    return target, drafter, tokenizer


def test_copying_pays_on_the_readme_example(demo_pair):
    """The default export's block (7 drafts + the anchor), the README's prompt, greedy."""
    target, drafter, tokenizer = demo_pair
    block, new_tokens = 8, 64
    prompt = [1] + tokenizer.encode("def fibonacci(n):", add_special_tokens=False).ids
    expected = eager_greedy_generate(target, prompt, new_tokens)
    runs = {}
    for min_match in (0, DEFAULT_LOOKUP_MIN_MATCH):
        runs[min_match] = speculative_generate(
            EagerTarget(target, prefill_length=len(prompt), verify_length=block),
            EagerDrafter(drafter, block_size=block), prompt, new_tokens, mask_token_id=3,
            lookup_min_match=min_match)
        assert runs[min_match].tokens == expected
    drafted, copying = runs[0], runs[DEFAULT_LOOKUP_MIN_MATCH]
    print(f"drafts only: {drafted.summary()}\nwith lookup: {copying.summary()}")
    assert drafted.lookup_steps == 0 and drafted.draft_calls == len(drafted.accepted)
    assert copying.lookup_steps > 0
    assert copying.draft_calls == len(copying.accepted) - copying.lookup_steps
    # Measured: 1.80 tokens per main call drafting alone, 3.00 with the default lookup (2).
    assert copying.tokens_per_verify_call > 1.3 * drafted.tokens_per_verify_call
    assert copying.lookup_mean_accepted_length > drafted.mean_accepted_length
