"""A replay drafter's chain for a batch's block pass (`scored_chain`) is its lattice's first-ranked path."""

import random

import pytest

from specpilot.runtime.lattice import Lattice
from specpilot.runtime.replay import Oracle, ReplayDrafter


class _Cost:
    """A cost network that records what it was asked to draft."""

    def __init__(self):
        self.asked = []

    def reset(self):
        pass

    def propose(self, context, n):
        self.asked.append(("propose", len(context), n))
        return Lattice.empty(1)

    def scored_chain(self, context, n):
        self.asked.append(("scored_chain", len(context), n))
        return []


@pytest.mark.parametrize("seed", range(8))
def test_scored_chain_is_the_lattice_s_first_path_on_fresh_contexts(seed):
    rng = random.Random(seed)
    vocab = rng.choice([11, 50, 257])
    oracle, prompts = Oracle(), []
    for _ in range(3):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        oracle.register(prompt, [rng.randrange(vocab) for _ in range(rng.randrange(5, 40))])
        prompts.append(prompt)
    plan = {"alpha": rng.choice([0.3, 0.8, 0.95]), "seed": seed} if seed % 2 else \
        {"accepted": [[rng.randrange(1, 6) for _ in range(8)]]}
    if seed >= 3:        # a real drafter's confidences scoring the plan
        plan["confidence"] = {"right": [[rng.random() + 1e-3, 1e-3] for _ in range(5)], "wrong": [[0.25], [0.5, 0.1]],
                              "ranks": [None, 1], "beyond": []}
    cost = _Cost()
    drafter = ReplayDrafter(cost, oracle, plan, top_k=rng.choice([1, 3, 8]), vocab_size=vocab)
    for _ in range(40):
        prompt = rng.choice(prompts)
        run = oracle.runs[tuple(prompt)]
        # on the continuation, at or past its end, or off it (the context left the run)
        context = prompt + run[:rng.randrange(len(run) + 1)]
        if rng.random() < 0.2:
            context = context + [rng.randrange(vocab)]
        n = rng.randrange(0, 18)
        want = drafter.propose(context, n).scored_chain()
        got = drafter.scored_chain(context, n)
        assert got == want, (context, n)
        assert cost.asked[-2:] == [("propose", len(context), n), ("scored_chain", len(context), n)]
