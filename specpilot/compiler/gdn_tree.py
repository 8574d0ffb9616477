"""Gated DeltaNet over a whole draft tree at once: the chunked (WY) form of the gated delta rule
with an ancestor mask in place of the causal one -- the fast path of gdn-path-recompute.

The sequential tree form (`kernels.gated_delta_rule` with ``tree``) walks the nodes one after
another: a chain of n dependent token updates, each two block barriers long (65 nodes: ~85-100
us a 27B-class layer on the H200, issue-latency bound).  Here every node is a function of its
root path in closed form.  With alpha_t = exp(g_t), G_t the sum of g along t's root path
(t included) and A(t) t's root path, the recurrence S_t = alpha_t S_p + k_t delta_t^T with
delta_t = beta_t (v_t - alpha_t S_p^T k_t) unrolls to

    S_t     = exp(G_t) S_0 + sum_{j in A(t)} exp(G_t - G_j) k_j delta_j^T
    delta_t = beta_t (v_t - exp(G_t) S_0^T k_t) - sum_{j in A(t), j != t} L[t, j] delta_j,
              L[t, j] = beta_t exp(G_t - G_j) (k_t . k_j)
    o_t     = S_t^T q_t = exp(G_t) S_0^T q_t + sum_{j in A(t)} exp(G_t - G_j) (q_t . k_j) delta_j

-- a unit lower-triangular system over the tree's ancestor pairs (chunked DeltaNet's
(I + beta K K^T)^-1 with the tree's mask).  Phases of a GPU block (sequence, head, 64 value
columns; 8 warps), each ended by a barrier:
  1. G by walking each node's path; L and P for every ancestor pair (a warp a node, lanes over
     d_k, two ancestors a round; L below the diagonal of one n x n array, P above, zeros
     elsewhere, so later sums run dense over j);
  2. the right-hand sides: S_0^T k for all nodes as register tiles (9 tokens x 2 columns a
     thread, 16-byte shared loads of the k rows: the phase is shared-load bound);
  3. the deltas: one thread a column, forward substitution in token order (parents come first)
     in its own L1-resident local memory -- no barrier at all;
  4. the outputs: S_0^T q as in 2, plus P times the deltas as a dense masked product.
float32 throughout; exp(G_t - G_j) <= 1 for an ancestor j.  The CPU form does the same
arithmetic in plain loops (tested against the PyTorch recurrence walking every root path).

H200, 27B-class heads (48 x 128 x 128), a best-first tree of 64 nodes + root: 70.0 us vs the
sequential form's 100.8, agreeing with the PyTorch recurrence to 2e-7 (tree-verify-20261201-
065929); in the model's tree verification 2436 -> 2340-2359 us (1.45x -> 1.41x the AR step).
Measured and dropped: solving level by level (nodes of a depth in parallel, two barriers a
level, paths walked for the sums: 59.8 us but slow chains), every thread of the block solving
(its local memory then spilled past L1: 100 us), a solve over each node's ancestor list only
(69.8 us; 73.4 with the list read 4 at a time, -071529: the solve is not the cost), 8 tokens a
thread (93.7 us: a second pass for token 64).  Nsight Compute (ncu-gdn-chunked-20261201.csv):
74 us, 12.5 % occupancy (one block of 8 warps an SM), stalls on barriers, 'wait' and long
scoreboard about equally -- latency, not throughput; kernels stopped after a phase (22.6 / 31.2
/ 55.9 us after L and P / the right-hand sides / the solve) are no reliable guide: with the
later phases gone nothing reads some earlier results, which the compiler may drop (not checked).
A long chain costs more than in the sequential form (every pair of its n nodes is an ancestor
pair: chain verify of 65 tokens 2337 -> 2637-2661 us in the model); trees are the case this
form is for (gdn-path-recompute{form=sequential} keeps the old kernel).

Same inputs, outputs and records as the sequential tree form (commit rebuilds the accepted
node's state from the records with `kernels.gdn_commit`, unchanged); the scratch output is
not written.  Padding tokens (slot < 0) leave the state as it is (g = beta = 0) and output 0.
At most ``nmax`` tokens (shared memory holds the n x n ancestor coefficients): a longer
verify fails with a clear error, not wrong numbers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.compiler.kernels import memo, record_width

WARPS = 8       # GPU form: warps a block
NMAX_LIMIT = 104   # the n x n coefficients and four n-vectors fit 48 KB of static shared memory
TOKENS = 9      # tokens a thread carries through the S_0 products: 8 warps x 9 >= 65 (64 nodes + root) in one pass


def column_block(dv: int) -> int:
    """Value columns a GPU block (at most 64: a thread each solves them): the columns' deltas and
    outputs are independent given the tree's coefficients, which every block of a head computes
    for itself."""
    return next(c for c in range(64, 0, -1) if dv % c == 0)


@memo
def gated_delta_rule_tree(n_heads: int, dk: int, dv: int, gpu: bool, stack: tuple[int, int] | None = None,
                          nmax: int = NMAX_LIMIT):
    """The chunked tree form; signature, attributes and records those of
    ``kernels.gated_delta_rule(n_heads, dk, dv, keep_states=True, gpu, tree=True, stack)``
    (``gdn.form`` = "chunked").  Parents must come before their children (the CPU form solves
    in token order); a malformed parents array cannot hang either form (every path walk stops
    after n steps)."""
    G, gi = stack if stack else (1, 0)
    if stack and not 0 <= gi < G:
        raise ValueError(f"stack={stack}: needs 0 <= g < G")
    if not 1 <= nmax <= NMAX_LIMIT or nmax % WARPS:
        raise ValueError(f"nmax={nmax}: needs a multiple of {WARPS} in 1..{NMAX_LIMIT}")
    inplace = gi > 0
    W = record_width(dk, dv)
    CB = column_block(dv)
    CPT = (CB + 31) // 32          # columns a lane
    DL = (dk + 31) // 32           # d_k elements a lane (the warp-wide dot products)
    THREADS = 32 * WARPS
    TK = TOKENS
    VEC = 4 if dk % 4 == 0 else 1  # d_k elements a shared load of the S_0 products
    KP = dk                        # k / q rows in shared memory (16-byte aligned where VEC = 4)
    # TVM raises a kernel's dynamic shared memory limit only once the dynamic part reaches 48 KB, and
    # static + dynamic past 48 KB fails at launch otherwise (CUDA_ERROR_INVALID_VALUE, seen on the H200
    # with a tiny hybrid's heads): then the k / q rows' buffer grows until the dynamic part is 48 KB.
    # Each dynamic buffer a multiple of 4 floats: TVM packs them into one, in an order of its own,
    # and the 16-byte row loads need every offset aligned.
    r4 = lambda x: (x + 3) // 4 * 4   # noqa: E731
    static_bytes = (4 * nmax + nmax * nmax) * 4
    KS, S0S, DS = r4(nmax * KP), r4(dk * CB), r4((nmax + 1) * CB)
    dynamic_bytes = (KS + S0S + DS) * 4
    if static_bytes + dynamic_bytes > 48 * 1024 > dynamic_bytes - 1:
        KS += r4((48 * 1024 - dynamic_bytes) // 4 + 32)

    def rat(n, b, t, h, w):
        return (((b * n + t) * G + gi) * n_heads + h) * W + w

    def cdiv(a, d):
        return (a + d - 1) // d

    @T.macro
    def records(k, v, g, beta, rec, n, b, h, c0, width, first, tid, stride):
        """Token records (k, v, g, beta): this worker's ``width`` value columns from c0; the first
        writes k, g and beta."""
        for r in range(cdiv(n * width, stride)):
            if r * stride + tid < n * width:
                rec[rat(n, b, (r * stride + tid) // width, h, dk + c0 + (r * stride + tid) % width)] = \
                    v[b, (r * stride + tid) // width, h, c0 + (r * stride + tid) % width]
        if first:
            for r in range(cdiv(n * dk, stride)):
                if r * stride + tid < n * dk:
                    rec[rat(n, b, (r * stride + tid) // dk, h, (r * stride + tid) % dk)] = \
                        k[b, (r * stride + tid) // dk, h, (r * stride + tid) % dk]
            for r in range(cdiv(n, stride)):
                if r * stride + tid < n:
                    rec[rat(n, b, r * stride + tid, h, dk + dv)] = g[b, r * stride + tid, h]
                    rec[rat(n, b, r * stride + tid, h, dk + dv + 1)] = beta[b, r * stride + tid, h]

    @T.macro
    def solve_step(row, delta, out, t, c, acc):
        """delta_t = r_t - sum_{j < t} L[t, j] delta_j (L zero off t's ancestors), r_t in out[t, c]:
        the sum as 2 interleaved partial sums (a shorter dependency chain)."""
        acc[0] = T.float32(0)
        acc[1] = T.float32(0)
        for j2 in range(t // 2):
            acc[0] = acc[0] + row(j2 * 2) * delta(j2 * 2)
            acc[1] = acc[1] + row(j2 * 2 + 1) * delta(j2 * 2 + 1)
        if t % 2 == 1:
            acc[0] = acc[0] + row(t - 1) * delta(t - 1)
        out[t, c] = out[t, c] - (acc[0] + acc[1])

    @T.macro
    def s0_tile(tile, sc, kx, rows, s0s, n, ty, tx, mg):
        """tile[m, u] = sum_i S_0[i, c_u] rows[t_m, i]: tokens t_m = ty + 8 (mg * TK + m), columns
        c_u = tx + 32 u of the block (the rows and S_0 block in shared memory).  Shared-load bound:
        a token's row is read 4 elements at a time (one 16-byte load, the same for the warp)."""
        for mm, u in T.grid(TK, CPT):
            tile[mm, u] = T.float32(0)
        for i4 in range(dk // VEC):
            for u in T.unroll(CPT):
                for e in T.unroll(VEC):
                    sc[u, e] = s0s[i4 * VEC + e, T.min(tx + 32 * u, CB - 1)]
            for mm in T.unroll(TK):
                for e in T.vectorized(VEC):
                    kx[mm, e] = rows[T.min(ty + WARPS * (mg * TK + mm), nmax - 1), i4 * VEC + e]
            for mm in T.unroll(TK):
                for u in T.unroll(CPT):
                    for e in T.unroll(VEC):
                        tile[mm, u] = tile[mm, u] + kx[mm, e] * sc[u, e]

    @T.macro
    def cpu_head(q, k, v, g, beta, s0, slots, parents, o, rec, n, b, h):
        """Sequence b, head h, every column: the GPU form's arithmetic, one thread."""
        gs = T.alloc_buffer((nmax,), "float32")
        lp = T.alloc_buffer((nmax, nmax), "float32")     # L[t, j] below the diagonal, P[t, j] at [j, t], else 0
        ds = T.alloc_buffer((nmax, dv), "float32")
        acc = T.alloc_buffer((2,), "float32")
        cur = T.alloc_buffer((2,), "int64")               # walking node, steps taken
        for t in range(n):
            acc[0] = T.float32(0)
            cur[0] = t
            cur[1] = 0
            while cur[0] >= 0 and cur[1] < n:
                acc[0] = acc[0] + T.if_then_else(slots[b, cur[0]] >= 0, g[b, cur[0], h], T.float32(0))
                cur[0] = T.Cast("int64", parents[b, cur[0]])
                cur[1] = cur[1] + 1
            gs[t] = acc[0]
            for j in range(n):
                lp[t, j] = T.float32(0)
        for t in range(n):
            cur[0] = t
            cur[1] = 0
            while cur[0] >= 0 and cur[1] < n:
                acc[0] = T.float32(0)
                acc[1] = T.float32(0)
                for i in range(dk):
                    acc[0] = acc[0] + k[b, t, h, i] * k[b, cur[0], h, i]
                    acc[1] = acc[1] + q[b, t, h, i] * k[b, cur[0], h, i]
                if cur[0] != t:
                    lp[t, cur[0]] = T.if_then_else(slots[b, t] >= 0, beta[b, t, h], T.float32(0)) * \
                        T.exp(gs[t] - gs[cur[0]]) * acc[0]
                lp[cur[0], t] = T.exp(gs[t] - gs[cur[0]]) * acc[1]
                cur[0] = T.Cast("int64", parents[b, cur[0]])
                cur[1] = cur[1] + 1
        for t in range(n):
            for c in range(dv):
                acc[0] = T.float32(0)
                for i in range(dk):
                    acc[0] = acc[0] + s0[b, h, i, c] * k[b, t, h, i]
                ds[t, c] = T.if_then_else(slots[b, t] >= 0,
                                          beta[b, t, h] * (v[b, t, h, c] - T.exp(gs[t]) * acc[0]), T.float32(0))
        for c in range(dv):   # forward substitution, token order (parents first)
            for t in range(n):
                solve_step(lambda j: lp[t, j], lambda j: ds[j, c], ds, t, c, acc)
        for t in range(n):
            for c in range(dv):
                acc[0] = T.float32(0)
                for i in range(dk):
                    acc[0] = acc[0] + s0[b, h, i, c] * q[b, t, h, i]
                acc[0] = T.exp(gs[t]) * acc[0]
                for j in range(n):
                    acc[0] = acc[0] + T.if_then_else(j <= t, lp[j, t], T.float32(0)) * ds[j, c]
                o[b, t, h, c] = T.if_then_else(slots[b, t] >= 0, acc[0], T.float32(0))
        records(k, v, g, beta, rec, n, b, h, 0, dv, True, 0, 1)

    @T.macro
    def gpu_block(q, k, v, g, beta, s0, slots, parents, o, rec, n, b, h, cb, ty, tx):
        """Sequence b, head h, value columns cb*CB .. cb*CB+CB-1; warp ty, lane tx."""
        par = T.alloc_buffer((nmax,), "int32", scope="shared")
        ge = T.alloc_buffer((nmax,), "float32", scope="shared")     # g (0: padding)
        be = T.alloc_buffer((nmax,), "float32", scope="shared")     # beta (0: padding)
        gs = T.alloc_buffer((nmax,), "float32", scope="shared")     # G, the path sums
        # (2-D views of flat buffers: TVM would otherwise shrink a buffer to the region its loops
        # touch, a size in terms of the loop counts, which the host / device split then loses)
        lp_flat = T.alloc_buffer((nmax * nmax,), "float32", scope="shared")
        ks = T.alloc_buffer((KS,), "float32", scope="shared.dyn")    # k rows, then q rows (KP apart)
        s0s_flat = T.alloc_buffer((S0S,), "float32", scope="shared.dyn")
        ds_flat = T.alloc_buffer((DS,), "float32", scope="shared.dyn")   # (nmax + a spare row) x CB
        s0s = T.decl_buffer((dk, CB), "float32", data=s0s_flat.data, scope="shared.dyn")
        lp = T.decl_buffer((nmax, nmax), "float32", data=lp_flat.data, scope="shared")
        ds = T.decl_buffer((nmax + 1, CB), "float32", data=ds_flat.data, scope="shared.dyn")
        rows = T.decl_buffer((nmax, KP), "float32", data=ks.data, scope="shared.dyn")
        cur = T.alloc_buffer((4,), "int64", scope="local")
        acc = T.alloc_buffer((8,), "float32", scope="local")
        kt = T.alloc_buffer((DL,), "float32", scope="local")
        qr = T.alloc_buffer((DL,), "float32", scope="local")
        tile = T.alloc_buffer((TK, CPT), "float32", scope="local")
        sc = T.alloc_buffer((CPT, VEC), "float32", scope="local")
        kx = T.alloc_buffer((TK, VEC), "float32", scope="local")
        dl_flat = T.alloc_buffer((nmax,), "float32", scope="local")   # a column's deltas (local memory)
        dl = T.decl_buffer((nmax, 1), "float32", data=dl_flat.data, scope="local")
        tid = ty * 32 + tx
        records(k, v, g, beta, rec, n, b, h, cb * CB, CB, cb == 0, tid, THREADS)
        for r in range(cdiv(n, THREADS)):
            if r * THREADS + tid < n:
                par[r * THREADS + tid] = parents[b, r * THREADS + tid]
                ge[r * THREADS + tid] = T.if_then_else(slots[b, r * THREADS + tid] >= 0,
                                                       g[b, r * THREADS + tid, h], T.float32(0))
                be[r * THREADS + tid] = T.if_then_else(slots[b, r * THREADS + tid] >= 0,
                                                       beta[b, r * THREADS + tid, h], T.float32(0))
        for r in range(cdiv(n * nmax, THREADS)):
            if r * THREADS + tid < n * nmax:
                lp[(r * THREADS + tid) // nmax, (r * THREADS + tid) % nmax] = T.float32(0)
        for r in range(cdiv(n * dk, THREADS)):
            if r * THREADS + tid < n * dk:
                rows[(r * THREADS + tid) // dk, (r * THREADS + tid) % dk] = \
                    k[b, (r * THREADS + tid) // dk, h, (r * THREADS + tid) % dk]
        for r in range(cdiv(dk * CB, THREADS)):
            if r * THREADS + tid < dk * CB:
                s0s[(r * THREADS + tid) // CB, (r * THREADS + tid) % CB] = \
                    s0[b, h, (r * THREADS + tid) // CB, cb * CB + (r * THREADS + tid) % CB]
        T.tvm_storage_sync("shared")
        # each node's path sum G: a walk to the root
        for r in range(cdiv(n, THREADS)):
            if r * THREADS + tid < n:
                acc[0] = T.float32(0)
                cur[0] = r * THREADS + tid
                cur[1] = 0
                while cur[0] >= 0 and cur[1] < n:
                    acc[0] = acc[0] + ge[cur[0]]
                    cur[0] = T.Cast("int64", par[cur[0]])
                    cur[1] = cur[1] + 1
                gs[r * THREADS + tid] = acc[0]
        T.tvm_storage_sync("shared")
        # L[t, j] and P[t, j] (at [j, t]) for every ancestor j of t: warp ty takes nodes ty, ty + 8, ..,
        # each lane DL elements of d_k; two ancestors a round (two independent shuffle trees)
        for m in range(cdiv(n - ty, WARPS)):
            for d in T.unroll(DL):
                kt[d] = rows[ty + WARPS * m, T.min(tx + 32 * d, dk - 1)]
                qr[d] = T.if_then_else(tx + 32 * d < dk, q[b, ty + WARPS * m, h, T.min(tx + 32 * d, dk - 1)],
                                       T.float32(0))
            cur[0] = ty + WARPS * m
            cur[3] = 0
            while cur[0] >= 0 and cur[3] < n:
                cur[1] = T.if_then_else(cur[0] >= 0, T.Cast("int64", par[T.max(cur[0], 0)]), T.int64(-1))
                for a in T.unroll(4):
                    acc[a] = T.float32(0)
                for d in T.unroll(DL):
                    if tx + 32 * d < dk:
                        for a in T.unroll(2):
                            acc[2 * a] = acc[2 * a] + kt[d] * rows[T.max(cur[a], 0), tx + 32 * d]
                            acc[2 * a + 1] = acc[2 * a + 1] + qr[d] * rows[T.max(cur[a], 0), tx + 32 * d]
                for u in T.unroll(5):
                    for a in T.unroll(4):
                        acc[a] = acc[a] + T.tvm_warp_shuffle_xor(T.tvm_warp_activemask(), acc[a],
                                                                 T.shift_right(16, u), 32, 32)
                if tx == 0:
                    for a in T.unroll(2):
                        if cur[a] >= 0:
                            if cur[a] != ty + WARPS * m:
                                lp[ty + WARPS * m, cur[a]] = be[ty + WARPS * m] * \
                                    T.exp(gs[ty + WARPS * m] - gs[cur[a]]) * acc[2 * a]
                            lp[cur[a], ty + WARPS * m] = T.exp(gs[ty + WARPS * m] - gs[cur[a]]) * acc[2 * a + 1]
                cur[0] = T.if_then_else(cur[1] >= 0, T.Cast("int64", par[T.max(cur[1], 0)]), T.int64(-1))
                cur[3] = cur[3] + 2
        T.tvm_storage_sync("shared")
        # the right-hand sides r = beta (v - exp(G) S_0^T k) into ds
        for mg in range(cdiv(cdiv(n, WARPS), TK)):   # the same count in every warp: a barrier may go inside
            s0_tile(tile, sc, kx, rows, s0s, n, ty, tx, mg)
            for mm in T.unroll(TK):
                for u in T.unroll(CPT):
                    if ty + WARPS * (mg * TK + mm) < n and tx + 32 * u < CB:
                        ds[ty + WARPS * (mg * TK + mm), tx + 32 * u] = T.if_then_else(
                            slots[b, ty + WARPS * (mg * TK + mm)] >= 0,
                            be[ty + WARPS * (mg * TK + mm)] * (
                                v[b, ty + WARPS * (mg * TK + mm), h, cb * CB + tx + 32 * u]
                                - T.exp(gs[ty + WARPS * (mg * TK + mm)]) * tile[mm, u]),
                            T.float32(0))
        T.tvm_storage_sync("shared")
        # the deltas: a forward substitution per column in token order, no barrier -- thread c < CB
        # solves column c in its own (local, L1-resident) memory; then q rows over the k rows
        if tid < CB:
            for t in range(n):
                dl[t, 0] = ds[t, tid]
            for t in range(n):
                solve_step(lambda j: lp[t, j], lambda j: dl[j, 0], dl, t, 0, acc)
        for r in range(cdiv(n * dk, THREADS)):
            if r * THREADS + tid < n * dk:
                rows[(r * THREADS + tid) // dk, (r * THREADS + tid) % dk] = \
                    q[b, (r * THREADS + tid) // dk, h, (r * THREADS + tid) % dk]
        for t in range(n):   # every thread stores (no barrier in a condition): the others to a spare row
            ds[T.if_then_else(tid < CB, t, nmax), T.min(tid, CB - 1)] = \
                T.if_then_else(tid < CB, dl[t, 0], T.float32(0))
        T.tvm_storage_sync("shared")
        # outputs exp(G) S_0^T q + sum_{j <= t} P[t, j] delta_j (P zero off t's root path)
        for mg in range(cdiv(cdiv(n, WARPS), TK)):
            s0_tile(tile, sc, kx, rows, s0s, n, ty, tx, mg)
            for mm in T.unroll(TK):
                for u in T.unroll(CPT):
                    tile[mm, u] = T.exp(gs[T.min(ty + WARPS * (mg * TK + mm), nmax - 1)]) * tile[mm, u]
            for j in range(n):
                for u in T.unroll(CPT):
                    sc[u, 0] = ds[j, T.min(tx + 32 * u, CB - 1)]
                for mm in T.unroll(TK):
                    kx[mm, 0] = T.if_then_else(j <= ty + WARPS * (mg * TK + mm),
                                            lp[j, T.min(ty + WARPS * (mg * TK + mm), nmax - 1)], T.float32(0))
                for mm in T.unroll(TK):
                    for u in T.unroll(CPT):
                        tile[mm, u] = tile[mm, u] + kx[mm, 0] * sc[u, 0]
            for mm in T.unroll(TK):
                for u in T.unroll(CPT):
                    if ty + WARPS * (mg * TK + mm) < n and tx + 32 * u < CB:
                        o[b, ty + WARPS * (mg * TK + mm), h, cb * CB + tx + 32 * u] = T.if_then_else(
                            slots[b, ty + WARPS * (mg * TK + mm)] >= 0, tile[mm, u], T.float32(0))

    attrs = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu, "gdn.kernel": "recurrence",
             "gdn.tree": True, "gdn.keep_states": True, "gdn.shape": [n_heads, dk, dv], "gdn.form": "chunked"}
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
        rec_nd = T.match_buffer(rec_h, rec_shape(batch, n), "float32")
        T.match_buffer(st_h, (batch, n, n_heads, dk, dv), "float32")   # the sequential form's scratch: unused
        assert n <= nmax, f"gated_delta_rule_tree: more tokens than its nmax ({nmax})"
        if True:
            rec = T.decl_buffer((batch * n * G * n_heads * W,), "float32", data=rec_nd.data)
            if gpu:
                for bhc in T.thread_binding(batch * n_heads * (dv // CB), thread="blockIdx.x"):
                    for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(32, thread="threadIdx.x"):
                            gpu_block(q, k, v, g, beta, s0, slots, parents, o, rec, n,
                                      bhc // (n_heads * (dv // CB)), bhc // (dv // CB) % n_heads, bhc % (dv // CB),
                                      T.Cast("int64", ty), T.Cast("int64", tx))
            else:
                for bh in T.parallel(batch * n_heads):
                    cpu_head(q, k, v, g, beta, s0, slots, parents, o, rec, n, bh // n_heads, bh % n_heads)

    if inplace:
        @T.prim_func(private=True)
        def kernel_inplace(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
                           s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, rec_h: T.handle,
                           o_h: T.handle, st_h: T.handle):
            body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h)
        return kernel_inplace

    @T.prim_func(private=True)
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
               s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, o_h: T.handle, rec_h: T.handle,
               st_h: T.handle):
        body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h)
    return kernel
