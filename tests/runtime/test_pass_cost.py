"""A batched chain's length chosen by what its passes cost (`runtime.pass_cost`, `BatchPolicy.adaptive`):
the fit recovers a pass's cost line from the run's own passes, the chosen length is the one with the
most expected tokens a second (against the closed form on random cases), a request's acceptance
rate follows its chains, and under a clock that charges rows the scheduler drafts less where rows
are dear, more where they are cheap -- every request's tokens its own greedy ones either way."""

from __future__ import annotations

import math
import random

import pytest

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.batch_bench import parse_lengths, with_lengths
from specpilot.runtime.batching import Arrival, BatchPolicy, run_batch
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.draft_schedule import DraftSchedule
from specpilot.runtime.drafters import ModelDrafter
from specpilot.runtime.pass_cost import PassCost, chain_length, expected_tokens, tree_nodes
from tests.conftest import DENSE, noisy_copy, tiny_model


def test_the_fit_recovers_a_pass_line_once_rows_vary():
    cost = PassCost()
    for _ in range(5):
        cost.observe(40, 0.025, 4, 0.009)
    assert cost.model() is None                      # one row count: a row's cost is unknown
    cost.observe(16, 0.0202, 4, 0.009)
    cost.observe(72, 0.0314, 4, 0.009)
    a, b, d, c, e = cost.model()                     # drafting seen at one length: its mean, no slope yet
    assert a == pytest.approx(0.017 + 0.009) and b == pytest.approx(0.0002) and d == 0.0 and c == 0.0
    for rows, levels in ((144, 8), (80, 5), (32, 1), (96, 12)):
        cost.observe(rows, 0.017 + 0.0002 * rows, levels, 0.003 + 0.0015 * levels)
    a, b, d, c, e = cost.model()                     # verification a + b rows, drafting c' + d levels
    assert a == pytest.approx(0.017 + 0.003) and b == pytest.approx(0.0002) and d == pytest.approx(0.0015)
    assert c == 0.0 == e                             # a padded build: no padded rows priced apart; no requests


def test_a_falling_line_is_priced_flat_not_negative():
    cost = PassCost()
    for rows in (10, 20, 30, 40):
        cost.observe(rows, 0.05 - 0.001 * rows, 0, 0.0)
    a, b, d, c, e = cost.model()
    assert b == 0.0 and a > 0 and d == 0.0 and c == 0.0 == e


def test_a_packed_build_prices_its_real_and_padded_rows_apart():
    """Passes whose real and padded rows vary apart recover both prices; rows that move together
    (chains) keep one price, the real rows'; a price that comes out negative is held at 0."""
    rng = random.Random(3)
    cost = PassCost()
    def seconds(real, padded):
        return 0.0176 + 0.6e-4 * real + 1.26e-4 * padded

    for _ in range(3):
        for rows in (40, 80):
            cost.observe(rows, seconds(rows, rows), 0, 0.0, padded=rows)
    a, b, _, c, _ = cost.model()                     # collinear: the real rows carry the whole price
    assert (a, b, c) == (pytest.approx(0.0176), pytest.approx(1.86e-4), 0.0)
    for _ in range(12):
        real = rng.randint(16, 200)
        padded = rng.randint(real, 300)
        cost.observe(real, seconds(real, padded), 0, 0.0, padded=padded)
    a, b, _, c, _ = cost.model()
    assert a == pytest.approx(0.0176, rel=0.02) and b == pytest.approx(0.6e-4, rel=0.02)
    assert c == pytest.approx(1.26e-4, rel=0.02)
    steady = PassCost()                              # every pass padded alike: no padded-row price from noise
    noise = random.Random(179)
    for _ in range(30):                              # (a constant count's spread is rounding noise, not zero)
        real = noise.randint(16, 200)
        steady.observe(real, 0.02 + 1e-4 * real + 1e-6 * noise.random(), 0, 0.0, padded=179)
    assert steady.model()[3] == 0.0 and steady.model()[1] == pytest.approx(1e-4, rel=0.05)
    dear = PassCost()                                # the padded rows alone cost: the real rows' price held at 0
    for _ in range(2):
        for real, padded in ((20, 100), (90, 100), (20, 200), (90, 200), (50, 150)):
            dear.observe(real, 0.01 + 2e-4 * padded - 1e-5 * real, 0, 0.0, padded=padded)
    a, b, _, c, _ = dear.model()
    assert b == 0.0 and c == pytest.approx(2e-4, rel=0.05) and a > 0


def test_running_requests_are_priced_apart_once_they_vary_apart_from_the_rows():
    """A request's own cost (its recurrent state) priced apart from its rows: where requests and rows fall
    together (a burst's tail at one chain length) the rows carry both; once chain lengths vary too, each its
    own -- and the chain chosen is the one the true prices choose, where rows alone would draft less."""
    def seconds(rows, running):
        return 0.02 + 1e-4 * rows + 8e-4 * running

    cost = PassCost()
    for running in (16, 12, 8, 4, 16, 12):           # chains of 8 (9 rows a request)
        cost.observe(9 * running, seconds(9 * running, running), 0, 0.0, running=running)
    a, b, _, _, e = cost.model()
    assert e == 0.0 and b == pytest.approx(1e-4 + 8e-4 / 9) and a == pytest.approx(0.02)
    rates, caps = [0.8] * 16, [16] * 16
    biased = chain_length(rates, caps, cost.model())
    rng = random.Random(5)
    for _ in range(20):
        running, k = rng.randint(2, 16), rng.choice([4, 6, 8, 12, 16])
        cost.observe(running * (k + 1), seconds(running * (k + 1), running), 0, 0.0, running=running)
    a, b, _, c, e = cost.model()
    assert (a, b, c, e) == (pytest.approx(0.02, rel=0.02), pytest.approx(1e-4, rel=0.02), 0.0, pytest.approx(8e-4, rel=0.02))
    assert chain_length(rates, caps, cost.model()) == chain_length(rates, caps, (0.02, 1e-4, 0.0, 0.0, 8e-4)) > biased


def _closed_form(rates, caps, cost, packed=False):
    """The best K by the geometric sums' closed form, searched independently."""
    a, b, d, c = (*cost, 0.0)[:4]
    values = []
    for k in range(max(caps) + 1):
        drafts = [min(k, cap) for cap in caps]
        longest = max(drafts)
        tokens = sum((1 - r ** (n + 1)) / (1 - r) if r != 1 else n + 1 for r, n in zip(rates, drafts))
        padded = len(caps) * (longest + 1)
        rows = b * (len(caps) + sum(drafts)) + c * padded if packed else b * padded
        values.append(tokens / (a + rows + d * longest))
    best = max(values)
    return next(k for k, v in enumerate(values) if v >= best * (1 - 1e-9))


def test_the_chosen_length_has_the_most_expected_tokens_a_second():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 33)
        rates = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
        caps = [rng.randint(0, 17) for _ in range(n)]
        if not max(caps):
            continue
        cost = (rng.uniform(0.001, 0.03), rng.choice([0.0, rng.uniform(1e-6, 1e-3)]), rng.uniform(0, 2e-3),
                rng.choice([0.0, rng.uniform(1e-6, 1e-3)]))
        packed = rng.random() < 0.5
        assert chain_length(rates, caps, cost, packed) == _closed_form(rates, caps, cost, packed)


def test_rows_that_cost_nothing_keep_the_caps_and_dear_rows_draft_nothing():
    rates, caps = [0.8] * 16, [8, 12, 16, 3] * 4
    assert chain_length(rates, caps, (0.02, 0.0, 0.0)) == 16
    assert chain_length(rates, caps, (0.0, 0.0, 0.0)) == 16        # no information: the caps stand
    assert chain_length(rates, caps, (0.001, 1.0, 0.0)) == 0
    assert chain_length(rates, caps, (0.0, 0.0, 0.0, 1.0), packed=True) == 0     # only the padded rows cost
    assert chain_length([0.8], [16], (0.017, 0.00017, 0.0009)) > chain_length(rates, caps, (0.017, 0.00017, 0.0009))
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(0.3, 0) == 1.0


def test_a_requests_rate_follows_its_chains():
    s = DraftSchedule(8)
    assert s.rate() == 0.5
    for _ in range(10):
        s.update(8, chain=8)                          # every draft lands
    high = s.rate()
    assert high > 0.9
    for _ in range(40):
        s.update(0, chain=8)                          # the first draft fails every time
    assert s.rate() < 0.1 < high
    before = s.rate()
    s.update(3)                                       # a tree's acceptance says nothing about a chain rate
    assert s.rate() == before


class _Clock:
    """Time that moves only as passes are charged."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def wait_until(self, t):
        self.t = max(self.t, t)

    def tick(self):
        pass


class _Charged:
    """A model whose batched passes cost ``fixed + per_row x rows`` seconds on ``clock``."""

    def __init__(self, model, clock, fixed, per_row):
        self.model, self.clock, self.fixed, self.per_row = model, clock, fixed, per_row

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, items, record: bool = False):
        self.clock.t += self.fixed + self.per_row * len(items) * max(len(it[0]) for it in items)
        return self.model.forward_batch(items, record=record)


PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]
MAX_NEW = [40, 36, 44, 30]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(DENSE, seed=5)
    alone = [autoregressive(target, p, n, 128).tokens for p, n in zip(PROMPTS, MAX_NEW)]
    return target, noisy_copy(target, 0.05), alone


def _drafted(pair, per_row, adaptive=True):
    target, draft, alone = pair
    clock = _Clock()
    drafting = _Charged(draft, clock, 0.0, 0.0)
    policy = BatchPolicy("chain", 4, 12, adaptive=adaptive)
    run = run_batch(_Charged(target, clock, 0.02, per_row), lambda: ModelDrafter(drafting, 3, 128),
                    [Arrival(0.0, tuple(p), n) for p, n in zip(PROMPTS, MAX_NEW)], policy, 128, clock)
    assert [g.tokens for g in run.generations] == alone
    steps = [s for s in run.steps if not s.prefill and s.running == 4]
    return sum(s.drafted for s in steps) / len(steps)


def test_the_scheduler_drafts_less_where_rows_are_dear(pair):
    """4 requests, chains of at most 12, a pass 20 ms plus each row's price: every request's tokens its
    own greedy ones, fewer drafted a pass the dearer a row."""
    fixed = _drafted(pair, 0.0, adaptive=False)
    free, cheap, dear = _drafted(pair, 0.0), _drafted(pair, 2e-5), _drafted(pair, 1e-2)
    assert free >= 0.8 * fixed          # free rows: the caps, but for the passes that price a row
    assert dear < cheap <= fixed and dear < fixed / 2


def test_an_adaptive_run_records_the_prices_it_fitted(pair):
    """Passes that cost 20 ms plus 3 ms a row exactly: the run's fitted prices are those, in the bench's
    milliseconds; a fixed policy fits none."""
    from specpilot.runtime.batch_bench import prices_ms
    target, draft, _ = pair

    def run(adaptive):
        clock = _Clock()
        return run_batch(_Charged(target, clock, 0.02, 3e-3), lambda: ModelDrafter(_Charged(draft, clock, 0.0, 0.0), 3, 128),
                         [Arrival(0.0, tuple(p), n) for p, n in zip(PROMPTS, MAX_NEW)],
                         BatchPolicy("chain", 4, 12, adaptive=adaptive), 128, clock)
    prices = prices_ms(run(True).prices)
    assert prices["pass"] == pytest.approx(20.0, abs=0.5) and prices["row"] == pytest.approx(3.0, rel=0.02)
    assert prices["level"] == pytest.approx(0.0, abs=1e-6) and prices["padded_row"] == 0.0
    assert prices["request"] == pytest.approx(0.0, abs=0.05)     # a request costs nothing but its rows here
    assert run(False).prices is None and prices_ms(None) is None


def test_auto_lengths_are_for_drafting_engines():
    assert parse_lengths("4,auto,8:6:4") == [(4,), "auto", (8, 6, 4)]
    with pytest.raises(SpecPilotError, match="auto is given twice"):
        parse_lengths("auto,auto")
    assert with_lengths(BatchPolicy("chain", 2, 8), "auto", "compiled-spec").adaptive
    assert with_lengths(BatchPolicy("tree", 2, 8, 12), "auto", "compiled-tree-sched").adaptive
    with pytest.raises(SpecPilotError, match="drafts nothing"):
        with_lengths(BatchPolicy("ar", 2), "auto", "compiled")
    with pytest.raises(SpecPilotError, match="need drafts"):
        BatchPolicy("ar", 2, adaptive=True)


def _tree_value(order, running, n, cost, drafted, packed=False):
    """Expected tokens a second of a pass verifying the first n nodes of ``order`` (its drafting,
    ``drafted`` seconds, spent whatever n is)."""
    a, b, _, c = (*cost, 0.0)[:4]
    sizes = [0] * running
    for request, _, _ in order[:n]:
        sizes[request] += 1
    value = running + sum(math.exp(score) for _, score, _ in order[:n])
    padded = running * (1 + max(sizes))
    return value / (a + drafted + (b * (running + n) + c * padded if packed else b * padded))


@pytest.mark.parametrize("seed", range(12))
def test_the_chosen_tree_prefix_has_the_most_expected_tokens_a_second(seed):
    """Random best-first orders (scores falling along each request's nodes) and pass costs: the
    chosen number of nodes is the fewest of those with the best value, against every prefix."""
    rng = random.Random(seed)
    running = rng.randint(1, 6)
    order, last = [], [0.0] * running
    for _ in range(rng.randint(0, 40)):
        r = rng.randrange(running)
        last[r] -= rng.choice([1e-3, 0.05, 0.7, 3.0])
        order.append((r, last[r], rng.randint(1, 9)))
    cost = (rng.uniform(0.005, 0.03), rng.choice([0.0, 1e-5, 1e-4, 1e-3]), rng.choice([0.0, 5e-4]),
            rng.choice([0.0, 1e-4, 2e-3]))
    drafted = rng.choice([0.0, 0.004])
    packed = seed % 2 == 1
    n = tree_nodes(order, running, cost, drafted, packed)
    values = [_tree_value(order, running, k, cost, drafted, packed) for k in range(len(order) + 1)]
    assert values[n] >= max(values) * (1 - 1e-9)
    assert all(v < values[n] * (1 + 1e-12) for v in values[:n])
    assert tree_nodes(order, running, (0.0, 0.0, 0.0)) == len(order)     # a free pass: the budget stands


def test_a_tree_pass_prices_its_padded_rows():
    """Two requests: a sure path of 6 for request 0, of 1 for request 1, then an unlikely node of
    request 0's.  Rows at 1 ms take the sure nodes, not the unlikely one (a row more for each request);
    rows at 50 ms take nothing (each of request 0's nodes pads request 1's tree by a row too)."""
    order = [(0, -1e-3 * (i + 1), i + 1) for i in range(6)] + [(1, -1e-3, 1), (0, -5.0, 7)]
    assert tree_nodes(order, 2, (0.02, 1e-3, 0.0)) == 7
    assert tree_nodes(order, 2, (0.02, 0.05, 0.0)) == 0
    # rows at 20 ms: packed, the 7 sure nodes verify 9 rows (8.98 tokens for 200 ms against 2 for 60 ms: they
    # pay, the unlikely one not); padded, request 0's 6 pad request 1's tree to 14 rows (8.98 for 300 ms: not)
    assert tree_nodes(order, 2, (0.02, 0.02, 0.0), packed=True) == 7
    assert tree_nodes(order, 2, (0.02, 0.02, 0.0)) == 0
    # packed, padded rows at 20 ms too: the 6 sure nodes of request 0 pad both trees to 7 rows a request
    # (14 padded; 8.98 tokens for 480 ms against 2 for 100 ms: not), so none; a padded build ignores c
    assert tree_nodes(order, 2, (0.02, 0.02, 0.0, 0.02), packed=True) == 0
    assert tree_nodes(order, 2, (0.02, 1e-3, 0.0, 0.02)) == 7


def _trees(pair, per_row, adaptive=True):
    target, draft, alone = pair
    clock = _Clock()
    policy = BatchPolicy("tree", 4, 8, 24, adaptive=adaptive)
    run = run_batch(_Charged(target, clock, 0.02, per_row), lambda: ModelDrafter(_Charged(draft, clock, 0.0, 0.0), 3, 128),
                    [Arrival(0.0, tuple(p), n) for p, n in zip(PROMPTS, MAX_NEW)], policy, 128, clock)
    assert [g.tokens for g in run.generations] == alone
    steps = [s for s in run.steps if not s.prefill and s.running == 4]
    return sum(s.drafted for s in steps) / len(steps)


def test_the_tree_scheduler_verifies_fewer_nodes_where_rows_are_dear(pair):
    """4 requests, trees under a shared budget of 24 nodes, a pass 20 ms plus each (padded) row's price:
    every request's tokens its own greedy ones, fewer nodes a pass the dearer a row."""
    fixed = _trees(pair, 0.0, adaptive=False)
    free, dear = _trees(pair, 0.0), _trees(pair, 1e-2)
    assert free >= 0.8 * fixed
    assert dear < fixed / 2


class _Packed(_Charged):
    """A packed build's model: a pass costs ``fixed`` + ``per_row`` a real row + ``per_padded`` a padded one."""

    packs_verification = True

    def __init__(self, model, clock, fixed, per_row, per_padded):
        super().__init__(model, clock, fixed, per_row)
        self.per_padded = per_padded

    def forward_batch(self, items, record: bool = False):
        real, padded = sum(len(it[0]) for it in items), len(items) * max(len(it[0]) for it in items)
        self.clock.t += self.fixed + self.per_row * real + self.per_padded * padded
        return self.model.forward_batch(items, record=record)


def test_a_packed_tree_scheduler_prices_the_padded_rows(pair):
    """Packed passes whose real rows are cheap: where the padded rows (attention, Gated DeltaNet) are dear
    too, fewer nodes a pass than where they are free; every request's tokens its own greedy ones."""
    target, draft, alone = pair

    def drafted(per_padded):
        clock = _Clock()
        run = run_batch(_Packed(target, clock, 0.02, 1e-4, per_padded),
                        lambda: ModelDrafter(_Charged(draft, clock, 0.0, 0.0), 3, 128),
                        [Arrival(0.0, tuple(p), n) for p, n in zip(PROMPTS, MAX_NEW)],
                        BatchPolicy("tree", 4, 8, 24, adaptive=True), 128, clock)
        assert [g.tokens for g in run.generations] == alone
        steps = [s for s in run.steps if not s.prefill and s.running == 4]
        return sum(s.drafted for s in steps) / len(steps)

    assert drafted(1e-2) < drafted(0.0) / 2
