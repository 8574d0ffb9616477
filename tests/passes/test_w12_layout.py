"""w12-layout: before/expected IR, where it must not fire, where it must raise, and compiled
builds that pass token forcing exactly on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from specpilot.core import w12
from specpilot import kernels
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse
from specpilot.passes.runner import run_pipeline

from tests.build_helpers import assert_forces_exactly

ROOT = Path(__file__).resolve().parents[2]


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), tokens: R.Tensor(("n",), "int32"),
             packed_params: R.Tuple(R.Tensor((6, 8), "float32"), R.Tensor((6,), "float32"),
                                    R.Tensor((10, 8), "float32"))) -> R.Tensor(("n", 6), "float32"):
        R.func_attr({"num_input": 2})
        with R.dataflow():
            w = packed_params[0]
            wt = R.permute_dims(w, axes=None)
            y = R.matmul(x, wt, out_dtype="float32")
            b = packed_params[1]
            table = packed_params[2]
            e = R.take(table, tokens, axis=0)
            z = R.add(y, b)
            s = R.add(z, R.sum(e, axis=[1], keepdims=True))
            R.output(s)
        return s


def _context(weights: dict) -> PassContext:
    return PassContext(target_kind="llvm", dtype="float32", params=weights)


def _weights(exact: bool = True):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 8, generator=g)
    w = w.to(torch.bfloat16).float() if exact else w
    table = torch.randn(10, 8, generator=g).to(torch.bfloat16).float()
    return {"target.a.weight": w, "target.a.bias": torch.randn(6, generator=g), "target.emb.weight": table}


def _expected(layout: w12.W12Kernel, hi_only: bool = False):
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 8), "float32"))
    tokens = relax.Var("tokens", relax.TensorType((n,), "int32"))
    planes = [layout.hi, layout.lo, layout.base, layout.esc_ptr, layout.esc_col, layout.esc_bits]
    fields = [relax.TensorType(list(layout.hi.shape), "uint8"), relax.TensorType((6,), "float32"),
              relax.TensorType((10, 8), "float32")] + \
             [relax.TensorType(list(t.shape), str(t.dtype).split(".")[-1]) for t in planes[1:]]
    packed = relax.Var("packed_params", relax.TupleType(fields))
    with bb.function("main", [x, tokens, packed], attrs={"num_input": 2}):
        gemm = bb.add_func(kernels.w12_gemm(6, 8, int(layout.esc_ptr[-1]), "float32", hi_only), "w12_gemm")
        with bb.dataflow():
            y = bb.emit(relax.call_tir(gemm, [x] + [relax.TupleGetItem(packed, j) for j in (0, 3, 4, 5, 6, 7)],
                                       relax.TensorType((n, 6), "float32")))
            b = bb.emit(relax.TupleGetItem(packed, 1))
            table = bb.emit(relax.TupleGetItem(packed, 2))
            e = bb.emit(relax.op.take(table, tokens, axis=0))
            z = bb.emit(relax.op.add(y, b))
            s = bb.emit_output(relax.op.add(z, relax.op.sum(e, axis=[1], keepdims=True)))
        bb.emit_func_output(s)
    return bb.get()


def test_before_expected():
    weights = _weights()
    context = _context(weights)
    after, records = run_pipeline(parse("w12-layout"), Before, context)
    layout = context.scratch["w12-layout"]["target.a.weight"][2]   # (N, K, layout)
    tvm.ir.assert_structural_equal(after, _expected(layout))
    assert records[0].statistics["rewritten"] == 1 and records[0].statistics["weights"] == 1
    # the weight read by take() stays as it is; the params follow the IR
    params = context.params     # the runner applied the pass's parameter rewrite
    assert list(params) == ["target.a.weight", "target.a.bias", "target.emb.weight", "target.a.weight.w12_lo",
                            "target.a.weight.w12_base", "target.a.weight.w12_esc_ptr",
                            "target.a.weight.w12_esc_col", "target.a.weight.w12_esc_bits"]
    assert torch.equal(w12.decode_kernel_layout(layout).float(), weights["target.a.weight"])


def test_does_not_fire_on_weights_that_are_not_bf16():
    context = _context(_weights(exact=False))
    after, records = run_pipeline(parse("w12-layout"), Before, context)
    tvm.ir.assert_structural_equal(after, Before)
    assert records[0].statistics["weights"] == 0


def test_min_size_excludes_small_matrices():
    context = _context(_weights())
    after, _ = run_pipeline(parse("w12-layout{min_size=49}"), Before, context)
    tvm.ir.assert_structural_equal(after, Before)


@pytest.mark.parametrize("context,reason", [
    (PassContext(target_kind="llvm", weights_known=False), "on the CPU it needs the weights at build time"),
    (PassContext(target_kind="cuda", arch="sm_90", dtype="float32"), "needs dtype bfloat16"),
    (PassContext(target_kind="cuda", arch="sm_75", dtype="bfloat16"), "needs sm_80 or later"),
])
def test_illegal_contexts_raise(context, reason):
    with pytest.raises(SpecPilotError, match=reason):
        run_pipeline(parse("w12-layout"), Before, context)


@pytest.mark.parametrize("example", ["tiny-llama.yaml", "tiny-hybrid.yaml"])
@pytest.mark.slow
def test_compiled_w12_builds_pass_token_forcing_exactly(example, tmp_path):
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target

    manifest = build(BuildRequest(load_spec(ROOT / "examples" / example), parse_target("llvm"), tmp_path / "b",
                     passes="w12-layout"))
    stats = manifest.passes[0]["statistics"]
    assert manifest.pipeline == "w12-layout" and stats["weights"] > 0 and stats["rewritten"] > 0
    assert stats["bytes_after"] < 0.8 * stats["bytes_before"]
    assert_forces_exactly(tmp_path / "b", 128)


def test_seeded_build_refuses_w12(tmp_path):
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    with pytest.raises(SpecPilotError, match="w12-layout: on the CPU it needs the weights at build time"):
        build(BuildRequest(load_spec(ROOT / "examples" / "tiny-llama.yaml"), parse_target("llvm"), tmp_path / "b",
              passes="w12-layout", params="seeded"))


def test_nested_int8_view_before_expected():
    weights = _weights()
    context = _context(weights)
    stages = {}
    out, records = run_pipeline(parse("w12-layout,nested-int8-view{function=main}"), Before, context,
                                after=lambda name, mod: stages.setdefault(name, mod))
    after_w12 = stages["w12-layout"]
    layout = context.scratch["w12-layout"]["target.a.weight"][2]   # (N, K, layout)
    # expected: the exact module plus main_view, whose GEMM reads the hi plane only
    view_module = _expected(layout, hi_only=True)
    expected = tvm.ir.IRModule(dict(after_w12.functions))
    bb = relax.BlockBuilder(expected)
    gv = view_module.get_global_var("w12_gemm")
    twin = bb.add_func(view_module[gv], "w12_gemm_view")
    main = view_module["main"]
    body = main.body
    call_tir = tvm.ir.Op.get("relax.call_tir")
    bindings = [relax.VarBinding(b.var, relax.call_tir(twin, b.value.args[1], b.value.ty))
                if isinstance(b.value, relax.Call) and b.value.op.same_as(call_tir) else b
                for b in body.blocks[0].bindings]
    new_body = relax.SeqExpr([relax.DataflowBlock(bindings)], body.body)
    view = relax.Function(main.params, new_body, main.ret_ty, main.is_pure, main.attrs)
    bb.add_func(view.with_attr("global_symbol", "main_view"), "main_view")
    tvm.ir.assert_structural_equal(out, relax.transform.Normalize()(bb.get()))
    assert records[1].statistics == {"functions_added": 1, "gemms_viewed": 1}


def test_nested_int8_view_needs_w12_layout():
    with pytest.raises(SpecPilotError, match="nested-int8-view requires w12-layout, which is not in the pipeline"):
        run_pipeline(parse("nested-int8-view{function=main}"), Before, _context(_weights()))
    with pytest.raises(SpecPilotError, match="nested-int8-view requires w12-layout earlier"):
        run_pipeline(parse("nested-int8-view{function=main},w12-layout"), Before, _context(_weights()))


@pytest.mark.slow
def test_view_function_in_a_build_is_close_not_exact(tmp_path):
    import numpy as np

    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    from specpilot.runtime.engine import CompiledModule
    manifest = build(BuildRequest(load_spec(ROOT / "examples" / "tiny-hybrid.yaml"), parse_target("llvm"), tmp_path / "b",
                     passes="w12-layout,nested-int8-view"))
    assert "target_verify_view" in manifest.functions
    module = CompiledModule(tmp_path / "b")
    model = module.model("target")
    state = model.new_state(1024)
    model.forward(list(range(30, 56)), state)
    start, toks = state.length, np.array([[56, 57, 58, 59]], "int32")
    slots = np.arange(start, start + 4, dtype="int32")[None]
    mask = (np.arange(start + 4)[None, :] <= (start + np.arange(4))[:, None])[None]
    args = [module.tensor(toks), module.tensor(slots), module.tensor(slots), module.tensor(mask),
            module.tensor(np.array([state.row], "int32")), module.tensor(np.arange(-1, 3, dtype="int32")[None]),
            model.kv, state.conv, state.rec]
    exact = module.functions["target_verify"](*args, module.params)[0].numpy()
    view = module.functions["target_verify_view"](*args, module.params)[0].numpy()
    rel = np.abs(exact - view).max() / np.abs(exact).max()
    assert 0 < rel < 0.5
    assert state.length == start   # calling the functions changed no engine state


def test_gpu_w12_converts_the_same_weights_with_or_without_them_at_build_time():
    """On cuda the kernel does not depend on the weights: a seeded build plans the same matrices by
    name and shape (escape counts left symbolic), and the engine's redo of the parameter rewrites
    on the redrawn weights (stacked projections, then W12 planes) gives the names and values a
    build with the weights stores."""
    from specpilot.compiler.build import lower_and_apply
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    from specpilot.core.weights import packed_parameters, rewritten_parameters

    spec = load_spec(ROOT / "bench" / "specs" / "tiny-llama-w12-bf16.yaml")
    target = parse_target("cuda -arch=sm_90")
    pipeline_text = "fuse-projections,w12-layout,nested-int8-view"
    runs = {}
    for mode in ("file", "seeded"):
        lowered = lower_and_apply(spec, target, pipeline_text, mode)
        entries = {p.name: p.manifest_entry(lowered.context) for p in lowered.pipeline if p.manifest_key}
        runs[mode] = (lowered.mod, lowered.records, lowered.context.params, entries,
                      (lowered.target_model, lowered.drafter_model))
    (mod, records, stored, entries, (tgt, drf)), (smod, srecords, snames, sentries, _) = runs["file"], runs["seeded"]
    fused, entry = entries["fuse-projections"], entries["w12-layout"]
    stats = records[1].statistics
    # target q/k/v and gate/up stacked per layer (the drafter's too); every target matrix tiles:
    # 4 layers x (qkv, o, gate+up, down) + lm_head
    assert records[0].statistics["groups"] == srecords[0].statistics["groups"] == 10
    assert stats["weights"] == 17 == srecords[1].statistics["weights"] and stats["rewritten"] > 17
    assert stats["bytes_after"] < 0.8 * stats["bytes_before"] and "bytes_after" not in srecords[1].statistics
    assert entries == sentries and entry["layout"] == "gpu" and len(entry["weights"]) == 17
    assert list(stored) == list(snames) and all(v is None for v in snames.values())
    gemms = [f for gv, f in mod.functions.items() if gv.name_hint.startswith("w12_gemm")]
    assert gemms and all("w12.gpu" in f.attrs for f in gemms)
    # seeded: escape counts are symbolic extents of the packed tuple, static with the weights
    head = list(stored).index("target.lm_head.weight")
    def fields(m):
        return m["target_decode"].params[-1].ty.fields
    assert isinstance(fields(smod)[-1].shape[0], tvm.tirx.Var) and isinstance(fields(mod)[-1].shape[0], tvm.tirx.IntImm)
    assert str(fields(mod)[head].dtype) == "int32"                 # the hi plane, tiled words
    # what the engine does for a seeded build
    from types import SimpleNamespace
    manifest = SimpleNamespace(dtype="bfloat16", params=list(stored), w12=entry, fused=fused)   # its fields
    redrawn = rewritten_parameters(manifest, tgt, drf)
    assert list(redrawn) == list(stored)
    assert all(torch.equal(redrawn[n], stored[n]) for n in stored)
    qkv = next(n for n in entry["weights"] if "q_proj" in n)
    members = packed_parameters(fused[qkv], tgt, drf, torch.bfloat16)
    want = w12.gpu_layout(w12.kernel_layout(w12.encode(torch.cat(list(members.values())))))
    assert torch.equal(stored[qkv], want.hi) and torch.equal(stored[f"{qkv}.w12_lo"], want.lo)


def test_gpu_w12_does_not_fire_on_shapes_the_kernel_does_not_tile():
    """tiny-llama-bf16 (hidden 96, MLP 203): no target matrix has N % 16 == 0 and K % 64 == 0, so on
    cuda nothing is converted and the IR is stock's."""
    from specpilot.compiler.build import lower_and_apply
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target

    spec = load_spec(ROOT / "bench" / "specs" / "tiny-llama-bf16.yaml")
    target = parse_target("cuda -arch=sm_90")
    lowered = lower_and_apply(spec, target, "", "seeded")
    stock, context = lowered.mod, lowered.context
    mod, records = run_pipeline(parse("w12-layout"), stock, context)
    assert records[0].statistics["weights"] == 0
    tvm.ir.assert_structural_equal(mod, stock)


@pytest.mark.slow
def test_view_copy_shares_no_constant_nodes_with_its_source(tmp_path):
    """target_verify_view is a copy of target_verify: a constant node in both made pattern fusion on
    cuda (FuseTransposeMatmul) reject the module ("appears in multiple partitions").  Heads of 16
    (8 of them) take the gathered attention path on the GPU, whose mask fill is a constant."""
    import yaml

    from specpilot.compiler.build import lower_and_apply
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target

    data = yaml.safe_load((ROOT / "bench" / "specs" / "tiny-llama-w12-bf16.yaml").read_text())
    data["target"]["config"]["num_attention_heads"] = 8
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    spec = load_spec(tmp_path / "spec.yaml")
    mod = lower_and_apply(spec, parse_target("cuda -arch=sm_90"), "w12-layout,nested-int8-view", "seeded").mod

    def constants(func):
        found = []
        relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, type(relax.const(0.0))) else None)
        return found
    source, view = constants(mod["target_verify"]), constants(mod["target_verify_view"])
    assert source and len(source) == len(view)
    assert not any(a.same_as(b) for a in source for b in view)
    relax.transform.FuseTransposeMatmul()(mod)     # raised before the copy made its own constants
