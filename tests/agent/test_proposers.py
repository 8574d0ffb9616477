"""The built-in proposer on hand-made cost reports: each direction proposes what its evidence
supports, with estimates computed from the report, and nothing without evidence."""

from __future__ import annotations

import pytest

from specpilot.agent.proposers import MIN_ESTIMATED_GAIN, BuiltinProposer, replay_chain
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse


def _report(kernels, wall, kernel_seconds, factors, **extra):
    return {"accepted_per_verification": 1.3, "wall_seconds": wall, "verifications": 10,
            "engine": "compiled-spec", "kernels": kernels, "kernel_seconds": kernel_seconds,
            "factors": factors, "tree_acceptance": {}, **extra}


def test_cpu_transposes_make_cpu_nt_the_kernel_candidate():
    kernels = [{"name": "transpose3", "seconds": 0.6, "ratio": 40.0}, {"name": "matmul2", "seconds": 0.2, "ratio": 3.0}]
    report = _report(kernels, wall=1.0, kernel_seconds=0.8, factors={"kernel": 13.0, "overhead": 1.2, "acceptance": 1.1})
    cands = BuiltinProposer().propose(report, parse(""), PassContext(), 5, [], set())
    by = {c.pipeline: c for c in cands}
    assert "kernel-schedule{set=cpu-nt}" in by
    # 0.6 s of transposes, scaled to wall time (1.0 / 0.8): removing 0.75 s of 1.0 s is a 4x step
    assert by["kernel-schedule{set=cpu-nt}"].estimated_gain == pytest.approx(1.0 / (1.0 - 0.75) - 1)
    assert not any("graph=true" in c.pipeline for c in cands)          # no CUDA graphs on a CPU


def test_host_overhead_on_cuda_proposes_cuda_graphs_and_keeps_the_schedule_set():
    report = _report([{"name": "fused_NT_matmul", "seconds": 0.004, "ratio": 1.5}], wall=0.010,
                     kernel_seconds=0.004, factors={"overhead": 2.5, "kernel": 1.5, "acceptance": 1.0})
    cuda = PassContext(target_kind="cuda", arch="sm_90")
    cands = BuiltinProposer().propose(report, parse("kernel-schedule{set=nt-gemv}"), cuda, 5, [], set())
    graph = [c for c in cands if "graph=true" in c.pipeline]
    assert len(graph) == 1 and graph[0].pipeline == "kernel-schedule{set=nt-gemv,graph=true}"
    assert graph[0].direction == "overhead"
    assert graph[0].estimated_gain == pytest.approx(0.010 / (0.010 - 0.5 * 0.006) - 1)
    # already on graphs: not proposed again
    again = BuiltinProposer().propose(report, parse("kernel-schedule{set=nt-gemv,graph=true}"), cuda, 5, [], set())
    assert not any("graph=true" in c.pipeline for c in again)


def test_on_graphs_a_single_sequence_tree_is_proposed_at_a_fixed_size():
    report = _report([{"name": "fused_NT_matmul", "seconds": 0.004, "ratio": 1.5}], wall=0.010,
                     kernel_seconds=0.004, factors={"overhead": 2.5, "kernel": 1.5, "acceptance": 1.0})
    cuda = PassContext(target_kind="cuda", arch="sm_90", max_batch=1)
    now = parse("tree-verify{budget=32},kernel-schedule{graph=true}")
    fixed = [c for c in BuiltinProposer().propose(report, now, cuda, 5, [], set()) if "fixed=true" in c.pipeline]
    assert len(fixed) == 1 and fixed[0].direction == "overhead"
    assert "tree-verify{budget=32,fixed=true}" in fixed[0].pipeline
    assert fixed[0].estimated_gain == pytest.approx(0.010 / (0.010 - 0.25 * 0.006) - 1)
    # not without graphs (the graph proposal comes first), not for a batch, not twice
    for pipeline, context in [("tree-verify{budget=32}", cuda),
                              ("tree-verify{budget=32},kernel-schedule{graph=true}",
                               PassContext(target_kind="cuda", arch="sm_90", max_batch=8)),
                              ("tree-verify{budget=32,fixed=true},kernel-schedule{graph=true}", cuda)]:
        cands = BuiltinProposer().propose(report, parse(pipeline), context, 5, [], set())
        assert not any("fixed=true" in c.pipeline and c.pipeline != pipeline for c in cands), pipeline


def test_no_evidence_no_candidate():
    report = _report([{"name": "fused_NT_matmul", "seconds": 0.009, "ratio": 5.0}], wall=0.010,
                     kernel_seconds=0.0099, factors={"kernel": 5.0, "overhead": 1.01, "acceptance": 1.0})
    cands = BuiltinProposer().propose(report, parse(""), PassContext(), 5, [], set())
    assert all(c.estimated_gain >= MIN_ESTIMATED_GAIN for c in cands)
    assert not any("kernel-schedule" in c.pipeline for c in cands)    # no transposes to remove


def test_chain_replay_counts_accepted_and_drafted_tokens():
    reference = [5, 1, 2, 3, 9, 4]
    # at position 1 the drafter's greedy chain is 1, 2, 7 (two right); at 4 (after the bonus 3) it says 9, 4
    expansions = {1: {(): [(1, -0.1)], (1,): [(2, -0.1)], (1, 2): [(7, -0.1)]},
                  4: {(): [(9, -0.1)], (9,): [(4, -0.1)]}}
    acc, drafted = replay_chain(expansions, reference, lambda step, last: 3)
    # step 1: accept 1, 2 + bonus 3 -> 3 tokens; step 2: 9, 4 reach the end -> 2 tokens
    assert acc == pytest.approx(2.5) and drafted == pytest.approx(2.5)


def test_matmuls_far_from_their_bound_on_sm80_propose_skinny_mma():
    report = _report([{"name": "fused_NT_matmul3_cast", "seconds": 0.004, "ratio": 8.0},
                      {"name": "fused_NT_matmul4", "seconds": 0.001, "ratio": 1.5}], wall=0.010,
                     kernel_seconds=0.008, factors={"kernel": 4.0, "overhead": 1.25, "acceptance": 1.0})
    sm90 = PassContext(target_kind="cuda", arch="sm_90")
    cands = BuiltinProposer().propose(report, parse("kernel-schedule{set=nt-gemv}"), sm90, 9, [], set())
    by = {c.pipeline.replace("kernel-schedule{set=nt-gemv},", ""): c for c in cands}
    # 4 ms at 8x its bound could come to 2x: 3 ms removable, scaled to wall time (10 / 8)
    assert by["kernel-schedule{set=skinny-mma}"].estimated_gain == pytest.approx(0.010 / (0.010 - 0.003 * 1.25) - 1)
    # with no schedule pass sm_90 already runs skinny-mma (the default there): not proposed again
    default = BuiltinProposer().propose(report, parse(""), sm90, 9, [], set())
    assert not any("set=skinny-mma" in c.pipeline for c in default) and any(c.pipeline == "fuse-projections"
                                                                           for c in default)
    # stacking the projections: half of that time
    assert by["fuse-projections"].estimated_gain == pytest.approx(0.010 / (0.010 - 0.5 * 0.003 * 1.25) - 1)
    # w12-layout on a bf16 sm_90 deployment (legal with seeded weights there), not on a float32 one
    bf16 = PassContext(target_kind="cuda", arch="sm_90", dtype="bfloat16", weights_known=False)
    assert "w12-layout" in {c.pipeline for c in BuiltinProposer().propose(report, parse(""), bf16, 9, [], set())}
    assert "w12-layout" not in by
    old = BuiltinProposer().propose(report, parse(""), PassContext(target_kind="cuda", arch="sm_75"), 9, [], set())
    assert not any("skinny-mma" in c.pipeline for c in old)      # no bf16 mma.sync before sm_80


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_tree_estimate_counts_model_drafter_calls_and_not_ngram_lookups(drafter_kind):
    """A tree of 16 nodes replayed at 2.6 tokens per verification against a 6-token chain's 1.3:
    a model drafter's 16 expansions cost 16 calls (more than the chain's 6, so no gain is
    estimated), an n-gram drafter's lookups cost nothing (the acceptance ratio is the gain)."""
    from specpilot.passes.base import PassContext
    report = _report([], wall=1.0, kernel_seconds=0.9, factors={"acceptance": 2.0, "kernel": 1.1, "overhead": 1.1},
                     tree_acceptance={"16": 2.6}, drafter_kind=drafter_kind)
    cands = BuiltinProposer().propose(report, parse(""), PassContext(hybrid=False), 6, [], set())
    tree = [c for c in cands if c.pipeline.startswith("tree-verify")]
    if drafter_kind == "model":
        assert not tree                       # (2.6 / 1.3) / (17 / 7) - 1 < 0
    else:
        assert len(tree) == 1 and tree[0].estimated_gain == pytest.approx(2.6 / 1.3 - 1)
        assert "n-gram lookups, not counted" in tree[0].rationale


def test_schedule_set_gemms_are_matmul_evidence():
    """On sm_80+ verification runs the skinny-mma set's own GEMMs (``skinny_mma_N_K``): a narrow
    one far from its bound is evidence for stacking projections, the near-bound ones for W12."""
    report = _report([{"name": "skinny_mma_1024_5120", "seconds": 0.002, "ratio": 5.0},
                      {"name": "skinny_mma_17408_5120", "seconds": 0.004, "ratio": 1.3},
                      {"name": "gated_delta_rule", "seconds": 0.002, "ratio": 9.0}], wall=0.010,
                     kernel_seconds=0.008, factors={"kernel": 2.0, "overhead": 1.25, "acceptance": 1.0})
    bf16 = PassContext(target_kind="cuda", arch="sm_90", dtype="bfloat16", weights_known=False)
    by = {c.pipeline: c for c in BuiltinProposer().propose(report, parse(""), bf16, 6, [], set())}
    removable = 0.002 * (1 - 2.0 / 5.0) * (0.010 / 0.008)
    assert by["fuse-projections"].estimated_gain == pytest.approx(0.010 / (0.010 - 0.5 * removable) - 1)
    # W12: a quarter of the near-bound GEMM's time (the GDN kernel is no GEMM)
    assert by["w12-layout"].estimated_gain == pytest.approx(0.010 / (0.010 - 0.25 * 0.004 * 0.010 / 0.008) - 1)


@pytest.mark.parametrize("batch", [1, 8])
def test_batch_deployments_are_offered_the_batch_schedule_with_its_estimate(batch):
    """At max_batch 8 with 16-node trees: 64 nodes a pass (8 a request) verify 8 x 17 / (8 + 64) = 1.89x
    fewer rows; the replayed acceptance at 8 nodes (3.1) against 3.6 at 16 discounts it.  A batch of one
    has nothing to share: no proposal (and the passes are illegal there)."""
    report = _report([], wall=1.0, kernel_seconds=0.8, factors={"kernel": 2.0, "acceptance": 1.2, "overhead": 1.1},
                     engine="compiled-tree", tree_acceptance={"8": 3.1, "16": 3.6, "32": 4.0})
    context = PassContext(hybrid=True, max_batch=batch)
    cands = BuiltinProposer().propose(report, parse("tree-verify{budget=16},gdn-path-recompute"), context, 5, [], set())
    mine = [c for c in cands if "node-budget" in c.pipeline]
    if batch == 1:
        assert not mine
        return
    assert [c.pipeline for c in mine] == ["tree-verify{budget=16},gdn-path-recompute,node-budget,"
                                          "draft-length{length=16,dynamic=true,min=8,step=4},prompt-admission{chunk=32}"]
    assert mine[0].estimated_gain == pytest.approx((3.1 / 3.6) * (8 * 17 / 72) - 1)


@pytest.mark.parametrize("pipeline,batch,offered", [
    ("tree-verify{budget=16},gdn-path-recompute,node-budget{nodes=64}", 8, True),
    ("tree-verify{budget=16},gdn-path-recompute,node-budget{nodes=64}", 1, False),
    ("tree-verify{budget=16},gdn-path-recompute", 8, False),                              # even trees: nothing pads
    ("tree-verify{budget=16,packed=true},gdn-path-recompute,node-budget{nodes=64}", 8, False)])
def test_a_shared_budget_is_offered_packed_verification_with_its_estimate(pipeline, batch, offered):
    """8 requests, trees of up to 16 sharing 64 nodes: at most 8 x 17 = 136 rows padded, 8 + 64 = 72 real;
    half the gap, 0.5 x (136 / 72 - 1), is the estimate.  Not at batch 1, not without a shared budget, not twice."""
    report = _report([], wall=1.0, kernel_seconds=0.8, factors={"kernel": 2.0, "acceptance": 1.2, "overhead": 1.1},
                     engine="compiled-tree", tree_acceptance={"8": 3.1, "16": 3.6})
    now = parse(pipeline)
    cands = BuiltinProposer().propose(report, now, PassContext(hybrid=True, max_batch=batch), 5, [], set())
    mine = [c for c in cands if "packed=true" in c.pipeline and "packed=true" not in pipeline]
    if not offered:
        assert not mine
        return
    assert len(mine) == 1 and mine[0].direction == "kernel"
    assert mine[0].pipeline == "tree-verify{budget=16,packed=true},gdn-path-recompute,node-budget"   # 64: the default
    assert mine[0].estimated_gain == pytest.approx(0.5 * (136 / 72 - 1))


def _chain_lattice(reference: list[int], wrong: int) -> dict:
    """At every position the drafter's chain starts with the reference token, then goes wrong."""
    return {str(p): [[[], [[reference[p], -0.1]]], [[reference[p]], [[wrong, -0.2]]]]
            for p in range(1, len(reference))}


@pytest.mark.parametrize("pipeline,batch,offered", [("", 8, True), ("draft-length{length=4,dynamic=true}", 8, True),
                                                    ("", 1, False), ("draft-length{length=4,priced=true}", 8, False),
                                                    ("tree-verify{budget=4}", 8, False)])
def test_batched_chains_are_offered_priced_lengths_with_their_estimate(pipeline, batch, offered):
    """Chains whose second draft always fails: every verification keeps the first draft and the bonus token,
    2 tokens for the k + 1 rows a chain of k verifies -- 2 / 5 at length 4, 2 / 2 at length 1, so pricing the
    rows (counted as time in a batch) is estimated at 1.0 / 0.4 - 1 = 1.5; against the dynamic schedule, which
    shortens the chains itself (replayed as it runs), at less.  Not offered at batch 1, with a tree, or where
    the chains are priced already."""
    reference = list(range(10, 211))
    report = _report([], wall=1.0, kernel_seconds=0.9, factors={"kernel": 2.0, "acceptance": 1.2, "overhead": 1.1},
                     lattices=[_chain_lattice(reference, wrong=3)])
    cands = BuiltinProposer().propose(report, parse(pipeline), PassContext(max_batch=batch), 4, [reference], set())
    mine = [c for c in cands if "priced=true" in c.pipeline and c.pipeline != pipeline]
    if not offered:
        assert not mine
        return
    (cand,) = mine
    assert "length=4" in cand.pipeline and ("dynamic=true" in cand.pipeline) == ("dynamic" in pipeline)
    assert cand.direction == "kernel" and "chains of 1" in cand.rationale
    if "dynamic" in pipeline:
        assert 0.03 < cand.estimated_gain < 1.0 / 0.4 - 1 - 0.1
    else:
        assert cand.estimated_gain == pytest.approx(1.0 / 0.4 - 1, rel=0.02)
