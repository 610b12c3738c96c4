"""The tree figures' replay (tools/tree_figures.py) is faithful: its width-1 chain accepts, step
for step, what the speculative loop accepts on the same pair, so its tree figures count what
the engine's tree steps would gain."""

import numpy as np

from museflash.builtin.demo_checkpoint import builtin_checkpoints
from museflash.runtime.speculative import EagerDrafter, EagerTarget, speculative_generate
from museflash.tools.tree_figures import Tally, replay, simulate
from museflash.training.distil_corpus import load_pair


def test_the_replayed_chain_accepts_what_the_loop_accepts():
    with builtin_checkpoints("demo") as (target_dir, drafter_dir):
        target, drafter = load_pair(target_dir, drafter_dir, max_context=256, max_query=128)
    block, mask = drafter.config.block_size, drafter.config.mask_token_id
    rng = np.random.default_rng(3)
    accepted_any = 0
    for _ in range(2):
        prompt = rng.integers(0, 200, 24).tolist()
        result = speculative_generate(EagerTarget(target, 32, block), EagerDrafter(drafter),
                                      prompt, 48, mask_token_id=mask, lookup_min_match=0)
        run = replay(target, prompt, 48, block, 128)
        assert run.ids[len(prompt):len(prompt) + 48] == result.tokens
        tally = Tally()
        simulate(run, drafter, block, mask, block, "chain", tally)
        # The loop's last step is cut to the requested length; every earlier one must match.
        steps = len(result.accepted) - 1
        assert tally.accepted[:steps] == result.accepted[:steps]
        accepted_any += sum(result.accepted)
    assert accepted_any > 0  # drafts were accepted: the comparison saw more than rejections

