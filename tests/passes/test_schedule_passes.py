"""draft-length, kernel-schedule and the logit-bias-fault test instrument."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpilot.compiler.build import BuildRequest, build, lower_and_apply
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.legality import check
from specpilot.passes.pipeline import parse
from specpilot.runtime.forcing import force_requests
from specpilot.runtime.systems import from_build
from specpilot.runtime.draft_schedule import DraftSchedule

LLAMA = Path(__file__).parents[2] / "examples" / "tiny-llama.yaml"


def test_draft_schedule_dynamic_follows_acceptance():
    fixed = DraftSchedule(5)
    fixed.update(0)
    assert fixed.next() == 5
    s = DraftSchedule(8, minimum=2, dynamic=True)
    assert s.next() == 8                      # optimistic start
    for _ in range(6):
        s.update(0)
    assert s.next() == 2                      # drafts keep failing: the minimum
    for _ in range(8):
        s.update(7)
    assert s.next() == 8                      # drafts keep landing: back to the maximum
    with pytest.raises(ValueError):
        DraftSchedule(0)


def test_legality_of_schedule_passes():
    assert check(parse("draft-length{length=3,dynamic=true},kernel-schedule{set=cpu-nt}"), PassContext()) == []
    assert check(parse("draft-length{length=2,min=3}"), PassContext()) == [
        "draft-length: min (3) exceeds length (2)"]
    assert check(parse("kernel-schedule{set=nt-gemv}"), PassContext()) == [
        "kernel-schedule: set=nt-gemv is not a llvm schedule set (tvm-default, cpu-nt)"]
    assert check(parse("tree-verify{budget=8},draft-length{length=2}"), PassContext()) == []   # nodes a request
    assert check(parse("draft-length{priced=true}"), PassContext()) == [
        "draft-length: priced: prices batched passes; needs deployment.max_batch >= 2"]
    assert check(parse("draft-length{priced=true}"), PassContext(max_batch=2)) == []


def test_schedule_passes_only_annotate():
    spec, target = load_spec(LLAMA), parse_target("llvm")
    stock = lower_and_apply(spec, target, "").mod
    lowered = lower_and_apply(spec, target, "draft-length{length=2,dynamic=true},kernel-schedule{set=cpu-nt}")
    mod, records = lowered.mod, lowered.records
    assert {k: str(v) for k, v in mod.attrs.items()} == {
        "specpilot.draft_len": "2", "specpilot.draft_dynamic": "1", "specpilot.draft_min": "1", "specpilot.draft_step": "1",
        "specpilot.schedule": "cpu-nt"}
    import tvm
    from specpilot.compiler.build import ir_hash
    assert ir_hash(tvm.IRModule(mod.functions)) == ir_hash(stock) != ir_hash(mod)   # functions unchanged
    assert records[1].statistics == {"schedule": "cpu-nt", "cuda_graph": 0}
    batched = spec.model_copy(update={"deployment": spec.deployment.model_copy(update={"max_batch": 2})})
    priced = lower_and_apply(batched, target, "draft-length{length=2,dynamic=true,priced=true}").mod
    assert str(priced.attrs["specpilot.draft_priced"]) == "1"           # set only where asked: the IR differs


def test_cuda_graph_knob_is_legal_only_for_cuda_and_round_trips():
    assert str(parse("kernel-schedule{set=nt-gemv,graph=true}")) == "kernel-schedule{set=nt-gemv,graph=true}"
    assert str(parse("kernel-schedule{graph=false}")) == "kernel-schedule"
    assert check(parse("kernel-schedule{graph=true}"), PassContext()) == [
        "kernel-schedule: graph=true needs a cuda target (CUDA graphs), not llvm"]
    assert check(parse("kernel-schedule{graph=true}"), PassContext(target_kind="cuda", arch="sm_90")) == []


def test_fault_passes_short_forcing_and_fails_long(tmp_path):
    """The paper's fault-injection experiment, scaled down: a logit bias from absolute position
    40 on is invisible to forcing that stops before it and caught by forcing past it."""
    spec = load_spec(LLAMA)
    d = tmp_path / "b"
    manifest = build(BuildRequest(spec, parse_target("llvm"), d, passes="draft-length{length=2},logit-bias-fault{after=40,token=5}"))
    assert manifest.serving.draft_len == 2 and manifest.passes[1]["statistics"] == {"functions_faulted": 3}
    system = from_build(d)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]                         # 8 tokens: new token i sits at position 8 + i - 1
    for engine in ("compiled", "compiled-spec"):
        stock = system.generate("stock", prompt, 64)
        short = force_requests([_cut(stock, 32)], [system.generate(engine, prompt, 32, force=stock.tokens[:32])])
        assert short.passed
        long = force_requests([stock], [system.generate(engine, prompt, 64, force=stock.tokens)])
        first = long.first_divergence
        assert not long.passed and first.system_token == 5 and first.position >= 33


def _cut(g, n):
    from dataclasses import replace
    return replace(g, tokens=g.tokens[:n], margins=g.margins[:n])


def test_skinny_mma_is_the_default_on_sm80_and_later_and_illegal_before():
    import tvm

    from specpilot.passes.runner import run_pipeline
    from specpilot.core.schedule_sets import default_schedule, sm_version
    Ctx = PassContext
    assert [sm_version(a) for a in ("sm_80", "sm_90a", "sm_120", None, "")] == [80, 90, 120, 0, 0]
    assert default_schedule("cuda", "sm_90") == default_schedule("cuda", "sm_120") == "skinny-mma"
    assert default_schedule("cuda", "sm_75") == "nt-gemv" and default_schedule("llvm") == "tvm-default"
    assert check(parse("kernel-schedule{set=skinny-mma}"), Ctx(target_kind="cuda", arch="sm_90")) == []
    assert check(parse("kernel-schedule{set=skinny-mma}"), Ctx(target_kind="cuda", arch="sm_75")) == [
        "kernel-schedule: set=skinny-mma needs bf16 mma.sync (sm_80 or later), not sm_75"]
    assert check(parse("kernel-schedule{set=skinny-mma}"), Ctx()) == [
        "kernel-schedule: set=skinny-mma is not a llvm schedule set (tvm-default, cpu-nt)"]
    for arch, chosen in (("sm_90", "skinny-mma"), ("sm_75", "nt-gemv")):
        mod, records = run_pipeline(parse("kernel-schedule"), tvm.IRModule(), Ctx(target_kind="cuda", arch=arch))
        assert records[0].statistics["schedule"] == chosen and str(mod.attrs["specpilot.schedule"]) == chosen


def test_build_refuses_skinny_mma_where_it_cannot_run(tmp_path):
    with pytest.raises(SpecPilotError, match="skinny-mma needs a cuda target of sm_80 or later"):
        build(BuildRequest(load_spec(LLAMA), parse_target("llvm"), tmp_path / "b", schedule="skinny-mma"))


def test_batch_schedule_passes_are_legal_only_where_they_make_sense():
    batch = PassContext(hybrid=True, max_batch=8)
    full = "tree-verify{budget=16},gdn-path-recompute,draft-length{length=16,min=8,step=4,dynamic=true}," \
           "node-budget{nodes=64,min_prob=0.01},prompt-admission{chunk=32}"
    assert check(parse(full), batch) == []
    assert check(parse(full), PassContext(hybrid=True)) == [
        "node-budget: shares a pass among requests: needs deployment.max_batch >= 2",
        "prompt-admission: rides beside running requests: needs deployment.max_batch >= 2"]
    assert check(parse("prompt-admission"), batch) == ["prompt-admission requires node-budget, which is not in the pipeline"]
    assert check(parse("node-budget"), batch) == ["node-budget requires tree-verify, which is not in the pipeline"]
    dense = PassContext(max_batch=8)
    assert check(parse("tree-verify{budget=8},draft-length{length=16}"), dense) == [
        "draft-length: length (16) exceeds the tree budget (8) of tree-verify"]
    assert check(parse("tree-verify{budget=8},node-budget{nodes=0}"), dense) == ["node-budget: nodes must be in 1..4096, got 0"]
    assert check(parse("tree-verify{budget=8},node-budget{min_prob=1.0}"), dense) == [
        "node-budget: min_prob must be in [0, 1), got 1.0"]
    assert check(parse("draft-length{step=0}"), batch) == ["draft-length: step must be in 1..64, got 0"]
    assert check(parse("tree-verify{budget=8},node-budget,prompt-admission{passes=0}"), PassContext(max_batch=8)) == [
        "prompt-admission: passes must be in 1..1024, got 0"]


def test_batch_schedule_reaches_the_manifest_and_the_engine(tmp_path):
    """The example's batch schedule, its chains and trees priced by their passes' cost (`draft-length{priced}`)."""
    spec = load_spec(Path(__file__).parents[2] / "examples" / "tiny-hybrid-batch.yaml")
    priced = spec.passes.replace("dynamic=true}", "dynamic=true,priced=true}")
    assert priced != spec.passes
    manifest = build(BuildRequest(spec, parse_target("llvm"), tmp_path / "b", priced))
    assert manifest.node_budget.nodes == 16 and (manifest.admission.chunk, manifest.admission.passes) == (8, 4)
    assert (manifest.serving.draft_nodes, manifest.serving.draft_min, manifest.serving.draft_step) == (8, 4, 2)
    assert manifest.serving.draft_priced
    system = from_build(tmp_path / "b")
    policy = system.batch_policy("compiled-tree-sched")
    assert (policy.mode, policy.max_batch, policy.nodes, policy.budget, policy.lengths, policy.chunk) == \
        ("tree", 4, 8, 16, (8, 6, 4), 8)
    assert system.batch_policy("compiled-tree").budget is None             # the plain tree shares nothing
    chain = system.batch_policy("compiled-spec")                            # chains share the pass's budget evenly
    assert (chain.mode, chain.budget, chain.chunk, chain.adaptive) == ("chain", 16, None, True)
    assert system.batch_policy("compiled-tree-sched").adaptive             # a prefix of the best-first budget
    assert system.batch_policy("compiled").budget is None
    with pytest.raises(SpecPilotError, match="holds 4 sequence"):
        system.batch_policy("compiled", 5)
