"""Sampled speculative decoding has the target's own distribution, checked statistically.

The loop runs over numpy stand-ins: a Markov target on a 6-token vocabulary (the next token's
logits depend only on the previous token) and drafters that see only the anchor, one close to
the target and one deliberately wrong. Because the target is Markov, the exact distribution of
every generated token given the previous one is known: P = the target's logits row after
temperature and top-p, computed here independently of runtime/sampling.py.

The bound. Let x_0 be the last prompt token and x_1..x_N the output. If the loop is exact,
P(x_t = b | everything before) = P[x_{t-1}, b], so for any token b

    D_b = sum_t (1[x_t = b] - P[x_{t-1}, b])

is a sum of martingale differences with conditional variances P[x_{t-1}, b](1 - P[...]) <= 1/4,
whatever the dependence between steps. Its variance is sigma_b^2 = sum_t P(1 - P) (taken along
the run, as the martingale CLT allows) and D_b / sigma_b is approximately standard normal. The
same holds per context a, summing only over t with x_{t-1} = a (n_a P(1 - P) variance). The test
requires |D| <= Z sigma for all 6 pooled and 36 per-context statistics, Z = 4.5: a correct
sampler crosses one of the 42 with probability about 42 * 6.8e-6 = 3e-4 (and the seeds are fixed).
A sampler that gives one token 1% more probability at every step shifts that token's D_b by
0.01 N. With N = 100k and sigma_b^2 = N v_b, where v_b, the mean of P(1 - P) for token b along
the chain, is at most 0.142 for this target (sigma_b <= 120), the shift of 1000 exceeds
Z sigma_b <= 540 by more than 3 sigma_b, so such a bias is detected; every run asserts this
margin, 0.01 N >= (Z + 3) sigma_b, for every token. (Without knowing v_b, v_b <= 1/4 would
need N >= ((Z + 3) / (2 * 0.01))^2 = 141k.) The per-context statistics only resolve biases of
~2-3%, as each context sees ~N/6 tokens. test_a_one_percent_bias_is_detected runs such a
sampler; test_always_accepting_is_detected replaces the min(1, p/q) rule by "always accept".
"""

import math

import numpy as np
import pytest

from museflash.bundle import FunctionName
from museflash.runtime import speculative
from museflash.runtime.sampling import Sampling, accept_drafts, probabilities, sample
from museflash.runtime.speculative import (
    Drafted,
    greedy_generate,
    speculative_generate,
    target_only_generate,
)

VOCAB = 6
BLOCK = 4  # drafter block and target verify length: 3 drafted tokens per step
PROMPT = [0, 1, 2, 3]
MASK = VOCAB  # never looked at by the stand-ins
TOKENS = 100_000  # per configuration, see the bound above
Z = 4.5
BIAS = 0.01


# --- Stand-in backends (satisfy speculative.Target / speculative.Drafter) --------------------


class MarkovTarget:
    prefill_length = BLOCK
    verify_length = BLOCK
    step_length = BLOCK  # no one-token decode: target-alone steps go through main
    step_function = FunctionName.MAIN

    def __init__(self, logits: np.ndarray, tree_length: int = 0):
        self.logits = logits  # [previous token, vocab]
        self.tree_length = tree_length

    def verify_tree(self, ids, positions, mask):
        # A Markov row depends on the node's own token alone, whatever its ancestors are.
        return self.logits[ids], np.zeros((len(ids), 1))

    def compact(self, base, path) -> None:
        pass

    def prefill(self, ids, positions):
        return self.logits[ids[-1]], np.zeros((len(ids), 1))

    def verify(self, ids, positions):
        return self.logits[ids], np.zeros((len(ids), 1))

    step = verify

    def reset(self) -> None:
        pass


class AnchorDrafter:
    """Drafts all positions at once from the anchor alone, like DFlash from its context."""

    block_size = BLOCK

    def __init__(self, table: np.ndarray):
        self.table = table  # [anchor, block, vocab]; row 0 (the anchor's own slot) unused

    def inject(self, features, positions) -> None:
        pass

    def draft(self, ids, positions):
        return Drafted(self.table[ids[0]])

    def reset(self) -> None:
        pass


def _target_logits() -> np.ndarray:
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.0, (VOCAB, VOCAB))
    logits[np.arange(VOCAB), (np.arange(VOCAB) + 1) % VOCAB] += 2.0  # a likely successor
    return logits


LOGITS = _target_logits()


def _drafter(kind: str) -> AnchorDrafter:
    """close: position j guesses the target's row for the likely path anchor+1, anchor+2, ...
    (exact at j = 1 up to small noise); wrong: the same rows negated, so the drafter prefers
    what the target finds least likely."""
    noise = np.random.default_rng(1).normal(0.0, 0.1, (VOCAB, BLOCK, VOCAB))
    table = np.zeros((VOCAB, BLOCK, VOCAB))
    for anchor in range(VOCAB):
        for j in range(1, BLOCK):
            row = LOGITS[(anchor + j - 1) % VOCAB]
            table[anchor, j] = row + noise[anchor, j] if kind == "close" else -row
    return AnchorDrafter(table)


def _reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Temperature softmax then nucleus, row by row in plain Python (independent of sampling.py)."""
    out = np.zeros_like(logits)
    for a, row in enumerate(logits):
        weights = [math.exp((v - max(row)) / temperature) for v in row]
        probs = [w / sum(weights) for w in weights]
        kept, mass = [], 0.0
        for token in sorted(range(len(row)), key=lambda t: (-probs[t], t)):
            if mass >= top_p:
                break
            kept.append(token)
            mass += probs[token]
        for token in kept:
            out[a, token] = probs[token] / mass
    return out


# --- The statistic ---------------------------------------------------------------------------


def _violations(tokens: list[int], exact: np.ndarray) -> list[str]:
    """The pooled and per-context statistics of the docstring that exceed Z sigma."""
    nxt = np.asarray(tokens)
    prev = np.concatenate([[PROMPT[-1]], nxt[:-1]])
    variance = exact * (1 - exact)
    found = []
    pooled = np.bincount(nxt, minlength=VOCAB) - exact[prev].sum(0)
    pooled_sigma = np.sqrt(variance[prev].sum(0))
    for b in range(VOCAB):
        if abs(pooled[b]) > Z * pooled_sigma[b] + 1e-6:
            found.append(f"token {b}: D = {pooled[b]:.0f}, sigma {pooled_sigma[b]:.0f}")
    counts = np.bincount(prev * VOCAB + nxt, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    visits = np.bincount(prev, minlength=VOCAB)[:, None]
    cell = counts - visits * exact
    cell_sigma = np.sqrt(visits * variance)
    for a, b in zip(*np.nonzero(np.abs(cell) > Z * cell_sigma + 1e-6), strict=True):
        found.append(f"{a} -> {b}: {counts[a, b]}/{visits[a, 0]}, expected {exact[a, b]:.4f}")
    return found


def _pooled_sigma(tokens: list[int], exact: np.ndarray) -> np.ndarray:
    prev = np.concatenate([[PROMPT[-1]], np.asarray(tokens)[:-1]])
    return np.sqrt((exact * (1 - exact))[prev].sum(0))


TREE_NODES = 8  # more than the vocabulary: nodes have several children


def _run(drafter: str, settings: Sampling, seed: int = 0, tokens: int = TOKENS,
         tree: bool = False):
    """drafter "close" or "wrong" drafts every step; "wrong+lookup" is "wrong" whose steps
    copy from the context when its last 2 tokens occurred before (nearly every step here).
    `tree`: every step verifies a sampled tree of TREE_NODES nodes (docs/trees.md)."""
    kind, _, lookup = drafter.partition("+")
    return speculative_generate(MarkovTarget(LOGITS, TREE_NODES if tree else 0), _drafter(kind),
                                PROMPT, tokens, mask_token_id=MASK, sampling=settings,
                                rng=np.random.default_rng(seed),
                                lookup_min_match=2 if lookup else 0,
                                tree_budget=TREE_NODES if tree else None)


CONFIGS = [Sampling(temperature=0.8), Sampling(temperature=0.8, top_p=0.9)]


@pytest.mark.parametrize("drafter", ["close", "wrong", "wrong+lookup"])
@pytest.mark.parametrize("settings", CONFIGS, ids=["t0.8", "t0.8-top_p0.9"])
def test_sampled_speculative_output_has_the_target_distribution(drafter, settings):
    exact = _reference(LOGITS, settings.temperature, settings.top_p)
    if settings.top_p < 1:
        assert (exact == 0).any()  # the nucleus really cuts tokens
    result = _run(drafter, settings)
    print(f"{drafter}, {settings.describe()}: {result.summary()}")
    assert len(result.tokens) == TOKENS
    assert _violations(result.tokens, exact) == []
    # The test can see a 1% bias on any token: the drift 0.01 N clears the bound by 3 sigma.
    assert np.all(BIAS * TOKENS >= (Z + 3) * _pooled_sigma(result.tokens, exact))
    # The drafters are what they claim, so both the accept and the residual paths ran a lot.
    if drafter == "close":
        assert result.acceptance_rate > 0.6, result.acceptance_rate
    elif drafter == "wrong+lookup":
        # Copied proposals are judged with a one-hot q: accepted with the target's p(x).
        assert result.lookup_steps > 0.9 * len(result.accepted)
        assert result.lookup_mean_accepted_length > 0.3  # both paths of the rule ran a lot
        assert max(result.lookup_accepted) == BLOCK - 1 and min(result.lookup_accepted) == 0
    else:
        assert result.acceptance_rate < 0.2, result.acceptance_rate
        assert max(result.accepted) == BLOCK - 1


def _stationary(transition: np.ndarray) -> np.ndarray:
    pi = np.full(len(transition), 1 / len(transition))
    for _ in range(1000):
        pi = pi @ transition
    return pi


def test_a_one_percent_bias_is_detected(monkeypatch):
    settings = CONFIGS[0]  # no top-p, so no zero cells that any misplaced token would trip
    exact = _reference(LOGITS, settings.temperature, settings.top_p)
    # Bias the token whose statistic is noisiest (largest expected sigma): the hardest case.
    token = int(np.argmax(_stationary(exact) @ (exact * (1 - exact))))

    def biased(logits, sampling):
        p = probabilities(logits, sampling)
        boosted = p[..., token] + BIAS
        assert np.all(boosted <= 1)
        p = p * ((1 - boosted) / (1 - p[..., token]))[..., None]
        p[..., token] = boosted
        return p

    monkeypatch.setattr(speculative, "probabilities", biased)
    found = _violations(_run("close", settings).tokens, exact)
    print(f"biased token {token}: {found}")
    assert any(line.startswith(f"token {token}:") for line in found), (token, found)


def test_always_accepting_is_detected(monkeypatch):
    def always_accept(p, q, drafted, rng):
        return len(drafted), int(sample(p[-1], rng))

    monkeypatch.setattr(speculative, "accept_drafts", always_accept)
    settings = CONFIGS[0]
    found = _violations(_run("wrong", settings).tokens,
                        _reference(LOGITS, settings.temperature, settings.top_p))
    assert len(found) > 10, found


@pytest.mark.parametrize("drafter, settings", [("close", CONFIGS[1]), ("wrong", CONFIGS[0])],
                         ids=["close-t0.8-top_p0.9", "wrong-t0.8"])
def test_sampled_trees_have_the_target_distribution(drafter, settings):
    """Trees judged by recursive rejection (tree.accept_sampled), with paths accepted below
    children after the first: the same bound as the chain's."""
    exact = _reference(LOGITS, settings.temperature, settings.top_p)
    result = _run(drafter, settings, tree=True)
    assert len(result.tokens) == TOKENS and result.tree_calls == len(result.accepted)
    assert _violations(result.tokens, exact) == []
    assert np.all(BIAS * TOKENS >= (Z + 3) * _pooled_sigma(result.tokens, exact))
    assert result.moved_rows > 0 and max(result.accepted) >= 2


def test_a_tree_rule_without_the_residual_is_detected(monkeypatch):
    """After a rejected child, judging the next one (and drawing the token) against the
    node's own p instead of the residual: the check sees it."""
    from museflash.runtime import tree as tree_module

    def no_residual(tree, p, q, rng):
        children, depths, path, node = tree.children(), tree.depths(), [], 0
        while True:
            target = p(node)
            for child in children[node]:
                x = int(tree.tokens[child])
                if rng.random() * q[depths[child] - 1][x] < target[x]:
                    path.append(child)
                    node = child
                    break
            else:
                return path, int(tree_module.sample(target, rng))

    monkeypatch.setattr(speculative, "accept_sampled", no_residual)
    settings = CONFIGS[0]
    # A gross bias: a fifth of the tokens shows it (the bound holds at any length).
    found = _violations(_run("wrong", settings, tree=True, tokens=TOKENS // 5).tokens,
                        _reference(LOGITS, settings.temperature, settings.top_p))
    assert len(found) > 3, found


def test_target_only_sampling_has_the_target_distribution():
    settings = CONFIGS[1]
    result = target_only_generate(MarkovTarget(LOGITS), PROMPT, 10_000, sampling=settings,
                                  rng=np.random.default_rng(3))
    assert _violations(result.tokens, _reference(LOGITS, 0.8, 0.9)) == []


# --- The loop's other guarantees -------------------------------------------------------------


@pytest.mark.parametrize("settings", [None, Sampling(), Sampling(temperature=0, top_p=0.5)])
def test_greedy_is_unchanged(settings):
    plain = greedy_generate(MarkovTarget(LOGITS), PROMPT, 200)
    assert target_only_generate(MarkovTarget(LOGITS), PROMPT, 200,
                                sampling=settings).tokens == plain.tokens
    for drafter, lookup in (("close", 0), ("wrong", 0), ("wrong", 2)):
        spec = speculative_generate(MarkovTarget(LOGITS), _drafter(drafter), PROMPT, 200,
                                    mask_token_id=MASK, sampling=settings,
                                    lookup_min_match=lookup)
        assert spec.tokens == plain.tokens
        assert (spec.lookup_steps > 0) == (lookup > 0)
        assert "sampled" not in spec.summary()


def test_sampled_run_figures_and_seeds():
    settings = CONFIGS[0]
    result = _run("close", settings, seed=5, tokens=1000)
    steps = len(result.accepted)
    assert result.prefill_calls == 1 and result.verify_calls == result.draft_calls == steps
    assert result.inject_calls == 1 + steps and result.drafter_calls == 1 + 2 * steps
    assert result.target_calls == 1 + steps
    produced = 1 + sum(result.accepted) + steps
    assert produced - (result.accepted[-1] + 1) < 1000 <= produced
    assert all(0 <= a <= BLOCK - 1 for a in result.accepted)
    assert "sampled (temperature 0.8, top-p 1)" in result.summary()
    assert _run("close", settings, seed=5, tokens=1000).tokens == result.tokens
    assert _run("close", settings, seed=6, tokens=1000).tokens != result.tokens


def test_sampling_needs_a_generator():
    with pytest.raises(ValueError, match="rng="):
        speculative_generate(MarkovTarget(LOGITS), _drafter("close"), PROMPT, 10,
                             mask_token_id=MASK, sampling=Sampling(temperature=1))
    with pytest.raises(ValueError, match="rng="):
        target_only_generate(MarkovTarget(LOGITS), PROMPT, 10, sampling=Sampling(temperature=1))


# --- sampling.py -----------------------------------------------------------------------------


def test_settings_are_validated_naming_the_flags():
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="^--temperature must be"):
            Sampling(temperature=bad)
    for bad in (0.0, -0.5, 1.01, math.nan):
        with pytest.raises(ValueError, match="^--top-p must be"):
            Sampling(temperature=1, top_p=bad)
    assert Sampling(temperature=0, top_p=1).greedy and not Sampling(temperature=0.1).greedy
    with pytest.raises(AttributeError):
        Sampling().temperature = 1  # frozen


def test_probabilities_temperature_and_greedy():
    logits = np.array([[1.0, 3.0, 2.0, 3.0], [0.0, -1.0, 5.0, 2.0]], np.float32)
    for temperature in (0.5, 1.0, 2.0):
        expected = np.exp(logits.astype(np.float64) / temperature)
        expected /= expected.sum(-1, keepdims=True)
        got = probabilities(logits, Sampling(temperature=temperature))
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    # Greedy: the one-hot of the first maximum, whatever top_p says.
    for settings in (Sampling(), Sampling(top_p=0.3)):
        np.testing.assert_array_equal(probabilities(logits, settings),
                                      [[0, 1, 0, 0], [0, 0, 1, 0]])
    # Batched rows keep their shape; huge logits do not overflow.
    batch = probabilities(np.stack([logits, 1e4 * logits]), Sampling(temperature=0.7))
    assert batch.shape == (2, 2, 4) and np.allclose(batch.sum(-1), 1)


def test_probabilities_top_p_boundary():
    probs = np.array([0.125, 0.5, 0.125, 0.25])  # ranked: 1, 3, then the tie 0, 2
    logits = np.log(probs)

    def nucleus(top_p):
        return probabilities(logits, Sampling(temperature=1, top_p=top_p))

    np.testing.assert_allclose(nucleus(1.0), probs, rtol=1e-12)
    np.testing.assert_allclose(nucleus(0.5 - 1e-9), [0, 1, 0, 0], atol=1e-12)
    np.testing.assert_allclose(nucleus(0.5 + 1e-9), [0, 2 / 3, 0, 1 / 3], rtol=1e-12)
    np.testing.assert_allclose(nucleus(0.75 - 1e-9), [0, 2 / 3, 0, 1 / 3], rtol=1e-12)
    # Past 0.75 a third token is needed; of the tied pair the lower id is kept.
    np.testing.assert_allclose(nucleus(0.75 + 1e-9), [1 / 7, 4 / 7, 0, 2 / 7], rtol=1e-12)
    np.testing.assert_allclose(nucleus(0.875 + 1e-9), probs, rtol=1e-12)
    np.testing.assert_allclose(nucleus(1e-6), [0, 1, 0, 0], atol=1e-12)


class _FixedUniform:
    """A stand-in Generator whose uniforms are all `value` (to reach edge cases)."""

    def __init__(self, value: float):
        self.value = value

    def random(self, shape=None):
        return np.full(shape if shape is not None else (), self.value)


def test_sample_never_draws_a_token_without_mass():
    probs = np.array([[0.0, 0.3, 0.7, 0.0], [0.5, 0.0, 0.5, 0.0]])
    assert sample(probs, _FixedUniform(0.0)).tolist() == [1, 0]
    assert sample(probs, _FixedUniform(np.nextafter(1.0, 0.0))).tolist() == [2, 2]
    assert sample(probs, _FixedUniform(1.0)).tolist() == [2, 2]  # u * total rounding up
    drawn = sample(np.tile(probs[0], (10_000, 1)), np.random.default_rng(0))
    assert set(drawn.tolist()) == {1, 2} and abs(np.mean(drawn == 2) - 0.7) < 0.02


def test_accept_drafts_rule():
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    # p == q: every draft is accepted (u < 1 = p/q), the bonus token comes from the last row.
    for _ in range(100):
        assert accept_drafts(p, p[:2], [1, 2], rng) == (2, 2)
    # p(x) = 0: always rejected; the residual max(0, p - q) = [0.5, 0, 0] decides.
    q = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for _ in range(100):
        assert accept_drafts(p, q, [2, 0], rng) == (0, 0)
    # p(x) >= q(x) always accepts; then position 1 is judged.
    assert accept_drafts(p, q, [1, 2], rng) == (2, 2)
    # A forced rejection where p == q leaves an all-zero residual: p itself is sampled.
    assert accept_drafts(p, p[:2], [1, 2], _FixedUniform(1.0)) == (0, 1)
    with pytest.raises(ValueError, match="probability 0"):
        accept_drafts(p, q, [0, 0], rng)
    with pytest.raises(ValueError, match="3 target rows"):
        accept_drafts(p[:2], q, [1, 2], rng)
