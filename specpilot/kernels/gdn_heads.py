"""Gated DeltaNet: a layer's q, k and v heads from its conv output, as one kernel."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo
from specpilot.kernels.norms import round_to


@memo
def gdn_heads(nk: int, nv: int, dk: int, dv: int, dtype: str, gpu: bool):
    """conv (B, T, C) float32, C = 2 nk dk + nv dv (the q, k and v channels, before SiLU) -> q, k
    (B, T, nv, dk) and v (B, T, nv, dv), float32: each value rounded to ``dtype``, SiLU in ``dtype``
    (rounded again), q and k L2-normed over d_k (x / sqrt(sum x^2 + 1e-6), q times dk^-1/2) and
    repeated from the nk key heads to the nv value heads (value head h reads key head h // (nv /
    nk)), v as it is.  The Relax operators' arithmetic (cast, silu, slice, cast, l2norm, repeat) in
    one pass over the conv output, where the operators took four kernels (dlight scheduled the k
    norm's, a slice at an offset, with a block per repeated head).

    CPU form: a loop per (token, key head), its SiLU values staged once, the sums in order over d_k,
    so it is the operators' result bit for bit (the roundings spelled out: `norms.round_to`).  GPU
    form: a block per (token, key head), a thread per d_k entry (rounded up to whole warps); the two
    sums of squares by warp shuffles, then the warps' sums added in order (float32 rounding apart,
    the same arithmetic); the block also writes the key head's nv / nk value heads."""
    if nv % nk:
        raise ValueError(f"gdn_heads: {nv} value heads are not a multiple of {nk} key heads")
    if gpu and dk > 1024:
        raise ValueError(f"gdn_heads: the GPU form takes d_k up to 1024 (a thread each), got {dk}")
    r = nv // nk
    C = 2 * nk * dk + nv * dv
    threads = -(-dk // 32) * 32
    warps = threads // 32
    v_rounds = -(-r * dv // threads)    # the block's r value heads, a value a thread at a time
    scale = dk ** -0.5
    spelled = not gpu

    def silu(c):
        """conv value c (float32) -> SiLU of it rounded to ``dtype``, as float32."""
        if dtype == "float32":
            return c * T.sigmoid(c)
        if gpu:     # CUDA computes bf16 natively: the operators' casts and bf16 SiLU as they are
            xb = T.Cast(dtype, c)
            return T.Cast("float32", xb * T.sigmoid(xb))
        x = round_to(dtype, c, spelled)
        return round_to(dtype, x * T.sigmoid(x), spelled)

    def normed(x, sq, scaled: bool):
        v = x / T.sqrt(sq + T.float32(1e-6))
        return v * T.float32(scale) if scaled else v

    @T.prim_func(private=True, s_tir=True)
    def kernel(c_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n = T.int64(), T.int64()
        conv = T.match_buffer(c_h, (batch, n, C), "float32")
        q = T.match_buffer(q_h, (batch, n, nv, dk), "float32")
        k = T.match_buffer(k_h, (batch, n, nv, dk), "float32")
        v = T.match_buffer(v_h, (batch, n, nv, dv), "float32")
        with T.sblock("root"):
            if gpu:
                for bt in T.thread_binding(batch * n, thread="blockIdx.x"):
                    for h in T.thread_binding(nk, thread="blockIdx.y"):
                        for i in T.thread_binding(threads, thread="threadIdx.x"):
                            part = T.alloc_buffer((2, warps), "float32", scope="shared")
                            x = T.alloc_buffer((2,), "float32", scope="local")
                            sq = T.alloc_buffer((2,), "float32", scope="local")
                            b, t = bt // n, bt % n
                            for s in T.unroll(2):
                                x[s] = T.float32(0)      # lanes past d_k add nothing
                                if i < dk:
                                    x[s] = silu(conv[b, t, s * nk * dk + h * dk + i])
                                sq[s] = x[s] * x[s]
                                for u in T.unroll(5):
                                    sq[s] = sq[s] + T.tvm_warp_shuffle_xor(
                                        T.tvm_warp_activemask(), sq[s], T.shift_right(16, u), 32, 32)
                                if i % 32 == 0:
                                    part[s, i // 32] = sq[s]
                            T.tvm_storage_sync("shared")
                            for s in T.unroll(2):
                                sq[s] = T.float32(0)
                                for w in range(warps):
                                    sq[s] = sq[s] + part[s, w]
                            if i < dk:
                                for e in T.unroll(r):
                                    q[b, t, h * r + e, i] = normed(x[0], sq[0], True)
                                    k[b, t, h * r + e, i] = normed(x[1], sq[1], False)
                            for e in range(v_rounds):
                                if e * threads + i < r * dv:
                                    v[b, t, h * r + (e * threads + i) // dv, (e * threads + i) % dv] = \
                                        silu(conv[b, t, 2 * nk * dk + h * r * dv + e * threads + i])
            else:
                for bt in T.parallel(batch * n):
                    for h in range(nk):
                        xs = T.alloc_buffer((2, dk), "float32", scope="local")
                        sq = T.alloc_buffer((2,), "float32", scope="local")
                        b, t = bt // n, bt % n
                        for s in range(2):
                            sq[s] = T.float32(0)
                            for i in range(dk):
                                xs[s, i] = silu(conv[b, t, s * nk * dk + h * dk + i])
                                sq[s] = sq[s] + xs[s, i] * xs[s, i]
                        for e, i in T.grid(r, dk):
                            q[b, t, h * r + e, i] = normed(xs[0, i], sq[0], True)
                            k[b, t, h * r + e, i] = normed(xs[1, i], sq[1], False)
                        for e, j in T.grid(r, dv):
                            v[b, t, h * r + e, j] = silu(conv[b, t, 2 * nk * dk + (h * r + e) * dv + j])
    return kernel
