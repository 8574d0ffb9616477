"""Gated DeltaNet: the gated delta rule recurrence (chain and tree forms), commit's rebuild of the
recurrent state along a root path, the short-conv windows verification keeps, and the selection of
the state after the accepted token."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo


def _gdn_blocking(dk: int, dv: int, split: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
    """The GPU forms' split of a head's (dk, dv) state: (parts, rows, cols, col_blocks) -- d_k in
    ``parts`` groups of ``rows`` over threadIdx.y, value columns ``cols`` a block over threadIdx.x
    (32 where dv allows: 27B-class heads, dv = 128, take 4 blocks), ``col_blocks`` blocks a head.
    ``split`` = (parts, cols) chooses them (parts must divide d_k, cols d_v, at most 1024 threads)."""
    if split is not None:
        parts, cols = split
        if parts < 1 or cols < 1 or dk % parts or dv % cols or parts * cols > 1024:
            raise ValueError(f"split={split}: needs parts dividing d_k={dk}, cols dividing d_v={dv} and "
                             f"at most 1024 threads a block")
        return parts, dk // parts, cols, dv // cols
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
                     stack: tuple[int, int] | None = None, operands: str = "shared", padding: str = "skip",
                     split: tuple[int, int] | None = None, parent: str = "load", min_blocks: int = 6):
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
    each token's k, v, g and beta.  (The state after every token would be, at 64 tree nodes and
    27B-class heads, 200 MB a layer, most of the kernel's time.)  With ``tree`` each token starts
    from its parent's state (parent -1: s0) -- the gdn-path-recompute form, every root path of a
    draft tree walked as a chain would walk it; without, tokens follow each other and parents is
    not read.  Parents come before their children, so one pass in token order meets every parent
    first: a token whose parent is the token before continues from the state in registers, the
    others read their parent's state back from ``scratch`` (B, T, H, dk, dv), where the kernel
    stores only the states of tokens that such a later token branches from (a third of the nodes of
    a best-first tree of 64).  Outputs: o, record, scratch (nothing in scratch is for the caller).

    ``stack`` = (G, g): the layers' tensors stacked, so no step slices or concatenates them: s0 is
    all G Gated DeltaNet layers' states (B, G, H, dk, dv), this layer's read at g in place (a copy
    of one layer's states is 50 MB at 16 sequences of 27B-class heads); with
    ``keep_states`` the records of all G layers of a verify go into one (B, T, G, H, W) tensor, this
    layer's at index g; without, the final states go into one such tensor as s0's.  Layer 0 allocates the
    stack it writes (its other layers' slices left to them); layer g > 0 writes its slice in
    place: the kernel then takes the stack after ``parents`` and returns it first
    (``call_tir_inplace`` order: in-place operand, then o and scratch).

    ``operands`` (GPU form): where a token's k and q wait for their step -- ``shared``, loaded once a
    block into shared memory (each value is read by all ``cols`` threads of its rows), or
    ``registers``, every thread's own copy of its rows (bench/gdn_recurrence.py times both).  Same
    arithmetic, same bits.

    ``padding`` (GPU form): ``skip`` ends a block's token loop after its sequence's last real token (a batch
    pads every sequence to the longest; its blocks then do the work of their own tokens, not the longest's,
    and free their SM for the next), ``walk`` steps through the padding too.  A padding token changes no
    state, so both write the same bits; padding before a real token is walked either way.  The scan for the
    last real token is n loads a thread, small beside the n steps of the loop.

    ``split`` (GPU form): (parts, cols), d_k's thread groups and a block's value columns (`_gdn_blocking`;
    None: its default).  Another split sums d_k in other pieces, so `gdn_commit` must be given the same.

    ``parent`` (tree form, GPU): ``prefetch`` loads a branching token's parent state one step ahead into
    registers of its own, ``load`` when the token's step comes (fewer registers a thread, a load's latency
    at each branch).  Same bits.

    ``min_blocks`` (GPU form): ``__launch_bounds__(threads, min_blocks)`` -- ptxas keeps a thread's
    registers to what that many blocks an SM leave (at most 1536 threads an SM's worth; 0: no bound).
    Same bits.
    """
    if operands not in ("shared", "registers"):
        raise ValueError(f"operands={operands!r}: expected 'shared' or 'registers'")
    if padding not in ("skip", "walk"):
        raise ValueError(f"padding={padding!r}: expected 'skip' or 'walk'")
    if parent not in ("prefetch", "load"):
        raise ValueError(f"parent={parent!r}: expected 'prefetch' or 'load'")
    if tree and not keep_states:
        raise ValueError("the tree form is verification's: it needs keep_states (a final state after a tree "
                         "is no one's)")
    G, gi = stack if stack else (1, 0)
    if stack and not 0 <= gi < G:
        raise ValueError(f"stack={stack}: needs 0 <= g < G")
    inplace = gi > 0
    W = record_width(dk, dv)
    # the GPU form indexes in int32 (int64 address arithmetic costs it registers and instructions a token
    # step; the kernel checks that the batch fits); its shape variables are int32 too
    I, idt = (T.int32, "int32") if gpu else (T.int64, "int64")
    stacked = stack is not None     # s0 (and the final state): all layers'
    SG, sg = (G, gi) if stacked else (1, 0)

    def sat(b, h, i, j):
        """Flat index of s0[b, (layer g,) h, i, j]; without ``keep_states`` the final state's too."""
        return (((b * SG + sg) * n_heads + h) * dk + i) * dv + j

    def at(n, b, t, h, i, j):
        """Flat index of scratch[b, t, h, i, j]."""
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
            s[i] = s0[sat(b, h, i, j)]
        for t in range(n):
            acc[0] = T.float32(0)
            if tree:
                if parents[b, t] < 0:
                    for i in range(dk):
                        s[i] = s0[sat(b, h, i, j)]
                elif T.Cast(idt, parents[b, t]) != t - I(1):
                    for i in range(dk):
                        s[i] = st[at(n, b, T.Cast(idt, parents[b, t]), h, i, j)]
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
                for c in range(t + I(2), n):
                    if T.Cast(idt, parents[b, c]) == t:
                        kept[0] = 1
                if kept[0] != 0:
                    for i in range(dk):
                        st[at(n, b, t, h, i, j)] = s[i]
        if not keep_states:
            for i in range(dk):
                st[sat(b, h, i, j)] = s[i]

    # GPU form: a block per (sequence, head, group of ``cols`` value columns) -- the columns of
    # the state evolve independently, so 27B-class heads (dv = 128) take 4 blocks each -- cols x
    # parts threads; thread (j, p) keeps rows p*R .. p*R+R-1 of column j of the state in
    # registers (R = dk / parts), the two dot products over d_k per token are summed through
    # shared memory.  Sums over d_k come as ``parts`` partial sums of 4 interleaved partial sums
    # each (short dependency chains: ncu found the kernel waiting on them once its loads were
    # hidden): float32 rounding apart, the CPU form's arithmetic; `gdn_commit` runs the same
    # update (`_delta_rule`).  The token loop is a chain of dependent steps, so what a step reads
    # from memory is loaded one step ahead: the next token's k, q, v, g, beta and slot (tokens go
    # two at a time, so the double buffers have fixed register indices); a branching token's
    # parent state is loaded at its own step by default (``parent``: prefetched it takes R
    # registers more a thread, and the batched step is short of registers: at 16-32 sequences the
    # blocks an SM, 3 at 167 registers, set its speed; int32 indices and ``min_blocks`` = 6 hold
    # it to 80 registers, 6 blocks an SM).  The records are
    # written before the loop, and which tokens' states go to scratch is found once: a bit per
    # token in shared memory (tokens past ``cap`` always store).  The k and q of the token at hand
    # and the next wait in shared memory, loaded by the block's threads together, ordered by the
    # barriers a step already has: held in registers they would take 2 x 2 x R of every thread's and
    # leave a batch of sequences to many waves of blocks (the alternatives measured: docs/bench-log.md;
    # bench/README "Gated DeltaNet recurrence").
    parts, rows, cols, col_blocks = _gdn_blocking(dk, dv, split)
    threads = parts * cols
    # blocks an SM asked of ptxas: at most what 1536 threads an SM hold (sm_86 - sm_120's limit)
    bound = min(min_blocks, 1536 // threads)
    cap = 1024
    update = _delta_rule(rows, parts)
    shared_ops = operands == "shared"
    prefetch = parent == "prefetch"
    NB = 2   # operand buffers: this token's and the next's


    def walked(live, n):
        """The tokens a block's loop walks: through its sequence's last real one (``skip``) or all n."""
        return live[0] if padding == "skip" else n

    def kq(p, i):
        """Index of row i of thread group p's rows in the k / q buffers (shared: the whole d_k)."""
        return p * rows + i if shared_ops else i

    @T.macro
    def fetch(q, k, v, g, beta, slots, kx, qx, sx, ix, n, b, t, h, p, j, lane, u):
        """Token t's operands into buffer u (t < n; kx, qx: the buffers, a Python list): k and q into shared memory, thread ``lane`` of the
        block taking every ``threads``-th value (or each thread's own rows into its registers), v[j],
        g, beta and the slot into the thread's registers."""
        if shared_ops:
            for r in T.unroll((dk + threads - 1) // threads):
                if r * threads + lane < dk:
                    kx[u][r * threads + lane] = k[b, t, h, r * threads + lane]
                    qx[u][r * threads + lane] = q[b, t, h, r * threads + lane]
        else:
            for i in T.unroll(rows):
                kx[u][i] = k[b, t, h, p * rows + i]
                qx[u][i] = q[b, t, h, p * rows + i]
        sx[u, 0] = v[b, t, h, j]
        sx[u, 1] = g[b, t, h]
        sx[u, 2] = beta[b, t, h]
        ix[u] = slots[b, t]

    @T.macro
    def parent_state(s0, st, parents, dst, n, b, t, h, p, j):
        """Rows p*R.. of column j of token t's parent's state (s0 for a root) into ``dst``."""
        if parents[b, t] < 0:
            for i in T.unroll(rows):
                dst[i] = s0[sat(b, h, p * rows + i, j)]
        else:
            for i in T.unroll(rows):
                dst[i] = st[at(n, b, T.Cast(idt, parents[b, t]), h, p * rows + i, j)]

    @T.macro
    def output(o, rq, acc, ix, m, b, t, h, p, jl, cb, u):
        """Token t's output (t < m), its ``parts`` partial sums in ``rq``, thread group 0 adding them."""
        if p == 0:
            if t < m:
                acc[1] = T.float32(0)
                for r in range(parts):
                    acc[1] = acc[1] + rq[0, r, jl]
                o[b, t, h, cb * cols + jl] = T.if_then_else(ix[u] >= 0, acc[1], T.float32(0))

    @T.macro
    def step(q, k, v, g, beta, s0, slots, parents, o, st, n, m, b, t, h, p, jl, cb,
             s, ps, kx, qx, sx, ix, acc, part, rk, rq, stored, u):
        """Token t of the ``m`` the loop walks (of n), its operands in buffer u (a Python int), the next
        token's fetched into the next buffer.  The loop goes in groups of ``NB``, so t may be past m: a
        step that changes nothing (TVM inserts barriers where a condition around the step would forbid
        them).  Every buffer a step writes is a buffer of its own (kx, qx, rk, rq: Python lists of NB), so TVM's
        barrier pass sees them apart and adds no barrier of its own."""
        if t >= m:
            ix[u] = -1
        if tree:
            if t < m:
                if T.Cast(idt, parents[b, t]) != t - I(1):
                    if prefetch:
                        for i in T.unroll(rows):
                            s[i] = ps[i]
                    else:
                        parent_state(s0, st, parents, s, n, b, t, h, p, cb * cols + jl)
        if t + 1 < m:
            fetch(q, k, v, g, beta, slots, kx, qx, sx, ix, n, b, t + 1, h, p, cb * cols + jl, p * cols + jl,
                  (u + 1) % NB)
            if tree and prefetch:
                if T.Cast(idt, parents[b, t + 1]) != t:
                    parent_state(s0, st, parents, ps, n, b, t + 1, h, p, cb * cols + jl)
        update(s, part, acc, rk[u], 0, p, jl, lambda i: kx[u][kq(p, i)], lambda i: qx[u][kq(p, i)],
               sx[u, 1], sx[u, 0], sx[u, 2], ix[u] >= 0)
        rq[u][0, p, jl] = (part[0] + part[1]) + (part[2] + part[3])
        T.tvm_storage_sync("shared")
        output(o, rq[u], acc, ix, m, b, t, h, p, jl, cb, u)
        if tree:   # (the bit goes through a register: TVM's barrier pass rejects shared loads in conditions)
            acc[0] = T.Cast("float32", T.if_then_else(t >= cap, 1, (stored[T.min(t, cap - 1) // 32] >> (t % 32)) & 1))
            if t < m:
                if acc[0] != T.float32(0):
                    for i in T.unroll(rows):
                        st[at(n, b, t, h, p * rows + i, cb * cols + jl)] = s[i]

    @T.macro
    def blocked(q, k, v, g, beta, s0, slots, parents, o, rec, st, n, b, h, p, jl, cb):
        """Sequence b, head h, value column j = cb * cols + jl, rows p*R..p*R+R-1 of d_k: the
        whole token loop."""
        s = T.alloc_buffer((rows,), "float32", scope="local")
        ps = T.alloc_buffer((rows,), "float32", scope="local")        # the next token's parent state
        # k, q of this token and the next, a buffer each
        kx0 = T.alloc_buffer((dk if shared_ops else rows,), "float32", scope="shared" if shared_ops else "local")
        kx1 = T.alloc_buffer((dk if shared_ops else rows,), "float32", scope="shared" if shared_ops else "local")
        qx0 = T.alloc_buffer((dk if shared_ops else rows,), "float32", scope="shared" if shared_ops else "local")
        qx1 = T.alloc_buffer((dk if shared_ops else rows,), "float32", scope="shared" if shared_ops else "local")
        sx = T.alloc_buffer((NB, 3), "float32", scope="local")         # v[j], g, beta
        ix = T.alloc_buffer((NB,), "int32", scope="local")             # slot
        acc = T.alloc_buffer((2,), "float32", scope="local")
        part = T.alloc_buffer((4,), "float32", scope="local")         # a dot product's 4 partial sums
        word = T.alloc_buffer((1,), "int32", scope="local")
        live = T.alloc_buffer((1,), idt, scope="local")           # tokens up to the last real one
        rk0 = T.alloc_buffer((1, parts, cols), "float32", scope="shared")   # the S^T k partial sums of a step
        rk1 = T.alloc_buffer((1, parts, cols), "float32", scope="shared")
        rq0 = T.alloc_buffer((1, parts, cols), "float32", scope="shared")   # its S^T q partial sums
        rq1 = T.alloc_buffer((1, parts, cols), "float32", scope="shared")
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
                            if T.Cast(idt, parents[b, c]) != c - 1:
                                if parents[b, c] // 32 == r * threads + p * cols + jl:
                                    word[0] = word[0] | (1 << (parents[b, c] % 32))
                    stored[r * threads + p * cols + jl] = word[0]
            T.tvm_storage_sync("shared")
        for i in T.unroll(rows):
            s[i] = s0[sat(b, h, p * rows + i, cb * cols + jl)]
        kx, qx, rk, rq = [kx0, kx1], [qx0, qx1], [rk0, rk1], [rq0, rq1]
        fetch(q, k, v, g, beta, slots, kx, qx, sx, ix, n, b, I(0), h, p, cb * cols + jl, p * cols + jl, 0)
        if shared_ops:
            T.tvm_storage_sync("shared")
        if padding == "skip":   # the tokens up to the sequence's last real one (the same for the whole block)
            live[0] = I(0)
            for c in range(n):
                if slots[b, c] >= 0:
                    live[0] = c + I(1)
            if p == 0:   # the padding past it outputs 0, as a walked padding token does
                for t in range(live[0], n):
                    o[b, t, h, cb * cols + jl] = T.float32(0)
        for t2 in range((walked(live, n) + NB - 1) // NB):
            step(q, k, v, g, beta, s0, slots, parents, o, st, n, walked(live, n), b, t2 * NB, h, p, jl, cb,
                 s, ps, kx, qx, sx, ix, acc, part, rk, rq, stored, 0)
            step(q, k, v, g, beta, s0, slots, parents, o, st, n, walked(live, n), b, t2 * NB + 1, h, p, jl, cb,
                 s, ps, kx, qx, sx, ix, acc, part, rk, rq, stored, 1)
        if not keep_states:
            for i in T.unroll(rows):
                st[sat(b, h, p * rows + i, cb * cols + jl)] = s[i]

    attrs = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu, "gdn.kernel": "recurrence",
             "gdn.tree": tree, "gdn.keep_states": keep_states, "gdn.shape": [n_heads, dk, dv]}
    if stack:
        attrs["gdn.stack"] = [G, gi]
    rec_shape = lambda batch, n: (batch, n, G, n_heads, W) if stack else (batch, n, n_heads, W)  # noqa: E731
    state_shape = lambda batch: (batch, G, n_heads, dk, dv) if stacked else (batch, n_heads, dk, dv)  # noqa: E731

    @T.macro
    def body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, rec_h, st_h):
        T.func_attr(attrs)
        batch, n = I(), I()
        q = T.match_buffer(q_h, (batch, n, n_heads, dk), "float32")
        k = T.match_buffer(k_h, (batch, n, n_heads, dk), "float32")
        v = T.match_buffer(v_h, (batch, n, n_heads, dv), "float32")
        g = T.match_buffer(g_h, (batch, n, n_heads), "float32")
        beta = T.match_buffer(b_h, (batch, n, n_heads), "float32")
        s0_nd = T.match_buffer(s0_h, state_shape(batch), "float32")
        slots = T.match_buffer(slots_h, (batch, n), "int32")
        parents = T.match_buffer(parents_h, (batch, n), "int32")
        o = T.match_buffer(o_h, (batch, n, n_heads, dv), "float32")
        if keep_states:
            rec_nd = T.match_buffer(rec_h, rec_shape(batch, n), "float32")
            st_nd = T.match_buffer(st_h, (batch, n, n_heads, dk, dv), "float32")
        else:
            st_nd = T.match_buffer(st_h, state_shape(batch), "float32")
        with T.sblock("root"):
            if gpu:   # its int32 indices: the states' stack, the scratch, records and outputs must fit them
                assert T.Cast("int64", batch) * T.int64(SG * n_heads * dk * dv) < T.int64(2 ** 31) and \
                    T.Cast("int64", batch) * T.Cast("int64", n) * T.int64(n_heads * max(dk * dv if keep_states else dk,
                                                                                     G * W if keep_states else dv,
                                                                                     dk, dv)) < T.int64(2 ** 31), \
                    "gated_delta_rule: a batch too large for the GPU form's int32 indices"
            s0 = T.decl_buffer((batch * SG * n_heads * dk * dv,), "float32", data=s0_nd.data)
            st = T.decl_buffer(((batch * n if keep_states else batch * SG) * n_heads * dk * dv,), "float32",
                               data=st_nd.data)
            if keep_states:
                rec = T.decl_buffer((batch * n * G * n_heads * W,), "float32", data=rec_nd.data)
            else:
                rec = st   # not written: prefill / decode keep no record
            if gpu:
                for bhc in T.thread_binding(batch * n_heads * col_blocks, thread="blockIdx.x"):
                    for p in T.thread_binding(parts, thread="threadIdx.y"):
                        for jl in T.thread_binding(cols, thread="threadIdx.x"):
                            if bound > 0:   # __launch_bounds__(threads, bound): registers for that many blocks an SM
                                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", bound):
                                    blocked(q, k, v, g, beta, s0, slots, parents, o, rec, st, n,
                                            bhc // (n_heads * col_blocks), bhc // col_blocks % n_heads, p, jl,
                                            bhc % col_blocks)
                            else:
                                blocked(q, k, v, g, beta, s0, slots, parents, o, rec, st, n,
                                        bhc // (n_heads * col_blocks), bhc // col_blocks % n_heads, p, jl,
                                        bhc % col_blocks)
            else:
                for bh in T.parallel(batch * n_heads):
                    for j in range(dv):
                        column(q, k, v, g, beta, s0, slots, parents, o, rec, st, n, bh // n_heads, bh % n_heads, j)

    if not keep_states and inplace:
        @T.prim_func(private=True, s_tir=True)
        def kernel_final_inplace(q_h: T.handle, k_h: T.handle, v_h: T.handle, g_h: T.handle, b_h: T.handle,
                                 s0_h: T.handle, slots_h: T.handle, parents_h: T.handle, st_h: T.handle,
                                 o_h: T.handle):
            body(q_h, k_h, v_h, g_h, b_h, s0_h, slots_h, parents_h, o_h, None, st_h)
        return kernel_final_inplace

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
def gdn_commit(n_layers: int, n_heads: int, dk: int, dv: int, gpu: bool, split: tuple[int, int] | None = None):
    """commit's recurrent states: the state after each sequence's accepted token, rebuilt from
    the state before the verify pass along the token's root path with the records the verify
    kept (`gated_delta_rule` with ``keep_states``) -- the same update in the same order, so the
    state is the one verify computed for that token.

    Inputs: record (B, T, G, H, W), s0 (B, G, H, dk, dv) float32, path (B, D) int32 -- the
    accepted token's root path among the T tokens, root first (entries < 0 are skipped: shorter
    paths of a batch padded).  Output: (B, G, H, dk, dv).  CPU form: a thread per (sequence,
    layer, head, value column); GPU form: the recurrence's blocks and threads (d_k in ``parts``
    partial sums: the recurrence's own update, `_delta_rule`; ``split`` as the recurrence's)."""
    G, W = n_layers, record_width(dk, dv)
    parts, rows, cols, col_blocks = _gdn_blocking(dk, dv, split)
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
                    stack: tuple[int, int] | None = None, step: bool = False):
    """A Gated DeltaNet layer's causal depthwise conv for verification, with the conv state after
    every token.  Inputs: the state before the pass (B, C, K-1; with ``stack`` all layers'), the new
    inputs (B, T, C) -- the projection's own layout: channels contiguous, so a block's threads (one
    channel each) read and write consecutive addresses, and no transpose runs around the kernel -- the weight
    (C, 1, K), parents (B, T), slots (B, T).  Outputs: conv (B, T, C) float32 (before SiLU) and the K-1 inputs
    kept after every token (B, T, C, K-1).  A token with slot < 0 is padding (a batch pads every draft to
    the longest): its conv output is 0 and its kept inputs are not written, which spares most of a packed
    pass's writes (nothing reads a padding token's states; its output only feeds padding rows).

    ``stack`` = (G, g), as `gated_delta_rule`'s: the state before the pass is all G layers' (B, G,
    C, K-1), this layer's read at g in place, and the per-token states of all G layers go into one
    (B, T, G, C, K-1) tensor, this layer's at index g, so no step slices or concatenates them; layer
    0 allocates it, layer g > 0 takes it after ``parents`` and writes its slice in place (returned
    first: ``call_tir_inplace`` order).

    Token t's window is its K-1 predecessors then itself: the previous tokens (chain) or, with
    ``tree``, its ancestors along parents (gdn-path-recompute), continued into the state
    before the pass when the path is shorter.  Taps are summed in float32 in tap order.

    ``step``: a decode step's conv (one token a sequence; its state after the token is the layer's
    new state, written for every row), the same arithmetic as the Relax conv over the window; marked so
    that gdn-path-recompute leaves it a chain (``gdn.keep_states`` False); ``parents`` is not read.
    """
    if tree and step:
        raise ValueError("gdn_conv_verify: a decode step's conv (step) follows no tree")
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

    @T.macro
    def token(state, x, weight, parents, slots, out, states, b, c, t):
        if step or slots[b, t] >= 0:
            one(state, x, weight, parents, out, states, b, c, t)
        else:
            out[b, t, c] = T.float32(0)

    attrs = {"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu, "gdn.kernel": "conv",
             "gdn.tree": tree, "gdn.keep_states": not step, "gdn.shape": [channels, kernel_size], "gdn.dtype": dtype}
    if stack:
        attrs["gdn.stack"] = [G, gi]
    st_shape = lambda batch, n: (batch, n, G, channels, keep) if stack else (batch, n, channels, keep)  # noqa: E731
    before_shape = lambda batch: (batch, G, channels, keep) if stack else (batch, channels, keep)  # noqa: E731

    @T.macro
    def body(s_h, x_h, w_h, p_h, sl_h, out_h, st_h):
        T.func_attr(attrs)
        batch, n = T.int64(), T.int64()
        state_nd = T.match_buffer(s_h, before_shape(batch), dtype)
        x = T.match_buffer(x_h, (batch, n, channels), dtype)
        weight = T.match_buffer(w_h, (channels, 1, kernel_size), dtype)
        parents = T.match_buffer(p_h, (batch, n), "int32")
        slots = T.match_buffer(sl_h, (batch, n), "int32")
        out = T.match_buffer(out_h, (batch, n, channels), "float32")
        st_nd = T.match_buffer(st_h, st_shape(batch, n), dtype)
        with T.sblock("root"):
            states = T.decl_buffer((batch, n, G, channels, keep), dtype, data=st_nd.data)
            state = T.decl_buffer((batch, channels, keep), dtype, data=state_nd.data,     # this layer's, a view
                                  strides=(T.int64(G * channels * keep), T.int64(keep), T.int64(1)),
                                  elem_offset=T.int64(gi * channels * keep))
            if gpu:   # a block per (token, 256 channels): 27B-class layers (10240 channels) fill the SMs
                for bt in T.thread_binding(batch * n, thread="blockIdx.x"):
                    for r in T.thread_binding(rounds, thread="blockIdx.y"):
                        for tx in T.thread_binding(threads, thread="threadIdx.x"):
                            if r * threads + tx < channels:
                                token(state, x, weight, parents, slots, out, states, bt // n, r * threads + tx,
                                      bt % n)
            else:
                for b, c, t in T.grid(batch, channels, n):
                    token(state, x, weight, parents, slots, out, states, b, c, t)

    if gi > 0:
        @T.prim_func(private=True, s_tir=True)
        def kernel_inplace(s_h: T.handle, x_h: T.handle, w_h: T.handle, p_h: T.handle, sl_h: T.handle,
                           st_h: T.handle, out_h: T.handle):
            body(s_h, x_h, w_h, p_h, sl_h, out_h, st_h)
        return kernel_inplace

    @T.prim_func(private=True, s_tir=True)
    def kernel(s_h: T.handle, x_h: T.handle, w_h: T.handle, p_h: T.handle, sl_h: T.handle, out_h: T.handle,
               st_h: T.handle):
        body(s_h, x_h, w_h, p_h, sl_h, out_h, st_h)
    return kernel


@memo
def gdn_conv_prefill(channels: int, kernel_size: int, dtype: str, gpu: bool):
    """A prefill's causal depthwise conv over a chain of tokens.  Inputs: the state before the pass
    (B, C, K-1), the new inputs (B, T, C) in the projection's layout, the weight (C, 1, K), slots
    (B, T) (< 0: padding after a shorter request's tokens).  Outputs: conv (B, T, C) float32
    (before SiLU) and the K-1 inputs kept after each sequence's last real token (B, C, K-1; the
    state itself where a sequence has none).  Token t's taps are inputs t-K+1 .. t, continued into
    the state, summed in float32 in tap order: the Relax conv over [state; inputs]'s arithmetic,
    without that window's concatenation and transposes (dlight's schedule of that Relax conv is
    58-67 % of a 27B-class prefill on the H200, bench/README "Batched")."""
    keep = kernel_size - 1
    threads = min(256, channels)
    rounds = (channels + threads - 1) // threads

    @T.macro
    def read(state, x, val, b, c, i):
        """Input i of sequence b, channel c into val[0]: i < 0 reads the state's entry K-1+i."""
        if i >= 0:
            val[0] = x[b, i, c]
        else:
            val[0] = state[b, c, keep + i]

    @T.macro
    def one(state, x, weight, slots, out, new, n, b, c, t):
        val = T.alloc_buffer((1,), dtype, scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        last = T.alloc_buffer((1,), "int32", scope="local")
        acc[0] = T.float32(0)
        for k in range(kernel_size):
            read(state, x, val, b, c, t - keep + k)
            acc[0] = acc[0] + T.Cast("float32", val[0]) * T.Cast("float32", weight[c, 0, k])
        out[b, t, c] = acc[0]
        last[0] = 0           # t is the last real token, or t = 0 of a sequence of padding only
        if slots[b, t] >= 0:
            if t + 1 == n:
                last[0] = 1
            elif slots[b, t + 1] < 0:
                last[0] = 1
        elif t == 0:
            last[0] = 2
        if last[0] > 0:
            for j in range(keep):
                read(state, x, val, b, c, t - keep + j + T.Cast("int64", last[0] == 1))
                new[b, c, j] = val[0]

    @T.prim_func(private=True, s_tir=True)
    def kernel(s_h: T.handle, x_h: T.handle, w_h: T.handle, slots_h: T.handle, out_h: T.handle, new_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        batch, n = T.int64(), T.int64()
        state = T.match_buffer(s_h, (batch, channels, keep), dtype)
        x = T.match_buffer(x_h, (batch, n, channels), dtype)
        weight = T.match_buffer(w_h, (channels, 1, kernel_size), dtype)
        slots = T.match_buffer(slots_h, (batch, n), "int32")
        out = T.match_buffer(out_h, (batch, n, channels), "float32")
        new = T.match_buffer(new_h, (batch, channels, keep), dtype)
        with T.sblock("root"):
            if gpu:   # a block per (token, 256 channels), as verify's conv
                for bt in T.thread_binding(batch * n, thread="blockIdx.x"):
                    for r in T.thread_binding(rounds, thread="blockIdx.y"):
                        for tx in T.thread_binding(threads, thread="threadIdx.x"):
                            if r * threads + tx < channels:
                                one(state, x, weight, slots, out, new, n, bt // n, r * threads + tx, bt % n)
            else:   # channels innermost: x and out are (B, T, C)
                for b, t, c in T.grid(batch, n, channels):
                    one(state, x, weight, slots, out, new, n, b, c, t)
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
