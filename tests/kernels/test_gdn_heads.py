"""`kernels.gdn_heads`: a Gated DeltaNet layer's q, k, v from its conv output in one kernel -- its CPU
form against the Relax operators it replaces (cast, SiLU, slices, casts, the L2 norm's operators,
repeat) bit for bit on random inputs, float32 and bf16, odd head sizes; its GPU form compiles to
sm_90 (a d_k short of a warp too); bad head counts are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot import kernels
from tests.kernel_helpers import run_cpu, sm90_source


def _operators(nk: int, nv: int, dk: int, dv: int, dtype: str):
    """The operators, built for llvm: conv (T, 1, C) -> q, k, v."""
    import tvm
    from tvm import relax, tirx
    op = relax.op
    C = 2 * nk * dk + nv * dv
    n = tirx.Var("n", "int64")
    conv = relax.Var("conv", relax.TensorType([1, n, C], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [conv]):
        with bb.dataflow():
            x = conv if dtype == "float32" else bb.emit(op.astype(conv, dtype))
            x = bb.emit(op.nn.silu(x))

            def heads(begin, end, count, width):
                part = op.strided_slice(x, axes=[2], begin=[begin], end=[end])
                return bb.emit(op.astype(op.reshape(part, (1, n, count, width)), "float32"))

            def normed(h, scale):
                ss = op.sum(op.multiply(h, h), axis=[-1], keepdims=True)
                out = op.divide(h, op.sqrt(op.add(ss, relax.const(1e-6, "float32"))))
                out = op.multiply(out, relax.const(scale, "float32")) if scale else out
                return bb.emit(op.repeat(out, nv // nk, axis=2))
            q = normed(heads(0, nk * dk, nk, dk), dk ** -0.5)
            k = normed(heads(nk * dk, 2 * nk * dk, nk, dk), None)
            v = heads(2 * nk * dk, C, nv, dv)
            out = bb.emit_output(relax.Tuple([q, k, v]))
        bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())


@pytest.mark.parametrize("dtype,nk,nv,dk,dv,n", [
    ("float32", 2, 6, 8, 5, 3),       # dk != dv
    ("bfloat16", 3, 3, 16, 16, 4),    # as many value heads as key heads
    ("bfloat16", 2, 4, 12, 7, 5),     # odd widths
    ("float32", 1, 3, 32, 32, 1),     # one token
])
def test_cpu_form_is_the_operators_bit_for_bit(dtype, nk, nv, dk, dv, n):
    import tvm
    rng = np.random.default_rng(nk * 100 + dk + dv)
    C = 2 * nk * dk + nv * dv
    conv = (rng.standard_normal((1, n, C)) * 3).astype("float32")
    got = run_cpu(kernels.gdn_heads(nk, nv, dk, dv, dtype, False), [conv],
                  [((1, n, nv, dk), "float32"), ((1, n, nv, dk), "float32"), ((1, n, nv, dv), "float32")])
    want = _operators(nk, nv, dk, dv, dtype)["main"](tvm.runtime.tensor(conv))
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_array_equal(g.view("int32"), w.numpy().view("int32"), err_msg=name)


def test_batched_tokens_are_each_their_own():
    """Each (sequence, token) row is computed from its own conv row alone: a batch of 3 equals the
    rows run one sequence at a time."""
    rng = np.random.default_rng(7)
    nk, nv, dk, dv, B, n = 2, 4, 8, 8, 3, 2
    conv = rng.standard_normal((B, n, 2 * nk * dk + nv * dv)).astype("float32")
    kernel = kernels.gdn_heads(nk, nv, dk, dv, "bfloat16", False)
    shapes = lambda b: [((b, n, nv, dk), "float32"), ((b, n, nv, dk), "float32"), ((b, n, nv, dv), "float32")]  # noqa: E731
    whole = run_cpu(kernel, [conv], shapes(B))
    for b in range(B):
        alone = run_cpu(kernel, [conv[b:b + 1]], shapes(1))
        for w, a in zip(whole, alone):
            np.testing.assert_array_equal(w[b:b + 1], a)


def test_head_counts_that_do_not_divide_are_clear_errors():
    with pytest.raises(ValueError, match="not a multiple of 3 key heads"):
        kernels.gdn_heads(3, 8, 16, 16, "float32", False)
    with pytest.raises(ValueError, match="d_k up to 1024"):
        kernels.gdn_heads(2, 4, 1040, 64, "bfloat16", True)


def test_gpu_form_compiles_to_sm90(tmp_path):
    src = sm90_source(tmp_path, "from specpilot import kernels",
                      "{'heads': kernels.gdn_heads(16, 48, 128, 128, 'bfloat16', True), "
                      "'narrow': kernels.gdn_heads(2, 4, 64, 40, 'float32', True), "
                      "'ragged': kernels.gdn_heads(3, 6, 24, 20, 'bfloat16', True)}")   # d_k short of a warp
    assert "__shfl_xor_sync" in src and src.count("__global__") >= 3
