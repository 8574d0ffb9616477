"""RMSNorm as one kernel (`lower.rms_norm_te`) and q / k norm + rotary as one kernel
(`lower.norm_rope_te`): against the same arithmetic written as Relax operators (what the lowering
emitted before: three kernels a norm, two more for rotary) bit for bit on the CPU, and against the
PyTorch reference within float32 rounding, on odd shapes, float32 and bfloat16, plain and
zero-centered weights, full and partial rotary, with symbolic leading axes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.compiler.lower import norm_rope_te, rms_norm_te
from specpilot.runtime.reference.model import rms_norm as reference_rms_norm, rotate_half


def _norm_operators(bb, x, w, dtype, zero_centered, eps, n):
    """RMSNorm as the Relax operators the lowering emitted before (three kernels)."""
    from tvm import relax
    h = bb.emit(relax.op.astype(x, "float32"))
    ss = bb.emit(relax.op.sum(relax.op.multiply(h, h), axis=[-1], keepdims=True))
    den = bb.emit(relax.op.sqrt(relax.op.add(relax.op.divide(ss, relax.const(float(n), "float32")),
                                             relax.const(eps, "float32"))))
    h = bb.emit(relax.op.divide(h, den))
    if zero_centered:
        wf = relax.op.add(relax.op.astype(w, "float32"), relax.const(1.0, "float32"))
        return bb.emit(relax.op.astype(relax.op.multiply(h, wf), dtype))
    return bb.emit(relax.op.multiply(relax.op.astype(h, dtype), w))


def _build(dtype: str, zero_centered: bool, eps: float, shape_tail: int, fused: bool):
    import tvm
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    a, b = tirx.Var("a", "int64"), tirx.Var("b", "int64")
    x = relax.Var("x", relax.TensorType([a, b, shape_tail], dtype))
    w = relax.Var("w", relax.TensorType([shape_tail], dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            if fused:
                out = bb.emit_te(rms_norm_te(eps, zero_centered, dtype), x, w)
            else:   # the operators the lowering emitted before
                out = _norm_operators(bb, x, w, dtype, zero_centered, eps, shape_tail)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    ex = tvm.compile(bb.get(), target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())


@pytest.mark.parametrize("dtype,zero_centered,shape,eps", [
    ("float32", False, (3, 5, 37), 1e-6),
    ("float32", True, (1, 7, 96), 1e-5),
    ("bfloat16", False, (2, 3, 203), 1e-6),
    ("bfloat16", True, (4, 1, 24), 1e-6),
])
def test_one_kernel_rms_norm_is_the_operators_bit_for_bit(dtype, zero_centered, shape, eps):
    import tvm
    rng = np.random.default_rng(sum(shape))
    xt = torch.from_numpy(rng.standard_normal(shape).astype("float32") * 3).to(getattr(torch, dtype))
    wt = torch.from_numpy(rng.standard_normal(shape[-1]).astype("float32")).to(getattr(torch, dtype))
    outs = []
    for fused in (True, False):
        vm = _build(dtype, zero_centered, eps, shape[-1], fused)
        outs.append(torch.from_dlpack(vm["main"](tvm.runtime.from_dlpack(xt.clone()), tvm.runtime.from_dlpack(wt.clone()))).clone())
    fused, operators = outs
    assert fused.dtype == getattr(torch, dtype) and fused.shape == shape
    assert torch.equal(fused.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                       operators.view(torch.int16 if dtype == "bfloat16" else torch.int32))
    want = reference_rms_norm(xt, wt, eps, zero_centered)
    # rsqrt(mean) vs 1 / sqrt(sum / n): float32 rounding apart; in bf16 at most one unit in the last place
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == "float32" else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(fused.float(), want.float(), **tol)


def _build_norm_rope(dtype, zero_centered, eps, heads, d, rot, fused):
    import tvm
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    B, T = tirx.Var("B", "int64"), tirx.Var("T", "int64")
    x = relax.Var("x", relax.TensorType([B, T, heads, d], dtype))
    w = relax.Var("w", relax.TensorType([d], dtype))
    cos = relax.Var("cos", relax.TensorType([B, T, rot], dtype))
    sin = relax.Var("sin", relax.TensorType([B, T, rot], dtype))
    op = relax.op
    with bb.function("main", [x, w, cos, sin]):
        with bb.dataflow():
            if fused:
                out = bb.emit_te(norm_rope_te(eps, zero_centered, dtype, rot), x, w, cos, sin)
            else:   # the lowering's operators before: the norm, then `Attention._rope`
                xn = _norm_operators(bb, x, w, dtype, zero_centered, eps, d)
                c, s_ = op.expand_dims(cos, 2), op.expand_dims(sin, 2)
                xr = op.strided_slice(xn, [3], [0], [rot]) if rot < d else xn
                x1, x2 = op.strided_slice(xr, [3], [0], [rot // 2]), op.strided_slice(xr, [3], [rot // 2], [rot])
                turned = op.add(op.multiply(xr, c), op.multiply(op.concat([op.negative(x2), x1], axis=3), s_))
                out = bb.emit(op.concat([turned, op.strided_slice(xn, [3], [rot], [d])], axis=3) if rot < d else turned)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())


@pytest.mark.parametrize("dtype,zero_centered,B,T,heads,d,rot", [
    ("float32", False, 2, 3, 5, 24, 24),
    ("bfloat16", False, 1, 7, 3, 40, 40),
    ("bfloat16", True, 3, 2, 2, 64, 16),     # partial rotary (Qwen3.5: a quarter of the head)
    ("float32", True, 1, 1, 4, 20, 10),
])
def test_one_kernel_norm_and_rotary_is_the_operators_bit_for_bit(dtype, zero_centered, B, T, heads, d, rot):
    import tvm
    rng = np.random.default_rng(d * 31 + rot)
    tdt = getattr(torch, dtype)
    x = torch.from_numpy(rng.standard_normal((B, T, heads, d)).astype("float32") * 2).to(tdt)
    w = torch.from_numpy(rng.standard_normal(d).astype("float32")).to(tdt)
    angles = torch.from_numpy(rng.uniform(0, 50, (B, T, rot)).astype("float32"))
    cos, sin = angles.cos().to(tdt), angles.sin().to(tdt)
    outs = []
    for fused in (True, False):
        vm = _build_norm_rope(dtype, zero_centered, 1e-6, heads, d, rot, fused)
        outs.append(torch.from_dlpack(vm["main"](*(tvm.runtime.from_dlpack(t.clone()) for t in (x, w, cos, sin))))
                    .clone())
    fused, operators = outs
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    assert fused.shape == x.shape and torch.equal(fused.view(bits), operators.view(bits))
    # the PyTorch reference: rms_norm per head, then rotary on the first rot dims
    normed = reference_rms_norm(x, w, 1e-6, zero_centered)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    want = torch.cat((normed[..., :rot] * c + rotate_half(normed[..., :rot]) * s, normed[..., rot:]), dim=-1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(fused.float(), want.float(), **tol)


def _build_gdn(kind: str, dtype: str, shape, fused: bool):
    import tvm
    from tvm import relax, tirx

    from specpilot.compiler.lower import gated_norm_te, l2norm_te
    bb = relax.BlockBuilder()
    T = tirx.Var("T", "int64")
    full = [T, *shape[1:]]
    op = relax.op
    if kind == "l2norm":
        params = [relax.Var("x", relax.TensorType(full, "float32"))]
    else:
        params = [relax.Var("o", relax.TensorType(full, "float32")), relax.Var("w", relax.TensorType([shape[-1]], dtype)),
                  relax.Var("z", relax.TensorType(full, dtype))]
    with bb.function("main", params):
        with bb.dataflow():
            if kind == "l2norm":
                (x,) = params
                if fused:
                    out = bb.emit_te(l2norm_te(0.125), x)
                else:
                    ss = op.sum(op.multiply(x, x), axis=[-1], keepdims=True)
                    out = bb.emit(op.multiply(op.divide(x, op.sqrt(op.add(ss, relax.const(1e-6, "float32")))),
                                              relax.const(0.125, "float32")))
            else:
                o, w, z = params
                if fused:
                    out = bb.emit_te(gated_norm_te(1e-6, dtype), o, w, z)
                else:
                    xn = _norm_operators(bb, bb.emit(op.astype(o, dtype)), w, dtype, False, 1e-6, shape[-1])
                    out = bb.emit(op.astype(op.multiply(op.astype(xn, "float32"), op.nn.silu(op.astype(z, "float32"))),
                                            dtype))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())


@pytest.mark.parametrize("kind,dtype,shape", [("l2norm", "float32", (5, 3, 40)), ("gated_norm", "bfloat16", (3, 4, 24)),
                                              ("gated_norm", "float32", (7, 2, 12))])
def test_gated_deltanet_norms_are_the_operators_bit_for_bit(kind, dtype, shape):
    """`lower.l2norm_te` (q / k) and `lower.gated_norm_te` (the output gate) against their operators."""
    import tvm
    rng = np.random.default_rng(len(kind) + shape[-1])
    tdt = getattr(torch, dtype)
    inputs = [torch.from_numpy(rng.standard_normal(shape).astype("float32") * 3)]
    if kind == "gated_norm":
        inputs += [torch.from_numpy(rng.standard_normal(shape[-1]).astype("float32")).to(tdt),
                   torch.from_numpy(rng.standard_normal(shape).astype("float32") * 2).to(tdt)]
    outs = [torch.from_dlpack(_build_gdn(kind, dtype, shape, fused)["main"](
        *(tvm.runtime.from_dlpack(t.clone()) for t in inputs))).clone() for fused in (True, False)]
    bits = torch.int16 if outs[0].dtype == torch.bfloat16 else torch.int32
    assert outs[0].shape == shape and torch.equal(outs[0].view(bits), outs[1].view(bits))


def test_gpu_forms_keep_the_roundings_as_native_casts(tmp_path):
    """On CUDA the norms round through bf16 casts (`round_to(..., spelled=False)`): the generated code
    keeps the float32 <- bf16 <- float32 pair (CUDA computes bf16 natively; nothing folds it away)."""
    from tests.kernel_helpers import sm90_source
    setup = ("from tvm import te\nfrom tvm.s_tir import dlight as dl\n"
             "from specpilot.compiler.lower import rms_norm_te, gated_norm_te\n"
             "x = te.placeholder((4, 4096), 'bfloat16', name='x'); w = te.placeholder((4096,), 'bfloat16', name='w')\n"
             "o = te.placeholder((1, 48, 128), 'float32', name='o'); v = te.placeholder((128,), 'bfloat16', name='v')\n"
             "z = te.placeholder((1, 48, 128), 'bfloat16', name='z')\n"
             "mod = tvm.IRModule({'rms': te.create_prim_func([x, w, rms_norm_te(1e-6, False, 'bfloat16', False)(x, w)]),\n"
             "                    'gated': te.create_prim_func([o, v, z, gated_norm_te(1e-6, 'bfloat16', False)(o, v, z)])})\n"
             "with tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90'}):\n"
             "    mod = dl.ApplyDefaultSchedule(dl.gpu.GeneralReduction())(mod)")
    text = sm90_source(tmp_path, setup, "{n: mod[n] for n in ('rms', 'gated')}")
    def body(name):     # the kernel's definition (the source declares each kernel first)
        start = text.rindex(f"{name}_kernel(")
        return text[start:text.index("\n}\n", start)]
    assert "((float)((nv_bfloat16)(((float)x_ptr[" in body("rms")
    gated = body("gated")
    store = [line for line in gated.splitlines() if "gated_norm_ptr[" in line and "=" in line]
    # o read as bf16, the norm's two roundings, the output's: a line of hundreds of characters, not thousands
    assert store and all(line.count("(nv_bfloat16)") == 4 and len(line) < 1200 for line in store)
