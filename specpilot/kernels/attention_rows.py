"""Many-row attention from the KV pool with any mask (prefill, chain and tree verification): CPU loops,
and on GPUs `mma.sync` flash attention split over the keys, merged by `attention_combine`."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.attention_decode import ATTN_CHUNK
from specpilot.kernels.attention_merge import ATTN_FLOOR
from specpilot.kernels.base import memo


ROWS_WARPS = 4       # GPU form of `attention_rows_partial`: warps per block, 16 query rows each
ROWS_KEYS = 32       # keys per shared-memory chunk (two chunks in flight)
ROWS_SPLIT = 256     # verification: keys per split (flash decoding) ...
ROWS_SPLITS = 16     # ... and at most this many splits (longer contexts: longer splits); prefill: one
CPU_KEYS = ATTN_CHUNK  # CPU form: keys a chunk (scores in one buffer, sums rescaled once a chunk): a decode split
CPU_LANES = 8        # CPU form: a dot product's partial sums, one vector


def key_splits(L, split: int = 0, splits: int = 0):
    """How many splits a pool attention kernel cuts L keys into (its partial outputs' S): of
    ``split`` keys each, at most ``splits`` of them when both are given; ``splits`` alone: exactly
    that many.  The kernels' buffers and the lowering's placeholders both take it from here."""
    from tvm import tirx
    if not split:
        return splits
    return tirx.min(tirx.IntImm("int64", splits), (L + split - 1) // split) if splits else (L + split - 1) // split


def rows_kernel_fits(head_dim: int, dtype: str) -> bool:
    """Whether `attention_rows_partial` has a GPU form for these heads: 16-bit values (mma.sync)
    and head_dim a multiple of 32 (its k steps)."""
    return dtype in ("bfloat16", "float16") and head_dim % 32 == 0


@memo
def attention_rows_partial(n_layers: int, layer: int, rows: int, n_kv: int, capacity: int, head_dim: int,
                           group: int, dtype: str, gpu: bool, split: int = 0, splits: int = 0, q_heads: int = 0):
    """Attention of many query rows (prefill, chain and tree verification) straight from the KV
    pool, split over the keys, first half -- what `attention_decode` does for one row.

    Inputs q (B, T, n_kv * group, d) after rotary, the pool kv (layers, 2, rows, n_kv, capacity, d),
    rows (B,) and mask (B, T, L) (a tree's ancestor mask, or causal); with ``q_heads`` q is
    (B, T, q_heads, d), the queries its first n_kv * group heads.  The query rows of KV head h
    are r = t * group + g (token t, query head h * group + g).  The keys go in S splits: of ``split``
    keys each (S = ceil(L / split)); with ``splits`` too, at most that many (S = min(splits,
    ceil(L / split)), ceil(L / S) keys each: the workspace stays bounded at long contexts); with
    ``splits`` alone, exactly that many (1: prefill, one split of all the keys).  Per split: the
    running max m of the scaled scores (float32 dot products times d^-0.5) over the split's keys
    that row's token may see, the sum l of exp(score - m), and sum of exp(score - m) * v --
    outputs acc (B, n_kv, S, T * group, d) and ml (B, n_kv, S, T * group, 2);
    `attention_combine` merges the splits.  No step copies keys or values out of the pool, and
    no step materializes the (T x L) scores (`lower`'s gathered form does both).

    CPU form (`_cpu_rows`; with one token and ``ATTN_CHUNK`` keys per split it is the CPU decode
    kernel; verification on the CPU takes the same splits, so a causal row adds what decode adds, in
    decode's order: keys a row may not see add nothing, and splits it sees none of merge with weight
    0).  GPU form (bf16 / fp16, `rows_kernel_fits`): flash attention on tensor cores.  A block per (sequence, KV head, split, 16 * ``ROWS_WARPS`` rows); its Q rows and
    chunks of ``ROWS_KEYS`` keys and values go to shared memory with cp.async (the next chunk in
    flight while this one is multiplied).  Each warp: S = Q K^T for its 16 rows (mma.sync m16n8k16,
    float32 sums; a lane's k slots stand for 8 consecutive dims, as in `schedules.skinny_kernels`),
    masked and scaled, the running max / sum per row (quad shuffles), P = exp(S - m) rounded to the
    value dtype as the A operand of O += P V straight from the S registers, V's B operands by
    ldmatrix.trans.  Shared rows are swizzled so each 8-lane phase of the operand loads hits 32
    distinct banks.  P is rounded before its product with V (as the gathered form rounds the
    probabilities); the sums are float32.
    """
    scale = float(head_dim) ** -0.5
    if split <= 0 and splits <= 0:
        raise ValueError("attention_rows_partial: give keys per split (split) and / or the number of splits (splits)")

    def n_splits(L):
        return key_splits(L, split, splits)

    def keys(L):
        return split if split and not splits else (L + n_splits(L) - 1) // n_splits(L)

    if not gpu:
        cpu_form = _cpu_rows(layer, n_kv, head_dim, group, scale, n_splits, keys)
        body = _rows_signature(n_layers, rows, n_kv, capacity, head_dim, group, dtype, n_splits, False, cpu_form,
                               q_heads)

        @T.prim_func(private=True, s_tir=True)
        def cpu(q_h: T.handle, kv_h: T.handle, rows_h: T.handle, mask_h: T.handle, acc_h: T.handle,
                ml_h: T.handle):
            body(q_h, kv_h, rows_h, mask_h, acc_h, ml_h)
        return cpu
    if not rows_kernel_fits(head_dim, dtype):
        raise ValueError(f"attention_rows_partial's GPU form needs bf16/fp16 and head_dim % 32 == 0, "
                         f"not {dtype} / {head_dim}")
    return _rows_gpu(n_layers, layer, rows, n_kv, capacity, head_dim, group, dtype, n_splits, keys, scale, q_heads)


def _cpu_rows(layer, n_kv, d, group, scale, n_splits, keys):
    """The CPU form: a parallel task per (sequence, KV head, split, query row).  The row's split goes
    in chunks of ``CPU_KEYS`` keys: each visible key's score (the dot product in ``CPU_LANES``
    vector partial sums, added in lane order, times d^-0.5) into a buffer, then the running max,
    sum and value sums rescaled once by the chunk's max and the chunk's values folded in with one
    exp a key, vectorised over the head dimension.  The buffers are constant-size: below TVM's 1 KB
    stack bound (head_dim < 256) they live on the task's stack (registers), not in a workspace
    allocation each."""
    lanes, ch = CPU_LANES, CPU_KEYS
    whole = d // lanes

    @T.macro
    def cpu_form(q, kv, row, mask, out, ml, batch, tokens, L):
        with T.sblock("root"):
            for task in T.parallel(batch * n_kv * n_splits(L) * (tokens * group)):
                # expressions, not variables (an assigned name would be a one-element workspace buffer)
                rs = T.meta_var(tokens * group)
                r = T.meta_var(task % rs)
                sp = T.meta_var(task // rs % n_splits(L))
                h = T.meta_var(task // (rs * n_splits(L)) % n_kv)
                b = T.meta_var(task // (rs * n_splits(L) * n_kv))
                t = T.meta_var(r // group)
                seq = T.meta_var(T.Cast("int64", row[b]))
                qv = T.alloc_buffer((d,), "float32")
                acc = T.alloc_buffer((d,), "float32")
                sc = T.alloc_buffer((ch,), "float32")
                vis = T.alloc_buffer((ch,), "int32")
                part = T.alloc_buffer((lanes,), "float32")
                st = T.alloc_buffer((4,), "float32")        # running max, running sum, chunk max, p
                for i in T.vectorized(d):
                    qv[i] = T.Cast("float32", q[b, t, h * group + r % group, i])
                    acc[i] = T.float32(0)
                st[0] = T.float32(ATTN_FLOOR)
                st[1] = T.float32(0)
                for c in range((keys(L) + ch - 1) // ch):
                    st[2] = T.float32(ATTN_FLOOR)
                    for jj in range(ch):
                        vis[jj] = 0
                        if c * ch + jj < keys(L) and sp * keys(L) + c * ch + jj < L:
                            if mask[b, t, sp * keys(L) + c * ch + jj]:
                                vis[jj] = 1
                                for l in T.vectorized(lanes):
                                    part[l] = T.float32(0)
                                for io in range(whole):
                                    for l in T.vectorized(lanes):
                                        part[l] = part[l] + qv[io * lanes + l] * T.Cast(
                                            "float32", kv[layer, 0, seq, h, sp * keys(L) + c * ch + jj, io * lanes + l])
                                for l in range(d - whole * lanes):
                                    part[l] = part[l] + qv[whole * lanes + l] * T.Cast(
                                        "float32", kv[layer, 0, seq, h, sp * keys(L) + c * ch + jj, whole * lanes + l])
                                sc[jj] = part[0]
                                for l in range(1, lanes):
                                    sc[jj] = sc[jj] + part[l]
                                sc[jj] = sc[jj] * T.float32(scale)
                                st[2] = T.max(st[2], sc[jj])
                    if st[2] > st[0]:       # a larger max: rescale what the row has so far
                        st[3] = T.exp(st[0] - st[2])
                        st[1] = st[1] * st[3]
                        for i in T.vectorized(d):
                            acc[i] = acc[i] * st[3]
                        st[0] = st[2]
                    for jj in range(ch):
                        if vis[jj] == 1:
                            st[3] = T.exp(sc[jj] - st[0])
                            st[1] = st[1] + st[3]
                            for i in T.vectorized(d):
                                acc[i] = acc[i] + st[3] * T.Cast(
                                    "float32", kv[layer, 1, seq, h, sp * keys(L) + c * ch + jj, i])
                ml[b, h, sp, r, 0] = st[0]
                ml[b, h, sp, r, 1] = st[1]
                for i in T.vectorized(d):
                    out[b, h, sp, r, i] = acc[i]
    return cpu_form


def _rows_signature(n_layers, rows, n_kv, capacity, d, group, dtype, n_splits, scheduled, form, q_heads=0):
    """The rows kernel's parameters, as both forms declare them; ``form`` (a macro) gets the buffers."""
    @T.macro
    def body(q_h, kv_h, rows_h, mask_h, acc_h, ml_h):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": scheduled})
        batch, tokens, L = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (batch, tokens, q_heads or n_kv * group, d), dtype)
        kv = T.match_buffer(kv_h, (n_layers, 2, rows, n_kv, capacity, d), dtype)
        row = T.match_buffer(rows_h, (batch,), "int32")
        mask = T.match_buffer(mask_h, (batch, tokens, L), "bool")
        out = T.match_buffer(acc_h, (batch, n_kv, n_splits(L), tokens * group, d), "float32")
        ml = T.match_buffer(ml_h, (batch, n_kv, n_splits(L), tokens * group, 2), "float32")
        form(q, kv, row, mask, out, ml, batch, tokens, L)
    return body


def _rows_gpu(n_layers, layer, rows, n_kv, capacity, d, group, dtype, n_splits, keys, scale, q_heads=0):
    W, KC = ROWS_WARPS, ROWS_KEYS
    BR = 16 * W                      # query rows per block
    P = d // 8                       # 16-byte pieces per row
    # piece XOR f(row): rows 2i, 2i+1 differ in bit 2 (an 8-lane phase of the Q / K operand loads
    # reads 4 pieces of two rows) and f(0..7) are distinct (ldmatrix reads one piece of 8 rows);
    # masked to the largest power of two dividing P, so a row's pieces stay in the row
    swm = min(8, P & -P) - 1
    threads = 32 * W
    q_rounds, kv_rounds = -(-BR * P // threads), -(-2 * KC * P // threads)
    steps, tiles = d // 32, KC // 8          # 32-wide k steps of S; 8-key tiles of a chunk
    ab = "bf16" if dtype == "bfloat16" else "fp16"
    copy = "cp.async.cg.shared.global"

    def sw(r, p):
        return T.bitwise_xor(p, T.bitwise_and(T.bitwise_xor((r % 2) * 4, (r // 2) % 4), swm))

    @T.macro
    def issue(smem, kv, row, b, h, key0, stage, tid):
        """Chunk keys key0 .. key0 + KC - 1 (clamped into the pool; masked later) -> stage."""
        for rr in T.serial(kv_rounds):
            if rr * threads + tid < 2 * KC * P:
                i = T.meta_var(rr * threads + tid)
                srow = T.meta_var(BR + (stage * 2 + i // (KC * P)) * KC + (i // P) % KC)
                T.evaluate(T.ptx[copy](T.address_of(smem[srow, sw(srow, i % P) * 8]), T.address_of(
                    kv[layer, i // (KC * P), T.Cast("int64", row[b]), h,
                       T.min(key0 + (i // P) % KC, capacity - 1), (i % P) * 8]), 16))

    @T.macro
    def gpu_form(q, kv, row, mask, out, ml, batch, tokens, L):
        for bh in T.thread_binding(batch * n_kv, thread="blockIdx.x"):
            for sp in T.thread_binding(n_splits(L), thread="blockIdx.y"):
                for rt in T.thread_binding((tokens * group + BR - 1) // BR, thread="blockIdx.z"):
                    for w in T.thread_binding(W, thread="threadIdx.y"):
                        for lane in T.thread_binding(32, thread="threadIdx.x"):
                            # one buffer for everything cp.async writes (FACTS.md: the planner
                            # does not see cp.async writes as uses): Q rows, then 2 stages x (K, V)
                            smem = T.alloc_buffer((BR + 4 * KC, d), dtype, scope="shared.dyn")
                            qa = T.alloc_buffer((2, 8), dtype, scope="local")
                            af = T.alloc_buffer((2, 8), dtype, scope="local")
                            kb = T.alloc_buffer((tiles, 8), dtype, scope="local")
                            kf = T.alloc_buffer((tiles, 8), dtype, scope="local")
                            sc = T.alloc_buffer((tiles, 4), "float32", scope="local")
                            ok = T.alloc_buffer((tiles, 4), "int32", scope="local")
                            pa = T.alloc_buffer((KC // 16, 8), dtype, scope="local")
                            vb = T.alloc_buffer((8,), dtype, scope="local")
                            o = T.alloc_buffer((d // 8, 4), "float32", scope="local")
                            mrow = T.alloc_buffer((2,), "float32", scope="local")
                            mnew = T.alloc_buffer((2,), "float32", scope="local")
                            corr = T.alloc_buffer((2,), "float32", scope="local")
                            lrow = T.alloc_buffer((2,), "float32", scope="local")
                            b, h = T.meta_var(bh // n_kv), T.meta_var(bh % n_kv)
                            R = T.meta_var(tokens * group)
                            k0 = T.meta_var(sp * keys(L))
                            nk = T.meta_var(T.min(T.Cast("int64", keys(L)), L - sp * keys(L)))
                            tid_ = T.meta_var(w * 32 + lane)
                            for e in T.unroll(d // 8):
                                for c in T.unroll(4):
                                    o[e, c] = T.float32(0)
                            for hh in T.unroll(2):
                                mrow[hh] = T.float32(ATTN_FLOOR)
                                lrow[hh] = T.float32(0)
                            for rr in T.serial(q_rounds):
                                if rr * threads + tid_ < BR * P:
                                    i = T.meta_var(rr * threads + tid_)
                                    gr = T.meta_var(T.min(rt * BR + i // P, R - 1))
                                    T.evaluate(T.ptx[copy](T.address_of(smem[i // P, sw(i // P, i % P) * 8]),
                                                           T.address_of(q[b, gr // group, h * group + gr % group,
                                                                          (i % P) * 8]), 16))
                            issue(smem, kv, row, b, h, k0, 0, tid_)
                            T.evaluate(T.ptx["cp.async.commit_group"]())
                            for c in T.serial((nk + KC - 1) // KC):
                                if (c + 1) * KC < nk:
                                    issue(smem, kv, row, b, h, k0 + (c + 1) * KC, (c + 1) % 2, tid_)
                                T.evaluate(T.ptx["cp.async.commit_group"]())
                                T.evaluate(T.ptx["cp.async.wait_group"](1))
                                T.tvm_storage_sync("shared")
                                base = T.meta_var(BR + (c % 2) * 2 * KC)
                                # S = Q K^T for the warp's 16 rows x the chunk's keys
                                for j in T.unroll(tiles):
                                    for e in T.unroll(4):
                                        sc[j, e] = T.float32(0)
                                for s in T.unroll(steps):
                                    for hh in T.unroll(2):
                                        for v in T.vectorized(8):
                                            qa[hh, v] = smem[w * 16 + hh * 8 + lane // 4,
                                                             sw(w * 16 + hh * 8 + lane // 4, s * 4 + lane % 4) * 8 + v]
                                    for j in T.unroll(tiles):
                                        for v in T.vectorized(8):
                                            kb[j, v] = smem[base + j * 8 + lane // 4,
                                                            sw(base + j * 8 + lane // 4, s * 4 + lane % 4) * 8 + v]
                                    for j in T.unroll(tiles):
                                        for v in T.unroll(8):
                                            kf[j, v] = kb[j, v]
                                    for qq in T.unroll(2):
                                        for h2 in T.unroll(2):
                                            for hh in T.unroll(2):
                                                for e in T.unroll(2):
                                                    af[qq, h2 * 4 + hh * 2 + e] = qa[hh, qq * 4 + h2 * 2 + e]
                                    for qq in T.unroll(2):
                                        for j in T.unroll(tiles):
                                            T.evaluate(T.ptx_legacy.mma(
                                                "m16n8k16", "row", "col", ab, ab, "fp32", af.data, qq * 8,
                                                kf.data, j * 8 + qq * 4, sc.data, j * 4, False, dtype="float32"))
                                # mask and scale; running max per row (rows g, g + 8 of the warp)
                                for hh in T.unroll(2):
                                    mnew[hh] = mrow[hh]
                                for j in T.unroll(tiles):
                                    for e in T.unroll(4):
                                        key = T.meta_var(k0 + c * KC + j * 8 + (lane % 4) * 2 + e % 2)
                                        r = T.meta_var(T.min(rt * BR + w * 16 + (e // 2) * 8 + lane // 4, R - 1))
                                        ok[j, e] = T.Cast("int32", key < k0 + nk)
                                        if ok[j, e] > 0:
                                            ok[j, e] = T.Cast("int32", mask[b, r // group, key])
                                        sc[j, e] = T.if_then_else(ok[j, e] > 0, sc[j, e] * T.float32(scale),
                                                                  T.float32(ATTN_FLOOR))
                                        mnew[e // 2] = T.max(mnew[e // 2], sc[j, e])
                                for hh in T.unroll(2):
                                    for u in T.unroll(2):   # the quad of lanes sharing the row
                                        mnew[hh] = T.max(mnew[hh], T.tvm_warp_shuffle_xor(
                                            T.tvm_warp_activemask(), mnew[hh], u + 1, 32, 32))
                                    corr[hh] = T.exp(mrow[hh] - mnew[hh])
                                    lrow[hh] = lrow[hh] * corr[hh]
                                for e in T.unroll(d // 8):
                                    for cc in T.unroll(4):
                                        o[e, cc] = o[e, cc] * corr[cc // 2]
                                for hh in T.unroll(2):
                                    mrow[hh] = mnew[hh]
                                for j in T.unroll(tiles):
                                    for e in T.unroll(4):
                                        sc[j, e] = T.if_then_else(ok[j, e] > 0, T.exp(sc[j, e] - mrow[e // 2]),
                                                                  T.float32(0))
                                        lrow[e // 2] = lrow[e // 2] + sc[j, e]
                                        # A fragments of P: 16-key step j // 2, half j % 2
                                        pa[j // 2, (j % 2) * 4 + e] = T.Cast(dtype, sc[j, e])
                                # O += P V: V's B operands (two 8-dim tiles per ldmatrix.x4.trans)
                                for ks in T.unroll(KC // 16):
                                    for dp in T.unroll(d // 16):
                                        vrow = T.meta_var(base + KC + ks * 16 + (lane // 8) % 2 * 8 + lane % 8)
                                        T.evaluate(T.ptx_legacy.ldmatrix(
                                            True, 4, ".b16", vb.data, 0, smem.data,
                                            vrow * d + sw(vrow, dp * 2 + lane // 16) * 8, dtype=dtype))
                                        for half in T.unroll(2):
                                            T.evaluate(T.ptx_legacy.mma(
                                                "m16n8k16", "row", "col", ab, ab, "fp32", pa.data, ks * 8,
                                                vb.data, half * 4, o.data, (dp * 2 + half) * 4, False,
                                                dtype="float32"))
                                # the stage the next issue overwrites was read above
                                T.tvm_storage_sync("shared")
                            for hh in T.unroll(2):
                                for u in T.unroll(2):
                                    lrow[hh] = lrow[hh] + T.tvm_warp_shuffle_xor(
                                        T.tvm_warp_activemask(), lrow[hh], u + 1, 32, 32)
                                r = T.meta_var(rt * BR + w * 16 + hh * 8 + lane // 4)
                                if r < R:
                                    if lane % 4 == 0:
                                        ml[b, h, sp, r, 0] = mrow[hh]
                                        ml[b, h, sp, r, 1] = lrow[hh]
                                    for e in T.unroll(d // 8):
                                        for x in T.unroll(2):
                                            out[b, h, sp, r, e * 8 + (lane % 4) * 2 + x] = o[e, hh * 2 + x]
    body = _rows_signature(n_layers, rows, n_kv, capacity, d, group, dtype, n_splits, True, gpu_form, q_heads)

    @T.prim_func(private=True)
    def kernel(q_h: T.handle, kv_h: T.handle, rows_h: T.handle, mask_h: T.handle, acc_h: T.handle,
               ml_h: T.handle):
        body(q_h, kv_h, rows_h, mask_h, acc_h, ml_h)
    return kernel
