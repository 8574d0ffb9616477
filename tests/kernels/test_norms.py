"""RMSNorm as one kernel (`lower.rms_norm_te`) and an attention layer's new heads as one kernel
(`lower.attention_heads_te`: q / k norm when the model has it, rotary, the value heads passed
through): against the same arithmetic written as Relax operators (what the lowering emitted
before: three kernels a norm, two more for rotary, a cast for v) bit for bit on the CPU, and
against the PyTorch reference within float32 rounding, on odd shapes, float32 and bfloat16, plain
and zero-centered weights, with and without the norm, full and partial rotary, with symbolic
leading axes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.kernels.norms import attention_heads_te, rms_norm_te
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


def _build_heads(dtype, zero_centered, eps, nq, nkv, d, rot, fused):
    import tvm
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    B, T = tirx.Var("B", "int64"), tirx.Var("T", "int64")
    q, k, v = (relax.Var(n, relax.TensorType([B, T, h, d], dtype)) for n, h in (("q", nq), ("k", nkv), ("v", nkv)))
    wq, wk = relax.Var("wq", relax.TensorType([d], dtype)), relax.Var("wk", relax.TensorType([d], dtype))
    cos = relax.Var("cos", relax.TensorType([B, T, rot], dtype))
    sin = relax.Var("sin", relax.TensorType([B, T, rot], dtype))
    op = relax.op

    def rope(x):    # `Attention._rope` as the lowering wrote it before
        c, s_ = op.expand_dims(cos, 2), op.expand_dims(sin, 2)
        xr = op.strided_slice(x, [3], [0], [rot]) if rot < d else x
        x1, x2 = op.strided_slice(xr, [3], [0], [rot // 2]), op.strided_slice(xr, [3], [rot // 2], [rot])
        turned = op.add(op.multiply(xr, c), op.multiply(op.concat([op.negative(x2), x1], axis=3), s_))
        return bb.emit(op.concat([turned, op.strided_slice(x, [3], [rot], [d])], axis=3) if rot < d else turned)

    with bb.function("main", [q, k, v, wq, wk, cos, sin]):
        with bb.dataflow():
            if fused:
                norm = [wq, wk] if eps is not None else []
                out = bb.emit_te(attention_heads_te(dtype, rot, nq, nkv, eps, zero_centered), q, k, v, *norm, cos, sin)
            else:   # the lowering's operators before: the norms, rotary, v alone
                qn, kn = (q, k) if eps is None else \
                    (_norm_operators(bb, q, wq, dtype, zero_centered, eps, d),
                     _norm_operators(bb, k, wk, dtype, zero_centered, eps, d))
                out = bb.emit(op.concat([rope(qn), rope(kn), v], axis=2))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())


@pytest.mark.parametrize("dtype,zero_centered,eps,B,T,nq,nkv,d,rot", [
    ("float32", False, 1e-6, 2, 3, 5, 1, 24, 24),
    ("bfloat16", False, 1e-6, 1, 7, 3, 3, 40, 40),
    ("bfloat16", True, 1e-6, 3, 2, 4, 2, 64, 16),     # partial rotary (Qwen3.5: a quarter of the head)
    ("float32", True, 1e-5, 1, 1, 4, 2, 20, 10),
    ("bfloat16", False, None, 2, 5, 6, 2, 24, 24),    # no q / k norm (Llama, SmolLM2)
    ("float32", False, None, 1, 3, 3, 1, 40, 20),
])
def test_one_kernel_attention_heads_are_the_operators_bit_for_bit(dtype, zero_centered, eps, B, T, nq, nkv, d, rot):
    import tvm
    rng = np.random.default_rng(d * 31 + rot + nq)
    tdt = getattr(torch, dtype)

    def draw(*shape, scale=2.0):
        return torch.from_numpy(rng.standard_normal(shape).astype("float32") * scale).to(tdt)
    q, k, v = draw(B, T, nq, d), draw(B, T, nkv, d), draw(B, T, nkv, d)
    wq, wk = draw(d, scale=1.0), draw(d, scale=1.0)
    angles = torch.from_numpy(rng.uniform(0, 50, (B, T, rot)).astype("float32"))
    cos, sin = angles.cos().to(tdt), angles.sin().to(tdt)
    outs = []
    for fused in (True, False):
        vm = _build_heads(dtype, zero_centered, eps, nq, nkv, d, rot, fused)
        outs.append(torch.from_dlpack(vm["main"](*(tvm.runtime.from_dlpack(t.clone())
                                                   for t in (q, k, v, wq, wk, cos, sin)))).clone())
    fused, operators = outs
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    assert fused.shape == (B, T, nq + 2 * nkv, d) and torch.equal(fused.view(bits), operators.view(bits))
    # the PyTorch reference: rms_norm per head, then rotary on the first rot dims; v untouched
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)

    def reference(x, w):
        x = x if eps is None else reference_rms_norm(x, w, eps, zero_centered)
        return torch.cat((x[..., :rot] * c + rotate_half(x[..., :rot]) * s, x[..., rot:]), dim=-1)
    want = torch.cat((reference(q, wq), reference(k, wk), v), dim=2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(fused.float(), want.float(), **tol)
    assert torch.equal(fused[:, :, nq + nkv:].view(bits), v.view(bits))


def _build_gated_norm(dtype: str, shape, fused: bool):
    import tvm
    from tvm import relax, tirx

    from specpilot.kernels.norms import gated_norm_te
    bb = relax.BlockBuilder()
    T = tirx.Var("T", "int64")
    full = [T, *shape[1:]]
    op = relax.op
    params = [relax.Var("o", relax.TensorType(full, "float32")), relax.Var("w", relax.TensorType([shape[-1]], dtype)),
              relax.Var("z", relax.TensorType(full, dtype))]
    with bb.function("main", params):
        with bb.dataflow():
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


@pytest.mark.parametrize("spelled", [True, False])
@pytest.mark.parametrize("dtype,eps,nq,nkv,d,rot", [
    ("bfloat16", None, 4, 2, 128, 128),     # the tail-MLP tiny build's heads, which read past k on the H200
    ("bfloat16", 1e-6, 3, 1, 64, 16),       # q / k norm, partial rotary: cos / sin past rot
    ("float32", 1e-6, 5, 1, 24, 24),
    ("bfloat16", 1e-6, 6, 2, 40, 20),
])
def test_attention_heads_never_load_outside_q_k_v_or_rotary(dtype, eps, nq, nkv, d, rot, spelled):
    """Every load of the heads kernel stays inside its tensor as the hardware evaluates it: both
    sides of a Select, the side taken of an if_then_else (`kernel_helpers.loads_out_of_bounds`).
    te drops the clamps of a side's indices under a plain Select condition, so the side not taken
    read up to a head width outside q, k, v and cos / sin -- an illegal address on the H200 where a
    tensor ended at the edge of its allocation."""
    from tvm import te

    from tests.kernel_helpers import loads_out_of_bounds
    B, T = 2, 3
    q, k, v = (te.placeholder((B, T, h, d), dtype, name=n) for n, h in (("q", nq), ("k", nkv), ("v", nkv)))
    norm = [te.placeholder((d,), dtype, name=n) for n in ("wq", "wk")] if eps is not None else []
    cos, sin = (te.placeholder((B, T, rot), dtype, name=n) for n in ("cos", "sin"))
    heads = attention_heads_te(dtype, rot, nq, nkv, eps, False, spelled)(q, k, v, *norm, cos, sin)
    assert loads_out_of_bounds(te.create_prim_func([q, k, v, *norm, cos, sin, heads])) == []


def test_the_bounds_check_sees_a_select_load_both_sides():
    """`loads_out_of_bounds` itself: a Select reading x[i + 1] on the side not taken at the last
    element is found (te dropped its clamp); the same choice as an if_then_else, or as a Select
    under ``likely`` (the clamp kept), is not."""
    from tvm import te, tirx

    from tests.kernel_helpers import loads_out_of_bounds
    x = te.placeholder((7,), "float32", name="x")
    kept = lambda c, a, b: tirx.Select(tirx.likely(c), a, b)   # noqa: E731
    for choose, expected in ((tirx.Select, 1), (tirx.if_then_else, 0), (kept, 0)):
        y = te.compute((7,), lambda i: choose(i < 6, x[tirx.min(i + 1, 6)], x[i]), name="y")
        found = loads_out_of_bounds(te.create_prim_func([x, y]))
        assert len(found) == expected and all("x[axis 0]" in f for f in found)


@pytest.mark.parametrize("dtype,shape", [("bfloat16", (3, 4, 24)), ("float32", (7, 2, 12))])
def test_gated_deltanet_gated_norm_is_the_operators_bit_for_bit(dtype, shape):
    """`norms.gated_norm_te` (the output gate) against its operators (q / k: tests/kernels/test_gdn_heads.py)."""
    import tvm
    rng = np.random.default_rng(10 + shape[-1])
    tdt = getattr(torch, dtype)
    inputs = [torch.from_numpy(rng.standard_normal(shape).astype("float32") * 3),
              torch.from_numpy(rng.standard_normal(shape[-1]).astype("float32")).to(tdt),
              torch.from_numpy(rng.standard_normal(shape).astype("float32") * 2).to(tdt)]
    outs = [torch.from_dlpack(_build_gated_norm(dtype, shape, fused)["main"](
        *(tvm.runtime.from_dlpack(t.clone()) for t in inputs))).clone() for fused in (True, False)]
    bits = torch.int16 if outs[0].dtype == torch.bfloat16 else torch.int32
    assert outs[0].shape == shape and torch.equal(outs[0].view(bits), outs[1].view(bits))


def test_gpu_forms_keep_the_roundings_as_native_casts(tmp_path):
    """On CUDA the norms round through bf16 casts (`round_to(..., spelled=False)`): the generated code
    keeps the float32 <- bf16 <- float32 pair (CUDA computes bf16 natively; nothing folds it away)."""
    from tests.kernel_helpers import sm90_source
    setup = ("from tvm import te\nfrom tvm.s_tir import dlight as dl\n"
             "from specpilot.kernels.norms import attention_heads_te, rms_norm_te, gated_norm_te\n"
             "x = te.placeholder((4, 4096), 'bfloat16', name='x'); w = te.placeholder((4096,), 'bfloat16', name='w')\n"
             "o = te.placeholder((1, 48, 128), 'float32', name='o'); v = te.placeholder((128,), 'bfloat16', name='v')\n"
             "z = te.placeholder((1, 48, 128), 'bfloat16', name='z')\n"
             "hq, hk, hv = (te.placeholder((1, 1, n, 128), 'bfloat16', name=c) for c, n in (('q', 32), ('k', 8), ('v', 8)))\n"
             "cs = [te.placeholder((1, 1, 128), 'bfloat16', name=c) for c in ('cos', 'sin')]\n"
             "heads = attention_heads_te('bfloat16', 128, 32, 8, 1e-6, False, False)(hq, hk, hv, v, v, *cs)\n"
             "mod = tvm.IRModule({'rms': te.create_prim_func([x, w, rms_norm_te(1e-6, False, 'bfloat16', False)(x, w)]),\n"
             "                    'gated': te.create_prim_func([o, v, z, gated_norm_te(1e-6, 'bfloat16', False)(o, v, z)]),\n"
             "                    'heads': te.create_prim_func([hq, hk, hv, v, *cs, heads])})\n"
             "with tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90'}):\n"
             "    mod = dl.ApplyDefaultSchedule(dl.gpu.GeneralReduction())(mod)")
    text = sm90_source(tmp_path, setup, "{n: mod[n] for n in ('rms', 'gated', 'heads')}")
    def body(name):     # the kernel's definition (the source declares each kernel first)
        start = text.rindex(f"{name}_kernel(")
        return text[start:text.index("\n}\n", start)]
    assert "((float)((nv_bfloat16)(((float)x_ptr[" in body("rms")
    gated = body("gated")
    store = [line for line in gated.splitlines() if "gated_norm_ptr[" in line and "=" in line]
    # o read as bf16, the norm's two roundings, the output's: a line of hundreds of characters, not thousands
    assert store and all(line.count("(nv_bfloat16)") == 4 and len(line) < 1200 for line in store)
    # the attention heads (Qwen3-8B's: 32 + 8 + 8 of 128): one kernel, the rotary's partner element
    # normed again rather than nested expressions; still a line of a few thousand characters at most
    assert "heads_kernel_1" not in text     # one kernel: dlight's GeneralReduction took it (no fallback)
    heads = body("heads")
    store = [line for line in heads.splitlines() if "attention_heads_ptr[" in line and "=" in line]
    assert store and all(len(line) < 4000 for line in store), max(map(len, store))


@pytest.mark.parametrize("norm,gated", [(True, False), (False, False), (True, True)])
def test_attention_heads_are_one_gpu_kernel_with_their_producers_fused_in(norm, gated):
    """The GPU pipeline's view of a decode step's heads: q, k, v as slices of one float32
    projection output, cast and reshaped (fuse-projections' form), into `attention_heads_te`.
    FuseOps takes the producers in (the op is marked injective) and the builds' schedules
    (`relax_pipeline.gpu_schedules`: dlight's GeneralReduction here) make the whole PrimFunc one
    kernel -- one blockIdx binding; without a matching rule it fell back to a kernel per operator
    (seven a layer on the H200, 8B shapes), and dlight's Reduction rule asserted on it."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op
    from specpilot.compiler.layers import slice_axis as _slice
    from specpilot.schedules.relax_pipeline import gpu_schedules
    nq, nkv, d = 6, 2, 64

    class Heads(nn.Module):
        def forward(self, y, wq, wk, cos, sin):
            g = 2 if gated else 1    # Qwen3.5: each query head's output gate beside it (attn_output_gate)
            q, k, v = (op.reshape(op.astype(_slice(y, 1, a * d, (a + n) * d, name), "bfloat16"), (1, 1, n, d))
                       for name, a, n in (("q", 0, nq * g), ("k", nq * g, nkv), ("v", nq * g + nkv, nkv)))
            if gated:
                q = _slice(op.reshape(q, (1, 1, nq, 2 * d)), 3, 0, d, "q")
            return op.tensor_expr_op(attention_heads_te("bfloat16", d, nq, nkv, 1e-6 if norm else None, False, False),
                                     "attention_heads", [q, k, v, *([wq, wk] if norm else []), cos, sin],
                                     attrs={"op_pattern": 2})
    spec = {"y": nn.spec.Tensor((1, (nq * (2 if gated else 1) + 2 * nkv) * d), "float32"), "wq": nn.spec.Tensor((d,), "bfloat16"),
            "wk": nn.spec.Tensor((d,), "bfloat16"), "cos": nn.spec.Tensor((1, 1, d), "bfloat16"),
            "sin": nn.spec.Tensor((1, 1, d), "bfloat16")}
    mod, _ = Heads().export_tvm({"forward": spec})
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        mod = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
            relax.transform.FuseTIR(), gpu_schedules()])(mod)
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1
    assert funcs[0].script().count('thread="blockIdx.x"') == 1


@pytest.mark.parametrize("dtype,half,B,T", [("float32", 64, 1, 1), ("bfloat16", 64, 3, 5), ("bfloat16", 16, 2, 7),
                                            ("float32", 3, 1, 9)])
def test_one_kernel_rotary_is_the_operators_bit_for_bit(dtype, half, B, T):
    """`lower.rotary_te` (cos and sin in one tensor) against the operators the lowering emitted
    before -- float32(positions) x inv_freq as a one-term matmul, concatenated with itself, cos and
    sin, each cast -- on random positions up to 40k and random frequencies, odd sizes: every bit."""
    import tvm
    from tvm import relax

    from specpilot.kernels.norms import rotary_te
    bb = relax.BlockBuilder()
    pos = relax.Var("pos", relax.TensorType([B, T], "int32"))
    inv = relax.Var("inv", relax.TensorType([half], "float32"))
    with bb.function("main", [pos, inv]):
        with bb.dataflow():
            cs = bb.emit_te(rotary_te(dtype), pos, inv)
            freqs = bb.emit(relax.op.matmul(relax.op.expand_dims(relax.op.astype(pos, "float32"), 2),
                                            relax.op.reshape(inv, (1, 1, half))))
            emb = bb.emit(relax.op.concat([freqs, freqs], axis=2))
            cos, sin = (bb.emit(relax.op.astype(f(emb), dtype)) for f in (relax.op.cos, relax.op.sin))
            out = bb.emit_output(relax.Tuple([cs, cos, sin]))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    gen = torch.Generator().manual_seed(half * 7 + T)
    positions = torch.randint(0, 40960, (B, T), generator=gen, dtype=torch.int32)
    freqs = 1e6 ** (-torch.arange(half, dtype=torch.float32) / half) * (1 + 0.01 * torch.rand(half, generator=gen))
    got = [torch.from_dlpack(t).clone() for t in vm["main"](tvm.runtime.from_dlpack(positions),
                                                             tvm.runtime.from_dlpack(freqs))]
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    assert got[0].shape == (2, B, T, 2 * half)
    assert torch.equal(got[0][0].view(bits), got[1].view(bits)) and torch.equal(got[0][1].view(bits), got[2].view(bits))


def test_spelled_bf16_rounding_is_torchs_bit_for_bit():
    """`lower.round_to(..., spelled=True)` (the CPU builds' bf16 rounding written on the bits) on
    random floats of every magnitude, exact ties to even and odd, the largest floats (rounding up
    to inf), subnormals, signed zeros, infinities and NaNs with payloads: the float32 bits of
    torch's ``x.to(bfloat16).float()``; a NaN stays a NaN (bf16's 0x7FC0 -- torch's CPU conversion
    gives 0xFFFF: NaN bits carry nothing a token depends on)."""
    import tvm
    from tvm import te

    from specpilot.kernels.norms import round_to
    rng = np.random.default_rng(0)
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                        0x7FFFFFFF, 0xFFFFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x00000001, 0x00008000,
                        0x00018000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x807FFFFF], dtype=np.uint32)
    bits = np.concatenate([special, rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)])
    x = bits.view(np.float32)
    n = len(x)
    inp = te.placeholder((n,), "float32", name="x")
    out = te.compute((n,), lambda i: round_to("bfloat16", inp[i], True), name="r")
    lib = tvm.compile(te.create_prim_func([inp, out]).with_attr("global_symbol", "k"), target="llvm")
    got = tvm.runtime.tensor(np.zeros(n, np.float32))
    lib["k"](tvm.runtime.tensor(x), got)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).float().numpy()
    nan = np.isnan(x)
    assert nan.sum() >= 6 and np.isnan(got.numpy()[nan]).all()
    assert (got.numpy()[nan].view(np.uint32) == 0x7FC00000).all()        # bf16-representable: low half zero
    np.testing.assert_array_equal(got.numpy()[~nan].view(np.uint32), want[~nan].view(np.uint32))
