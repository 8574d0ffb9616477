"""CUDA kernels for skinny GEMMs y[M, N] = x[M, K] . W[N, K]^T at decode batch sizes: one
reading W in the W12 layout (decoded in registers), one reading plain bf16 W, same schedule.

Schedule: a warp per output row, 8 (or 4) rows per block.  Each lane takes LANE weights
per step as four 32-bit hi words, each the word after the previous lane's (so every load
instruction of the warp is one contiguous 128-byte line), plus the lo word holding their
nibbles (shared by lane pairs); a warp reads 512 hi bytes and 256 lo bytes per step -- decodes them with a few
integer ops and accumulates M rows of x in float32 registers.  Escapes are applied after
the main loop as exact corrections (their plane entries decode to a known placeholder).
Lanes reduce through shared memory.  M is a compile-time constant (one kernel per M).

Layout the W12 kernel reads (see `w12_cuda_layout`): hi as uint32 (N, K/4), lo as uint32
(N, K/8) with weight j of a word in nibble j, base as int32 (N,), escapes as CSR
(`specpilot.compiler.w12.cuda_word_layout`).
"""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.compiler.kernels import memo
from specpilot.compiler.w12 import STEP  # 32 lanes x LANE weights

def _rows(m_rows: int) -> int:
    """Warps (rows) per block: 8, or 4 when the lane-reduction buffer would pass 48 KB of shared memory."""
    return 8 if 8 * 32 * m_rows * 4 <= 48 * 1024 else 4
LANE = 16       # consecutive weights per lane per step: 4 words of hi, 2 of lo in flight


def _reduce_lanes(m_rows: int):
    """Sum the 32 lanes' accumulators through shared memory; lane 0 writes row ``row`` of y."""

    @T.macro
    def reduce_lanes(acc, red, y, row, ty, tx):
        for m in range(m_rows):
            red[ty, tx, m] = acc[m]
        T.tvm_storage_sync("shared")
        if tx == 0:
            for m in range(m_rows):
                acc[m] = T.float32(0)
                for lane in range(32):
                    acc[m] = acc[m] + red[ty, lane, m]
                y[m, row] = acc[m]

    return reduce_lanes


@memo
def w12_gemv(m_rows: int, n_out: int, k_in: int):
    steps, ROWS = k_in // STEP, _rows(m_rows)
    reduce_lanes = _reduce_lanes(m_rows)

    @T.prim_func
    def kernel(x_h: T.handle, hi_h: T.handle, lo_h: T.handle, base_h: T.handle, ptr_h: T.handle,
               col_h: T.handle, bits_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        e = T.int64()   # escape count: known only with the weights
        x = T.match_buffer(x_h, (m_rows, k_in), "bfloat16")
        hi = T.match_buffer(hi_h, (n_out, k_in // 4), "int32")
        lo = T.match_buffer(lo_h, (n_out, k_in // 8), "int32")
        base = T.match_buffer(base_h, (n_out,), "int32")
        ptr = T.match_buffer(ptr_h, (n_out + 1,), "int32")
        col = T.match_buffer(col_h, (e,), "int32")
        bits = T.match_buffer(bits_h, (e,), "int32")
        y = T.match_buffer(y_h, (m_rows, n_out), "float32")
        for bx in T.thread_binding(n_out // ROWS, thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    acc = T.alloc_buffer((m_rows,), "float32", scope="local")
                    red = T.alloc_buffer((ROWS, 32, m_rows), "float32", scope="shared")
                    for m in T.unroll(m_rows):
                        acc[m] = T.float32(0)
                    for s in range(steps):
                        for q in T.unroll(4):   # word h = s*128 + q*32 + tx: consecutive lanes, consecutive words
                            for b in T.unroll(4):
                                acc_w = T.reinterpret("float32", T.shift_left(T.Cast("uint32", T.bitwise_or(T.bitwise_or(
                                    T.shift_left(T.bitwise_and(T.shift_right(
                                        hi[bx * ROWS + ty, s * 128 + q * 32 + tx], b * 8 + 7), 1), 15),
                                    T.shift_left(base[bx * ROWS + ty] + T.bitwise_and(T.shift_right(
                                        hi[bx * ROWS + ty, s * 128 + q * 32 + tx], b * 8 + 3), 15), 7)),
                                    T.bitwise_or(T.shift_left(T.bitwise_and(T.shift_right(
                                        hi[bx * ROWS + ty, s * 128 + q * 32 + tx], b * 8), 7), 4),
                                        T.bitwise_and(T.shift_right(lo[bx * ROWS + ty, (s * 128 + q * 32 + tx) // 2],
                                                                    (((s * 128 + q * 32 + tx) % 2) * 4 + b) * 4), 15)))),
                                    T.uint32(16)))
                                for m in T.unroll(m_rows):
                                    acc[m] = acc[m] + T.Cast("float32", x[m, (s * 128 + q * 32 + tx) * 4 + b]) * acc_w
                    # escapes: their planes decode to 2**(base-127); swap that for the exact value
                    for p in range((ptr[bx * ROWS + ty + 1] - ptr[bx * ROWS + ty] + 31 - tx) // 32):
                        for m in range(m_rows):
                            acc[m] = acc[m] + T.Cast("float32", x[m, col[ptr[bx * ROWS + ty] + tx + p * 32]]) * (
                                T.reinterpret("float32", T.shift_left(T.Cast("uint32", bits[ptr[bx * ROWS + ty] + tx + p * 32]),
                                                                      T.uint32(16)))
                                - T.reinterpret("float32", T.shift_left(T.Cast("uint32", base[bx * ROWS + ty]),
                                                                        T.uint32(23))))
                    reduce_lanes(acc, red, y, bx * ROWS + ty, ty, tx)
    return kernel


@memo
def bf16_gemv(m_rows: int, n_out: int, k_in: int):
    """The same schedule over plain bf16 weights (32 bytes per lane per step)."""
    steps, ROWS = k_in // STEP, _rows(m_rows)
    reduce_lanes = _reduce_lanes(m_rows)

    @T.prim_func
    def kernel(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(x_h, (m_rows, k_in), "bfloat16")
        w = T.match_buffer(w_h, (n_out, k_in), "bfloat16")
        y = T.match_buffer(y_h, (m_rows, n_out), "float32")
        for bx in T.thread_binding(n_out // ROWS, thread="blockIdx.x"):
            for ty in T.thread_binding(ROWS, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    acc = T.alloc_buffer((m_rows,), "float32", scope="local")
                    red = T.alloc_buffer((ROWS, 32, m_rows), "float32", scope="shared")
                    for m in T.unroll(m_rows):
                        acc[m] = T.float32(0)
                    for s in range(steps):
                        for q in T.unroll(4):   # 4 weights (8 bytes) per lane per q, consecutive lanes adjacent
                            for b in T.unroll(4):
                                for m in T.unroll(m_rows):
                                    acc[m] = acc[m] + T.Cast("float32", x[m, (s * 128 + q * 32 + tx) * 4 + b]) * \
                                        T.Cast("float32", w[bx * ROWS + ty, (s * 128 + q * 32 + tx) * 4 + b])
                    reduce_lanes(acc, red, y, bx * ROWS + ty, ty, tx)
    return kernel
