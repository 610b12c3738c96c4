"""Token trees (runtime/tree.py): best-first building within a budget from each source, the
ancestor mask and its refusals, and greedy acceptance."""

import itertools
import math

import numpy as np
import pytest

from museflash.runtime.tree import (
    RecycledTable,
    Source,
    TokenTree,
    TreeError,
    accept_greedy,
    build_tree,
    check_ancestor_mask,
    mask_parents,
    top_log_probabilities,
)


def log_softmax(row):
    row = np.asarray(row, np.float64)
    return row - row.max() - math.log(np.exp(row - row.max()).sum())


def paths(tree: TokenTree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.tokens[n]) for n in tree.path(node)) for node in range(len(tree))]


def test_drafter_tree_is_the_budgets_likeliest_paths():
    """Every path of up to 3 rows' top-4 tokens, scored by its product of row probabilities:
    the tree holds exactly the budget's best, each reached once, parents first."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, (3, 20))
    top = [top_log_probabilities(row, 4) for row in logits]
    scored = {}
    for depth in range(1, 4):
        for choice in itertools.product(range(4), repeat=depth):
            path = tuple(int(top[d][0][c]) for d, c in enumerate(choice))
            scored[path] = sum(float(top[d][1][c]) for d, c in enumerate(choice))
    for budget in (1, 2, 5, 12, 30):
        tree = build_tree(5, budget, draft_logits=logits, draft_top_k=4)
        best = sorted(scored, key=lambda p: -scored[p])[:budget - 1]
        assert len(tree) == budget
        assert sorted(paths(tree)[1:]) == sorted(best)
        assert len(set(paths(tree))) == budget
        assert all(tree.parents[n] < n for n in range(1, budget))
        assert set(tree.sources[1:].tolist()) <= {Source.DRAFTER}


def test_an_edge_two_sources_propose_is_one_node_from_the_likelier():
    logits = np.full((2, 10), -10.0)
    logits[0, 3], logits[1, 4] = 0.0, 0.0  # the drafter: 3 then 4, almost surely
    tree = build_tree(1, 4, draft_logits=logits, lookup=[3, 7], lookup_probability=0.5)
    by_path = dict(zip(paths(tree), tree.sources.tolist(), strict=True))
    assert by_path[(3,)] == Source.DRAFTER  # proposed by both: once, from the drafter
    assert by_path[(3, 4)] == Source.DRAFTER
    assert by_path[(3, 7)] == Source.LOOKUP  # lookup goes on below the shared node
    assert len(tree) == 4


def test_lookup_alone_is_its_chain_within_the_budget():
    tree = build_tree(9, 3, lookup=[4, 5, 6])
    assert tree.tokens.tolist() == [9, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.sources.tolist() == [Source.ROOT, Source.LOOKUP, Source.LOOKUP]


def test_recycled_tree_follows_the_targets_remembered_choices():
    vocab = 12
    table = RecycledTable(top_k=2)
    rows = np.full((2, vocab), -5.0)
    rows[0, [2, 3]] = [2.0, 1.0]  # after token 1: 2, then 3
    rows[1, [1, 8]] = [3.0, 0.0]  # after token 2: 1, then 8
    table.update([1, 2], rows)
    tree = build_tree(1, 4, recycled=table, max_depth=3, recycled_weight=1.0)
    assert paths(tree)[1:3] == [(2,), (2, 1)]  # the likeliest path first
    assert {p for p in paths(tree)[3:]} <= {(3,), (2, 1, 2)}
    # Discounted, each edge the table gives costs its weight: the second child of the root
    # (one edge) now outscores the grandchild (two).
    assert paths(build_tree(1, 4, recycled=table, max_depth=3, recycled_weight=0.3))[1:3] == [
        (2,), (3,)]
    np.testing.assert_allclose(table.successors(1)[1], log_softmax(rows[0])[[2, 3]])
    assert len(table.successors(5)[0]) == 0


def test_depth_is_bounded():
    logits = np.zeros((2, 3))
    tree = build_tree(0, 50, draft_logits=logits)
    assert tree.depths().max() == 2
    assert len(tree) == 1 + 3 + 9


def test_ancestor_mask_is_a_tree_and_gives_its_parents_back():
    tree = TokenTree(np.array([0, 1, 2, 3, 4, 5], np.int32),
                     np.array([-1, 0, 0, 1, 3, 2], np.int32), np.zeros(6, np.int8))
    mask = tree.ancestor_mask()
    assert mask.tolist()[4] == [True, True, False, True, True, False]
    check_ancestor_mask(mask)
    assert mask_parents(mask).tolist() == tree.parents.tolist()


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.__setitem__((3, 2), True), "its parent"),  # node 3 sees node 1's sibling
    (lambda m: m.__setitem__((1, 4), True), "later node"),
    (lambda m: m.__setitem__((2, 0), False), "root"),
    (lambda m: m.__setitem__((5, 5), False), "itself"),
])
def test_a_mask_that_is_not_a_tree_is_refused(edit, words):
    tree = TokenTree(np.arange(6, dtype=np.int32), np.array([-1, 0, 0, 1, 3, 2], np.int32),
                     np.zeros(6, np.int8))
    mask = tree.ancestor_mask()
    edit(mask)
    with pytest.raises(TreeError, match=words):
        check_ancestor_mask(mask)


def test_a_node_before_its_parent_is_refused():
    with pytest.raises(TreeError, match="earlier node"):
        TokenTree(np.arange(3, dtype=np.int32), np.array([-1, 2, 0], np.int32),
                  np.zeros(3, np.int8))


def test_greedy_acceptance_walks_the_targets_choices():
    # root 7 -> {1: node 1, 2: node 2}; node 1 -> 3 (node 3); node 3 -> 4 (node 4)
    tree = TokenTree(np.array([7, 1, 2, 3, 4], np.int32), np.array([-1, 0, 0, 1, 3], np.int32),
                     np.zeros(5, np.int8))
    assert accept_greedy(tree, [1, 3, 9, 4, 6]) == ([1, 3, 4], 6)
    assert accept_greedy(tree, [2, 3, 5, 4, 6]) == ([2], 5)
    assert accept_greedy(tree, [8, 3, 5, 4, 6]) == ([], 8)
    with pytest.raises(TreeError):
        accept_greedy(tree, [1, 2])


def test_a_chain_accepts_what_the_chain_loop_accepts():
    """The width-1 tree gives the chain rule: drafts accepted while each equals the target's
    argmax at the row before it, then the target's token."""
    drafts = [5, 6, 2]
    tree = TokenTree.chain(4, drafts)
    for choices in ([5, 6, 2, 9], [5, 6, 1, 9], [3, 6, 2, 9]):
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        path, token = accept_greedy(tree, choices)
        assert len(path) == accepted and token == choices[accepted]
