"""tree-verify: what it adds to a module, where it is refused, and compiled tree decoding on
the CPU that emits stock's tokens exactly for budgets 8 / 32 / 64."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import yaml

from specpilot.compiler.build import BuildRequest, build
from specpilot.core.config import ModelConfig
from specpilot.compiler.lower import lower_deployment
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse
from specpilot.passes.runner import run_pipeline
from specpilot.runtime.decoding import speculative_tree
from specpilot.runtime.systems import from_build
from tests.conftest import DENSE, TINY_CONFIGS, tiny_config


def _module(arch=DENSE):
    cfg = tiny_config(arch)
    mod, _ = lower_deployment(cfg, None, "float32", 64, gpu=False, n_rows=2)
    return cfg, mod


def test_adds_compact_kv_and_changes_nothing_else():
    _, before = _module()
    after, records = run_pipeline(parse("tree-verify{budget=32}"), before, PassContext(target_kind="llvm"))
    added = {gv.name_hint for gv in after.get_global_vars()} - {gv.name_hint for gv in before.get_global_vars()}
    assert added == {"target_compact_kv", "compact_kv"}
    for gv in before.get_global_vars():
        tvm.ir.assert_structural_equal(after[gv.name_hint], before[gv])
    text = after["target_compact_kv"].script()
    assert "call_tir_inplace" in text and "compact_kv" in text
    assert records[0].statistics == {"functions_added": 1, "budget": 32}


@pytest.mark.parametrize("text,context,reason", [
    ("tree-verify", PassContext(hybrid=True), "needs gdn-path-recompute"),
    ("tree-verify{budget=0}", PassContext(), "budget must be in 1..1024"),
])
def test_illegal_uses_are_refused_with_the_reason(text, context, reason):
    with pytest.raises(SpecPilotError, match=reason):
        run_pipeline(parse(text), _module()[1], context)


def test_compact_kv_kernel_moves_entries_within_a_row():
    """Reference semantics on random data: entries move in order inside the given pool row only."""
    from specpilot import kernels
    A, R, H, S, d = 2, 3, 2, 11, 5
    kernel = kernels.compact_kv(A, R, H, S, d, "float32", gpu=False)
    lib = tvm.compile(kernel.with_attr("global_symbol", "compact_kv"), target="llvm")
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((A, 2, R, H, S, d)).astype("float32")
    want = kv.copy()
    src, dst = np.array([[5, 7, 9]], "int32"), np.array([[4, 5, 6]], "int32")
    for s, t in zip(src[0], dst[0]):
        want[:, :, 2, :, t] = want[:, :, 2, :, s]
    arr = tvm.runtime.tensor(kv)
    lib["compact_kv"](arr, tvm.runtime.tensor(np.array([2], "int32")), tvm.runtime.tensor(src),
                      tvm.runtime.tensor(dst))
    np.testing.assert_array_equal(arr.numpy(), want)


@pytest.fixture(scope="module")
def tree_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tree")
    data = {"target": {"architecture": "LlamaForCausalLM", "config": TINY_CONFIGS["LlamaForCausalLM"],
                       "init": {"seed": 1}},
            "drafter": {"kind": "early-exit", "layers": 2, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 300, "max_batch": 2},
            "passes": "tree-verify{budget=16}"}
    (tmp / "model.yaml").write_text(yaml.safe_dump(data))
    build(BuildRequest(load_spec(tmp / "model.yaml"), parse_target("llvm"), tmp / "b"))
    return tmp / "b"


def test_compiled_tree_decoding_is_exact(tree_build):
    system = from_build(tree_build)
    assert {"stock-tree", "compiled-tree"} <= set(system.engines)
    compiled, make = system.engines["compiled"].model, system.engines["compiled-tree"].drafter
    prompts = [[(11 * i + 3 * r) % 301 for i in range(9 + 5 * r)] for r in range(3)]
    off_rank = 0
    for prompt in prompts:
        stock = system.generate("stock", prompt, 48)
        for budget in (8, 32, 64):
            gen = speculative_tree(compiled, make(), prompt, 48, budget, 300, force=stock.tokens)
            assert gen.choices == stock.tokens, (prompt, budget)
            off_rank += gen.off_first_rank
        assert system.generate("compiled-tree", prompt, 48).tokens == stock.tokens
        assert system.generate("stock-tree", prompt, 48).tokens == stock.tokens
    assert off_rank > 0


def test_sampled_tree_decoding_draws_stock_s_tokens(tree_build):
    from specpilot.core.sampling import SamplingParams
    from specpilot.runtime.forcing import force
    system = from_build(tree_build)
    params = SamplingParams(temperature=1.1, top_k=30, seed=5)
    requests = [([(7 * i + r) % 301 for i in range(8 + 3 * r)], 48) for r in range(3)]
    report, stock_runs, runs = force(system, "compiled-tree", requests, sampling=params)
    assert report.passed and not report.excused, report.reason
    assert system.generate("compiled-tree", requests[0][0], 48, sampling=params).tokens == stock_runs[0].tokens
    assert system.generate("stock-tree", requests[0][0], 48, sampling=params).tokens == stock_runs[0].tokens


def test_a_build_without_tree_verify_cannot_keep_a_tree_path(tmp_path):
    data = {"target": {"architecture": DENSE, "config": TINY_CONFIGS[DENSE], "init": {"seed": 1}},
            "drafter": {"kind": "ngram"}, "deployment": {"dtype": "float32", "max_seq_len": 64}}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    build(BuildRequest(load_spec(tmp_path / "model.yaml"), parse_target("llvm"), tmp_path / "b"))
    model = from_build(tmp_path / "b").engines["compiled"].model
    st = model.new_state(64)
    model.forward([1, 2, 3, 4], st)
    with pytest.raises(SpecPilotError, match="build it with the tree-verify pass"):
        model.accept_path(st, 1, [0, 2])
    assert isinstance(model.cfg, ModelConfig)


@pytest.mark.parametrize("text", ["tree-verify", "tree-verify{budget=8}", "w12-layout,tree-verify{budget=32},gdn-path-recompute",
                                  "draft-length{length=2}", ""])
def test_the_grammar_reads_the_budget_like_the_parser(text):
    from specpilot.passes.pipeline import parse
    from specpilot.core.pipeline_text import tree_budget
    want = next((p["budget"] for p in parse(text).passes if p.name == "tree-verify"), 0)
    assert tree_budget(text) == want


@pytest.mark.parametrize("arch", [DENSE, "Qwen3_5ForCausalLM"])
def test_a_fixed_size_verification_pads_its_trees_and_chains_and_keeps_stock_s_tokens(arch, tmp_path):
    """tree-verify{fixed=true}: target_verify_tree takes one sequence of exactly budget + 1 tokens;
    every verification that fits is padded to it (trees and chains, the hybrid's path recompute
    included) and decoding stays stock's; a larger tree falls back to target_verify."""
    hybrid = "linear_attention" in tiny_config(arch).layer_types
    data = {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 4}},
            "drafter": {"kind": "early-exit", "layers": 2, "top_k": 3, "draft_len": 4},
            "deployment": {"dtype": "float32", "max_seq_len": 300, "max_batch": 2},
            "passes": "tree-verify{budget=10,fixed=true}" + (",gdn-path-recompute" if hybrid else "")}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    manifest = build(BuildRequest(load_spec(tmp_path / "model.yaml"), parse_target("llvm"), tmp_path / "b"))
    assert manifest.tree.fixed_tokens == 11
    system = from_build(tmp_path / "b")
    compiled, make = system.engines["compiled"].model, system.engines["compiled-tree"].drafter
    calls = {"fixed": 0, "any": 0}
    fixed, any_size = compiled._verify_fixed, compiled._verify

    def counted(fn, key):
        def call(*args):
            calls[key] += 1
            assert key == "any" or tuple(args[0].shape) == (1, 11)
            return fn(*args)
        return call
    compiled._verify_fixed, compiled._verify = counted(fixed, "fixed"), counted(any_size, "any")
    for r in range(3):
        prompt = [(13 * i + 5 * r) % 301 for i in range(7 + 6 * r)]
        stock = system.generate("stock", prompt, 40)
        for budget in (4, 10):
            before = dict(calls)
            gen = speculative_tree(compiled, make(), prompt, 40, budget, 300, force=stock.tokens)
            assert gen.choices == stock.tokens, (prompt, budget)
            assert calls["fixed"] > before["fixed"] and calls["any"] == before["any"]
        before = dict(calls)
        assert speculative_tree(compiled, make(), prompt, 40, 32, 300).tokens == stock.tokens
        assert calls["any"] > before["any"]          # 33 tokens do not fit the fixed 11
        before = dict(calls)
        assert system.generate("compiled-spec", prompt, 40).tokens == stock.tokens
        assert calls["fixed"] > before["fixed"]
    from specpilot.core.sampling import SamplingParams
    from specpilot.runtime.forcing import force
    before = dict(calls)
    requests = [([(5 * i + r) % 301 for i in range(9 + 4 * r)], 32) for r in range(2)]
    report, _, _ = force(system, "compiled-tree", requests, sampling=SamplingParams(temperature=0.9, top_k=40, seed=3))
    assert report.passed and not report.excused, report.reason       # seeded sampling draws stock's tokens
    assert calls["fixed"] > before["fixed"]
