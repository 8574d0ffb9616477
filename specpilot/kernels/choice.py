"""The greedy choice inside the compiled module: each row's argmax, ties to the lowest index (the
rule every loop uses, `runtime.decoding.top2`).  A runtime that keeps logits on the device reads
back one int32 a row instead of the row (the C++ runtime; a 248k-token vocabulary is 1 MB a row).

GPU: two kernels, so a row is read by many SMs at once: `argmax_parts` -- a block per (row, part
of the row); each thread scans a strided slice of its part (ascending, so its best is the lowest
index of its maximum), then a tree reduction in shared memory keeps (value, index), the lower
index on equal values; `argmax_merge` -- a block per row reduces the parts' bests the same way.
TVM's ThreadSync pass puts the barriers between the halvings.  CPU: one loop a row.

`rank_rows`: a drafter's top k a row (equal logits in index order) and their log-probabilities,
so a drafting cycle reads back k pairs a position instead of its logits.
"""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo

THREADS = 256
PARTS = 64          # blocks a row (a power of two, <= THREADS)


def _halvings(n: int) -> int:
    return n.bit_length() - 1


@T.macro
def _block_best(vals, idxs, best, at, mine, mine_at, tx, threads: T.int32, steps: T.int32, none: T.int32):
    """(vals, idxs)[0] := the best of the block's ``threads`` entries (index ``none``: no value)."""
    for s in range(steps):
        # every thread takes part (ThreadSync's barriers cannot sit under a condition): the lower half
        # takes the upper half's (value, index) if it is larger, or equal at a lower index
        best[0] = vals[(tx + (threads >> (s + 1))) % threads]
        at[0] = idxs[(tx + (threads >> (s + 1))) % threads]
        mine[0] = vals[tx]
        mine_at[0] = idxs[tx]
        vals[tx] = T.if_then_else(T.And(tx < (threads >> (s + 1)), T.Or(mine_at[0] == none, T.And(at[0] < none, T.Or(
            best[0] > mine[0], T.And(best[0] == mine[0], at[0] < mine_at[0]))))), best[0], mine[0])
        idxs[tx] = T.if_then_else(T.And(tx < (threads >> (s + 1)), T.Or(mine_at[0] == none, T.And(at[0] < none, T.Or(
            best[0] > mine[0], T.And(best[0] == mine[0], at[0] < mine_at[0]))))), at[0], mine_at[0])


@memo
def argmax_parts(vocab: int):
    """logits (rows, vocab) -> (rows, PARTS, 2) float32: each part's best value and its index (vocab:
    an empty part), the index as a float (exact below 2**24)."""
    chunk = (vocab + PARTS - 1) // PARTS
    per_thread = (chunk + THREADS - 1) // THREADS

    @T.prim_func(private=True, s_tir=True)
    def kernel(l_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        rows = T.int64()
        logits = T.match_buffer(l_h, (rows, vocab), "float32")
        out = T.match_buffer(out_h, (rows, PARTS, 2), "float32")
        with T.sblock("root"):
            for bx in T.thread_binding(rows * PARTS, thread="blockIdx.x"):
                vals = T.alloc_buffer((THREADS,), "float32", scope="shared")
                idxs = T.alloc_buffer((THREADS,), "int32", scope="shared")
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    best = T.alloc_buffer((1,), "float32", scope="local")
                    at = T.alloc_buffer((1,), "int32", scope="local")
                    mine = T.alloc_buffer((1,), "float32", scope="local")
                    mine_at = T.alloc_buffer((1,), "int32", scope="local")
                    best[0] = T.float32("-inf")
                    at[0] = T.int32(vocab)
                    for i in range(per_thread):
                        if T.And(i * THREADS + tx < chunk, bx % PARTS * chunk + i * THREADS + tx < vocab):
                            if T.Or(logits[bx // PARTS, bx % PARTS * chunk + i * THREADS + tx] > best[0], at[0] == vocab):
                                best[0] = logits[bx // PARTS, bx % PARTS * chunk + i * THREADS + tx]
                                at[0] = T.Cast("int32", bx % PARTS * chunk + i * THREADS + tx)
                    vals[tx] = best[0]
                    idxs[tx] = at[0]
                    _block_best(vals, idxs, best, at, mine, mine_at, tx, THREADS, _halvings(THREADS), vocab)
                    if tx == 0:
                        out[bx // PARTS, bx % PARTS, 0] = vals[0]
                        out[bx // PARTS, bx % PARTS, 1] = T.Cast("float32", idxs[0])
    return kernel


@memo
def argmax_merge(vocab: int):
    """(rows, PARTS, 2) parts' bests -> (rows,) int32."""

    @T.prim_func(private=True, s_tir=True)
    def kernel(p_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        rows = T.int64()
        parts = T.match_buffer(p_h, (rows, PARTS, 2), "float32")
        out = T.match_buffer(out_h, (rows,), "int32")
        with T.sblock("root"):
            for bx in T.thread_binding(rows, thread="blockIdx.x"):
                vals = T.alloc_buffer((PARTS,), "float32", scope="shared")
                idxs = T.alloc_buffer((PARTS,), "int32", scope="shared")
                for tx in T.thread_binding(PARTS, thread="threadIdx.x"):
                    best = T.alloc_buffer((1,), "float32", scope="local")
                    at = T.alloc_buffer((1,), "int32", scope="local")
                    mine = T.alloc_buffer((1,), "float32", scope="local")
                    mine_at = T.alloc_buffer((1,), "int32", scope="local")
                    vals[tx] = parts[bx, tx, 0]
                    idxs[tx] = T.Cast("int32", parts[bx, tx, 1])
                    _block_best(vals, idxs, best, at, mine, mine_at, tx, PARTS, _halvings(PARTS), vocab)
                    if tx == 0:
                        out[bx] = idxs[0]
    return kernel


@memo
def argmax_rows(vocab: int):
    """CPU: logits (rows, vocab) -> (rows,) int32, a loop a row."""

    @T.prim_func(private=True, s_tir=True)
    def kernel(l_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        rows = T.int64()
        logits = T.match_buffer(l_h, (rows, vocab), "float32")
        out = T.match_buffer(out_h, (rows,), "int32")
        with T.sblock("root"):
            for r in T.parallel(rows):
                at = T.alloc_buffer((1,), "int32", scope="local")
                at[0] = 0
                for v in range(1, vocab):
                    if logits[r, v] > logits[r, at[0]]:
                        at[0] = T.Cast("int32", v)
                out[r] = at[0]
    return kernel


@memo
def rank_rows(vocab: int, k: int, gpu: bool):
    """A drafter's ranked proposals inside the compiled module: logits (rows, vocab) -> (rows, k, 2)
    float32, each row's k best as (log-probability, index as a float), best first, equal logits in
    index order -- `drafters.ranked`'s rule over the logits (`BlockDrafter.block_ranked` ranks its
    fallback the same way).  The log-probability is the logit less the row's log-sum-exp (max + log
    sum exp(x - max), float32).  NaN logits are not ranked on the GPU; rows are expected finite or -inf.

    GPU: a block a row: the row's maximum and its index (`_block_best`), the sum of exponentials
    (a tree sum in shared memory), then k - 1 more rounds, each the best of what ranks after the
    previous pick.  CPU: a loop a row, the k best kept sorted as it scans (a later equal value goes
    after the earlier)."""
    threads, none = 512, vocab
    per_thread = (vocab + threads - 1) // threads

    @T.macro
    def pick(logits, vals, idxs, best, at, mine, mine_at, prev, prev_at, bx, tx):
        """prev := the best of the row ranking after prev (the block's shared halvings)."""
        best[0] = T.float32("-inf")
        at[0] = T.int32(none)
        for i in range(per_thread):
            if i * threads + tx < vocab:
                if T.Or(logits[bx, i * threads + tx] < prev[0], T.And(
                        logits[bx, i * threads + tx] == prev[0], i * threads + tx > prev_at[0])):
                    if T.Or(logits[bx, i * threads + tx] > best[0], at[0] == none):
                        best[0] = logits[bx, i * threads + tx]
                        at[0] = T.Cast("int32", i * threads + tx)
        vals[tx] = best[0]
        idxs[tx] = at[0]
        _block_best(vals, idxs, best, at, mine, mine_at, tx, threads, _halvings(threads), none)
        prev[0] = vals[0]
        prev_at[0] = idxs[0]

    @T.prim_func(private=True, s_tir=True)
    def gpu_kernel(l_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        rows = T.int64()
        logits = T.match_buffer(l_h, (rows, vocab), "float32")
        out = T.match_buffer(out_h, (rows, k, 2), "float32")
        with T.sblock("root"):
            for bx in T.thread_binding(rows, thread="blockIdx.x"):
                vals = T.alloc_buffer((threads,), "float32", scope="shared")
                idxs = T.alloc_buffer((threads,), "int32", scope="shared")
                sums = T.alloc_buffer((threads,), "float32", scope="shared")
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    best = T.alloc_buffer((1,), "float32", scope="local")
                    at = T.alloc_buffer((1,), "int32", scope="local")
                    mine = T.alloc_buffer((1,), "float32", scope="local")
                    mine_at = T.alloc_buffer((1,), "int32", scope="local")
                    prev = T.alloc_buffer((1,), "float32", scope="local")
                    prev_at = T.alloc_buffer((1,), "int32", scope="local")
                    lse = T.alloc_buffer((1,), "float32", scope="local")
                    prev[0] = T.float32("inf")
                    prev_at[0] = T.int32(-1)
                    pick(logits, vals, idxs, best, at, mine, mine_at, prev, prev_at, bx, tx)     # the maximum
                    mine[0] = T.float32(0)
                    for i in range(per_thread):
                        if i * threads + tx < vocab:
                            mine[0] = mine[0] + T.exp(logits[bx, i * threads + tx] - prev[0])
                    sums[tx] = mine[0]
                    for s in range(_halvings(threads)):
                        mine[0] = sums[(tx + (threads >> (s + 1))) % threads]
                        best[0] = sums[tx]
                        sums[tx] = T.if_then_else(tx < (threads >> (s + 1)), best[0] + mine[0], best[0])
                    lse[0] = prev[0] + T.log(sums[0])
                    if tx == 0:
                        out[bx, 0, 0] = prev[0] - lse[0]
                        out[bx, 0, 1] = T.Cast("float32", prev_at[0])
                    for r in range(1, k):
                        pick(logits, vals, idxs, best, at, mine, mine_at, prev, prev_at, bx, tx)
                        if tx == 0:
                            out[bx, r, 0] = prev[0] - lse[0]
                            out[bx, r, 1] = T.Cast("float32", prev_at[0])

    @T.prim_func(private=True, s_tir=True)
    def cpu_kernel(l_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8})
        rows = T.int64()
        logits = T.match_buffer(l_h, (rows, vocab), "float32")
        out = T.match_buffer(out_h, (rows, k, 2), "float32")
        with T.sblock("root"):
            for b in T.parallel(rows):
                vals = T.alloc_buffer((k,), "float32")
                idxs = T.alloc_buffer((k,), "int32")
                acc = T.alloc_buffer((2,), "float32")
                place = T.alloc_buffer((1,), "int32")
                for j in range(k):
                    vals[j] = T.float32("-inf")
                    idxs[j] = T.int32(none)
                for v in range(vocab):      # into the sorted k best: after every value >= it
                    if T.Or(logits[b, v] > vals[k - 1], idxs[k - 1] == none):
                        place[0] = k - 1
                        for j in range(k - 1):
                            if T.Or(logits[b, v] > vals[k - 2 - j], idxs[k - 2 - j] == none):
                                place[0] = k - 2 - j
                        for j in range(k - 1):
                            if k - 1 - j > place[0]:
                                vals[k - 1 - j] = vals[k - 2 - j]
                                idxs[k - 1 - j] = idxs[k - 2 - j]
                        vals[place[0]] = logits[b, v]
                        idxs[place[0]] = T.Cast("int32", v)
                acc[0] = vals[0]
                acc[1] = T.float32(0)
                for v in range(vocab):
                    acc[1] = acc[1] + T.exp(logits[b, v] - acc[0])
                for j in range(k):
                    out[b, j, 0] = vals[j] - (acc[0] + T.log(acc[1]))
                    out[b, j, 1] = T.Cast("float32", idxs[j])
    return gpu_kernel if gpu else cpu_kernel
