"""Decode attention straight from the KV pool: one query row a sequence, keys split over blocks
(flash decoding), the last block of a head merging the splits."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.attention_merge import ATTN_FLOOR, merge_splits
from specpilot.kernels.base import memo

ATTN_CHUNK = 64     # keys per split of a decode attention (a block of the GPU form)



DECODE_THREADS = 128   # `attention_decode`: threads per block (one split of keys) ...
PART_BYTES = 32768     # ... and at most this much shared memory for its P V partial sums
# ... and the most query-row elements (group x head_dim) its last block merges itself; past that
# `attention_combine` does, a kernel of its own.  H200 (bench/README "Attention from the KV pool",
# merged in the kernel vs + combine, 77 / 512 / 4096 keys): 27B-style 6 x 256 20 / 26 / 77 vs
# 16 / 18 / 29 us, 16 x 128 28 / 34 / 103 vs 24 / 26 / 34; Qwen3-8B 4 x 128 10.0 / 11.6 / 31.9 vs
# 9.7 / 11.1 / 25.7 alone, but a launch fewer a layer in the step; tiny 2 x 2 x 32 5.2 / 5.7 / 9.8
# vs 8.2 / 8.3 / 12.8
DECODE_MERGE_MAX = 512


def _decode_tiling(head_dim: int) -> tuple[int, int, int, int]:
    """How a decode block covers a key row: (VEC elements per load, lanes per key, pieces per
    lane, keys in flight per thread round).  A row is ``head_dim / VEC`` pieces of one 16-byte
    load each (VEC = 8 for 16-bit values) where head_dim allows, taken by LPK lanes (a power of
    two, at most a warp; PPL pieces each); the block's DECODE_THREADS / LPK key groups take the
    split's keys in turn."""
    vec = next(v for v in (8, 4, 2, 1) if head_dim % v == 0)
    pieces = head_dim // vec
    lpk = 1
    while lpk < min(pieces, 32):
        lpk *= 2
    ppl = (pieces + lpk - 1) // lpk
    return vec, lpk, ppl, DECODE_THREADS // lpk


@memo
def attention_decode(n_layers: int, layer: int, rows: int, n_kv: int, capacity: int, head_dim: int, group: int,
                     dtype: str, q_heads: int = 0, write_at: tuple[int, int] | None = None, merges: bool = True):
    """Decode attention straight from the KV pool, split over the keys (flash decoding), with the
    new token's pool write and (``merges``) the merge of the splits in the same kernel.

    Inputs q (B, 1, q_heads or n_kv * group, d) after rotary (its first n_kv * group heads the
    queries: `lower.attention_heads_te`'s tensor), the pool kv (layers, 2, rows, n_kv, capacity, d),
    rows (B,), mask (B, 1, L), the new tokens' slots (B, 1) and counters (B * n_kv,) int32, zero
    on entry and left zero.  Query head h reads KV head h // group.  Output o (B, 1, n_kv * group,
    d): the attention rounded to ``dtype``.  For each split of ``ATTN_CHUNK`` keys, each sequence,
    KV head and query head of its group, a block finds the running max m of the scaled scores
    (float32 dot products times d^-0.5) over the split's unmasked keys, the sum l of
    exp(score - m), and sum of exp(score - m) * v -- into acc (B, n_kv, S, group, d) and ml (B,
    n_kv, S, group, 2), S = ceil(L / ATTN_CHUNK); a split without a visible key has m =
    ATTN_FLOOR, l = 0, acc = 0.  The last of a (sequence, KV head)'s S blocks to finish (its
    counter, atomically) merges them with `attention_combine`'s arithmetic -- with ``merges``; else
    (o untouched, the counters unread) `attention_combine` does, a kernel of its own, faster where a
    query group is wide (DECODE_MERGE_MAX).  With ``write_at`` =
    (k0, v0) it also does `kv_write`'s work for the new token (q's heads k0.. and v0.. are its
    keys and values, written at their slots; slot < 0 writes nothing): the block whose split
    holds the slot writes them into the pool and takes that key row from q instead of the pool
    (no other block reads the slot).  The pool and the counters are in-place arguments; one
    kernel a layer in place of three (kv_write, the partial sums, attention_combine), two
    without ``merges``.  No step copies keys or values out of the pool.

    GPU only (the CPU form of every step is `attention_rows_partial` + `attention_combine`, which
    with one token and ``ATTN_CHUNK`` keys per split compute exactly this).  A block of
    DECODE_THREADS per (sequence, KV head, split), in three phases with no dependent load inside
    any: (1) scores -- key groups of LPK lanes (`_decode_tiling`) each take keys j = g, g + groups,
    ... (a warp's groups read consecutive rows), every key row -- and every value row and the
    lane's mask bits, so that one DRAM round trip serves all three -- loaded before any
    product, q in registers, each dot product summed across its lanes by shuffles, into shared
    memory; (2) a warp per query head: the split's max, p = exp(score - m) (0 where masked), l;
    (3) P V the same way round (the value rows, already in registers, weighted by p), the key
    groups' partial sums added in shared memory; then (4) the counter, and in the last block the
    merge.
    """
    vec, lpk, ppl, groups = _decode_tiling(head_dim)
    CH, NT = ATTN_CHUNK, DECODE_THREADS
    kpg = (CH + groups - 1) // groups          # keys a group takes (the last round may run past CH)
    pieces = head_dim // vec
    NW = NT // 32
    lanes_keys = (CH + 31) // 32
    scale = float(head_dim) ** -0.5
    shuffles = lpk.bit_length() - 1            # butterfly over lpk / 2, ..., 1 lanes apart
    # the key groups' partial P V sums meet in shared memory, heads_a_round query heads at a time
    heads_a_round = max(1, min(group, PART_BYTES // (groups * head_dim * 4)))
    rounds = (group + heads_a_round - 1) // heads_a_round
    outs = (heads_a_round * head_dim + NT - 1) // NT
    writes = write_at is not None
    k0, v0 = write_at or (0, 0)
    merge = merge_splits(group, dtype)

    @T.macro
    def issue_rows(raw, kv, which, seq, h, sp, g, ll):
        """The 16-byte loads of the key (which = 0) or value rows of the thread's kpg keys, all
        issued before any is used (the value rows with the key rows: their latency overlaps the
        scores and the softmax)."""
        for u in T.unroll(kpg):
            for p in T.unroll(ppl):
                for e in T.vectorized(vec):
                    raw[u, p, e] = kv[layer, which, seq, h, T.min(sp * CH + u * groups + g, capacity - 1),
                                      T.min(ll + p * lpk, pieces - 1) * vec + e]

    @T.macro
    def take_rows(raw, rows_, q, b, h, sp, g, ll, slot, at):
        """The loaded rows copied to a buffer TVM types as elements (not uint4); with ``write_at``,
        the new token's row from q."""
        for u in T.unroll(kpg):
            for p in T.unroll(ppl):
                for e in T.unroll(vec):
                    rows_[u, p, e] = raw[u, p, e]
        if writes:
            for u in T.unroll(kpg):
                if sp * CH + u * groups + g == slot:
                    for p in T.unroll(ppl):
                        for e in T.unroll(vec):
                            rows_[u, p, e] = q[b, 0, at + h, T.min(ll + p * lpk, pieces - 1) * vec + e]

    @T.prim_func(private=True, s_tir=True)
    def kernel(q_h: T.handle, kv_h: T.handle, rows_h: T.handle, mask_h: T.handle, slots_h: T.handle,
               counters_h: T.handle, acc_h: T.handle, ml_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        batch, L = T.int64(), T.int64()
        q = T.match_buffer(q_h, (batch, 1, q_heads or n_kv * group, head_dim), dtype)
        kv = T.match_buffer(kv_h, (n_layers, 2, rows, n_kv, capacity, head_dim), dtype)
        row = T.match_buffer(rows_h, (batch,), "int32")
        mask = T.match_buffer(mask_h, (batch, 1, L), "bool")
        slots = T.match_buffer(slots_h, (batch, 1), "int32")
        counters = T.match_buffer(counters_h, (batch * n_kv,), "int32")
        o = T.match_buffer(o_h, (batch, 1, n_kv * group, head_dim), dtype)
        out = T.match_buffer(acc_h, (batch, n_kv, (L + CH - 1) // CH, group, head_dim), "float32")
        ml = T.match_buffer(ml_h, (batch, n_kv, (L + CH - 1) // CH, group, 2), "float32")
        with T.sblock("root"):
            for bh in T.thread_binding(batch * n_kv, thread="blockIdx.x"):
                for sp in T.thread_binding((L + CH - 1) // CH, thread="blockIdx.y"):
                    for tid in T.thread_binding(NT, thread="threadIdx.x"):
                        b, h = bh // n_kv, bh % n_kv
                        g, ll = tid // lpk, tid % lpk
                        seq = T.Cast("int64", row[b])
                        slot = T.Cast("int64", slots[b, 0])   # read only with write_at
                        qr = T.alloc_buffer((group, ppl, vec), "float32", scope="local")
                        raw = T.alloc_buffer((kpg, ppl, vec), dtype, scope="local")
                        rawv = T.alloc_buffer((kpg, ppl, vec), dtype, scope="local")
                        rows_ = T.alloc_buffer((kpg, ppl, vec), dtype, scope="local")
                        vis = T.alloc_buffer((lanes_keys,), "int32", scope="local")   # the lane's keys visible
                        acc = T.alloc_buffer((group, ppl, vec), "float32", scope="local")
                        sc = T.alloc_buffer((group,), "float32", scope="local")
                        red = T.alloc_buffer((2,), "float32", scope="local")
                        ps = T.alloc_buffer((group, kpg * groups), "float32", scope="shared")   # scores
                        pw = T.alloc_buffer((group, CH), "float32", scope="shared")             # weights p
                        part = T.alloc_buffer((groups, heads_a_round, head_dim), "float32", scope="shared")
                        done = T.alloc_buffer((1,), "int32", scope="shared")
                        seen = T.alloc_buffer((1,), "int32", scope="local")
                        for r in T.unroll(group):
                            for p in T.unroll(ppl):
                                for e in T.unroll(vec):
                                    qr[r, p, e] = T.if_then_else(ll + p * lpk < pieces, T.Cast(
                                        "float32", q[b, 0, h * group + r, T.min(ll + p * lpk, pieces - 1) * vec + e]),
                                        T.float32(0))
                        if writes:   # the new token's key and value rows into the pool, by its split's block
                            if slot >= 0 and sp == slot // CH:
                                for o in range((head_dim + NT - 1) // NT):
                                    if o * NT + tid < head_dim:
                                        kv[layer, 0, seq, h, slot, o * NT + tid] = q[b, 0, k0 + h, o * NT + tid]
                                        kv[layer, 1, seq, h, slot, o * NT + tid] = q[b, 0, v0 + h, o * NT + tid]
                        # (1) scores: the key and value rows (clamped inside the pool) and the mask loaded
                        # first, then the products
                        issue_rows(raw, kv, 0, seq, h, sp, g, ll)
                        issue_rows(rawv, kv, 1, seq, h, sp, g, ll)
                        for i in T.unroll(lanes_keys):
                            vis[i] = T.if_then_else(sp * CH + i * 32 + tid % 32 < L, T.Cast(
                                "int32", mask[b, 0, T.min(sp * CH + i * 32 + tid % 32, L - 1)]), 0)
                        take_rows(raw, rows_, q, b, h, sp, g, ll, slot, k0)
                        for u in T.unroll(kpg):
                            for r in T.unroll(group):
                                sc[r] = T.float32(0)
                                for p in T.unroll(ppl):
                                    for e in T.unroll(vec):
                                        sc[r] = sc[r] + qr[r, p, e] * T.Cast("float32", rows_[u, p, e])
                                for s in T.unroll(shuffles):
                                    sc[r] = sc[r] + T.tvm_warp_shuffle_xor(
                                        T.tvm_warp_activemask(), sc[r], T.shift_right(lpk // 2, s), 32, 32)
                                if ll == 0:
                                    ps[r, u * groups + g] = sc[r] * T.float32(scale)
                        T.tvm_storage_sync("shared")
                        # (2) a warp per query head: max, p (0 where no key is visible), l
                        for rr in range((group + NW - 1) // NW):
                            r = rr * NW + tid // 32
                            if r < group:
                                red[0] = T.float32(ATTN_FLOOR)
                                for i in T.unroll(lanes_keys):
                                    if i * 32 + tid % 32 < CH and vis[i] != 0:
                                        red[0] = T.max(red[0], ps[r, i * 32 + tid % 32])
                                for s in T.unroll(5):
                                    red[0] = T.max(red[0], T.tvm_warp_shuffle_xor(
                                        T.tvm_warp_activemask(), red[0], T.shift_right(16, s), 32, 32))
                                red[1] = T.float32(0)
                                for i in T.unroll(lanes_keys):
                                    if i * 32 + tid % 32 < CH:
                                        sc[0] = T.if_then_else(vis[i] != 0, T.exp(ps[r, i * 32 + tid % 32] - red[0]),
                                                               T.float32(0))
                                        pw[r, i * 32 + tid % 32] = sc[0]
                                        red[1] = red[1] + sc[0]
                                for s in T.unroll(5):
                                    red[1] = red[1] + T.tvm_warp_shuffle_xor(
                                        T.tvm_warp_activemask(), red[1], T.shift_right(16, s), 32, 32)
                                if tid % 32 == 0:
                                    ml[b, h, sp, r, 0] = red[0]
                                    ml[b, h, sp, r, 1] = red[1]
                        T.tvm_storage_sync("shared")
                        # (3) P V: the value rows first, then weighted by p (keys past CH or L weigh 0)
                        take_rows(rawv, rows_, q, b, h, sp, g, ll, slot, v0)
                        for r in T.unroll(group):
                            for p in T.unroll(ppl):
                                for e in T.unroll(vec):
                                    acc[r, p, e] = T.float32(0)
                        for u in T.unroll(kpg):
                            if u * groups + g < CH:
                                for r in T.unroll(group):
                                    for p in T.unroll(ppl):
                                        for e in T.unroll(vec):
                                            acc[r, p, e] = acc[r, p, e] + T.if_then_else(
                                                pw[r, u * groups + g] > T.float32(0),
                                                pw[r, u * groups + g] * T.Cast("float32", rows_[u, p, e]), T.float32(0))
                        if heads_a_round >= group:   # every query head's partial sums at once
                            for r in T.unroll(group):
                                for p in T.unroll(ppl):
                                    for e in T.unroll(vec):
                                        if ll + p * lpk < pieces:
                                            part[g, r, (ll + p * lpk) * vec + e] = acc[r, p, e]
                            T.tvm_storage_sync("shared")
                            for o in range(outs):
                                if o * NT + tid < group * head_dim:
                                    red[0] = T.float32(0)
                                    for gg in range(groups):
                                        red[0] = red[0] + part[gg, (o * NT + tid) // head_dim, (o * NT + tid) % head_dim]
                                    out[b, h, sp, (o * NT + tid) // head_dim, (o * NT + tid) % head_dim] = red[0]
                        else:   # heads_a_round query heads a round (the shared buffer stays under PART_BYTES)
                            for rc in T.unroll(rounds):
                                T.tvm_storage_sync("shared")
                                for rr in T.unroll(heads_a_round):
                                    for p in T.unroll(ppl):
                                        for e in T.unroll(vec):
                                            if rc * heads_a_round + rr < group and ll + p * lpk < pieces:
                                                part[g, rr, (ll + p * lpk) * vec + e] = acc[
                                                    T.min(rc * heads_a_round + rr, group - 1), p, e]
                                T.tvm_storage_sync("shared")
                                for o in range(outs):
                                    if o * NT + tid < heads_a_round * head_dim and \
                                            rc * heads_a_round + (o * NT + tid) // head_dim < group:
                                        red[0] = T.float32(0)
                                        for gg in range(groups):
                                            red[0] = red[0] + part[gg, (o * NT + tid) // head_dim, (o * NT + tid) % head_dim]
                                        out[b, h, sp, rc * heads_a_round + (o * NT + tid) // head_dim,
                                            (o * NT + tid) % head_dim] = red[0]
                        if merges:
                            # (4) the last of the (sequence, KV head)'s blocks to finish merges its splits
                            # (`attention_combine`'s arithmetic) and sets the counter back to 0
                            T.cuda.thread_fence()
                            T.tvm_storage_sync("shared")
                            if tid == 0:
                                done[0] = T.cuda.atomic_add(T.address_of(counters[bh]), 1)
                            T.tvm_storage_sync("shared")
                            seen[0] = done[0]
                            if T.Cast("int64", seen[0]) == (L + CH - 1) // CH - 1:
                                T.cuda.thread_fence()
                                for oo in range((group * head_dim + NT - 1) // NT):
                                    if oo * NT + tid < group * head_dim:
                                        merge(out, ml, o, b, h, (oo * NT + tid) // head_dim, (oo * NT + tid) % head_dim,
                                              (L + CH - 1) // CH)
                                if tid == 0:
                                    counters[bh] = 0
    return kernel
