"""Continuous batching (`runtime.batching`): requests from an arrival trace join and leave one
batch, each step one batched target pass; every request's tokens equal its own single-request
greedy tokens for autoregressive, chain, tree and shared-budget runs (with dynamic draft lengths
and prompt admission), the node budget holds in every pass, a bounded queue refuses, and a trace
replays to the same schedule under a step clock."""

from __future__ import annotations

import json
import math

import pytest

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.batching import (Arrival, BatchPolicy, StepClock, poisson_trace, read_trace, run_batch,
                                        write_trace)
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.draft_schedule import DraftSchedule, lengths
from specpilot.runtime.drafters import ModelDrafter
from tests.conftest import DENSE, HYBRID, noisy_copy, tiny_model

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8], [3, 2], [3, 8, 4, 6, 2, 6], [4, 3, 3],
           [2, 7, 1, 8, 2, 8, 1]]
MAX_NEW = [13, 5, 11, 16, 1, 7, 9]
AT = [0.0, 0.0, 0.015, 0.02, 0.05, 0.11, 0.112]      # seconds; the step clock takes 0.01 a pass


class _Counting:
    """A model whose batched passes are recorded: (items, tokens per item, record)."""

    def __init__(self, model):
        self.model, self.passes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, items, record: bool = False):
        self.passes.append(([len(item[0]) for item in items], record))
        return self.model.forward_batch(items, record=record)


POLICIES = {
    "ar": BatchPolicy("ar", 3, prefill=6),
    "ar-admission": BatchPolicy("ar", 3, chunk=4),
    "chain": BatchPolicy("chain", 3, 4),
    "chain-dynamic": BatchPolicy("chain", 3, 6, lengths=(6, 4, 2)),
    "chain-shared": BatchPolicy("chain", 3, 6, budget=8, lengths=(6, 4, 2)),
    "chain-scarce": BatchPolicy("chain", 3, 4, budget=2),     # fewer tokens than requests: some draft none
    "tree": BatchPolicy("tree", 3, 6),
    "tree-shared": BatchPolicy("tree", 3, 6, budget=8, lengths=(6, 4, 2), chunk=3),
    "tree-floor": BatchPolicy("tree", 3, 6, budget=10, min_prob=0.05, chunk=5),
}


# every policy on a dense target; on a hybrid one (Gated DeltaNet rows kept per request) those that cut states
CASES = [(DENSE, name) for name in POLICIES] + [(HYBRID, name) for name in ("ar-admission", "chain-dynamic",
                                                                             "chain-shared", "chain-scarce", "tree-shared",
                                                                             "tree-floor")]
_PAIRS: dict = {}


def _pair(arch):
    if arch not in _PAIRS:
        target = tiny_model(arch, seed=5)
        _PAIRS[arch] = (target, noisy_copy(target, 0.3),
                        [autoregressive(target, p, n, 128).tokens for p, n in zip(PROMPTS, MAX_NEW)])
    return _PAIRS[arch]


@pytest.fixture(scope="module", params=[DENSE, HYBRID])
def pair(request):
    return _pair(request.param)[:2]


@pytest.fixture(scope="module")
def alone(pair):
    return next(v[2] for v in _PAIRS.values() if v[0] is pair[0])


def _run(pair, policy, forces=None, clock=None, drafting=None):
    target, draft = pair
    counting = _Counting(target)
    drafting = drafting if drafting is not None else _Counting(draft)
    make = (lambda: ModelDrafter(drafting, 3, 128)) if policy.mode != "ar" else None
    arrivals = [Arrival(t, tuple(p), n) for t, p, n in zip(AT, PROMPTS, MAX_NEW)]
    return run_batch(counting, make, arrivals, policy, 128, clock or StepClock(0.01), forces), counting


@pytest.mark.parametrize("arch,name", CASES)
def test_every_request_gets_its_own_greedy_tokens(arch, name):
    target, draft, alone = _pair(arch)
    pair, policy = (target, draft), POLICIES[name]
    run, counting = _run(pair, policy)
    for gen, want, n in zip(run.generations, alone, MAX_NEW):
        assert gen.tokens == want and sum(gen.accepted) == n
    running = [s.running for s in run.steps]
    assert max(running) == 3 and any(0 < r < 3 for r in running)          # requests joined and left
    assert all(len(items) <= 3 for items, _ in counting.passes)              # never more rows than the batch
    t = run.timings
    assert all(a.arrival <= a.started <= a.first <= a.done for a in t)
    if policy.mode != "ar":
        assert any(a > 1 for gen in run.generations for a in gen.accepted[1:])   # drafts accepted
        assert all(items for items, record in counting.passes if record)
    if policy.budget is not None:
        assert all(s.drafted <= policy.budget for s in run.steps)
        assert any(s.drafted < s.running * policy.nodes for s in run.steps if s.running == 3)   # the budget binds
    if policy.chunk is not None:
        assert all(s.running == 0 for s in run.steps if s.prefill)           # a prompt's own pass only when idle
        assert any(s.admitted and s.running and not s.prefill for s in run.steps)   # chunks rode along
        assert all(s.admitted <= (policy.budget or policy.chunk) for s in run.steps if not s.prefill)
    else:
        assert any(s.prefill and s.running for s in run.steps)               # joins delayed the running ones
        assert all(s.admitted <= max(policy.prefill, max(map(len, PROMPTS))) for s in run.steps if s.prefill)


def test_the_drafter_runs_once_a_level_for_the_whole_batch(pair, alone):
    """A shared-budget step syncs every running request's drafter in one batched pass and scores each
    tree level of all of them in one more: passes with several requests' rows, and fewer drafter
    passes than tree nodes."""
    drafting = _Counting(pair[1])
    run, _ = _run(pair, POLICIES["tree-shared"], drafting=drafting)
    assert [g.tokens for g in run.generations] == alone
    batched = [sizes for sizes, record in drafting.passes if record and len(sizes) > 1]
    assert batched and any(max(sizes) > 1 for sizes in batched)       # tree levels of several requests at once
    recorded = len([p for p in drafting.passes if p[1]])
    assert recorded < sum(s.drafted for s in run.steps)
    levels = sum(s.levels for s in run.steps)           # the steps count their tree-level passes
    assert 0 < levels < recorded and all(s.levels <= POLICIES["tree-shared"].nodes for s in run.steps)
    assert all(s.levels == 0 for s in _run(pair, POLICIES["ar"])[0].steps)


def test_chains_are_drafted_a_position_at_a_time_for_the_whole_batch(pair, alone):
    """A chain step drafts every running request's chain together: one batched drafter pass a
    chain position (several requests' rows in it), not one pass a token a request."""
    drafting = _Counting(pair[1])
    run, _ = _run(pair, POLICIES["chain"], drafting=drafting)
    assert [g.tokens for g in run.generations] == alone
    assert any(len(sizes) > 1 for sizes, record in drafting.passes if record)
    assert all(s.levels < POLICIES["chain"].nodes for s in run.steps)     # the root needs no pass
    assert sum(s.levels for s in run.steps) >= sum(s.drafted > s.running for s in run.steps if not s.prefill)


def test_shared_budget_with_forcing_reports_own_choices(pair, alone):
    """Forced onto stock's tokens, a batched run's own choices are stock's (token forcing in batches)."""
    run, _ = _run(pair, POLICIES["tree-shared"], forces=alone)
    for gen, want in zip(run.generations, alone):
        assert gen.tokens == want and gen.choices == want


def test_a_trace_replays_to_the_same_schedule(pair):
    first, _ = _run(pair, POLICIES["tree-shared"])
    again, _ = _run(pair, POLICIES["tree-shared"])
    assert first.steps == again.steps and first.timings == again.timings
    assert [g.accepted for g in first.generations] == [g.accepted for g in again.generations]


def test_a_full_queue_refuses_and_the_rest_are_exact(pair, alone):
    policy = BatchPolicy("tree", 1, 6, queue=1)
    run, _ = _run(pair, policy)
    assert run.refused and 0 not in run.refused
    assert all(run.timings[i].started is None and run.timings[i].done >= run.timings[i].arrival
               for i in run.refused)                                            # refused when it came
    for i, gen in enumerate(run.generations):
        assert gen is None or gen.tokens == alone[i]


def test_dynamic_lengths_follow_acceptance_and_confidence():
    assert lengths(16, 8, 4) == (16, 12, 8) and lengths(5) == (5, 4, 3, 2, 1)
    s = DraftSchedule(16, 8, dynamic=True, step=4)
    assert s.next() == 16                             # optimistic start
    for _ in range(6):
        s.update(1)
    assert s.next() == 8                              # drafts keep failing: the shortest
    for _ in range(5):
        s.update(8, confidence=15.0)
    assert s.next() == 16                             # landing, and the drafter is sure
    s.update(8, confidence=8.0)                       # the drafter is less sure of its next draft
    assert s.next() == 12
    assert DraftSchedule(16, 8, step=4).next() == 16  # fixed


def test_trace_files_round_trip_and_bad_lines_say_where(tmp_path):
    arrivals = poisson_trace([[1, 2], [3], [4, 5, 6]], 7, rate=20.0, seed=3)
    assert arrivals[0].at == 0.0 and all(a.at <= b.at for a, b in zip(arrivals, arrivals[1:]))
    assert poisson_trace([[1, 2], [3], [4, 5, 6]], 7, rate=20.0, seed=3) == arrivals
    path = tmp_path / "trace.jsonl"
    write_trace(path, arrivals)
    assert read_trace(path) == [Arrival(round(a.at, 6), a.prompt, a.max_new) for a in arrivals]
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"at": 0.5, "prompt": "ab", "max_new_tokens": 3}) + "\n")
    assert read_trace(text, encode=lambda s: [ord(c) for c in s]) == [Arrival(0.5, (97, 98), 3)]
    with pytest.raises(SpecPilotError, match="needs a tokenizer"):
        read_trace(text)
    for line, words in [("{", "not JSON"), ("[1]", "expected an object"),
                        ('{"at": -1, "prompt_ids": [1], "max_new_tokens": 2}', "'at' must be"),
                        ('{"at": 0, "prompt_ids": [], "max_new_tokens": 2}', "'prompt_ids' must be"),
                        ('{"at": 0, "prompt_ids": [1], "max_new_tokens": 0}', "'max_new_tokens' must be"),
                        ('{"at": 0, "max_new_tokens": 2}', "needs 'prompt_ids'")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"at": 0, "prompt_ids": [1], "max_new_tokens": 2}\n' + line + "\n")
        with pytest.raises(SpecPilotError, match=f"bad.jsonl:2: .*{words}"):
            read_trace(bad)


def test_policies_refuse_what_they_cannot_do():
    for kw, words in [(dict(mode="beam"), "ar, chain or tree"), (dict(mode="chain", nodes=0), "nodes >= 1"),
                      (dict(mode="ar", budget=8), "needs drafts"),
                      (dict(mode="chain", nodes=4, budget=8, min_prob=0.1), "floor needs tree verification"),
                      (dict(mode="tree", nodes=4, chunk=4), "node budget"),
                      (dict(mode="ar", queue=-1), "bound")]:
        with pytest.raises(SpecPilotError, match=words):
            BatchPolicy(**kw)
    assert math.isclose(BatchPolicy("tree", 2, 4, budget=6, min_prob=0.1).min_prob, 0.1)
    assert BatchPolicy("chain", 2, 4, budget=6).budget == 6


def test_a_chain_pass_splits_its_budget_as_evenly_as_the_caps_allow():
    """`split_budget` against brute force on small random cases: within the caps and the budget, all of
    the budget the caps can take, and max-min fair (no allocation raises its smallest share, then the
    next, ...); deterministic in the caps' order."""
    import itertools
    import random

    from specpilot.runtime.batching import split_budget

    rng = random.Random(11)
    for _ in range(300):
        caps = [rng.randint(0, 5) for _ in range(rng.randint(1, 4))]
        budget = rng.randint(0, 16)
        got = split_budget(budget, caps)
        assert all(0 <= g <= c for g, c in zip(got, caps)) and sum(got) == min(budget, sum(caps)), (caps, budget, got)
        best = max((x for x in itertools.product(*(range(c + 1) for c in caps)) if sum(x) == sum(got)),
                   key=lambda x: sorted(x))
        assert sorted(got) == sorted(best), (caps, budget, got, best)
        assert split_budget(budget, caps) == got
    assert split_budget(128, [8] * 32) == [4] * 32 and split_budget(128, [8] * 16) == [8] * 16
    # a budget below the requests: each turn shorts other ones
    assert [split_budget(2, [4, 4, 4], turn) for turn in range(3)] == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]



def test_a_free_row_admits_a_waiting_prompt_while_drafts_would_fill_the_budget(pair):
    """One long request whose drafts alone fill the budget (4 nodes, budget 4) and a free row: a short
    request arriving meanwhile is admitted in chunks from the part of the budget kept for it, and
    finishes long before the long one -- not after it, as it would if drafts took every node."""
    target, draft = pair
    arrivals = [Arrival(0.0, (3, 1, 4, 1, 5), 30), Arrival(0.03, (9, 2, 6, 5, 3), 4)]
    policy = BatchPolicy("tree", 2, 4, budget=4, chunk=4)
    run = run_batch(target, lambda: ModelDrafter(draft, 3, 128), arrivals, policy, 128, StepClock(0.01))
    for a, gen in zip(arrivals, run.generations):
        assert gen.tokens == autoregressive(target, list(a.prompt), a.max_new, 128).tokens
    long, short = run.timings
    assert short.started <= short.arrival + 0.02 and short.done < long.done
    assert any(s.admitted and s.running and not s.prefill for s in run.steps)


@pytest.mark.parametrize("passes", [4, 10])
def test_a_burst_joins_by_a_prefill_pass_and_a_small_backlog_rides(pair, passes):
    """Two 10-token prompts arrive while one request runs, with two free rows and 2-token chunks: a
    backlog of 20 tokens is more than 4 chunks, so the prompts join by a prefill pass of their own (the
    running request waits for it); allowed 10 chunks, they ride along in verification passes."""
    target, draft = pair
    arrivals = [Arrival(0.0, (3, 1, 4, 1, 5), 24), Arrival(0.03, (9, 2, 6, 5, 3, 5, 8, 9, 7, 9), 6),
                Arrival(0.03, (2, 7, 1, 8, 2, 8, 1, 8, 2, 8), 6)]
    policy = BatchPolicy("tree", 3, 4, budget=8, chunk=2, passes=passes)
    run = run_batch(target, lambda: ModelDrafter(draft, 3, 128), arrivals, policy, 128, StepClock(0.01))
    for a, gen in zip(arrivals, run.generations):
        assert gen.tokens == autoregressive(target, list(a.prompt), a.max_new, 128).tokens
    joined = [s for s in run.steps if s.prefill and s.running]
    rode = [s for s in run.steps if s.admitted and not s.prefill]
    if passes == 4:
        assert len(joined) == 1 and joined[0].admitted == 20 and not rode
    else:
        assert not joined and sum(s.admitted for s in rode) == 20
        assert all(s.drafted + s.admitted <= 8 for s in rode)


def test_admission_refuses_an_empty_backlog_bound():
    with pytest.raises(SpecPilotError, match="backlog"):
        BatchPolicy("tree", 2, 4, budget=8, chunk=2, passes=0)
