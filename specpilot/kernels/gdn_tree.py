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
(I + beta K K^T)^-1 with the tree's mask).  The nodes of one depth are independent given their
ancestors' deltas, all shallower.  Two GPU forms (`form_for` picks by the tokens a build verifies):

The level form (``levels``, up to ``LEVELS_NMAX`` tokens; what a default budget-64 build runs).
A block: (sequence, head, 32 value columns), 8 warps, two blocks an SM; int32 indexing.
  0. every load at once: k rows, the S_0 column block and the v block by cp.async into shared
     memory, each lane's q chunks into registers, the per-token scalars; records from the copies;
  1. each node's G, depth and ancestor list (a walk to the root, one thread a node);
  2. L and P for every ancestor pair: 8-lane groups, a group a node (its ancestor list), lanes
     over d_k, three shuffles a dot product; L at [t, j] below the diagonal, P at [j, t];
  3. the right-hand sides r = beta (v - exp(G) S_0^T k): register tiles of 9 tokens x 1 column,
     three tokens at a time (threes past n skipped); the q rows go where the k rows were;
  4. the deltas a level at a time: delta_t = r_t - sum over t's ancestor list of L[t, j] delta_j,
     two barriers a level (the sums, then the stores);
  5. the outputs: exp(G) S_0^T q as in 3 plus P times the deltas over each node's ancestor list.
H200, 27B-class heads (48 x 128 x 128, bench/README "Gated DeltaNet tree kernel"): a best-first
tree of 64 nodes + root 38.9 us vs the substitution form's 70.1, a chain of 65 150.0 vs 168.6, of
7 19.5 vs 23.1; 2.0e-7 of the PyTorch recurrence along every root path, records bit-identical.
Its probe form (``probe``: clock64 at each phase boundary, thread 0 of each block) put the tree's
62k cycles a block in L and P + S_0^T k (24k), the outputs (17k), the level solve (13k: ~3k a
level, barriers and loop overhead) and the loads (6k).  int32 indexing, the q rows in registers
and sums over ancestor lists only (not dense over j < t) take it from 56.7 us to 38.9; 16 or 64
columns a block are slower (docs/bench-log.md).

The substitution form (up to ``NMAX_LIMIT`` tokens).  A block: (sequence, head, 64 value columns),
8 warps, phases each ended by a barrier:
  1. G by walking each node's path; L and P for every ancestor pair (a warp a node, lanes over
     d_k, two ancestors a round; L below the diagonal of one n x n array, P above, zeros
     elsewhere, so later sums run dense over j);
  2. the right-hand sides: S_0^T k for all nodes as register tiles (9 tokens x 2 columns a
     thread, 16-byte shared loads of the k rows: the phase is shared-load bound);
  3. the deltas: one thread a column, forward substitution in token order (parents come first)
     in its own L1-resident local memory -- no barrier at all;
  4. the outputs: S_0^T q as in 2, plus P times the deltas as a dense masked product.
H200, 27B-class heads, a best-first tree of 64 nodes + root: 70.0 us vs the sequential form's
100.8; in the model's tree verification 2436 -> 2340-2359 us (docs/bench-log.md).  Nsight Compute
(bench/README "Nsight Compute summaries"): 74 us, 12.5 % occupancy (one block of 8 warps an SM),
stalls on barriers, 'wait' and long scoreboard about equally.

float32 throughout; exp(G_t - G_j) <= 1 for an ancestor j.  The CPU form does the same arithmetic
in plain loops (tested against the PyTorch recurrence walking every root path).  A long chain is
the chunked forms' worst case (every pair of its n nodes an ancestor pair, n levels);
gdn-path-recompute{form=sequential} keeps the sequential kernel.

Same inputs, outputs and records as the sequential tree form (commit rebuilds the accepted
node's state from the records with `kernels.gdn_commit`, unchanged); the scratch output is
not written.  Padding tokens (slot < 0) leave the state as it is (g = beta = 0) and output 0.
At most ``nmax`` tokens (shared memory holds the n x n ancestor coefficients): a longer
verify fails with a clear error, not wrong numbers.  The level form wants parents before their
children too (an ancestor's index below its descendant's: where L and P go in the n x n array).
"""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels import memo, record_width

WARPS = 8       # GPU form: warps a block
NMAX_LIMIT = 104   # the n x n coefficients and four n-vectors fit 48 KB of static shared memory
LEVELS_NMAX = 72   # the level form: coefficients and ancestor lists (2 x n x n) in 48 KB of static shared memory
LEVELS_COLUMNS = 32   # its value columns a block (16 and 64 slower: bench/README "Gated DeltaNet tree kernel")
TOKENS = 9      # tokens a thread carries through the S_0 products: 8 warps x 9 >= 65 (64 nodes + root) in one pass


def form_for(tokens: int) -> dict | None:
    """gated_delta_rule_tree's arguments for verifications of up to ``tokens`` tokens: the level
    form while its ``LEVELS_NMAX`` tokens hold them, else the substitution form (``NMAX_LIMIT``),
    else None (the sequential form).  The build's limit is the form's nmax, not ``tokens``: an
    engine may verify larger trees or longer chains with it."""
    levels = min(LEVELS_NMAX, NMAX_LIMIT)
    if tokens <= levels:
        return {"levels": True, "nmax": levels, "columns": LEVELS_COLUMNS}
    return {"levels": False, "nmax": NMAX_LIMIT} if tokens <= NMAX_LIMIT else None


def column_block(dv: int, most: int = 64) -> int:
    """Value columns a GPU block (the largest divisor of dv up to ``most``; the substitution form's
    64: a thread each solves them): the columns' deltas and outputs are independent given the tree's
    coefficients, which every block of a head computes for itself."""
    return next(c for c in range(min(most, dv), 0, -1) if dv % c == 0)


def _dynamic_pad(static_bytes: int, dynamic_bytes: int) -> int:
    """Floats to add to a kernel's dynamic shared memory.  TVM raises a kernel's dynamic shared memory
    limit only once the dynamic part reaches 48 KB, and static + dynamic past 48 KB fails at launch
    otherwise (CUDA_ERROR_INVALID_VALUE, seen on the H200 with a tiny hybrid's heads): then the
    dynamic part grows to 48 KB (a multiple of 4 floats, as every dynamic buffer: TVM packs them into
    one, in an order of its own, and the 16-byte loads need every offset aligned)."""
    if static_bytes + dynamic_bytes > 48 * 1024 > dynamic_bytes - 1:
        return ((48 * 1024 - dynamic_bytes) // 4 + 32 + 3) // 4 * 4
    return 0


def _r4(x: int) -> int:
    """Floats rounded up to a multiple of 4 (16-byte offsets for every dynamic buffer)."""
    return (x + 3) // 4 * 4


def _substitution_sizes(nmax: int, dk: int, cb: int) -> tuple[int, int, int, int]:
    """The substitution form's (static floats: 4 vectors and L / P; dynamic buffers in floats: k / q
    rows grown by `_dynamic_pad`, S_0's columns, the deltas)."""
    static = 4 * nmax + nmax * nmax
    ks, s0s, ds = _r4(nmax * dk), _r4(dk * cb), _r4((nmax + 1) * cb)
    return static, ks + _dynamic_pad(static * 4, (ks + s0s + ds) * 4), s0s, ds


def level_sizes(nmax: int, dk: int, lc: int) -> tuple[int, int, int, int]:
    """The level form's (static floats: 5 vectors, L / P and the ancestor lists; its dynamic buffers)."""
    static = 5 * nmax + 2 * nmax * nmax
    ks, s0, ds = _r4(nmax * dk), _r4(dk * lc), _r4((nmax + 1) * lc)
    return static, ks + _dynamic_pad(static * 4, (ks + s0 + ds) * 4), s0, ds


def columns_within(dv: int, most: int, sizes, shared: int | None) -> int:
    """The value columns a block takes: `column_block`'s up to ``most``, fewer (halving the bound)
    while the block's shared memory (``sizes(columns)``, floats) passes ``shared`` bytes -- a card
    with 99 KiB a block (sm_89, sm_120) takes the 27B-class level form in 16-column blocks."""
    while True:
        cols = column_block(dv, most)
        if shared is None or 4 * sum(sizes(cols)) <= shared or cols == 1:
            return cols
        most = cols // 2


@memo
def gated_delta_rule_tree(n_heads: int, dk: int, dv: int, gpu: bool, stack: tuple[int, int] | None = None,
                          nmax: int = NMAX_LIMIT, levels: bool = False, columns: int = LEVELS_COLUMNS,
                          probe: bool = False, shared: int | None = None):
    """The chunked tree form; signature, attributes and records those of
    ``kernels.gated_delta_rule(n_heads, dk, dv, keep_states=True, gpu, tree=True, stack)``
    (``gdn.form`` = "chunked").  Parents must come before their children (the CPU form solves
    in token order); a malformed parents array cannot hang either form (every path walk stops
    after n steps).  ``shared``: the card's shared memory a block, bytes (the GPU forms take fewer
    value columns a block where theirs would not fit)."""
    G, gi = stack if stack else (1, 0)
    if stack and not 0 <= gi < G:
        raise ValueError(f"stack={stack}: needs 0 <= g < G")
    if not 1 <= nmax <= NMAX_LIMIT or nmax % WARPS:
        raise ValueError(f"nmax={nmax}: needs a multiple of {WARPS} in 1..{NMAX_LIMIT}")
    if levels and nmax > LEVELS_NMAX:
        raise ValueError(f"nmax={nmax}: the level form holds at most {LEVELS_NMAX} tokens")
    inplace = gi > 0
    W = record_width(dk, dv)
    CB = columns_within(dv, 64, lambda cb: _substitution_sizes(nmax, dk, cb), shared)
    CPT = (CB + 31) // 32          # columns a lane
    DL = (dk + 31) // 32           # d_k elements a lane (the warp-wide dot products)
    THREADS = 32 * WARPS
    TK = TOKENS
    VEC = 4 if dk % 4 == 0 else 1  # d_k elements a shared load of the S_0 products
    KP = dk                        # k / q rows in shared memory (16-byte aligned where VEC = 4)
    # dynamic buffers a multiple of 4 floats (16-byte offsets); the k / q rows' grows by `_dynamic_pad`
    _, KS, S0S, DS = _substitution_sizes(nmax, KP, CB)

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
    def token_scalars(par, ge, be, parents, slots, g, beta, b, h, t):
        """Token t's parent, g and beta into shared memory (g = beta = 0 for padding: slot < 0)."""
        par[t] = parents[b, t]
        ge[t] = T.if_then_else(slots[b, t] >= 0, g[b, t, h], T.float32(0))
        be[t] = T.if_then_else(slots[b, t] >= 0, beta[b, t, h], T.float32(0))

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
                token_scalars(par, ge, be, parents, slots, g, beta, b, h, r * THREADS + tid)
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

    # ---- the level form (``levels``): every load issued at once, the deltas solved a tree level at a
    # time (the nodes of one depth are independent given their ancestors'), ``columns`` value columns
    # a block.  Threads: column c = tid % LC of the block's LC, token group tid // LC (LG groups),
    # tokens tg + LG m (m < LK).
    LC = columns_within(dv, columns, lambda lc: level_sizes(nmax, dk, lc), shared)
    LG = THREADS // LC
    LK = cdiv(nmax, LG)
    VK = 4 if dk % 4 == 0 else 1      # 16-byte copies of k / q rows where they are 16-byte aligned
    VC = 4 if LC % 4 == 0 and dv % 4 == 0 else 1
    # the n x n coefficients in static shared memory like the other form's (TVM's sync planner takes
    # every dynamic shared buffer for one: the rows read while coefficients are stored would need a
    # barrier inside a condition)
    _, L_KS, L_S0, L_DS = level_sizes(nmax, dk, LC)

    def copy_async(dst, src, elems):
        """cp.async of ``elems`` float32 (1 or 4) from global ``src`` to shared ``dst``."""
        op = "cp.async.cg.shared.global" if elems == 4 else "cp.async.ca.shared.global"
        return T.evaluate(T.ptx[op](T.address_of(dst), T.address_of(src), 4 * elems))

    LK3 = cdiv(LK, 3) * 3             # the S_0 products' tokens a thread, three at a time (the rest unstored)
    PQ = cdiv(nmax, 4 * WARPS)        # the ancestor products: nodes an 8-lane group takes
    PC = cdiv(dk // VK, 8)            # d_k chunks (of VK) a lane of a group takes

    def node(m, ty, tx):
        return (m * WARPS + ty) * 4 + tx // 8

    @T.macro
    def s0_products(tile, sc, kx, rows, s0s, n, tg, c):
        """tile[mm] = sum_i rows[t_mm, i] S_0[i, c] for the thread's tokens t_mm = tg + LG mm, three
        tokens at a time, skipping the threes past n (a short chain computes one)."""
        for mm in T.unroll(LK):
            tile[mm] = T.float32(0)
        for mg in T.unroll(LK3 // 3):
            if tg + LG * (mg * 3) < n:
                for i4 in range(dk // VK):
                    for e in T.unroll(VK):
                        sc[e] = s0s[i4 * VK + e, c]
                    for u in T.unroll(3):
                        for e in T.vectorized(VK):
                            kx[mg * 3 + u, e] = rows[T.min(tg + LG * (mg * 3 + u), nmax - 1), i4 * VK + e]
                    for u in T.unroll(3):
                        for e in T.unroll(VK):
                            tile[mg * 3 + u] = tile[mg * 3 + u] + kx[mg * 3 + u, e] * sc[e]

    @T.macro
    def mark(marks, slot, tid, blk):
        if probe:
            if tid == 0:
                marks[blk, slot] = T.call_extern("int64", "clock64")

    @T.macro
    def gpu_levels(q, k, v, g, beta, s0, slots, parents, o, rec, n, b, h, cb, ty, tx, marks, blk):
        par = T.alloc_buffer((nmax,), "int32", scope="shared")
        dep = T.alloc_buffer((nmax,), "int32", scope="shared")    # a node's depth (1: the root's row)
        ge = T.alloc_buffer((nmax,), "float32", scope="shared")
        be = T.alloc_buffer((nmax,), "float32", scope="shared")
        gs = T.alloc_buffer((nmax,), "float32", scope="shared")
        ks = T.alloc_buffer((L_KS,), "float32", scope="shared.dyn")     # k rows, then q rows
        s0_flat = T.alloc_buffer((L_S0,), "float32", scope="shared.dyn")
        ds_flat = T.alloc_buffer((L_DS,), "float32", scope="shared.dyn")   # v, then r, then the deltas
        lp_flat = T.alloc_buffer((nmax * nmax,), "float32", scope="shared")
        anc_flat = T.alloc_buffer((nmax * nmax,), "int32", scope="shared")   # row t: t, its parent, .., the root's row
        rows = T.decl_buffer((nmax, dk), "float32", data=ks.data, scope="shared.dyn")
        s0s = T.decl_buffer((dk, LC), "float32", data=s0_flat.data, scope="shared.dyn")
        ds = T.decl_buffer((nmax + 1, LC), "float32", data=ds_flat.data, scope="shared.dyn")
        lp = T.decl_buffer((nmax, nmax), "float32", data=lp_flat.data, scope="shared")
        anc = T.decl_buffer((nmax, nmax), "int32", data=anc_flat.data, scope="shared")
        cur = T.alloc_buffer((4,), "int32", scope="local")
        acc = T.alloc_buffer((4,), "float32", scope="local")
        qreg = T.alloc_buffer((PQ, PC, VK), "float32", scope="local")
        kt = T.alloc_buffer((PC, VK), "float32", scope="local")
        tile = T.alloc_buffer((LK3,), "float32", scope="local")
        sc = T.alloc_buffer((VK,), "float32", scope="local")
        kx = T.alloc_buffer((LK3, VK), "float32", scope="local")
        act = T.alloc_buffer((LK,), "int32", scope="local")     # the level solve: each token's depth (0: none)
        tid = T.meta_var(ty * 32 + tx)
        c = T.meta_var(tid % LC)
        tg = T.meta_var(tid // LC)
        mark(marks, 0, tid, blk)
        # every load at once: k rows, the S_0 block and the v block by cp.async, each warp's q rows
        # into registers, the per-token scalars
        for r in T.unroll(cdiv(nmax * (dk // VK), THREADS)):
            if r * THREADS + tid < n * (dk // VK):
                copy_async(rows[(r * THREADS + tid) // (dk // VK), (r * THREADS + tid) % (dk // VK) * VK],
                           k[b, (r * THREADS + tid) // (dk // VK), h, (r * THREADS + tid) % (dk // VK) * VK], VK)
        for r in T.unroll(cdiv(dk * (LC // VC), THREADS)):
            if r * THREADS + tid < dk * (LC // VC):
                copy_async(s0s[(r * THREADS + tid) // (LC // VC), (r * THREADS + tid) % (LC // VC) * VC],
                           s0[b, h, (r * THREADS + tid) // (LC // VC),
                              cb * LC + (r * THREADS + tid) % (LC // VC) * VC], VC)
        for r in T.unroll(cdiv(nmax * (LC // VC), THREADS)):
            if r * THREADS + tid < n * (LC // VC):
                copy_async(ds[(r * THREADS + tid) // (LC // VC), (r * THREADS + tid) % (LC // VC) * VC],
                           v[b, (r * THREADS + tid) // (LC // VC), h,
                             cb * LC + (r * THREADS + tid) % (LC // VC) * VC], VC)
        T.evaluate(T.ptx["cp.async.commit_group"]())
        for m in T.unroll(PQ):
            for i in T.unroll(PC):
                for e in T.unroll(VK):
                    qreg[m, i, e] = T.if_then_else(node(m, ty, tx) < n and tx % 8 + 8 * i < dk // VK,
                                                   q[b, T.min(node(m, ty, tx), n - 1), h,
                                                     T.min(tx % 8 + 8 * i, dk // VK - 1) * VK + e], T.float32(0))
        for r in T.unroll(cdiv(nmax, THREADS)):
            if r * THREADS + tid < n:
                token_scalars(par, ge, be, parents, slots, g, beta, b, h, r * THREADS + tid)
                if cb == 0:
                    rec[rat(n, b, r * THREADS + tid, h, dk + dv)] = g[b, r * THREADS + tid, h]
                    rec[rat(n, b, r * THREADS + tid, h, dk + dv + 1)] = beta[b, r * THREADS + tid, h]
        for r in T.unroll(cdiv(nmax * nmax, THREADS)):
            if r * THREADS + tid < n * nmax:
                lp_flat[r * THREADS + tid] = T.float32(0)
        T.evaluate(T.ptx["cp.async.wait_group"](0))
        T.tvm_storage_sync("shared")
        mark(marks, 1, tid, blk)
        # records from the shared copies (this block's v columns; block 0 of the head k too)
        for r in T.unroll(cdiv(nmax * LC, THREADS)):
            if r * THREADS + tid < n * LC:
                rec[rat(n, b, (r * THREADS + tid) // LC, h, dk + cb * LC + (r * THREADS + tid) % LC)] = \
                    ds[(r * THREADS + tid) // LC, (r * THREADS + tid) % LC]
        if cb == 0:
            for r in T.unroll(cdiv(nmax * dk, THREADS)):
                if r * THREADS + tid < n * dk:
                    rec[rat(n, b, (r * THREADS + tid) // dk, h, (r * THREADS + tid) % dk)] = \
                        rows[(r * THREADS + tid) // dk, (r * THREADS + tid) % dk]
        # each node's path sum G and depth: a walk to the root
        # (no walk inside a condition: TVM's sync planner cannot place a barrier there)
        for r in T.unroll(cdiv(nmax, THREADS)):
            acc[0] = T.float32(0)
            cur[0] = T.if_then_else(r * THREADS + tid < n, r * THREADS + tid, -1)
            cur[1] = 0
            while cur[0] >= 0 and cur[1] < n:
                acc[0] = acc[0] + ge[cur[0]]
                anc[r * THREADS + tid, cur[1]] = cur[0]
                cur[0] = par[cur[0]]
                cur[1] = cur[1] + 1
            if r * THREADS + tid < n:
                gs[r * THREADS + tid] = acc[0]
                dep[r * THREADS + tid] = cur[1]
        T.tvm_storage_sync("shared")
        mark(marks, 2, tid, blk)
        # L[t, j] and P[t, j] (at [j, t]) for every ancestor j of t: groups of 8 lanes, group tx // 8 of
        # warp ty the node (4 m + ty) 4 + tx // 8 (q rows from registers), lane tx % 8 the d_k chunks
        # tx % 8 + 8 i; an ancestor (from the node's list) a round, each dot product as two partial sums
        for m in T.unroll(PQ):
            for i in T.unroll(PC):
                for e in T.unroll(VK):
                    kt[i, e] = T.if_then_else(tx % 8 + 8 * i < dk // VK, rows[T.min(node(m, ty, tx), nmax - 1),
                                              T.min(tx % 8 + 8 * i, dk // VK - 1) * VK + e], T.float32(0))
            cur[3] = T.if_then_else(node(m, ty, tx) < n, dep[T.min(node(m, ty, tx), nmax - 1)], 0)
            for a in range(cur[3]):
                cur[0] = anc[T.min(node(m, ty, tx), nmax - 1), a]
                for u in T.unroll(4):
                    acc[u] = T.float32(0)
                for i in T.unroll(PC):
                    for e in T.unroll(VK):
                        acc[i % 2] = acc[i % 2] + kt[i, e] * rows[cur[0], T.min(tx % 8 + 8 * i, dk // VK - 1) * VK + e]
                        acc[2 + i % 2] = acc[2 + i % 2] + \
                            qreg[m, i, e] * rows[cur[0], T.min(tx % 8 + 8 * i, dk // VK - 1) * VK + e]
                acc[0] = acc[0] + acc[1]
                acc[1] = acc[2] + acc[3]
                for u in T.unroll(3):
                    for w in T.unroll(2):
                        acc[w] = acc[w] + T.tvm_warp_shuffle_xor(T.tvm_warp_activemask(), acc[w],
                                                                 T.shift_right(4, u), 32, 32)
                if tx % 8 == 0:
                    if cur[0] != node(m, ty, tx):
                        lp[node(m, ty, tx), cur[0]] = be[node(m, ty, tx)] * \
                            T.exp(gs[node(m, ty, tx)] - gs[cur[0]]) * acc[0]
                    lp[cur[0], node(m, ty, tx)] = T.exp(gs[node(m, ty, tx)] - gs[cur[0]]) * acc[1]
        # the right-hand sides r = beta (v - exp(G) S_0^T k), in place of v
        if tg < LG:
            s0_products(tile, sc, kx, rows, s0s, n, tg, c)
            for mm in T.unroll(LK):
                tile[mm] = T.if_then_else(
                    tg + LG * mm < n and slots[b, T.min(tg + LG * mm, n - 1)] >= 0,
                    be[T.min(tg + LG * mm, nmax - 1)] * (ds[T.min(tg + LG * mm, nmax - 1), c]
                                                         - T.exp(gs[T.min(tg + LG * mm, nmax - 1)]) * tile[mm]),
                    T.float32(0))
        T.tvm_storage_sync("shared")
        mark(marks, 3, tid, blk)
        # (the reads above, the stores here: TVM's sync planner cannot place a barrier in a condition)
        for mm in T.unroll(LK):
            if tg < LG and tg + LG * mm < n:
                ds[tg + LG * mm, c] = tile[mm]
        # the k rows are read: the q rows go in their place while the deltas are solved
        for r in T.unroll(cdiv(nmax * (dk // VK), THREADS)):
            if r * THREADS + tid < n * (dk // VK):
                copy_async(rows[(r * THREADS + tid) // (dk // VK), (r * THREADS + tid) % (dk // VK) * VK],
                           q[b, (r * THREADS + tid) // (dk // VK), h, (r * THREADS + tid) % (dk // VK) * VK], VK)
        T.evaluate(T.ptx["cp.async.commit_group"]())
        cur[1] = 1                  # the deepest node's depth (every thread the same)
        for t in range(n):
            cur[1] = T.max(cur[1], dep[t])
        T.tvm_storage_sync("shared")
        mark(marks, 4, tid, blk)
        # the deltas, a level at a time: delta_t = r_t - sum_{j < t} L[t, j] delta_j (L zero off t's
        # ancestors, all of them shallower), 4 interleaved partial sums
        for mm in T.unroll(LK):
            act[mm] = T.if_then_else(tg < LG and tg + LG * mm < n, dep[T.min(tg + LG * mm, nmax - 1)], 0)
        cur[0] = 2
        while cur[0] <= cur[1]:
            # the sums first, every thread (those off this level sum nothing), then the stores: TVM's
            # sync planner cannot place a barrier inside a condition
            for mm in T.unroll(LK):
                for a in T.unroll(2):
                    acc[a] = T.float32(0)
                # ancestors a = 1 .. depth - 1 of the token (its list), two partial sums
                for a2 in range(T.if_then_else(act[mm] == cur[0], (cur[0] - 1) // 2, 0)):
                    for a in T.unroll(2):
                        acc[a] = acc[a] + lp[tg + LG * mm, anc[tg + LG * mm, 1 + a2 * 2 + a]] * \
                            ds[anc[tg + LG * mm, 1 + a2 * 2 + a], c]
                if act[mm] == cur[0] and (cur[0] - 1) % 2 == 1:
                    acc[0] = acc[0] + lp[tg + LG * mm, anc[tg + LG * mm, cur[0] - 1]] * \
                        ds[anc[tg + LG * mm, cur[0] - 1], c]
                tile[mm] = ds[T.min(tg + LG * mm, nmax - 1), c] - (acc[0] + acc[1])
            T.tvm_storage_sync("shared")
            for mm in T.unroll(LK):
                if act[mm] == cur[0]:
                    ds[tg + LG * mm, c] = tile[mm]
            T.tvm_storage_sync("shared")
            cur[0] = cur[0] + 1
        T.evaluate(T.ptx["cp.async.wait_group"](0))
        T.tvm_storage_sync("shared")
        mark(marks, 5, tid, blk)
        # outputs exp(G) S_0^T q + sum_{j <= t} P[t, j] delta_j (P zero off t's root path)
        if tg < LG:
            s0_products(tile, sc, kx, rows, s0s, n, tg, c)
            for mm in T.unroll(LK):
                tile[mm] = T.exp(gs[T.min(tg + LG * mm, nmax - 1)]) * tile[mm]
            for mm in T.unroll(LK):
                for a in range(act[mm]):
                    tile[mm] = tile[mm] + lp[anc[tg + LG * mm, a], tg + LG * mm] * ds[anc[tg + LG * mm, a], c]
            for mm in T.unroll(LK):
                if tg + LG * mm < n:
                    o[b, tg + LG * mm, h, cb * LC + c] = T.if_then_else(slots[b, tg + LG * mm] >= 0, tile[mm],
                                                                       T.float32(0))
        mark(marks, 6, tid, blk)

    attrs = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu, "gdn.kernel": "recurrence",
             "gdn.tree": True, "gdn.keep_states": True, "gdn.shape": [n_heads, dk, dv], "gdn.form": "chunked",
             "gdn.max_tokens": nmax, "gdn.solve": "levels" if gpu and levels else "substitution"}
    if stack:
        attrs["gdn.stack"] = [G, gi]
    # the level form indexes in int32 (int64 arithmetic would be a large part of its instructions; the
    # kernel checks that the batch's states and records fit); its shape variables are int32 too
    index_var = T.int32 if gpu and levels else T.int64
    rec_shape = lambda batch, n: (batch, n, G, n_heads, W) if stack else (batch, n, n_heads, W)  # noqa: E731
    state_shape = lambda batch: (batch, G, n_heads, dk, dv) if stack else (batch, n_heads, dk, dv)  # noqa: E731

    @T.macro
    def body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h, marks):
        T.func_attr(attrs)
        batch, n = index_var(), index_var()
        q = T.match_buffer(q_h, (batch, n, n_heads, dk), "float32")
        k = T.match_buffer(k_h, (batch, n, n_heads, dk), "float32")
        v = T.match_buffer(v_h, (batch, n, n_heads, dv), "float32")
        g = T.match_buffer(g_h, (batch, n, n_heads), "float32")
        beta = T.match_buffer(b_h, (batch, n, n_heads), "float32")
        s0_nd = T.match_buffer(s0_h, state_shape(batch), "float32")
        slots = T.match_buffer(slots_h, (batch, n), "int32")
        parents = T.match_buffer(parents_h, (batch, n), "int32")
        o = T.match_buffer(o_h, (batch, n, n_heads, dv), "float32")
        rec_nd = T.match_buffer(rec_h, rec_shape(batch, n), "float32")
        T.match_buffer(st_h, (batch, n, n_heads, dk, dv), "float32")   # the sequential form's scratch: unused
        assert n <= nmax, f"gated_delta_rule_tree: more tokens than its nmax ({nmax})"
        if gpu and levels:   # its int32 indices: the states' stack and the records must fit them
            assert T.Cast("int64", batch) * T.int64(G * n_heads * dk * dv) < T.int64(2 ** 31) and \
                T.Cast("int64", batch) * T.Cast("int64", n) * T.int64(G * n_heads * W) < T.int64(2 ** 31), \
                "gated_delta_rule_tree: a batch too large for the level form's int32 indices"
        if True:
            rec = T.decl_buffer((batch * n * G * n_heads * W,), "float32", data=rec_nd.data)
            # this layer's states, read in place out of the stack (a view, no copy)
            s0 = T.decl_buffer((batch, n_heads, dk, dv), "float32", data=s0_nd.data,
                               strides=(index_var(G * n_heads * dk * dv), index_var(dk * dv), index_var(dv),
                                        index_var(1)),
                               elem_offset=index_var(gi * n_heads * dk * dv))
            if gpu and levels:
                for blk in T.thread_binding(batch * n_heads * (dv // LC), thread="blockIdx.x"):
                    for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(32, thread="threadIdx.x"):
                            gpu_levels(q, k, v, g, beta, s0, slots, parents, o, rec, n,
                                       blk // (n_heads * (dv // LC)), blk // (dv // LC) % n_heads, blk % (dv // LC),
                                       ty, tx, marks, blk)
            elif gpu:
                for bhc in T.thread_binding(batch * n_heads * (dv // CB), thread="blockIdx.x"):
                    for ty in T.thread_binding(WARPS, thread="threadIdx.y"):
                        for tx in T.thread_binding(32, thread="threadIdx.x"):
                            gpu_block(q, k, v, g, beta, s0, slots, parents, o, rec, n,
                                      bhc // (n_heads * (dv // CB)), bhc // (dv // CB) % n_heads, bhc % (dv // CB),
                                      T.Cast("int64", ty), T.Cast("int64", tx))
            else:
                for bh in T.parallel(batch * n_heads):
                    cpu_head(q, k, v, g, beta, s0, slots, parents, o, rec, n, bh // n_heads, bh % n_heads)

    if probe:   # bench/gdn_tree.py: clock64 at the phase boundaries, thread 0 of each block
        if not (gpu and levels) or inplace:
            raise ValueError("probe: the GPU level form of a kernel that is not stacked in place")

        @T.prim_func(private=True)
        def kernel_probe(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
                         s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, o_h: T.handle, rec_h: T.handle,
                         st_h: T.handle, marks_h: T.handle):
            blocks = T.int64()
            marks = T.match_buffer(marks_h, (blocks, 8), "int64")
            body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h, marks)
        return kernel_probe

    if inplace:
        @T.prim_func(private=True)
        def kernel_inplace(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
                           s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, rec_h: T.handle,
                           o_h: T.handle, st_h: T.handle):
            body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h, None)
        return kernel_inplace

    @T.prim_func(private=True)
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
               s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, o_h: T.handle, rec_h: T.handle,
               st_h: T.handle):
        body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h, None)
    return kernel
