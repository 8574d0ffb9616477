"""TIR kernels the lowering calls where Relax has no operator: the KV-cache write, attention
read straight from the KV pool (decode, and many rows: prefill, chain and tree verification),
the gated delta rule recurrence, and the per-token conv windows that rollback needs.

Each kernel comes in a CPU form (plain loops, the outer ones parallel) and a GPU form (the
same loops bound to blocks and threads); both compute the same thing in the same order, so
the reference comparisons in the tests hold for either.  ``gpu`` picks the form.  The
exceptions: the gated delta rule's GPU form splits d_k over threads and sums partial dot
products (float32 rounding apart, the same arithmetic), and the GPU forms of attention are
flash attention (decode: CUDA cores, one row; many rows: tensor cores, P rounded to the value
dtype before P V) -- checked against PyTorch on the H200 (bench/tree_verify.py,
bench/attention_rows.py) and by bf16 token forcing (bench/gpu_forcing.py).
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from specpilot.compiler.fast_frames import quick_stack


def memo(factory):
    """Kernels are immutable IR: make each (factory, arguments) once per process (a lowering
    asks for the same kernels per layer), parsed under `quick_stack` (TVMScript's own
    ``inspect.stack`` calls were most of the ~0.15 s a kernel took)."""
    cache: dict = {}

    @functools.wraps(factory)
    def make(*args, **kwargs):
        key = tuple((type(a).__name__, a if isinstance(a, (bool, int, float, str)) else str(a))
                    for a in (*args, *sorted(kwargs.items())))
        if key not in cache:
            with quick_stack():
                cache[key] = factory(*args, **kwargs)
        return cache[key]
    return make


@memo
def kv_write(n_layers: int, layer: int, rows: int, n_kv: int, capacity: int, head_dim: int, dtype: str,
             gpu: bool, heads_at: tuple[int, int]):
    """kv[layer, 0|1, rows[b], h, slots[b, t], :] = heads[b, t, k0|v0 + h, :] for the new tokens (in
    place): the keys and values are heads k0.. and v0.. of one tensor (B, T, heads, d)
    (`lower.attention_heads_te`'s: queries, keys, values), ``heads_at`` = (k0, v0).

    The cache is a pool of ``rows`` sequences; batch entry b writes its own row.  A token with
    slot < 0 is padding (a shorter request in a padded batch) and writes nothing.
    """
    width = n_kv * head_dim
    threads = min(256, width)
    rounds = (width + threads - 1) // threads
    k0, v0 = heads_at
    n_heads = max(k0, v0) + n_kv

    @T.macro
    def put(kv, heads, slots, row, b, t, h, x):
        if slots[b, t] >= 0:
            kv[layer, 0, T.Cast("int64", row[b]), h, T.Cast("int64", slots[b, t]), x] = heads[b, t, k0 + h, x]
            kv[layer, 1, T.Cast("int64", row[b]), h, T.Cast("int64", slots[b, t]), x] = heads[b, t, v0 + h, x]

    @T.prim_func(private=True, s_tir=True)
    def kernel(kv_h: T.handle, heads_h: T.handle, slots_h: T.handle, rows_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n = T.int64(), T.int64()
        kv = T.match_buffer(kv_h, (n_layers, 2, rows, n_kv, capacity, head_dim), dtype)
        heads = T.match_buffer(heads_h, (batch, n, n_heads, head_dim), dtype)
        slots = T.match_buffer(slots_h, (batch, n), "int32")
        row = T.match_buffer(rows_h, (batch,), "int32")
        with T.sblock("root"):
            if gpu:   # a block per token, its n_kv * head_dim values spread over the threads
                for bt in T.thread_binding(batch * n, thread="blockIdx.x"):
                    for tx in T.thread_binding(threads, thread="threadIdx.x"):
                        for r in range(rounds):
                            if r * threads + tx < width:
                                put(kv, heads, slots, row, bt // n, bt % n,
                                    (r * threads + tx) // head_dim, (r * threads + tx) % head_dim)
            else:
                for b, t, h, x in T.grid(batch, n, n_kv, head_dim):
                    put(kv, heads, slots, row, b, t, h, x)
    return kernel


@memo
def compact_kv(n_layers: int, rows: int, n_kv: int, capacity: int, head_dim: int, dtype: str, gpu: bool):
    """After a tree verification: kv[:, :, rows[b], :, dst[b, i]] = kv[:, :, rows[b], :, src[b, i]]
    for i in order (in place; src >= dst along an accepted path, so no copy reads a moved entry).
    Entries with src < 0 are padding."""
    width = n_layers * 2 * n_kv * head_dim
    threads = min(256, width)
    rounds = (width + threads - 1) // threads

    @T.macro
    def move(kv, row, src, dst, n, b, e):
        for i in range(n):
            if src[b, i] >= 0:
                kv[e // (2 * n_kv * head_dim), e // (n_kv * head_dim) % 2, T.Cast("int64", row[b]),
                   e // head_dim % n_kv, T.Cast("int64", dst[b, i]), e % head_dim] = kv[
                    e // (2 * n_kv * head_dim), e // (n_kv * head_dim) % 2, T.Cast("int64", row[b]),
                    e // head_dim % n_kv, T.Cast("int64", src[b, i]), e % head_dim]

    @T.prim_func(private=True, s_tir=True)
    def kernel(kv_h: T.handle, rows_h: T.handle, src_h: T.handle, dst_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n = T.int64(), T.int64()
        kv = T.match_buffer(kv_h, (n_layers, 2, rows, n_kv, capacity, head_dim), dtype)
        row = T.match_buffer(rows_h, (batch,), "int32")
        src = T.match_buffer(src_h, (batch, n), "int32")
        dst = T.match_buffer(dst_h, (batch, n), "int32")
        with T.sblock("root"):
            if gpu:
                for bx in T.thread_binding(batch * rounds, thread="blockIdx.x"):
                    for tx in T.thread_binding(threads, thread="threadIdx.x"):
                        if bx % rounds * threads + tx < width:
                            move(kv, row, src, dst, n, bx // rounds, bx % rounds * threads + tx)
            else:
                for b, e in T.grid(batch, width):
                    move(kv, row, src, dst, n, b, e)
    return kernel


ATTN_CHUNK = 64     # keys per split of a decode attention (a block of the GPU form)
ATTN_FLOOR = -1e30  # the running max before any key: finite, so exp(floor - m) is 0, never NaN


def _online(head_dim: int):
    @T.macro
    def online(ml_m, ml_l, acc, r, score, vrow, e_count, idx):
        """Fold one key (its score, its value row read through vrow(i)) into row r's running sums."""
        m_new = T.max(ml_m[r], score)
        c = T.exp(ml_m[r] - m_new)
        p = T.exp(score - m_new)
        ml_l[r] = ml_l[r] * c + p
        ml_m[r] = m_new
        for e in range(e_count):
            if idx(e) < head_dim:
                acc[r, e] = acc[r, e] * c + p * T.Cast("float32", vrow(idx(e)))
    return online


DECODE_THREADS = 128   # `attention_decode`: threads per block (one split of keys) ...
PART_BYTES = 32768     # ... and at most this much shared memory for its P V partial sums
# ... and the most query-row elements (group x head_dim) its last block merges itself; past that
# `attention_combine` does, a kernel of its own.  H200 (bench/results/attention-rows-20261201-135131,
# merged in the kernel vs + combine, 77 / 512 / 4096 keys): 27B-style 6 x 256 20 / 26 / 77 vs
# 16 / 18 / 29 us, 16 x 128 28 / 34 / 103 vs 24 / 26 / 34; Qwen3-8B 4 x 128 10.0 / 11.6 / 31.9 vs
# 9.7 / 11.1 / 25.7 alone, but a launch fewer a layer in the step (the step with this session's
# three decode changes together: 1.40 -> 1.34 ms at 512; the merge was not timed apart there);
# tiny 2 x 2 x 32 5.2 / 5.7 / 9.8 vs 8.2 / 8.3 / 12.8
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
    kernel a layer stands where three ran (kv_write, the partial sums, attention_combine), two
    without ``merges``.  No step copies keys or values out of the pool.

    GPU only (the CPU form of every step is `attention_rows_partial` + `attention_combine`, which
    with one token and ``ATTN_CHUNK`` keys per split compute exactly this).  A block of
    DECODE_THREADS per (sequence, KV head, split), in three phases with no dependent load inside
    any: (1) scores -- key groups of LPK lanes (`_decode_tiling`) each take keys j = g, g + groups,
    ... (a warp's groups read consecutive rows), every key row -- and every value row and the
    lane's mask bits, so that one DRAM round trip stands where three were -- loaded before any
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
    merge = _merge_splits(group, dtype)

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


ROWS_WARPS = 4       # GPU form of `attention_rows_partial`: warps per block, 16 query rows each
ROWS_KEYS = 32       # keys per shared-memory chunk (two chunks in flight)
ROWS_SPLIT = 256     # verification: keys per split (flash decoding) ...
ROWS_SPLITS = 16     # ... and at most this many splits (longer contexts: longer splits); prefill: one


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
    no step materializes the (T x L) scores (the gathered form did both: bench/results/tree-verify-*).

    CPU form: the decode form's loop per row (with one token and ``ATTN_CHUNK`` keys per split it
    is the CPU decode kernel).  GPU form (bf16 / fp16, `rows_kernel_fits`): flash attention on
    tensor cores.  A block per (sequence, KV head, split, 16 * ``ROWS_WARPS`` rows); its Q rows and
    chunks of ``ROWS_KEYS`` keys and values go to shared memory with cp.async (the next chunk in
    flight while this one is multiplied).  Each warp: S = Q K^T for its 16 rows (mma.sync m16n8k16,
    float32 sums; a lane's k slots stand for 8 consecutive dims, as in `schedules.skinny_mma`),
    masked and scaled, the running max / sum per row (quad shuffles), P = exp(S - m) rounded to the
    value dtype as the A operand of O += P V straight from the S registers, V's B operands by
    ldmatrix.trans.  Shared rows are swizzled so each 8-lane phase of the operand loads hits 32
    distinct banks.  P is rounded before its product with V (as the gathered form rounded the
    probabilities); the sums are float32.
    """
    scale = float(head_dim) ** -0.5
    online = _online(head_dim)
    if split <= 0 and splits <= 0:
        raise ValueError("attention_rows_partial: give keys per split (split) and / or the number of splits (splits)")

    def n_splits(L):
        return key_splits(L, split, splits)

    def keys(L):
        return split if split and not splits else (L + n_splits(L) - 1) // n_splits(L)

    if not gpu:
        @T.macro
        def cpu_form(q, kv, row, mask, out, ml, batch, tokens, L):
            with T.sblock("root"):
                for b, h, sp, r in T.grid(batch, n_kv, n_splits(L), tokens * group):
                    acc = T.alloc_buffer((1, head_dim), "float32", scope="local")
                    m = T.alloc_buffer((1,), "float32", scope="local")
                    lsum = T.alloc_buffer((1,), "float32", scope="local")
                    sc = T.alloc_buffer((1,), "float32", scope="local")
                    for i in range(head_dim):
                        acc[0, i] = T.float32(0)
                    m[0] = T.float32(ATTN_FLOOR)
                    lsum[0] = T.float32(0)
                    for jj in range(keys(L)):
                        if sp * keys(L) + jj < L:
                            if mask[b, r // group, sp * keys(L) + jj]:
                                sc[0] = T.float32(0)
                                for i in range(head_dim):
                                    sc[0] = sc[0] + T.Cast("float32", q[b, r // group, h * group + r % group, i]) * \
                                        T.Cast("float32", kv[layer, 0, T.Cast("int64", row[b]), h, sp * keys(L) + jj, i])
                                online(m, lsum, acc, 0, sc[0] * T.float32(scale),
                                       lambda i: kv[layer, 1, T.Cast("int64", row[b]), h, sp * keys(L) + jj, i],
                                       head_dim, lambda e: e)
                    ml[b, h, sp, r, 0] = m[0]
                    ml[b, h, sp, r, 1] = lsum[0]
                    for i in range(head_dim):
                        out[b, h, sp, r, i] = acc[0, i]
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


def _merge_splits(group: int, dtype: str):
    """Query row r's element i of KV head h from the S splits' partial sums: sum_s e^(m_s - M)
    acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s, rounded to ``dtype`` into out[b, t, h * group + g]
    (r = t * group + g)."""
    @T.macro
    def merge(acc, ml, out, b, h, r, i, S):
        top = T.alloc_buffer((3,), "float32", scope="local")
        top[0] = T.float32(ATTN_FLOOR)
        for sp in range(S):
            top[0] = T.max(top[0], ml[b, h, sp, r, 0])
        top[1] = T.float32(0)
        top[2] = T.float32(0)
        for sp in range(S):
            top[1] = top[1] + ml[b, h, sp, r, 1] * T.exp(ml[b, h, sp, r, 0] - top[0])
            top[2] = top[2] + acc[b, h, sp, r, i] * T.exp(ml[b, h, sp, r, 0] - top[0])
        out[b, r // group, h * group + r % group, i] = T.Cast(dtype, top[2] / top[1])
    return merge


@memo
def attention_combine(n_kv: int, head_dim: int, group: int, dtype: str, gpu: bool):
    """Second half of `attention_rows_partial` (`attention_decode` merges its own): merge the splits of
    each query row r = t * group + g of KV head h, out[b, t, h * group + g] =
    sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s, rounded once to ``dtype``."""
    threads = min(256, head_dim)
    rounds = (head_dim + threads - 1) // threads
    merge = _merge_splits(group, dtype)

    @T.prim_func(private=True, s_tir=True)
    def kernel(acc_h: T.handle, ml_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, S, tokens = T.int64(), T.int64(), T.int64()
        out = T.match_buffer(out_h, (batch, tokens, n_kv * group, head_dim), dtype)
        acc = T.match_buffer(acc_h, (batch, n_kv, S, tokens * group, head_dim), "float32")
        ml = T.match_buffer(ml_h, (batch, n_kv, S, tokens * group, 2), "float32")
        with T.sblock("root"):
            if gpu:
                for bhr in T.thread_binding(batch * n_kv * tokens * group, thread="blockIdx.x"):
                    for tx in T.thread_binding(threads, thread="threadIdx.x"):
                        for rr in range(rounds):
                            if rr * threads + tx < head_dim:
                                merge(acc, ml, out, bhr // (n_kv * tokens * group), bhr // (tokens * group) % n_kv,
                                      bhr % (tokens * group), rr * threads + tx, S)
            else:
                for b, h, r, i in T.grid(batch, n_kv, tokens * group, head_dim):
                    merge(acc, ml, out, b, h, r, i, S)
    return kernel


def _gdn_blocking(dk: int, dv: int) -> tuple[int, int, int, int]:
    """The GPU forms' split of a head's (dk, dv) state: (parts, rows, cols, col_blocks) -- d_k in
    ``parts`` groups of ``rows`` over threadIdx.y, value columns ``cols`` a block over threadIdx.x
    (32 where dv allows: 27B-class heads, dv = 128, take 4 blocks), ``col_blocks`` blocks a head."""
    parts = 4 if dk % 4 == 0 and dv * 4 <= 1024 else (2 if dk % 2 == 0 and dv * 2 <= 1024 else 1)
    cols = next(dv // c for c in (4, 2, 1) if dv % c == 0 and dv // c >= 32) if dv >= 32 else dv
    return parts, dk // parts, cols, dv // cols


def record_width(dk: int, dv: int) -> int:
    """Floats a head and token in a verify's Gated DeltaNet record: k (dk), v (dv), g, beta."""
    return dk + dv + 2


def _delta_rule(rows: int, parts: int):
    """The GPU forms' token update, one macro for the recurrence (`gated_delta_rule`) and
    `gdn_commit`, so the state commit rebuilds is the one verify computed, bit for bit: the
    thread's ``rows`` rows of state column decayed by exp(g), S^T k as 4 interleaved partial sums
    summed over the ``parts`` thread groups through shared memory (``red[slot]``), delta = (v -
    S^T k) beta, then S += k delta -- with ``query``, S^T q after it in the same 4-sum order (its
    partial sums left in ``part``).  ``key(i)`` / ``query(i)``: row i's k / q; ``live``: False
    leaves the state as it is (padding; a Python True adds no condition)."""
    @T.macro
    def update(s, part, acc, red, slot, p, jl, key, query, decay, value, beta, live):
        for c in T.unroll(4):
            part[c] = T.float32(0)
        if live:
            for i in T.unroll(rows):
                s[i] = s[i] * T.exp(decay)
                part[i % 4] = part[i % 4] + key(i) * s[i]
        red[slot, p, jl] = (part[0] + part[1]) + (part[2] + part[3])
        T.tvm_storage_sync("shared")
        acc[0] = T.float32(0)
        for r in range(parts):
            acc[0] = acc[0] + red[slot, r, jl]
        acc[0] = (value - acc[0]) * beta
        if query is not None:
            for c in T.unroll(4):
                part[c] = T.float32(0)
        if live:
            for i in T.unroll(rows):
                s[i] = s[i] + key(i) * acc[0]
                if query is not None:
                    part[i % 4] = part[i % 4] + query(i) * s[i]
    return update


@memo
def gated_delta_rule(n_heads: int, dk: int, dv: int, keep_states: bool, gpu: bool, tree: bool = False,
                     stack: tuple[int, int] | None = None):
    """The recurrence of `runtime.reference.gdn.recurrent_gated_delta_rule`.  CPU form: one
    thread per (sequence, head, value column), S[:, j] local while the tokens stream by; GPU
    form: d_k split over threads too (see ``blocked``).

    Inputs q, k (B, T, H, dk) normalized (q scaled), v (B, T, H, dv), g, beta (B, T, H),
    s0 (B, H, dk, dv), all float32, slots (B, T) -- a token with slot < 0 is padding and leaves
    the state as it is (its output is 0) -- and parents (B, T).  Without ``keep_states``
    (prefill, decode: parents is not read) the outputs are o (B, T, H, dv) and the final state
    (B, H, dk, dv).

    With ``keep_states`` (verify) the kernel hands back, instead of a state, what `gdn_commit`
    needs to rebuild the state after any token: the record (B, T, H, W), W = `record_width`, of
    each token's k, v, g and beta.  (Until session 12 it wrote the state after every token: at
    64 tree nodes and 27B-class heads 200 MB a layer, most of the kernel's time.)  With ``tree``
    each token starts from its parent's state (parent -1: s0) -- the gdn-path-recompute form,
    every root path of a draft tree walked as a chain would walk it; without, tokens follow
    each other and parents is not read.  Parents come before their children, so one pass in
    token order meets every parent first: a token whose parent is the token before continues
    from the state in registers, the others read their parent's state back from ``scratch``
    (B, T, H, dk, dv), where the kernel stores only the states of tokens that such a later
    token branches from (a third of the nodes of a best-first tree of 64).  Outputs: o, record,
    scratch (nothing in scratch is for the caller).

    ``stack`` = (G, g), with ``keep_states``: the records of all G Gated DeltaNet layers of a
    verify go into one (B, T, G, H, W) tensor, this layer's at index g, so no step concatenates
    them.  Layer 0 allocates it (its other layers' slices left to them); layer g > 0 writes its
    slice in place: the kernel then takes the stack after ``parents`` and returns it first
    (``call_tir_inplace`` order: in-place operand, then o and scratch).
    """
    G, gi = stack if stack else (1, 0)
    if stack and (not keep_states or not 0 <= gi < G):
        raise ValueError(f"stack={stack}: needs keep_states and 0 <= g < G")
    inplace = gi > 0
    W = record_width(dk, dv)

    def at(n, b, t, h, i, j):
        """Flat index of scratch[b, t, h, i, j]; at(1, b, 0, h, i, j): of the final state[b, h, i, j]."""
        return (((b * n + t) * n_heads + h) * dk + i) * dv + j

    def rat(n, b, t, h, w):
        """Flat index of record[b, t, (layer,) h, w]: the stacked and unstacked layouts alike."""
        return (((b * n + t) * G + gi) * n_heads + h) * W + w

    @T.macro
    def keep_record(k, v, g, beta, rec, n, b, t, h, j, first, lane, lanes):
        """Token t's k, v, g, beta into the record: value column j writes v[j]; the ``lanes``
        threads holding ``first`` (column 0) share k and write g, beta."""
        rec[rat(n, b, t, h, dk + j)] = v[b, t, h, j]
        if first:
            for r in range((dk + lanes - 1) // lanes):
                if r * lanes + lane < dk:
                    rec[rat(n, b, t, h, r * lanes + lane)] = k[b, t, h, r * lanes + lane]
            if lane == 0:
                rec[rat(n, b, t, h, dk + dv)] = g[b, t, h]
                rec[rat(n, b, t, h, dk + dv + 1)] = beta[b, t, h]

    @T.macro
    def column(q, k, v, g, beta, s0, slots, parents, o, rec, st, n, b, h, j):
        """CPU form.  Sequence b, head h, value column j: the whole token loop."""
        s = T.alloc_buffer((dk,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        kept = T.alloc_buffer((1,), "int32", scope="local")
        for i in range(dk):
            s[i] = s0[b, h, i, j]
        for t in range(n):
            acc[0] = T.float32(0)
            if tree:
                if parents[b, t] < 0:
                    for i in range(dk):
                        s[i] = s0[b, h, i, j]
                elif T.Cast("int64", parents[b, t]) != t - T.int64(1):
                    for i in range(dk):
                        s[i] = st[at(n, b, T.Cast("int64", parents[b, t]), h, i, j)]
            if slots[b, t] >= 0:
                for i in range(dk):
                    s[i] = s[i] * T.exp(g[b, t, h])
                    acc[0] = acc[0] + k[b, t, h, i] * s[i]
                acc[0] = (v[b, t, h, j] - acc[0]) * beta[b, t, h]
                for i in range(dk):
                    s[i] = s[i] + k[b, t, h, i] * acc[0]
                acc[0] = T.float32(0)
                for i in range(dk):
                    acc[0] = acc[0] + q[b, t, h, i] * s[i]
            o[b, t, h, j] = acc[0]
            if keep_states:
                keep_record(k, v, g, beta, rec, n, b, t, h, j, j == 0, 0, 1)
            if tree:   # a later token (not the next) branching from t: scanned for here
                kept[0] = 0
                for c in range(t + T.int64(2), n):
                    if T.Cast("int64", parents[b, c]) == t:
                        kept[0] = 1
                if kept[0] != 0:
                    for i in range(dk):
                        st[at(n, b, t, h, i, j)] = s[i]
        if not keep_states:
            for i in range(dk):
                st[at(1, b, 0, h, i, j)] = s[i]

    # GPU form: a block per (sequence, head, group of ``cols`` value columns) -- the columns of
    # the state evolve independently, so 27B-class heads (dv = 128) take 4 blocks each -- cols x
    # parts threads; thread (j, p) keeps rows p*R .. p*R+R-1 of column j of the state in
    # registers (R = dk / parts), the two dot products over d_k per token are summed through
    # shared memory.  Sums over d_k come as ``parts`` partial sums of 4 interleaved partial sums
    # each (short dependency chains: ncu found the kernel waiting on them once its loads were
    # hidden): float32 rounding apart, the CPU form's arithmetic; `gdn_commit` runs the same
    # update (`_delta_rule`).  The token loop is a chain of dependent steps, so everything a step
    # reads from memory is loaded one step ahead: the next token's k, q, v, g, beta and slot,
    # and, in the tree form, its parent's state when that is not the one in registers (tokens
    # go two at a time, so the double buffers have fixed register indices).  The records are
    # written before the loop, and which tokens' states go to scratch is found once: a bit per
    # token in shared memory (tokens past ``cap`` always store).  (Measured and dropped: a
    # column's parts on adjacent lanes summed by shuffles, no barriers -- 151 -> 211 us at 65
    # rows with per-token state stores (tree-verify-20261130-204921), and still 102.5 -> 147 us
    # with them gone (tree-verify-20261201-011634); a shared buffer per sum and token parity, two
    # barriers a token instead of TVM's four: 102.5 -> 103.4 us (-012313).)
    parts, rows, cols, col_blocks = _gdn_blocking(dk, dv)
    threads = parts * cols
    cap = 1024
    update = _delta_rule(rows, parts)

    @T.macro
    def fetch(q, k, v, g, beta, slots, kx, qx, sx, ix, n, b, t, h, p, j, u):
        """Token t's operands into buffer u of the registers (t < n)."""
        for i in T.unroll(rows):
            kx[u, i] = k[b, t, h, p * rows + i]
            qx[u, i] = q[b, t, h, p * rows + i]
        sx[u, 0] = v[b, t, h, j]
        sx[u, 1] = g[b, t, h]
        sx[u, 2] = beta[b, t, h]
        ix[u] = slots[b, t]

    @T.macro
    def step(q, k, v, g, beta, s0, slots, parents, o, st, n, b, t, h, p, jl, cb,
             s, ps, kx, qx, sx, ix, acc, part, red, stored, u):
        """Token t, its operands in buffer u (a Python int), the next token's fetched into 1 - u.
        The loop goes in pairs, so t may be n: a step that changes nothing (TVM inserts barriers
        where a condition around the step would forbid them)."""
        if t >= n:
            ix[u] = -1
        if tree:
            if t < n:
                if T.Cast("int64", parents[b, t]) != t - T.int64(1):
                    for i in T.unroll(rows):
                        s[i] = ps[i]
        if t + 1 < n:
            fetch(q, k, v, g, beta, slots, kx, qx, sx, ix, n, b, t + 1, h, p, cb * cols + jl, 1 - u)
            if tree:
                if T.Cast("int64", parents[b, t + 1]) != t:
                    if parents[b, t + 1] < 0:
                        for i in T.unroll(rows):
                            ps[i] = s0[b, h, p * rows + i, cb * cols + jl]
                    else:
                        for i in T.unroll(rows):
                            ps[i] = st[at(n, b, T.Cast("int64", parents[b, t + 1]), h, p * rows + i, cb * cols + jl)]
        update(s, part, acc, red, 0, p, jl, lambda i: kx[u, i], lambda i: qx[u, i], sx[u, 1], sx[u, 0], sx[u, 2],
               ix[u] >= 0)
        red[1, p, jl] = (part[0] + part[1]) + (part[2] + part[3])
        T.tvm_storage_sync("shared")
        if p == 0:
            if t < n:
                acc[1] = T.float32(0)
                for r in range(parts):
                    acc[1] = acc[1] + red[1, r, jl]
                o[b, t, h, cb * cols + jl] = T.if_then_else(ix[u] >= 0, acc[1], T.float32(0))
        if tree:   # (the bit goes through a register: TVM's barrier pass rejects shared loads in conditions)
            acc[0] = T.Cast("float32", T.if_then_else(t >= cap, 1, (stored[T.min(t, cap - 1) // 32] >> (t % 32)) & 1))
            if t < n:
                if acc[0] != T.float32(0):
                    for i in T.unroll(rows):
                        st[at(n, b, t, h, p * rows + i, cb * cols + jl)] = s[i]

    @T.macro
    def blocked(q, k, v, g, beta, s0, slots, parents, o, rec, st, n, b, h, p, jl, cb):
        """Sequence b, head h, value column j = cb * cols + jl, rows p*R..p*R+R-1 of d_k: the
        whole token loop."""
        s = T.alloc_buffer((rows,), "float32", scope="local")
        ps = T.alloc_buffer((rows,), "float32", scope="local")        # the next token's parent state
        kx = T.alloc_buffer((2, rows), "float32", scope="local")      # k, q of this token and the next
        qx = T.alloc_buffer((2, rows), "float32", scope="local")
        sx = T.alloc_buffer((2, 3), "float32", scope="local")         # v[j], g, beta
        ix = T.alloc_buffer((2,), "int32", scope="local")             # slot
        acc = T.alloc_buffer((2,), "float32", scope="local")
        part = T.alloc_buffer((4,), "float32", scope="local")         # a dot product's 4 partial sums
        word = T.alloc_buffer((1,), "int32", scope="local")
        red = T.alloc_buffer((2, parts, cols), "float32", scope="shared")
        stored = T.alloc_buffer((cap // 32,), "int32", scope="shared")
        if keep_states:   # the records first: nothing in the token loop waits for them
            for r in range((n + parts - 1) // parts):
                if r * parts + p < n:
                    keep_record(k, v, g, beta, rec, n, b, r * parts + p, h, cb * cols + jl, cb == 0, jl, cols)
        if tree:   # bit t of stored: a token after t + 1 starts from t's state (a word per thread and round)
            for r in range((cap // 32 + threads - 1) // threads):
                if r * threads + p * cols + jl < cap // 32:
                    word[0] = 0
                    for c in range(n):
                        if parents[b, c] >= 0:
                            if T.Cast("int64", parents[b, c]) != c - 1:
                                if parents[b, c] // 32 == r * threads + p * cols + jl:
                                    word[0] = word[0] | (1 << (parents[b, c] % 32))
                    stored[r * threads + p * cols + jl] = word[0]
            T.tvm_storage_sync("shared")
        for i in T.unroll(rows):
            s[i] = s0[b, h, p * rows + i, cb * cols + jl]
        fetch(q, k, v, g, beta, slots, kx, qx, sx, ix, n, b, T.int64(0), h, p, cb * cols + jl, 0)
        for t2 in range((n + 1) // 2):
            for u in T.unroll(2):
                step(q, k, v, g, beta, s0, slots, parents, o, st, n, b, t2 * 2 + u, h, p, jl, cb,
                     s, ps, kx, qx, sx, ix, acc, part, red, stored, u)
        if not keep_states:
            for i in T.unroll(rows):
                st[at(1, b, 0, h, p * rows + i, cb * cols + jl)] = s[i]

    attrs = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu, "gdn.kernel": "recurrence",
             "gdn.tree": tree, "gdn.keep_states": keep_states, "gdn.shape": [n_heads, dk, dv]}
    if stack:
        attrs["gdn.stack"] = [G, gi]
    rec_shape = lambda batch, n: (batch, n, G, n_heads, W) if stack else (batch, n, n_heads, W)  # noqa: E731

    @T.macro
    def body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h):
        T.func_attr(attrs)
        batch, n = T.int64(), T.int64()
        q = T.match_buffer(q_h, (batch, n, n_heads, dk), "float32")
        k = T.match_buffer(k_h, (batch, n, n_heads, dk), "float32")
        v = T.match_buffer(v_h, (batch, n, n_heads, dv), "float32")
        g = T.match_buffer(g_h, (batch, n, n_heads), "float32")
        beta = T.match_buffer(b_h, (batch, n, n_heads), "float32")
        s0 = T.match_buffer(s0_h, (batch, n_heads, dk, dv), "float32")
        slots = T.match_buffer(slots_h, (batch, n), "int32")
        parents = T.match_buffer(parents_h, (batch, n), "int32")
        o = T.match_buffer(o_h, (batch, n, n_heads, dv), "float32")
        if keep_states:
            rec_nd = T.match_buffer(rec_h, rec_shape(batch, n), "float32")
            st_nd = T.match_buffer(st_h, (batch, n, n_heads, dk, dv), "float32")
        else:
            st_nd = T.match_buffer(st_h, (batch, n_heads, dk, dv), "float32")
        with T.sblock("root"):
            st = T.decl_buffer(((batch * n if keep_states else batch) * n_heads * dk * dv,), "float32",
                               data=st_nd.data)
            if keep_states:
                rec = T.decl_buffer((batch * n * G * n_heads * W,), "float32", data=rec_nd.data)
            else:
                rec = st   # not written: prefill / decode keep no record
            if gpu:
                for bhc in T.thread_binding(batch * n_heads * col_blocks, thread="blockIdx.x"):
                    for p in T.thread_binding(parts, thread="threadIdx.y"):
                        for jl in T.thread_binding(cols, thread="threadIdx.x"):
                            blocked(q, k, v, g, beta, s0, slots, parents, o, rec, st, n,
                                    bhc // (n_heads * col_blocks), bhc // col_blocks % n_heads, p, jl,
                                    bhc % col_blocks)
            else:
                for bh in T.parallel(batch * n_heads):
                    for j in range(dv):
                        column(q, k, v, g, beta, s0, slots, parents, o, rec, st, n, bh // n_heads, bh % n_heads, j)

    if not keep_states:
        @T.prim_func(private=True, s_tir=True)
        def kernel_final(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
                         s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, o_h: T.handle, st_h: T.handle):
            body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, None, st_h)
        return kernel_final

    if inplace:
        @T.prim_func(private=True, s_tir=True)
        def kernel_inplace(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
                           s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, rec_h: T.handle,
                           o_h: T.handle, st_h: T.handle):
            body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h)
        return kernel_inplace

    @T.prim_func(private=True, s_tir=True)
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
               s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, o_h: T.handle, rec_h: T.handle,
               st_h: T.handle):
        body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h)
    return kernel


@memo
def gdn_commit(n_layers: int, n_heads: int, dk: int, dv: int, gpu: bool):
    """commit's recurrent states: the state after each sequence's accepted token, rebuilt from
    the state before the verify pass along the token's root path with the records the verify
    kept (`gated_delta_rule` with ``keep_states``) -- the same update in the same order, so the
    state is the one verify computed for that token.

    Inputs: record (B, T, G, H, W), s0 (B, G, H, dk, dv) float32, path (B, D) int32 -- the
    accepted token's root path among the T tokens, root first (entries < 0 are skipped: shorter
    paths of a batch padded).  Output: (B, G, H, dk, dv).  CPU form: a thread per (sequence,
    layer, head, value column); GPU form: the recurrence's blocks and threads (d_k in ``parts``
    partial sums: the recurrence's own update, `_delta_rule`)."""
    G, W = n_layers, record_width(dk, dv)
    parts, rows, cols, col_blocks = _gdn_blocking(dk, dv)
    update = _delta_rule(rows, parts)

    @T.prim_func(private=True, s_tir=True)
    def kernel(r_h: T.handle, s0_h: T.handle, path_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n, depth = T.int64(), T.int64(), T.int64()
        rec = T.match_buffer(r_h, (batch, n, G, n_heads, W), "float32")
        s0 = T.match_buffer(s0_h, (batch, G, n_heads, dk, dv), "float32")
        path = T.match_buffer(path_h, (batch, depth), "int32")
        out = T.match_buffer(out_h, (batch, G, n_heads, dk, dv), "float32")
        with T.sblock("root"):
            if gpu:
                for bghc in T.thread_binding(batch * G * n_heads * col_blocks, thread="blockIdx.x"):
                    for p in T.thread_binding(parts, thread="threadIdx.y"):
                        for jl in T.thread_binding(cols, thread="threadIdx.x"):
                            s = T.alloc_buffer((rows,), "float32", scope="local")
                            acc = T.alloc_buffer((1,), "float32", scope="local")
                            part = T.alloc_buffer((4,), "float32", scope="local")
                            red = T.alloc_buffer((2, parts, cols), "float32", scope="shared")
                            b = bghc // (G * n_heads * col_blocks)
                            gl = bghc // (n_heads * col_blocks) % G
                            h = bghc // col_blocks % n_heads
                            j = bghc % col_blocks * cols + jl
                            for i in T.unroll(rows):
                                s[i] = s0[b, gl, h, p * rows + i, j]
                            for d in range(depth):
                                if path[b, d] >= 0:
                                    update(s, part, acc, red, d % 2, p, jl,
                                           lambda i: rec[b, path[b, d], gl, h, p * rows + i], None,
                                           rec[b, path[b, d], gl, h, dk + dv], rec[b, path[b, d], gl, h, dk + j],
                                           rec[b, path[b, d], gl, h, dk + dv + 1], True)
                            for i in T.unroll(rows):
                                out[b, gl, h, p * rows + i, j] = s[i]
            else:
                for bgh in T.parallel(batch * G * n_heads):
                    for j in range(dv):
                        s = T.alloc_buffer((dk,), "float32", scope="local")
                        acc = T.alloc_buffer((1,), "float32", scope="local")
                        b, gl, h = bgh // (G * n_heads), bgh // n_heads % G, bgh % n_heads
                        for i in range(dk):
                            s[i] = s0[b, gl, h, i, j]
                        for d in range(depth):
                            if path[b, d] >= 0:
                                acc[0] = T.float32(0)
                                for i in range(dk):
                                    s[i] = s[i] * T.exp(rec[b, path[b, d], gl, h, dk + dv])
                                    acc[0] = acc[0] + rec[b, path[b, d], gl, h, i] * s[i]
                                acc[0] = (rec[b, path[b, d], gl, h, dk + j] - acc[0]) * \
                                    rec[b, path[b, d], gl, h, dk + dv + 1]
                                for i in range(dk):
                                    s[i] = s[i] + rec[b, path[b, d], gl, h, i] * acc[0]
                        for i in range(dk):
                            out[b, gl, h, i, j] = s[i]
    return kernel


@memo
def gdn_conv_verify(channels: int, kernel_size: int, dtype: str, gpu: bool, tree: bool = False,
                    stack: tuple[int, int] | None = None):
    """A Gated DeltaNet layer's causal depthwise conv for verification, with the conv state after
    every token.  Inputs: the state before the pass (B, C, K-1), the new inputs (B, T, C) -- the
    projection's own layout: channels contiguous, so a block's threads (one channel each) read
    and write consecutive addresses, and no transpose runs around the kernel -- the weight
    (C, 1, K), parents (B, T).  Outputs: conv (B, T, C) float32 (before SiLU) and the K-1 inputs
    kept after every token (B, T, C, K-1).

    ``stack`` = (G, g), as `gated_delta_rule`'s: the per-token states of all G layers go into one
    (B, T, G, C, K-1) tensor, this layer's at index g, so no step concatenates them; layer 0
    allocates it, layer g > 0 takes it after ``parents`` and writes its slice in place (returned
    first: ``call_tir_inplace`` order).

    Token t's window is its K-1 predecessors then itself: the previous tokens (chain) or, with
    ``tree``, its ancestors along parents (gdn-path-recompute), continued into the state
    before the pass when the path is shorter.  Taps are summed in float32 in tap order.
    """
    keep = kernel_size - 1
    threads = min(256, channels)
    rounds = (channels + threads - 1) // threads
    G, gi = stack if stack else (1, 0)
    if stack and not 0 <= gi < G:
        raise ValueError(f"stack={stack}: needs 0 <= g < G")

    @T.macro
    def one(state, x, weight, parents, out, states, b, c, t):
        window = T.alloc_buffer((kernel_size,), dtype, scope="local")
        cur = T.alloc_buffer((1,), "int64", scope="local")
        cs = T.alloc_buffer((1,), "int64", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        window[keep] = x[b, t, c]
        cur[0] = t
        cs[0] = T.int64(keep - 1)
        for kk in range(keep):
            if cur[0] >= 0:
                if tree:
                    cur[0] = T.Cast("int64", parents[b, cur[0]])
                else:
                    cur[0] = cur[0] - 1
            if cur[0] >= 0:
                window[keep - 1 - kk] = x[b, cur[0], c]
            else:
                window[keep - 1 - kk] = state[b, c, cs[0]]
                cs[0] = cs[0] - 1
        acc[0] = T.float32(0)
        for k in range(kernel_size):
            acc[0] = acc[0] + T.Cast("float32", window[k]) * T.Cast("float32", weight[c, 0, k])
        out[b, t, c] = acc[0]
        for k in range(keep):
            states[b, t, gi, c, k] = window[k + 1]

    attrs = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu, "gdn.kernel": "conv",
             "gdn.tree": tree, "gdn.shape": [channels, kernel_size], "gdn.dtype": dtype}
    if stack:
        attrs["gdn.stack"] = [G, gi]
    st_shape = lambda batch, n: (batch, n, G, channels, keep) if stack else (batch, n, channels, keep)  # noqa: E731

    @T.macro
    def body(s_h, x_h, w_h, p_h, out_h, st_h):
        T.func_attr(attrs)
        batch, n = T.int64(), T.int64()
        state = T.match_buffer(s_h, (batch, channels, keep), dtype)
        x = T.match_buffer(x_h, (batch, n, channels), dtype)
        weight = T.match_buffer(w_h, (channels, 1, kernel_size), dtype)
        parents = T.match_buffer(p_h, (batch, n), "int32")
        out = T.match_buffer(out_h, (batch, n, channels), "float32")
        st_nd = T.match_buffer(st_h, st_shape(batch, n), dtype)
        with T.sblock("root"):
            states = T.decl_buffer((batch, n, G, channels, keep), dtype, data=st_nd.data)
            if gpu:   # a block per (token, 256 channels): 27B-class layers (10240 channels) fill the SMs
                for bt in T.thread_binding(batch * n, thread="blockIdx.x"):
                    for r in T.thread_binding(rounds, thread="blockIdx.y"):
                        for tx in T.thread_binding(threads, thread="threadIdx.x"):
                            if r * threads + tx < channels:
                                one(state, x, weight, parents, out, states, bt // n, r * threads + tx, bt % n)
            else:
                for b, c, t in T.grid(batch, channels, n):
                    one(state, x, weight, parents, out, states, b, c, t)

    if gi > 0:
        @T.prim_func(private=True, s_tir=True)
        def kernel_inplace(s_h: T.handle, x_h: T.handle, w_h: T.handle, p_h: T.handle, st_h: T.handle,
                           out_h: T.handle):
            body(s_h, x_h, w_h, p_h, out_h, st_h)
        return kernel_inplace

    @T.prim_func(private=True, s_tir=True)
    def kernel(s_h: T.handle, x_h: T.handle, w_h: T.handle, p_h: T.handle, out_h: T.handle, st_h: T.handle):
        body(s_h, x_h, w_h, p_h, out_h, st_h)
    return kernel


@memo
def conv_window_states(channels: int, kernel_size: int, dtype: str, gpu: bool):
    """The K-1 conv inputs a Gated DeltaNet layer keeps after a prefill / decode step, from its
    window (B, C, K-1+T): out[b, c, :] = the window after the last *real* token of sequence b
    (tokens with slot < 0 are padding at the end of a shorter request)."""
    keep = kernel_size - 1
    threads = min(256, channels)
    rounds = (channels + threads - 1) // threads

    @T.macro
    def copy(window, slots, out, n, b, c):
        length = T.alloc_buffer((1,), "int64", scope="local")
        length[0] = T.int64(0)
        for i in range(n):
            if slots[b, i] >= 0:
                length[0] = i + 1
        for j in range(keep):
            out[b, c, j] = window[b, c, length[0] + j]

    @T.prim_func(private=True, s_tir=True)
    def kernel(w_h: T.handle, slots_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n = T.int64(), T.int64()
        window = T.match_buffer(w_h, (batch, channels, n + keep), dtype)
        slots = T.match_buffer(slots_h, (batch, n), "int32")
        out = T.match_buffer(out_h, (batch, channels, keep), dtype)
        with T.sblock("root"):
            if gpu:   # a block per (sequence, 256 channels)
                for b in T.thread_binding(batch, thread="blockIdx.x"):
                    for r in T.thread_binding(rounds, thread="blockIdx.y"):
                        for tx in T.thread_binding(threads, thread="threadIdx.x"):
                            if r * threads + tx < channels:
                                copy(window, slots, out, n, b, r * threads + tx)
            else:
                for b, c in T.grid(batch, channels):
                    copy(window, slots, out, n, b, c)
    return kernel


@memo
def select_token(tokens_axis_width: int, dtype: str, gpu: bool):
    """out[b, :] = states[b, index[b], :] -- commit: keep the state after the accepted token."""
    width = tokens_axis_width
    threads = min(256, width)
    rounds = (width + threads - 1) // threads

    @T.prim_func(private=True, s_tir=True)
    def kernel(s_h: T.handle, i_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n = T.int64(), T.int64()
        states = T.match_buffer(s_h, (batch, n, width), dtype)
        index = T.match_buffer(i_h, (batch,), "int32")
        out = T.match_buffer(out_h, (batch, width), dtype)
        with T.sblock("root"):
            if gpu:
                for bx in T.thread_binding(batch * rounds, thread="blockIdx.x"):
                    for tx in T.thread_binding(threads, thread="threadIdx.x"):
                        if bx % rounds * threads + tx < width:
                            out[bx // rounds, bx % rounds * threads + tx] = states[
                                bx // rounds, T.Cast("int64", index[bx // rounds]), bx % rounds * threads + tx]
            else:
                for b, x in T.grid(batch, width):
                    out[b, x] = states[b, T.Cast("int64", index[b]), x]
    return kernel


@memo
def w12_gemm(n_out: int, k_in: int, n_escapes: int, x_dtype: str, hi_only: bool = False):
    """y[m, n] = sum_k x[m, k] * W[n, k] (float32), W decoded in registers from its W12 planes.

    Row n's escapes are merged in column order as k advances, so every weight enters the sum
    with its exact bf16 value and in the same order as a plain GEMM over the decoded matrix.
    CPU form: rows in parallel.  (The CUDA schedule is issue 4's kernel work.)

    ``hi_only``: the nested 8-bit view -- the lo plane is not read, the low mantissa bits are
    taken at their midpoint (0b1000); escapes stay exact.
    """
    lo_len = (n_out * k_in + 1) // 2
    e = max(n_escapes, 1)
    x_dtype = str(x_dtype)   # a Relax DataType or a string: the attribute records the string

    @T.prim_func(private=True, s_tir=True)
    def kernel(x_h: T.handle, hi_h: T.handle, lo_h: T.handle, base_h: T.handle, ptr_h: T.handle,
               col_h: T.handle, bits_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": False,
                     "w12.n": n_out, "w12.k": k_in, "w12.escapes": n_escapes, "w12.x_dtype": x_dtype})
        m = T.int64()
        x = T.match_buffer(x_h, (m, k_in), x_dtype)
        hi = T.match_buffer(hi_h, (n_out, k_in), "uint8")
        lo = T.match_buffer(lo_h, (lo_len,), "uint8")
        base = T.match_buffer(base_h, (n_out,), "uint8")
        ptr = T.match_buffer(ptr_h, (n_out + 1,), "int32")
        col = T.match_buffer(col_h, (e,), "int32")
        bits = T.match_buffer(bits_h, (e,), "int32")
        y = T.match_buffer(y_h, (m, n_out), "float32")
        with T.sblock("root"):
            for i in range(m):
                for n in T.parallel(n_out):
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    w = T.alloc_buffer((1,), "float32", scope="local")
                    p = T.alloc_buffer((1,), "int32", scope="local")
                    acc[0] = T.float32(0)
                    p[0] = ptr[n]
                    for k in range(k_in):
                        if p[0] < ptr[n + 1] and col[T.min(p[0], e - 1)] == T.Cast("int32", k):
                            w[0] = T.reinterpret("float32", T.shift_left(T.Cast("uint32", bits[p[0]]), T.uint32(16)))
                            p[0] = p[0] + 1
                        else:
                            w[0] = T.reinterpret("float32", T.shift_left(
                                T.bitwise_or(T.bitwise_or(
                                    T.shift_left(T.shift_right(T.Cast("uint32", hi[n, k]), T.uint32(7)), T.uint32(15)),
                                    T.shift_left(T.Cast("uint32", base[n]) + T.bitwise_and(
                                        T.shift_right(T.Cast("uint32", hi[n, k]), T.uint32(3)), T.uint32(15)), T.uint32(7))),
                                    T.bitwise_or(T.shift_left(T.bitwise_and(T.Cast("uint32", hi[n, k]), T.uint32(7)), T.uint32(4)),
                                                 T.uint32(8) if hi_only else
                                                 T.bitwise_and(T.shift_right(T.Cast("uint32", lo[(n * k_in + k) // 2]),
                                                                             T.Cast("uint32", ((n * k_in + k) % 2) * 4)),
                                                               T.uint32(15)))),
                                T.uint32(16)))
                        acc[0] = acc[0] + T.Cast("float32", x[i, k]) * w[0]
                    y[i, n] = acc[0]
    return kernel
