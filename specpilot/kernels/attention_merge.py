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


def _cpu_merge(n_kv: int, d: int, group: int, dtype: str):
    """`merge_splits` on the CPU: a parallel task a (sequence, KV head, query row), each split's weight
    e^(m_s - M) computed once for the row and its partial sums added vectorised over the head dimension
    -- the same terms added in the same order as the per-element form."""
    @T.macro
    def cpu_merge(acc, ml, out, batch, tokens, S):
        for task in T.parallel(batch * n_kv * tokens * group):
            # expressions, not variables (an assigned name would be a one-element workspace buffer)
            b = T.meta_var(task // (n_kv * tokens * group))
            h = T.meta_var(task // (tokens * group) % n_kv)
            r = T.meta_var(task % (tokens * group))
            top = T.alloc_buffer((3,), "float32")       # M, the sum of the weighted l_s, a split's weight
            sums = T.alloc_buffer((d,), "float32")
            top[0] = T.float32(ATTN_FLOOR)
            for sp in range(S):
                top[0] = T.max(top[0], ml[b, h, sp, r, 0])
            top[1] = T.float32(0)
            for i in T.vectorized(d):
                sums[i] = T.float32(0)
            for sp in range(S):
                top[2] = T.exp(ml[b, h, sp, r, 0] - top[0])
                top[1] = top[1] + ml[b, h, sp, r, 1] * top[2]
                for i in T.vectorized(d):
                    sums[i] = sums[i] + acc[b, h, sp, r, i] * top[2]
            for i in T.vectorized(d):
                out[b, r // group, h * group + r % group, i] = T.Cast(dtype, sums[i] / top[1])
    return cpu_merge


@memo
def attention_combine(n_kv: int, head_dim: int, group: int, dtype: str, gpu: bool):
    """Second half of `attention_rows_partial` (`attention_decode` merges its own): merge the splits of
    each query row r = t * group + g of KV head h, out[b, t, h * group + g] =
    sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s, rounded once to ``dtype``."""
    threads = min(256, head_dim)
    rounds = (head_dim + threads - 1) // threads
    merge = merge_splits(group, dtype)
    cpu_merge = _cpu_merge(n_kv, head_dim, group, dtype)

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
                cpu_merge(acc, ml, out, batch, tokens, S)
    return kernel
