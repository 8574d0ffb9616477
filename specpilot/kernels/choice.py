"""The greedy choice inside the compiled module: each row's argmax, ties to the lowest index (the
rule every loop uses, `runtime.decoding.top2`).  A runtime that keeps logits on the device reads
back one int32 a row instead of the row (the C++ runtime; a 248k-token vocabulary is 1 MB a row).

GPU: a block a row; each thread scans a strided part of the row (ascending, so its best is the
lowest index of its maximum), then a tree reduction in shared memory keeps (value, index) with the
lower index on equal values (TVM's ThreadSync pass puts the barriers between the halvings).
"""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo

THREADS = 256
STEPS = 8            # log2(THREADS): the reduction's halvings


@memo
def argmax_rows(vocab: int, gpu: bool):
    per_thread = (vocab + THREADS - 1) // THREADS

    @T.macro
    def gpu_row(logits, out, r, tx, vals, idxs):
        best = T.alloc_buffer((1,), "float32", scope="local")
        at = T.alloc_buffer((1,), "int32", scope="local")
        mine = T.alloc_buffer((1,), "float32", scope="local")
        mine_at = T.alloc_buffer((1,), "int32", scope="local")
        best[0] = T.float32("-inf")
        at[0] = T.int32(vocab)                    # no value yet: loses every comparison below
        for i in range(per_thread):
            if i * THREADS + tx < vocab:
                if T.Or(logits[r, i * THREADS + tx] > best[0], at[0] == vocab):
                    best[0] = logits[r, i * THREADS + tx]
                    at[0] = T.Cast("int32", i * THREADS + tx)
        vals[tx] = best[0]
        idxs[tx] = at[0]
        for s in range(STEPS):
            # every thread takes part (the barriers ThreadSync inserts cannot sit under a condition): the
            # lower half takes the upper half's (value, index) if larger, or equal at a lower index
            best[0] = vals[(tx + (THREADS >> (s + 1))) % THREADS]
            at[0] = idxs[(tx + (THREADS >> (s + 1))) % THREADS]
            mine[0] = vals[tx]
            mine_at[0] = idxs[tx]
            vals[tx] = T.if_then_else(T.And(tx < (THREADS >> (s + 1)), T.Or(mine_at[0] == vocab, T.And(at[0] < vocab, T.Or(
                best[0] > mine[0], T.And(best[0] == mine[0], at[0] < mine_at[0]))))), best[0], mine[0])
            idxs[tx] = T.if_then_else(T.And(tx < (THREADS >> (s + 1)), T.Or(mine_at[0] == vocab, T.And(at[0] < vocab, T.Or(
                best[0] > mine[0], T.And(best[0] == mine[0], at[0] < mine_at[0]))))), at[0], mine_at[0])
        if tx == 0:
            out[r] = idxs[0]

    @T.prim_func(private=True, s_tir=True)
    def kernel(l_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        rows = T.int64()
        logits = T.match_buffer(l_h, (rows, vocab), "float32")
        out = T.match_buffer(out_h, (rows,), "int32")
        with T.sblock("root"):
            if gpu:
                for bx in T.thread_binding(rows, thread="blockIdx.x"):
                    vals = T.alloc_buffer((THREADS,), "float32", scope="shared")
                    idxs = T.alloc_buffer((THREADS,), "int32", scope="shared")
                    for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                        gpu_row(logits, out, bx, tx, vals, idxs)
            else:
                for r in T.parallel(rows):
                    at = T.alloc_buffer((1,), "int32", scope="local")
                    at[0] = 0
                    for v in range(1, vocab):
                        if logits[r, v] > logits[r, at[0]]:
                            at[0] = T.Cast("int32", v)
                    out[r] = at[0]
    return kernel
