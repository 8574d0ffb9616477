"""Before / expected IR for the passes that change what a build verifies: tree-verify,
gdn-path-recompute and two-level-verify -- each on a small hand-written module, the expected module
built independently of the pass, plus where each must not fire and where it must raise."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

from specpilot import kernels
from specpilot.core.errors import SpecPilotError
from specpilot.kernels import gdn_tree
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse
from specpilot.passes.runner import run_pipeline

KV = (2, 2, 3, 2, 11, 5)      # attention layers, k/v, pool rows, KV heads, capacity, head dim


@I.ir_module
class Verify:
    @R.function
    def target_verify(tokens: R.Tensor(("b", "n"), "int32"),
                      kv: R.Tensor((2, 2, 3, 2, 11, 5), "float32")) -> R.Tensor((2, 2, 3, 2, 11, 5), "float32"):
        return kv


def _with_compact_kv(mod):
    """``mod`` plus target_compact_kv(kv, rows, src, dst): the pool's entries moved in place."""
    bb = relax.BlockBuilder(mod)
    batch, n = tirx.Var("batch", "int64"), tirx.Var("n", "int64")
    kv_ty = relax.TensorType(KV, "float32")
    kv = relax.Var("kv", kv_ty)
    rows = relax.Var("rows", relax.TensorType([batch], "int32"))
    src = relax.Var("src", relax.TensorType([batch, n], "int32"))
    dst = relax.Var("dst", relax.TensorType([batch, n], "int32"))
    with bb.function("target_compact_kv", [kv, rows, src, dst]):
        gv = bb.add_func(kernels.compact_kv(2, 3, 2, 11, 5, "float32", False), "compact_kv")
        out = bb.emit(relax.call_tir_inplace(gv, [kv, rows, src, dst], inplace_indices=[0], out_ty=kv_ty))
        bb.emit_func_output(out)
    return bb.get()


def test_tree_verify_before_expected():
    after, _ = run_pipeline(parse("tree-verify{budget=8}"), Verify, PassContext(target_kind="llvm"))
    tvm.ir.assert_structural_equal(after, _with_compact_kv(Verify))


def test_tree_verify_raises_without_a_verify_function():
    @I.ir_module
    class NoVerify:
        @R.function
        def target_decode(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            return x

    with pytest.raises(SpecPilotError, match="no target_verify"):
        run_pipeline(parse("tree-verify"), NoVerify, PassContext())


def test_packed_tree_verify_raises_where_the_lowering_added_no_packed_function():
    with pytest.raises(SpecPilotError, match="no target_verify_packed"):
        run_pipeline(parse("tree-verify{budget=8,packed=true}"), Verify, PassContext(target_kind="llvm"))


def _gdn_module(keep_states: bool):
    """A module holding a chain-form verify recurrence (keep_states: it records) and conv kernel."""
    bb = relax.BlockBuilder()
    bb.add_func(kernels.gated_delta_rule(2, 8, 6, keep_states=keep_states, gpu=False), "recurrence")
    bb.add_func(kernels.gdn_conv_verify(12, 3, "float32", gpu=False), "conv")
    return bb.get()


def _replaced(mod, forms: dict):
    out = mod.clone()
    for name, func in forms.items():
        out[name] = func
    return out


@pytest.mark.parametrize("form", ["chunked", "sequential"])
def test_gdn_path_recompute_before_expected(form):
    before = Verify.clone()
    for gv, func in _gdn_module(keep_states=True).functions.items():
        before[gv.name_hint] = func
    pipeline = "tree-verify{budget=8},gdn-path-recompute" + ("{form=sequential}" if form == "sequential" else "")
    after, records = run_pipeline(parse(pipeline), before, PassContext(target_kind="llvm", hybrid=True))
    recurrence = (gdn_tree.gated_delta_rule_tree(2, 8, 6, gpu=False, **gdn_tree.form_for(9)) if form == "chunked"
                  else kernels.gated_delta_rule(2, 8, 6, keep_states=True, gpu=False, tree=True))
    expected = _replaced(_with_compact_kv(before), {
        "recurrence": recurrence, "conv": kernels.gdn_conv_verify(12, 3, "float32", gpu=False, tree=True)})
    tvm.ir.assert_structural_equal(after, expected)
    assert records[1].statistics == {"kernels_rewritten": 2}


def test_gdn_path_recompute_leaves_a_recurrence_that_records_nothing():
    """Prefill / decode recurrences (no per-token records) follow one sequence: not rewritten."""
    before = Verify.clone()
    for gv, func in _gdn_module(keep_states=False).functions.items():
        before[gv.name_hint] = func
    after, records = run_pipeline(parse("tree-verify,gdn-path-recompute"), before, PassContext(hybrid=True))
    tvm.ir.assert_structural_equal(after["recurrence"], before["recurrence"])
    assert records[1].statistics == {"kernels_rewritten": 1}      # the conv only


@I.ir_module
class Viewed:
    @R.function
    def target_verify(tokens: R.Tensor(("b", "n"), "int32"),
                      kv: R.Tensor((2, 2, 3, 2, 11, 5), "float32")) -> R.Tensor((2, 2, 3, 2, 11, 5), "float32"):
        return kv

    @R.function
    def target_verify_view(tokens: R.Tensor(("b", "n"), "int32"),
                           kv: R.Tensor((2, 2, 3, 2, 11, 5), "float32")) -> R.Tensor((2, 2, 3, 2, 11, 5), "float32"):
        return kv


def test_two_level_verify_changes_no_function():
    """The graph is unchanged: the build's manifest (two_level) tells the engine to propose with the view."""
    from specpilot.passes.registry import REGISTRY
    context = PassContext(statistics={"two-level-verify": {}})
    after = REGISTRY["two-level-verify"]().apply(Viewed, context)
    tvm.ir.assert_structural_equal(after, Viewed)
    assert after is not Viewed and context.statistics["two-level-verify"] == {"view_function": "target_verify_view"}
    with pytest.raises(SpecPilotError, match="no target_verify_view"):
        REGISTRY["two-level-verify"]().apply(Verify, PassContext())
