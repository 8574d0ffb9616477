"""Norms as tensor expressions with the operators' roundings spelled out (bit-identical to the
reference on the CPU): RMSNorm, q / k norm with rotary, Gated DeltaNet's gated norm.
The lowering wraps them as Relax calls; the decode GEMV schedule reuses `rms_scaled` as its prologue."""

from __future__ import annotations

NORM_ATTR = "specpilot.rms_norm"   # on `RMSNorm`'s PrimFunc: JSON {eps, zero_centered, spelled}
HEADS_BLOCK = "attention_heads"     # the block of `attention_heads_te` (fused functions keep block names)


def f32(v):
    from tvm import tirx
    return tirx.Cast("float32", v)


def sum_squares(x_at, shape):
    """sum over the last axis of x_at(*i, k)^2 (x_at gives float32): a tensor over shape[:-1]."""
    from tvm import te
    k = te.reduce_axis((0, shape[-1]), "k")
    return te.compute(tuple(shape[:-1]), lambda *i: te.sum(x_at(*i, k) * x_at(*i, k), axis=k), name="sum_squares")


def rms_scaled(xf, squares, n, w_j, eps: float, zero_centered: bool, dtype: str, spelled: bool):
    """RMSNorm of one element before its final rounding to ``dtype``, in float32: h = xf /
    sqrt(squares / n + eps), then dtype(h) * w (the reference rounds h first) or h * (w + 1)
    zero-centered (Qwen3-Next / Qwen3.5)."""
    from tvm import tirx
    h = xf / tirx.sqrt(squares / tirx.const(float(int(n)), "float32") + tirx.const(eps, "float32"))
    if zero_centered:
        return h * (f32(w_j) + tirx.const(1.0, "float32"))
    return round_to(dtype, h, spelled) * f32(w_j)


def rms_norm_te(eps: float, zero_centered: bool, dtype: str, spelled: bool = True):
    """The tensor expression of `RMSNorm`: (x[..., n], w[n]) -> [..., n] in ``dtype``."""
    from tvm import te, tirx

    def compute(x: te.Tensor, w: te.Tensor) -> te.Tensor:
        squares = sum_squares(lambda *i: f32(x[i]), x.shape)
        return te.compute(tuple(x.shape), lambda *i: tirx.Cast(dtype, rms_scaled(
            f32(x[i]), squares[i[:-1]], x.shape[-1], w[i[-1]], eps, zero_centered, dtype, spelled)), name="rms_norm")
    return compute


def attention_heads_te(dtype: str, rot: int, n_q: int, n_kv: int, eps: float | None = None,
                       zero_centered: bool = False, spelled: bool = True):
    """An attention layer's new heads as one tensor expression: (q[B, T, n_q, d], k[B, T, n_kv, d],
    v[B, T, n_kv, d], [wq[d], wk[d],] cos[B, T, rot], sin[B, T, rot]) -> [B, T, n_q + 2 n_kv, d] in
    ``dtype``: the query heads, then the key heads -- each RMSNorm'd per head when ``eps`` is given
    (Qwen3's q / k norm, weights wq / wk), then rotary on its first ``rot`` dims (x * cos +
    rotate_half(x) * sin, the rest passed through) -- then the value heads as they are.  The
    attention kernels and `kernels.kv_write` read their heads out of it at offsets 0, n_q and
    n_q + n_kv, so one kernel (the slices and casts producing q, k and v fused in: it is marked
    injective) stands where the operators ran three or four.  Every value the operators rounded to
    ``dtype`` is rounded here (`round_to`), so the result is theirs bit for bit: the norm's two
    roundings, each product's, the sum's.  Every choice between loads is an ``if_then_else``, which
    is evaluated lazily: a ``Select`` is evaluated whole on the GPU (both sides loaded), while te
    simplifies each side's indices under its condition -- the clamps that kept a side in bounds
    dropped, so the side not taken read up to a head width outside q, k, v and cos / sin (an
    illegal address on the H200)."""
    from tvm import te, tirx
    pick = tirx.if_then_else

    def r(v):       # float32 -> dtype -> float32
        return round_to(dtype, v, spelled)

    half, normed_heads = rot // 2, n_q + n_kv

    def compute(q: te.Tensor, k: te.Tensor, v: te.Tensor, *rest: te.Tensor) -> te.Tensor:
        wq, wk, cos, sin = rest if eps is not None else (None, None, *rest)
        B, T, _, n = q.shape

        def x(b, t, h, j):      # head h of the output's input, as float32
            return pick(h < n_q, f32(q[b, t, tirx.min(h, n_q - 1), j]), pick(
                h < normed_heads, f32(k[b, t, tirx.max(tirx.min(h - n_q, n_kv - 1), 0), j]),
                f32(v[b, t, tirx.max(tirx.min(h - normed_heads, n_kv - 1), 0), j])))

        if eps is not None:
            # over every head, the value heads' unused: a reduction over fewer heads than the output
            # has is not dlight GeneralReduction's pattern (it fell back to a kernel per operator)
            squares = sum_squares(x, (B, T, n_q + 2 * n_kv, n))

            def normed(b, t, h, j):
                w = tirx.Select(h < n_q, wq[j], wk[j])
                return r(rms_scaled(x(b, t, h, j), squares[b, t, h], n, w, eps, zero_centered, dtype, spelled))
            if spelled and dtype == "bfloat16":     # where `round_to` writes the rounding on the bits
                normed = _staged(normed, (B, T, normed_heads, n))
        else:
            normed = x

        def head(b, t, h, i):
            if rot == 0:
                turned = normed(b, t, h, i)
            else:
                ci = tirx.min(i, rot - 1)
                partner = pick(i < half, -normed(b, t, h, tirx.min(i + half, n - 1)),
                                normed(b, t, h, tirx.max(i - half, 0)))
                turned = pick(i < rot, r(r(normed(b, t, h, i) * f32(cos[b, t, ci]))
                                                + r(partner * f32(sin[b, t, ci]))), normed(b, t, h, i))
            return tirx.Cast(dtype, pick(h < normed_heads, turned, x(b, t, h, i)))
        return te.compute((B, T, n_q + 2 * n_kv, n), head, name=HEADS_BLOCK)
    return compute


def _staged(value, shape):
    """``value`` (float32, over ``shape``) computed into a buffer of its own and read from it: the
    spelled roundings name their operand three times (`round_to`), so rotary's roundings over the
    norm's, written out in place, grew the heads kernel's expression as 3^4 (most of a bf16 model's
    CPU build time); read back, the float32 values are the same bits."""
    from tvm import te, tirx
    stage = te.compute(shape, value, name="heads_normed")

    def read(b, t, h, j):
        return stage[b, t, tirx.min(h, shape[2] - 1), j]
    return read


def rotary_te(dtype: str):
    """Rotary's cos and sin as one tensor expression: (positions[B, T] int32, inv_freq[h] float32) ->
    [2, B, T, 2 h] in ``dtype``, [0] the cos and [1] the sin of float32(position) x inv_freq[i mod h]
    -- the angles of the operators it stands for (positions times the inverse frequencies as a
    one-term float32 matmul, concatenated with themselves), each rounded once to ``dtype``.  One
    kernel a step for the matmul, the concatenation, cos and sin (every attention layer reads
    them, so FuseOps would fuse none of them into a layer); each layer's heads kernel reads its
    slices."""
    from tvm import te, tirx

    def compute(positions: te.Tensor, inv: te.Tensor) -> te.Tensor:
        half = inv.shape[0]
        B, T = positions.shape

        def value(which, b, t, i):
            angle = f32(positions[b, t]) * inv[i % max(int(half), 1)]     # (no element when half is 0)
            return tirx.Cast(dtype, tirx.Select(which == 0, tirx.cos(angle), tirx.sin(angle)))
        return te.compute((2, B, T, 2 * half), value, name="rotary")
    return compute


def gated_norm_te(eps: float, dtype: str, spelled: bool = True):
    """The Gated DeltaNet output gate as one kernel: o (float32) rounded to ``dtype``, RMSNorm per
    value head (`rms_norm_te`'s arithmetic), times silu(z) in float32, rounded to ``dtype``:
    (o[..., dv], w[dv], z[..., dv]) -> [..., dv]."""
    from tvm import te, tirx

    def compute(o: te.Tensor, w: te.Tensor, z: te.Tensor) -> te.Tensor:
        def x(*i):      # o as the dtype value the norm reads
            return round_to(dtype, o[i], spelled)
        squares = sum_squares(x, o.shape)

        def gated(*i):
            normed = round_to(dtype, rms_scaled(x(*i), squares[i[:-1]], o.shape[-1], w[i[-1]], eps, False, dtype,
                                                 spelled), spelled)
            zf = f32(z[i])
            return tirx.Cast(dtype, normed * (zf * tirx.sigmoid(zf)))
        return te.compute(tuple(o.shape), gated, name="gated_norm")
    return compute


def round_to(dtype: str, v, spelled: bool):
    """float32 ``v`` rounded to ``dtype`` and read back as float32, inside an expression.  On GPUs
    (``spelled`` False) two casts: CUDA computes bf16 natively and keeps them.  TVM's CPU
    legalization computes bf16 arithmetic in float32 and drops a bf16 cast whose value only feeds
    more arithmetic, which would skip this rounding (the reference rounds here, e.g.
    ``weight * h.to(bf16)``), so there (``spelled``) the rounding to nearest even is written out
    on the bits (a NaN becomes bf16's 0x7FC0).  That form names ``v`` three times (the
    fewest it can: the NaN test, the bits, their lowest kept bit) and these roundings nest, so a
    nest's expression grows as 3^depth (4^depth with the NaN's own bits kept): the heads kernel
    stages its norm (`_staged`; a ``Let`` would bind ``v`` once, but TVM's bf16 legalization does
    not rewrite the loads inside a ``Let``'s value).  LLVM shares the repeats, nvcc did not (a
    130 us gated norm), hence the GPU's casts."""
    from tvm import tirx
    if dtype == "float32":
        return v
    if dtype != "bfloat16" or not spelled:
        return tirx.Cast("float32", tirx.Cast(dtype, v))
    bits = tirx.reinterpret("uint32", v)
    rounded = (bits + tirx.const(0x7FFF, "uint32") + ((bits >> tirx.const(16, "uint32")) & tirx.const(1, "uint32"))) \
        & tirx.const(0xFFFF0000, "uint32")
    return tirx.reinterpret("float32", tirx.Select(tirx.isnan(v), tirx.const(0x7FC00000, "uint32"), rounded))
