"""A real drafter's confidence, recorded and replayed: a chain engine's first-ranked probabilities
pooled by what the target made of them, and a replay drafter scoring its plan with draws from those
pools -- the plan's acceptance and tokens untouched, only what confidence-ranked schedules see."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import yaml

from specpilot.core.acceptance_profile import (confidence_pools, read_confidence, read_document, read_profile,
                                               round_probability, write_profile)
from specpilot.core.errors import SpecError, SpecPilotError
from specpilot.core.spec import load_spec
from specpilot.runtime.lattice import Lattice
from specpilot.runtime.replay import LEAST, OFF_PLAN, ON_PLAN, Oracle, ReplayDrafter, rejection_points
from tests.runtime.test_bench import COST, DENSE_TARGET, PROFILE

POOLS = {"right": [[0.9, 0.05, 0.01], [0.75, 0.2]], "wrong": [[0.3, 0.25, 0.1], [0.5, 0.3, 0.1], [0.4, 0.1, 0.05]],
         "ranks": [2, None, 1], "beyond": [[0.05, 0.04, 0.03], [0.02, 0.01, 0.001]]}


class _Cost:
    def reset(self):
        pass

    def propose(self, context, n):
        return Lattice.empty(1)

    def scored_chain(self, context, n):
        return []

    def expander(self, context):
        return lambda path: []


def test_pools_split_each_chain_at_its_first_rejected_draft_and_leave_the_last_verification_out():
    accepted = [[1, 3, 1, 4, 2], [1, 2]]
    rows = lambda *firsts: [[f, -3.0] for f in firsts]  # noqa: E731
    drafts = [[(rows(-0.1, -0.2, -0.3), [[1, 2], [3, 4], [5, 6]], 6), (rows(-0.5, -0.6), [[7, 8], [9, 10]], 9),
               (rows(-0.01, -0.02, -0.03), [[1, 2]] * 3, 3), (rows(-9.0), [[1, 2]], 1)], [(rows(-0.4), [[1, 2]], 2)]]
    pools = confidence_pools(accepted, drafts)
    p = lambda s: [float(f"{math.exp(s):.4g}"), float(f"{math.exp(-3.0):.4g}")]  # noqa: E731
    assert pools == {"right": [p(-0.1), p(-0.2), p(-0.01), p(-0.02), p(-0.03)], "wrong": [p(-0.3), p(-0.5)],
                     "ranks": [1, None], "beyond": [p(-0.6)]}
    # over the cap: a seeded sample, each wrong row still beside its own rank
    drafts = [([[-0.1, -3.0], [-0.01 * i, -0.02 * i, -0.03 * i]], [[1, 2], [9, 4, 5]], 3 + i % 3) for i in range(40)]
    many = confidence_pools([[1] + [2] * 40], [drafts], cap=8)
    assert len(many["right"]) == len(many["wrong"]) == len(many["ranks"]) == 8
    for row, rank in zip(many["wrong"], many["ranks"]):
        i = next(i for i in range(39) if [round_probability(math.exp(-0.01 * i))] == row[:1])
        assert rank == (None if i % 3 == 0 else i % 3)
    assert many == confidence_pools([[1] + [2] * 40], [drafts], cap=8)


def test_a_profile_keeps_its_pools_and_bad_pools_are_refused(tmp_path):
    write_profile(tmp_path / "p.json", PROFILE, "test", POOLS)
    assert read_document(tmp_path / "p.json") == {"accepted": PROFILE, "confidence": POOLS}
    write_profile(tmp_path / "plain.json", PROFILE, "test")
    assert read_profile(tmp_path / "plain.json") == PROFILE
    with pytest.raises(SpecPilotError, match="no drafter confidences"):
        read_confidence(tmp_path / "plain.json")
    for bad, message in (({**POOLS, "right": [[1.5]]}, r"confidence.right: rows of probabilities in \(0, 1\]"),
                         ({**POOLS, "wrong": [[0.0]] * 3}, "confidence.wrong: rows of probabilities"),
                         ({**POOLS, "right": []}, "confidence.right is empty"),
                         ({**POOLS, "beyond": [[]]}, "confidence.beyond: rows"),
                         ({**POOLS, "ranks": [2, None]}, "confidence.ranks: one per wrong row"),
                         ({**POOLS, "ranks": [3, None, 1]}, "confidence.ranks"),
                         ({**POOLS, "ranks": [0, None, 1]}, "confidence.ranks"),
                         ({"right": [[0.5]], "wrong": [[0.5]], "beyond": []}, "must map right, wrong, beyond")):
        document = json.loads((tmp_path / "p.json").read_text())
        (tmp_path / "bad.json").write_text(json.dumps({**document, "confidence": bad}))
        with pytest.raises(SpecPilotError, match=message):
            read_confidence(tmp_path / "bad.json")


def _drafter(plan, seed, top_k=3):
    rng = random.Random(seed)
    vocab = rng.choice([13, 64, 300])
    oracle = Oracle()
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 7))]
    run = [rng.randrange(vocab) for _ in range(rng.randrange(20, 60))]
    oracle.register(prompt, run)
    return ReplayDrafter(_Cost(), oracle, plan, top_k, vocab), prompt, run, rng


def _logs(rows, top_k):
    return [np.asarray([max(math.log(r[0]), LEAST)] + [math.log(p) for p in r[1:top_k]], dtype=np.float32).tolist()
            for r in rows]


@pytest.mark.parametrize("seed", range(8))
def test_recorded_rows_score_the_plan_by_outcome_and_the_chain_stays_the_plan_s(seed):
    alpha = seed % 2 == 1
    plan = {"alpha": 0.7, "seed": seed} if alpha else {"accepted": [[random.Random(seed).randrange(1, 6)
                                                                       for _ in range(20)]]}
    certain, prompt, run, rng = _drafter(plan, seed)
    scored, *_ = _drafter({**plan, "confidence": POOLS}, seed)
    rows = {pool: _logs(POOLS[pool], 3) for pool in ("right", "wrong", "beyond")}
    rows["right"][1].append(float(np.float32(min(math.log(0.2), OFF_PLAN) - 1)))      # padded to top_k 3
    for _ in range(30):
        start = rng.randrange(len(run) + 1)
        context, n = prompt + run[:start], rng.randrange(1, 20)
        want, got = certain.propose(context, n), scored.propose(context, n)
        assert want.tokens[:, 0].tolist() == got.tokens[:, 0].tolist(), "the chain is the plan's"
        on_path = True
        for i in range(n):
            old, new = want.logprobs[i].tolist(), got.logprobs[i].tolist()
            accepted = abs(old[0] - ON_PLAN) < 1e-6
            pool = "right" if accepted else "wrong" if on_path else "beyond"
            assert new in rows[pool], (i, pool)
            right = run[start + i] if start + i < len(run) else None
            offered = got.tokens[i].tolist()
            if pool == "wrong" and alpha and right is not None:
                rank = POOLS["ranks"][rows["wrong"].index(new)]
                assert offered.index(right) == rank if rank is not None else right not in offered
            elif not accepted:
                assert right not in offered, "a recorded profile's rejection points offer no right token"
            on_path = on_path and accepted
        assert scored.scored_chain(context, n) == got.scored_chain()
        again, *_ = _drafter({**plan, "confidence": POOLS}, seed)
        assert torch_equal(again.propose(context, n).logprobs, got.logprobs), "seeded: the same draws every time"


def test_each_request_draws_its_own_rows():
    oracle, prompts = Oracle(), ([1, 2, 3], [4, 5])
    for prompt in prompts:
        oracle.register(prompt, [7] * 200)
    drafter = ReplayDrafter(_Cost(), oracle, {"alpha": 1.0, "seed": 0, "confidence": POOLS}, 1, 64)
    scores = [[s for _, s in drafter.scored_chain(prompt, 120)] for prompt in prompts]
    assert scores[0] != scores[1]


def test_a_tree_scores_its_first_ranked_path_as_the_chain_does_and_goes_on_below_a_sibling_hit():
    plan = {"alpha": 0.6, "seed": 3, "confidence": {**POOLS, "ranks": [1, 1, 1]}}     # every miss offered at rank 1
    drafter, prompt, run, _ = _drafter(plan, 3, top_k=2)
    wrong = sorted(rejection_points(plan, 0, tuple(prompt), len(run) + 1))
    context = prompt + run[:wrong[0] - 1]
    expand = drafter.expander(context)
    chain = drafter.scored_chain(context, 4)
    path = []
    for token, score in chain:
        assert expand(path)[0] == (token, score)
        path.append(token)
    below = expand([run[wrong[0] - 1]])           # the rejection point: the continuation's token second
    assert below[1][0] == run[wrong[0]] and below[0][0] != run[wrong[0]]
    assert expand([run[wrong[0] - 1], run[wrong[0]]])[0][1] in {r[0] for r in _logs(POOLS["right"], 2)} | \
        {r[0] for r in _logs(POOLS["wrong"], 2)}, "on the continuation again below the sibling"


def test_the_drawn_rows_cover_their_pools_over_many_positions():
    oracle, prompt, run = Oracle(), [3, 1], [random.Random(11).randrange(64) for _ in range(400)]
    oracle.register(prompt, run)
    drafter = ReplayDrafter(_Cost(), oracle, {"alpha": 0.75, "seed": 11, "confidence": POOLS}, 1, 64)
    wrong = rejection_points(drafter.plan, 0, tuple(prompt), len(run) + 1)
    seen = {"right": set(), "wrong": set()}
    for start in range(len(run) - 1):
        (token, score), = drafter.scored_chain(prompt + run[:start], 1)
        seen["wrong" if start in wrong else "right"].add(score)
    for outcome in seen:
        assert seen[outcome] == {r[0] for r in _logs(POOLS[outcome], 1)}


def test_a_spec_takes_a_confidence_profile_for_its_replay_only(tmp_path):
    write_profile(tmp_path / "c.json", PROFILE, "test", POOLS)
    write_profile(tmp_path / "plain.json", PROFILE, "test")
    base = {"target": DENSE_TARGET, "deployment": {"max_seq_len": 128}}
    spec = {**base, "drafter": {"kind": "replay", "alpha": 0.6, "cost": COST, "confidence": "c.json"}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    from specpilot.core.spec import replay_plan
    assert replay_plan(load_spec(tmp_path / "m.yaml")) == {"alpha": 0.6, "seed": 0, "confidence": POOLS}
    for drafter, message in (({"kind": "replay", "alpha": 0.6, "cost": COST, "confidence": "plain.json"},
                              "drafter.confidence: .*no drafter confidences"),
                             ({"kind": "ngram", "confidence": "c.json"}, "drafter.confidence: an acceptance plan")):
        (tmp_path / "m.yaml").write_text(yaml.safe_dump({**base, "drafter": drafter}))
        with pytest.raises(SpecError, match=message):
            load_spec(tmp_path / "m.yaml")


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_a_chain_engine_records_its_drafter_s_confidence_and_a_replay_scores_with_it(run_cli, tmp_path):
    """Recorded from a real (tiny, seeded) early-exit drafter's chain engine, then replayed: the rows with the
    drafter's confidence keep the plan's acceptance and AR's tokens, alone and in a batch."""
    base = {"target": DENSE_TARGET, "deployment": {"dtype": "float32", "max_seq_len": 128, "max_batch": 2}}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({**base, "drafter": {"kind": "early-exit", "layers": 1, "draft_len": 4}}))
    code, stdout, err = run_cli("bench", tmp_path / "model.yaml", "--engines", "stock,stock-spec", "--requests", 2,
                                "--max-new-tokens", 40, "--breakdown-requests", 0, "--json",
                                "--record-profile", tmp_path / "rec.json")
    assert code == 0, err
    chain = json.loads(stdout)["engines"][1]
    pools = read_confidence(tmp_path / "rec.json")
    kept = [a for request in chain["accepted"] for a in request[:-1]]       # the last verification left out
    assert len(pools["right"]) == sum(a - 1 for a in kept)
    assert len(pools["wrong"]) == sum(a < 5 for a in kept)
    assert 0 < len(pools["beyond"]) <= sum(4 - a for a in kept if a < 5)      # chains shorten near the end
    assert "confidence" not in chain
    replay = {**base, "passes": "tree-verify{budget=8}",
              "drafter": {"kind": "replay", "alpha": 0.7, "seed": 2, "draft_len": 4, "top_k": 2, "cost": COST}}
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(replay))
    (tmp_path / "scored.yaml").write_text(yaml.safe_dump({**replay, "drafter": {**replay["drafter"],
                                                                                 "confidence": "rec.json"}}))
    rows, sources = {}, []
    for spec, extra in (("replay", ()), ("replay", ("--replay-confidence", tmp_path / "rec.json")), ("scored", ())):
        code, stdout, err = run_cli("bench", tmp_path / f"{spec}.yaml", "--engines", "stock,stock-spec,stock-tree",
                                    "--requests", 2, "--max-new-tokens", 40, "--breakdown-requests", 0, "--json",
                                    "--replay-alpha", "0.7", *extra)
        assert code == 0, err
        report = json.loads(stdout)
        assert report["tokens_checked"] and all(e["check"]["identical"] == 2 for e in report["engines"])
        rows.update({(spec, e["engine"], e["replay"]): e["accepted"] for e in report["engines"]})
        sources.append(report["replay_confidence"])
    assert sources == [None, str(tmp_path / "rec.json"), "build"]
    chain = [rows["replay", "stock-spec", "alpha=0.7"], rows["replay", "stock-spec", "alpha=0.7, confidence=rec.json"]]
    assert chain[0] == chain[1], "a chain accepts as planned"
    tree = [rows["replay", "stock-tree", "alpha=0.7"], rows["replay", "stock-tree", "alpha=0.7, confidence=rec.json"]]
    assert tree[0] != tree[1], "the drafter's scores shape the tree, its siblings may hold the target's token"
    assert rows["scored", "stock-tree", "alpha=0.7"] == tree[1], "the spec's own confidence scores --replay-alpha's"
    code, stdout, err = run_cli("bench", tmp_path / "replay.yaml", "--batch", "2", "--requests", 2, "--max-new-tokens",
                                24, "--engines", "stock,stock-spec,stock-tree", "--json",
                                "--replay-confidence", tmp_path / "rec.json")
    assert code == 0, err
    batched = json.loads(stdout)
    assert batched["tokens_checked"] and batched["replay_confidence"] == str(tmp_path / "rec.json")
    code, _, err = run_cli("bench", tmp_path / "model.yaml", "--requests", 1, "--replay-confidence", tmp_path / "rec.json")
    assert code != 0 and "need a replay drafter" in err
    # a run with nothing to pool (one verification a request, always left out) records its counts alone
    code, _, err = run_cli("bench", tmp_path / "model.yaml", "--engines", "stock,stock-spec", "--requests", 1,
                           "--max-new-tokens", 3, "--breakdown-requests", 0, "--record-profile", tmp_path / "short.json")
    assert code == 0 and "no drafter confidence" in err and read_document(tmp_path / "short.json")["confidence"] is None


def test_a_build_s_replay_plan_is_checked_when_read():
    from pydantic import ValidationError

    from specpilot.core.manifest import DrafterInfo
    info = {"kind": "replay", "draft_len": 4, "top_k": 2, "max_ngram": 4, "min_ngram": 1}
    assert DrafterInfo.model_validate({**info, "replay": {"alpha": 0.8, "seed": 0, "confidence": POOLS}}).replay
    for plan, message in (({"alpha": 0.8, "confidence": {**POOLS, "wrong": [7]}}, "confidence.wrong"),
                          ({"alpha": 2}, "'alpha' is a rate"), ({"alpha": True}, "'alpha' is a rate"),
                          ({"alpha": 0.5, "accepted": [[1]]}, "one of 'accepted'"),
                          ({"accepted": [[0]]}, "integers in 1..1025")):
        with pytest.raises(ValidationError, match=message):
            DrafterInfo.model_validate({**info, "replay": plan})
