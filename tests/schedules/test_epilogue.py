"""Elementwise epilogues fused into the skinny GEMMs' stores (`schedules.epilogue`).

On the CPU: a stand-in producer (a plain TIR matmul that, like the skinny kernels, only stores
to its output) followed by real legalized consumers (FuseOps + FuseTIR of Relax casts, adds,
SiLU, bias, ...) is built twice for llvm -- with and without `fuse_epilogues` -- and run on
fresh random inputs at odd row counts: the outputs must be bit-identical.  Consumers that move
elements (transpose, slice) or a GEMM output with a second user must not fuse.  On the GPU
side: the real skinny kernel with an epilogue compiles for sm_90a with the stores rewritten.
"""

from __future__ import annotations

import re

import pytest
import torch
import tvm
from tvm import relax

from specpilot.schedules.epilogue import ATTR, elementwise_epilogue, fuse_epilogues
from tests.kernel_helpers import sm90_source

K = 24


def _producer(n_out: int, k_in: int = K):
    """x[m, K] . W[N, K]^T -> float32 y (m symbolic), each y element stored once, as the skinny
    kernels do."""
    from tvm.script import tirx as T
    N, KK = T.int64(n_out), T.int64(k_in)

    @T.prim_func(private=True, s_tir=True)
    def mm(x_h: T.handle, w: T.Buffer((N, KK), "bfloat16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, ATTR: 2})
        m = T.int64()
        x = T.match_buffer(x_h, (m, KK), "bfloat16")
        y = T.match_buffer(y_h, (m, N), "float32")
        with T.sblock("root"):
            acc = T.alloc_buffer((1,), "float32", scope="local")
            for i, j in T.grid(m, N):
                acc[0] = T.float32(0)
                for k in range(KK):
                    acc[0] = acc[0] + T.Cast("float32", x[i, k]) * T.Cast("float32", w[j, k])
                y[i, j] = acc[0]
    return mm


def _module(n_out: int, tail, producers: int = 1):
    """main(x, W..., extra...) = tail(bb, [producer(x, W_i)...], extras); returns (module, extra shapes)."""
    bb = relax.BlockBuilder()
    m = tvm.tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType([m, K], "bfloat16"))
    ws = [relax.Var(f"w{i}", relax.TensorType([n_out, K], "bfloat16")) for i in range(producers)]
    r = relax.Var("r", relax.TensorType([m, n_out], "bfloat16"))
    b = relax.Var("b", relax.TensorType([n_out], "float32"))
    gv = bb.add_func(_producer(n_out), "mm")
    with bb.function("main", [x, *ws, r, b]):
        with bb.dataflow():
            ys = [bb.emit(relax.call_tir(gv, [x, w], relax.TensorType([m, n_out], "float32"))) for w in ws]
            out = bb.emit_output(tail(bb, ys, r, b))
        bb.emit_func_output(out)
    seq = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                    relax.transform.FuseOps(), relax.transform.FuseTIR()])
    return seq(bb.get())


TAILS = {
    "cast": lambda bb, ys, r, b: relax.op.astype(ys[0], "bfloat16"),
    "cast+residual": lambda bb, ys, r, b: relax.op.add(bb.emit(relax.op.astype(ys[0], "bfloat16")), r),
    "logits rounding": lambda bb, ys, r, b: relax.op.astype(bb.emit(relax.op.astype(ys[0], "bfloat16")), "float32"),
    "bias (broadcast over rows)+silu": lambda bb, ys, r, b: relax.op.nn.silu(bb.emit(relax.op.add(ys[0], b))),
    "read twice": lambda bb, ys, r, b: relax.op.multiply(ys[0], bb.emit(relax.op.sigmoid(ys[0]))),
    # a parameter-only intermediate over its own domain (as -exp(A_log) per head), inlined where read
    "bias from a parameter-only intermediate": lambda bb, ys, r, b: relax.op.multiply(
        ys[0], bb.emit(relax.op.negative(bb.emit(relax.op.exp(b))))),
}


def _run(mod, n_out: int, rows: int, producers: int, seed: int) -> torch.Tensor:
    """The module's output bits on fresh random bf16 inputs (x, W..., residual) and a float32 bias."""
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    gen = torch.Generator().manual_seed(seed)
    shapes = [(rows, K)] + [(n_out, K)] * producers + [(rows, n_out)]
    args = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes] + [torch.randn(n_out, generator=gen)]
    result = vm["main"](*[tvm.runtime.from_dlpack(a) for a in args])
    outs = [torch.from_dlpack(o).clone() for o in (result if isinstance(result, (list, tuple)) or
                                                   type(result).__name__ == "Array" else [result])]
    return torch.cat([o.view(torch.int16 if o.dtype == torch.bfloat16 else torch.int32).flatten().to(torch.int64)
                      for o in outs])


@pytest.mark.parametrize("name", list(TAILS))
def test_fused_epilogue_is_bit_identical_to_the_separate_kernel(name):
    n_out = 40
    mod = _module(n_out, TAILS[name])
    fused, count = fuse_epilogues(mod)
    assert count == 1
    calls = [b.value.args[0].name_hint for blk in fused["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call)]
    assert len(calls) == 1 and calls[0].startswith("mm_"), calls
    for rows, seed in ((1, 0), (7, 1), (13, 2)):
        want = _run(mod, n_out, rows, 1, seed)
        got = _run(fused, n_out, rows, 1, seed)
        assert want.shape == got.shape and torch.equal(want, got), (name, rows)


def test_two_producers_one_consumer_fuses_into_one_of_them():
    """SwiGLU over separate gate / up GEMMs: the consumer joins one GEMM, reading the other's
    output as an ordinary input."""
    n_out = 32

    def swiglu(bb, ys, r, b):
        gate = bb.emit(relax.op.nn.silu(bb.emit(relax.op.astype(ys[0], "bfloat16"))))
        return relax.op.multiply(gate, bb.emit(relax.op.astype(ys[1], "bfloat16")))
    mod = _module(n_out, swiglu, producers=2)
    fused, count = fuse_epilogues(mod)
    assert count == 1
    assert len([b for blk in fused["main"].body.blocks for b in blk.bindings]) == 2
    for rows, seed in ((3, 5), (11, 6)):
        assert torch.equal(_run(mod, n_out, rows, 2, seed), _run(fused, n_out, rows, 2, seed))


NOT_MAPS = ["transpose", "column slice", "first rows", "two users", "row reduction"]


@pytest.mark.parametrize("name", NOT_MAPS)
def test_consumers_that_are_not_elementwise_maps_stay_separate(name):
    """A user that moves or drops elements, or a second user, keeps the GEMM's float32 output: the
    fused kernel stores every element of the output once (a row or column slice would have it write
    past its user's output)."""
    n_out = 32

    def cast(bb, y):
        return bb.emit(relax.op.astype(y, "bfloat16"))
    tails = {
        "transpose": lambda bb, ys, r, b: relax.op.permute_dims(ys[0]),
        "column slice": lambda bb, ys, r, b: cast(bb, bb.emit(relax.op.strided_slice(ys[0], axes=[1], begin=[8],
                                                                                      end=[27]))),
        "first rows": lambda bb, ys, r, b: cast(bb, bb.emit(relax.op.strided_slice(ys[0], axes=[0], begin=[0],
                                                                                    end=[1]))),
        "two users": lambda bb, ys, r, b: relax.Tuple([
            cast(bb, bb.emit(relax.op.strided_slice(ys[0], axes=[1], begin=[0], end=[8]))),
            cast(bb, bb.emit(relax.op.strided_slice(ys[0], axes=[1], begin=[8], end=[32])))]),
        "row reduction": lambda bb, ys, r, b: relax.op.sum(ys[0], axis=[1], keepdims=True),
    }
    mod = _module(n_out, tails[name])
    fused, count = fuse_epilogues(mod)
    assert count == 0
    tvm.ir.assert_structural_equal(fused, mod)


def _hand_map(rows: int | None, shift: int):
    """o[i, j] = 2 y[i, (j + shift) % 16] over o's rows: all of y's (rows None) or its first ``rows``."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def f(y_h: T.handle, o_h: T.handle):
        m = T.int64()
        y = T.match_buffer(y_h, (m, T.int64(16)), "float32")
        o = T.match_buffer(o_h, (m if rows is None else T.int64(rows), T.int64(16)), "float32")
        for i, j in T.grid(m if rows is None else T.int64(rows), T.int64(16)):
            with T.sblock("o"):
                vi, vj = T.axis.remap("SS", [i, j])
                o[vi, vj] = y[vi, (vj + T.int64(shift)) % T.int64(16) if shift != 0 else vj] * T.float32(2)
    return f


def test_epilogue_refuses_a_consumer_reading_the_output_elsewhere():
    """A consumer reading y at a shifted column (a hand-made stencil), or only some of its rows,
    is not an epilogue: the fused kernel stores every element of y once, so a user of fewer rows
    would be written past its end."""
    assert elementwise_epilogue(_hand_map(None, 1), 0, 16) is None
    assert elementwise_epilogue(_hand_map(None, 0), 0, 8) is None      # wrong width
    assert elementwise_epilogue(_hand_map(4, 0), 0, 16) is None         # y's first 4 rows only
    assert elementwise_epilogue(_hand_map(None, 0), 0, 16) is not None


def test_skinny_kernel_with_epilogue_compiles_for_sm90a(tmp_path):
    """The real wgmma kernel with the residual epilogue: bf16 stores to the consumer's output, the
    residual read in the same kernel, no float32 output parameter left."""
    setup = (
        "from tvm import relax\n"
        "from specpilot.schedules.skinny_mma import substitute\n"
        "from specpilot.schedules.epilogue import fuse_epilogues\n"
        "bb = relax.BlockBuilder(); m = tvm.tirx.Var('m', 'int64')\n"
        "x = relax.Var('x', relax.TensorType([m, 128], 'bfloat16'))\n"
        "w = relax.Var('w', relax.TensorType([256, 128], 'bfloat16'))\n"
        "r = relax.Var('r', relax.TensorType([m, 256], 'bfloat16'))\n"
        "with bb.function('main', [x, w, r]):\n"
        "    with bb.dataflow():\n"
        "        y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype='float32'))\n"
        "        out = bb.emit_output(relax.op.add(bb.emit(relax.op.astype(y, 'bfloat16')), r))\n"
        "    bb.emit_func_output(out)\n"
        "mod = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps()])(bb.get())\n"
        "mod, n = substitute(mod, wgmma=True); assert n == 1\n"
        "mod = tvm.transform.Sequential([relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),"
        " relax.transform.FuseTIR()])(mod)\n"
        "mod, n = fuse_epilogues(mod); assert n == 1\n"
        "fused = [f for gv, f in mod.functions.items() if gv.name_hint.startswith('skinny_mma_256_128_')]\n"
        "assert len(fused) == 1 and len(fused[0].params) == 4\n")
    text = sm90_source(tmp_path, setup, "{'epi': fused[0]}", arch="sm_90a")
    heads = {name: params for name, params in re.findall(r"void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{", text)}
    assert heads and all("float* __restrict__" not in p.split(",")[-1] for p in heads.values())
    assert "wgmma.mma_async.sync.aligned" in text and "nv_bfloat16* __restrict__ r" in text



def test_the_skinny_mma_pipeline_fuses_epilogues():
    """The schedule set wires the pass in: through `relax_pipeline.pipeline(sm_90a, "skinny-mma")` the
    projection's cast and residual add run inside the skinny kernel, no kernel of their own left."""
    from tvm import tirx

    from specpilot.schedules.relax_pipeline import pipeline
    bb = relax.BlockBuilder()
    m = tvm.tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType([m, 128], "bfloat16"))
    w = relax.Var("w", relax.TensorType([256, 128], "bfloat16"))
    r = relax.Var("r", relax.TensorType([m, 256], "bfloat16"))
    with bb.function("main", [x, w, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32"))
            out = bb.emit_output(relax.op.add(bb.emit(relax.op.astype(y, "bfloat16")), r))
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        mod = pipeline(target, "skinny-mma")(bb.get())
    kernels = sorted(gv.name_hint for gv, f in mod.functions.items()
                     if isinstance(f, tirx.PrimFunc) and not gv.name_hint.startswith("shape_func"))
    assert kernels == ["skinny_mma_256_128_fused_cast_add"], kernels
