"""The pass toolkit: pipeline text round trips, typed options, z3 legality with reasons in
words, enumeration of legal orderings, and the runner's instruments.  The passes here are
fixtures shaped like the real ones (requires / conflicts / order / target / legality)."""

from __future__ import annotations

import pytest

from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import Option, Pass, PassContext
from specpilot.passes.legality import check, orderings
from specpilot.passes.pipeline import Pipeline, parse


class Layout(Pass):
    name, doc = "w12-layout", "fixture: weights in a new layout"
    options = (Option("min_rows", int, 0, "skip smaller matrices"), Option("escape_cap", float, 0.01))
    statistics = ("rewritten",)

    def legal(self, context):
        return (context.dtype != "float16", "float16 weights have no bf16 bit layout")

    def apply(self, mod, context):
        import tvm
        context.statistics[self.name]["rewritten"] = len(mod.functions)
        return tvm.ir.IRModule(dict(mod.functions))


class View(Pass):
    name = "nested-int8-view"
    requires = ("w12-layout",)
    targets = ("cuda",)


class Tree(Pass):
    name = "tree-verify"
    options = (Option("budget", int, 64), Option("exact", bool, True), Option("mode", str, "best-first",
                                                                                  choices=("best-first", "top-k")))


class Recompute(Pass):
    name = "gdn-path-recompute"
    requires = ("tree-verify",)

    def legal(self, context):
        return (context.hybrid, "the target has no Gated DeltaNet layers")


class Chain(Pass):
    name = "chain-only"
    conflicts = ("tree-verify",)


class Late(Pass):
    name = "late"
    after = ("w12-layout", "tree-verify")


REG = {cls.name: cls for cls in (Layout, View, Tree, Recompute, Chain, Late)}
CUDA_HYBRID = PassContext(target_kind="cuda", arch="sm_90", hybrid=True, dtype="bfloat16")


@pytest.mark.parametrize("text,canonical", [
    ("w12-layout", "w12-layout"),
    ("w12-layout{min_rows=0}", "w12-layout"),                            # defaults are omitted
    (" w12-layout{escape_cap=0.5, min_rows=3} ,tree-verify{budget=32}",   # declared order, no spaces
     "w12-layout{min_rows=3,escape_cap=0.5},tree-verify{budget=32}"),
    ("tree-verify{exact=false,mode=top-k}", "tree-verify{exact=false,mode=top-k}"),
    ("", ""),
])
def test_round_trip(text, canonical):
    p = parse(text, REG)
    assert str(p) == canonical
    assert parse(str(p), REG) == p and hash(parse(str(p), REG)) == hash(p)


def test_options_are_typed():
    p = parse("tree-verify{budget=8}", REG)
    assert p.passes[0]["budget"] == 8 and isinstance(p.passes[0]["budget"], int)
    assert parse("w12-layout{escape_cap=1}", REG).passes[0]["escape_cap"] == 1.0


@pytest.mark.parametrize("text,message", [("logit-bias-fault{after=1,token=5,bias=1e400}", "expected a finite number"),
                                          ("logit-bias-fault{after=4294967296,token=5}", "outside the 32-bit range")])
def test_options_beyond_their_type_s_range_are_refused(text, message):
    from specpilot.passes.registry import REGISTRY
    with pytest.raises(SpecPilotError, match=message):
        parse(text, REGISTRY)


@pytest.mark.parametrize("text,message", [
    ("tree-verify{budget=many}", "tree-verify{budget=...}: expected int, got 'many'"),
    ("tree-verify{budget=1.5}", "expected int, got 1.5"),
    ("tree-verify{budget=true}", "expected int, got True"),
    ("tree-verify{exact=yes}", "expected true or false"),
    ("tree-verify{mode=greedy}", "expected one of ['best-first', 'top-k']"),
    ("tree-verify{depth=3}", "unknown option 'depth'; options: budget, exact, mode"),
    ("tree-verify{budget=3,budget=4}", "option 'budget' given twice"),
    ("tree-verify{budget=3", "expected ',' or '}'"),
    ("tree-verify w12-layout", "expected ',' between passes"),
    ("Tree-Verify", "is not a pass name"),
    ("fuse-everything", "unknown pass 'fuse-everything'; known: chain-only, gdn-path-recompute"),
    ("tree-verify,", "expected a pass name"),
])
def test_parse_errors_say_where_and_what(text, message):
    with pytest.raises(SpecPilotError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("{", r"\{").replace("}", r"\}").replace("(", r"\(").replace(")", r"\)")):
        parse(text, REG)


def test_legal_pipeline_has_no_reasons():
    assert check(parse("w12-layout,nested-int8-view,tree-verify,gdn-path-recompute,late", REG), CUDA_HYBRID) == []


@pytest.mark.parametrize("text,context,reasons", [
    ("nested-int8-view,w12-layout", CUDA_HYBRID, ["nested-int8-view requires w12-layout earlier in the pipeline"]),
    ("nested-int8-view", CUDA_HYBRID, ["nested-int8-view requires w12-layout, which is not in the pipeline"]),
    ("tree-verify,chain-only", CUDA_HYBRID, ["chain-only conflicts with tree-verify"]),
    ("late,tree-verify", CUDA_HYBRID, ["late must come after tree-verify"]),
    ("w12-layout,nested-int8-view", PassContext(target_kind="llvm"),
     ["nested-int8-view is not available for target llvm (only cuda)"]),
    ("tree-verify,gdn-path-recompute", PassContext(target_kind="cuda", hybrid=False),
     ["gdn-path-recompute: the target has no Gated DeltaNet layers"]),
    ("w12-layout", PassContext(target_kind="cuda", dtype="float16"),
     ["w12-layout: float16 weights have no bf16 bit layout"]),
    ("tree-verify,tree-verify", CUDA_HYBRID, ["tree-verify appears 2 times; a pass may appear once"]),
])
def test_illegal_pipelines_name_the_unsatisfied_constraint(text, context, reasons):
    assert check(parse(text, REG), context) == reasons


def test_several_violations_are_all_reported():
    reasons = check(parse("late,tree-verify,chain-only", REG), CUDA_HYBRID)
    assert reasons == ["chain-only conflicts with tree-verify", "late must come after tree-verify"]


def test_enumerate_legal_orderings():
    passes = [REG[n]() for n in ("late", "tree-verify", "w12-layout", "nested-int8-view")]
    found = [str(p) for p in orderings(passes, CUDA_HYBRID)]
    # w12-layout < nested-int8-view, and late after both w12-layout and tree-verify
    assert found == [
        "tree-verify,w12-layout,late,nested-int8-view",
        "tree-verify,w12-layout,nested-int8-view,late",
        "w12-layout,nested-int8-view,tree-verify,late",
        "w12-layout,tree-verify,late,nested-int8-view",
        "w12-layout,tree-verify,nested-int8-view,late",
    ]
    assert all(check(parse(p, REG), CUDA_HYBRID) == [] for p in found)
    assert orderings([REG["tree-verify"](), REG["chain-only"]()], CUDA_HYBRID) == []


def test_runner_applies_instruments_and_refuses_illegal():
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return x

    from specpilot.passes.runner import run_pipeline
    seen = []
    context = PassContext(target_kind="cuda", dtype="bfloat16")
    out, records = run_pipeline(parse("w12-layout{min_rows=2}", REG), Module, context,
                                after=lambda name, mod: seen.append((name, len(mod.functions))))
    assert seen == [("w12-layout", 1)] and relax.analysis.check_well_formed(out)
    assert records[0].text == "w12-layout{min_rows=2}" and records[0].statistics == {"rewritten": 1}
    assert records[0].seconds >= 0
    with pytest.raises(SpecPilotError, match="illegal pipeline 'w12-layout': w12-layout: float16"):
        run_pipeline(parse("w12-layout", REG), Module, PassContext(dtype="float16"))


def test_empty_registry_and_spec_passes_key(tmp_path):
    """A spec's pipeline is checked in two places: its grammar when the spec loads (core knows no
    passes), which passes exist when it is lowered; both errors name the spec's ``passes`` field."""
    import yaml

    from specpilot.compiler.build import lower_and_apply
    from specpilot.core.spec import load_spec
    from specpilot.core.errors import SpecError
    from specpilot.core.target import parse_target
    assert Pipeline() == parse("")
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"target": {"architecture": "LlamaForCausalLM", "config": {
        "vocab_size": 300, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 1,
        "num_attention_heads": 2}, "init": {"seed": 0}}, "passes": "no-such-pass{x=1}"}))
    with pytest.raises(SpecError, match=r"m.yaml: passes: pipeline 'no-such-pass\{x=1\}', column 1: unknown pass"):
        lower_and_apply(load_spec(path), parse_target("llvm"))
    path.write_text(path.read_text().replace("no-such-pass{x=1}", "tree-verify{budget"))
    with pytest.raises(SpecError, match=r"m.yaml: passes: pipeline 'tree-verify\{budget', column 13: expected key=value"):
        load_spec(path)


def test_cli_passes_check_and_list(run_cli):
    code, out, _ = run_cli("passes", "list", "--json")
    assert code == 0 and isinstance(__import__("json").loads(out), list)
    code, out, _ = run_cli("passes", "check", "")
    assert code == 0 and out.startswith("legal")
    code, out, _ = run_cli("passes", "list", "--json")
    assert [p["name"] for p in __import__("json").loads(out)] == [
        "draft-length", "fuse-projections", "gdn-path-recompute", "kernel-schedule", "logit-bias-fault", "nested-int8-view",
        "node-budget", "prompt-admission", "tree-verify", "two-level-verify", "w12-layout"]
    code, out, _ = run_cli("passes", "check", "w12-layout", "--target", "llvm")
    assert code == 0 and out.startswith("legal: w12-layout")
    code, out, _ = run_cli("passes", "check", "w12-layout", "--target", "cuda -arch=sm_90")   # no spec: float32
    assert code == 1 and "w12-layout: the GPU W12 GEMM multiplies bf16 activations: needs dtype bfloat16" in out
    code, _, err = run_cli("passes", "check", "fuse-everything")
    assert code == 2 and "unknown pass 'fuse-everything'" in err
