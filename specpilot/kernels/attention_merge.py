"""The merge of key splits (flash decoding) and the running max's floor, shared by the decode and
many-row attention kernels."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo

ATTN_FLOOR = -1e30  # the running max before any key: finite, so exp(floor - m) is 0, never NaN


def merge_splits(group: int, dtype: str):
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
    merge = merge_splits(group, dtype)

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
