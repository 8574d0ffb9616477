"""The greedy choice inside the compiled module: each row's argmax, ties to the lowest index (the
rule every loop uses, `runtime.decoding.top2`).  A runtime that keeps logits on the device reads
back one int32 a row instead of the row (the C++ runtime; a 248k-token vocabulary is 1 MB a row).

GPU: two kernels, so a row is read by many SMs at once: `argmax_parts` -- a block per (row, part
of the row); each thread scans a strided slice of its part (ascending, so its best is the lowest
index of its maximum), then a tree reduction in shared memory keeps (value, index), the lower
index on equal values; `argmax_merge` -- a block per row reduces the parts' bests the same way.
TVM's ThreadSync pass puts the barriers between the halvings.  CPU: one loop a row.
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
