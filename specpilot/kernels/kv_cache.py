"""The KV-cache pool: writing new keys / values in place, and compacting an accepted tree path's
entries into consecutive slots."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo


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
