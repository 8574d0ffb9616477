"""The W12 GEMM on tensor cores: y[M, N] = x[M, K] . W[N, K]^T with W read in its W12 planes
(12 bits a weight) and decoded to exact bf16 in registers, straight into ``mma.sync`` A
fragments -- `schedules.skinny_kernels`' kernel with the weight loads swapped for plane loads and
an integer decode.

Per 64-wide k block, the four lanes of a row group own 16 consecutive weights each: one 16-byte
load of the hi plane, one 8-byte load of the lo plane, two 16-byte loads of x per row of x; the
planes are tiled (`compiler.w12.gpu_layout`) so each plane load of a warp is one contiguous
512- or 256-byte run.
The lane's 16 weights are its k slots of two 32-wide steps (the K permutation of skinny_mma:
A and B only have to agree on which physical k a slot stands for).

In the GPU planes the bytes of every 4-weight group are stored in the order (0, 2, 1, 3) and the
nibbles of every 8-weight group in the order (0, 2, 4, 6, 1, 3, 5, 7), so a pair of neighbouring weights decodes into one 32-bit A register (two bf16) with
word-wide integer operations, two weights at a time::

    w    = hi_word & 0x00FF00FF            (or hi_word >> 8: the other pair of the word)
    bits = (w << 8) & 0x80008000           sign
         | ((w & 0x007F007F) << 4)         exponent offset, mantissa bits 6..4
           + base << 7 | base << 23        the row's base exponent (no carry: base + offset < 255)
           + (lo_word >> 4p) & 0x000F000F  mantissa bits 3..0

Escapes (±0, subnormals, out-of-window exponents, inf, NaN) have zero planes, which decode to
2**(base-127); the epilogue adds x * exact - x * that for each, per output, after the split-K sum.
``hi_only`` (the nested 8-bit view) reads no lo plane: the low mantissa bits at their midpoint.
"""

from __future__ import annotations

from functools import lru_cache

from specpilot.schedules.skinny_config import Config, choose

BLOCK = 64   # weights of one row per k block: 4 lanes x 16

def candidates(n_out: int, k_in: int):
    """(largest M, configurations in order of preference) per range of M for this shape; ``unroll``
    counts 64-wide k blocks in flight.  From the H200 runs of bench/w12_gemm.py (tiled planes;
    bench/README "W12 GEMM"): up to 8 rows one 8-row tile per warp, split-K over the fewest warps
    (4, 8 or 16 a block) that still give >= 3072 warps (N/16 tiles x warps); up to 16 rows two
    tiles over 8 warps; beyond, 32 rows a block (x re-read per tile -- W12 loses to cuBLAS there)."""
    tiles = n_out // 16
    wk = next((w for w in (4, 8) if tiles * w >= 3072), 16)
    wk32 = 2 if (n_out // 16) * 2 >= 1792 else 4
    # up to 1024 channels (64 tiles) beyond 16 rows: 16 rows a block over 8 warps beat 32-row blocks
    # 1.4-2x (4096 -> 1024 at 32-65 rows, bench/README "W12 GEMM")
    narrow = (Config(2, 1, 1, 8, 2),) if tiles <= 64 else ()
    return (
        (8, (Config(1, 1, 1, wk, 4 if wk == 4 else 2), Config(1, 1, 1, 8, 2), Config(1, 1, 1, 4, 2),
             Config(1, 1, 1, 2, 2), Config(1, 1, 1, 1, 2))),
        (16, (Config(2, 1, 1, 8, 2), Config(2, 1, 1, 4, 2), Config(2, 1, 1, 2, 2), Config(2, 1, 1, 1, 2))),
        (32, (*narrow, Config(4, 1, 2, 2, 2) if wk32 == 2 else Config(2, 1, 1, 4, 4), Config(2, 1, 1, 4, 2),
              Config(2, 1, 1, 2, 2), Config(2, 1, 1, 1, 2))),
        (None, (*narrow, Config(4, 1, 1, 4, 2), Config(4, 1, 1, 2, 2), Config(4, 1, 1, 1, 2))),
    )


def pick(n_out: int, k_in: int):
    """One configuration per M range for this shape, or None when no configuration tiles it."""
    return choose(candidates(n_out, k_in), lambda c: c.fits(n_out, k_in, BLOCK))


def applicable(n_out: int, k_in: int) -> bool:
    return pick(n_out, k_in) is not None


def _kernel(n_out: int, k_in: int, cfg: Config, hi_only: bool):
    """A macro launching one configuration over all M rows of x (``m`` symbolic)."""
    from tvm.script import tirx as T

    MT, AT, WN, WK = cfg.m_tiles, cfg.a_tiles, cfg.wn, cfg.wk
    BN, BM = cfg.block_n(), cfg.block_m()
    blocks = k_in // (BLOCK * WK)        # 64-wide k blocks per warp
    U = next(u for u in (cfg.unroll, 2, 1) if blocks % u == 0)
    k_share = k_in // WK
    slots = cfg.slots()
    threads = cfg.threads()

    @T.macro
    def launch(x, hi, lo, base, ptr, col, bits, y, m):
        for bx in T.thread_binding(n_out // BN, thread="blockIdx.x"):
            for by in T.thread_binding((m + BM - 1) // BM, thread="blockIdx.y"):
                for kw in T.thread_binding(WK, thread="threadIdx.z"):
                    for nw in T.thread_binding(WN, thread="threadIdx.y"):
                        for lane in T.thread_binding(32, thread="threadIdx.x"):
                            hw = T.alloc_buffer((U, AT, 2, 4), "int32", scope="local")
                            lw = T.alloc_buffer((U, AT, 2, 2), "int32", scope="local")
                            bs = T.alloc_buffer((AT, 2), "uint32", scope="local")
                            af = T.alloc_buffer((2, AT, 4), "uint32", scope="local")
                            xb = T.alloc_buffer((U, MT, 16), "bfloat16", scope="local")
                            bf = T.alloc_buffer((U, MT, 16), "bfloat16", scope="local")
                            acc = T.alloc_buffer((AT, MT, 4), "float32", scope="local")
                            red = T.alloc_buffer((WK, slots), "float32", scope="shared")
                            for a, t, c in T.grid(AT, MT, 4):
                                acc[a, t, c] = T.float32(0)
                            for a, h in T.grid(AT, 2):
                                bs[a, h] = T.bitwise_or(
                                    T.shift_left(T.Cast("uint32", base[bx * BN + nw * (16 * AT) + a * 16 + h * 8 + lane // 4]), T.uint32(7)),
                                    T.shift_left(T.Cast("uint32", base[bx * BN + nw * (16 * AT) + a * 16 + h * 8 + lane // 4]), T.uint32(23)))
                            for so in T.serial(blocks // U):
                                for u, a, h in T.grid(U, AT, 2):
                                    for v in T.vectorized(4):
                                        hw[u, a, h, v] = hi[(bx * BN + nw * (16 * AT)) // 16 + a,
                                                            ((kw * k_share) // BLOCK + so * U + u) * 256 + h * 128 + lane * 4 + v]
                                    if not hi_only:
                                        for v in T.vectorized(2):
                                            lw[u, a, h, v] = lo[(bx * BN + nw * (16 * AT)) // 16 + a,
                                                                ((kw * k_share) // BLOCK + so * U + u) * 128 + h * 64 + lane * 2 + v]
                                for u, t, half in T.grid(U, MT, 2):
                                    for v in T.vectorized(8):
                                        xb[u, t, half * 8 + v] = x[T.min(by * BM + t * 8 + lane // 4, m - 1),
                                                                   kw * k_share + (so * U + u) * BLOCK + (lane % 4) * 16 + half * 8 + v]
                                # element copies (registers after nvcc): the mma operand is addressed in
                                # bf16 elements, and TVM types a buffer only ever vector-loaded as uint4
                                for u, t, v in T.grid(U, MT, 16):
                                    bf[u, t, v] = xb[u, t, v]
                                for u in T.unroll(U):
                                    for s in T.unroll(2):      # the two 32-wide steps of the block
                                        # A registers {a0a1 | a2a3 | a4a5 | a6a7} = pairs {2q: row g, 2q: row g+8,
                                        # 2q+1: row g, 2q+1: row g+8}; pair p of step s: hi word 2s + p // 2
                                        for q, a, h2, h in T.grid(2, AT, 2, 2):
                                            af[q, a, h2 * 2 + h] = T.bitwise_or(
                                                T.bitwise_and(T.shift_left(T.bitwise_and(
                                                    T.shift_right(T.Cast("uint32", hw[u, a, h, s * 2 + q]), T.Cast("uint32", h2 * 8)),
                                                    T.uint32(0x00FF00FF)), T.uint32(8)), T.uint32(0x80008000)),
                                                T.shift_left(T.bitwise_and(
                                                    T.shift_right(T.Cast("uint32", hw[u, a, h, s * 2 + q]), T.Cast("uint32", h2 * 8)),
                                                    T.uint32(0x007F007F)), T.uint32(4))
                                                + bs[a, h]
                                                + (T.uint32(0x00080008) if hi_only else T.bitwise_and(
                                                    T.shift_right(T.Cast("uint32", lw[u, a, h, s]), T.Cast("uint32", (q * 2 + h2) * 4)),
                                                    T.uint32(0x000F000F))))
                                        for q, a, t in T.grid(2, AT, MT):
                                            T.evaluate(T.ptx_legacy.mma(
                                                "m16n8k16", "row", "col", "bf16", "bf16", "fp32",
                                                af.data, (q * AT + a) * 4, bf.data, (u * MT + t) * 16 + s * 8 + q * 4,
                                                acc.data, (a * MT + t) * 4, False, dtype="float32"))
                            for a, t, c in T.grid(AT, MT, 4):
                                red[kw, (((nw * AT + a) * MT + t) * 4 + c) * 32 + lane] = acc[a, t, c]
                            T.tvm_storage_sync("shared")
                            for r in T.serial((slots + threads - 1) // threads):
                                if r * threads + (kw * WN + nw) * 32 + lane < slots:
                                    total = T.alloc_buffer((1,), "float32", scope="local")
                                    total[0] = T.float32(0)
                                    for j in T.unroll(WK):
                                        total[0] = total[0] + red[j, r * threads + (kw * WN + nw) * 32 + lane]
                                    o = T.meta_var(r * threads + (kw * WN + nw) * 32 + lane)
                                    row = T.meta_var(by * BM + ((o // 128) % MT) * 8 + (o % 32) % 4 * 2 + (o // 32) % 2)
                                    chan = T.meta_var(bx * BN + (o // (128 * MT)) * 16 + ((o // 32) % 4) // 2 * 8 + (o % 32) // 4)
                                    if row < m:
                                        # escapes: their planes decoded to 2**(base-127); add x * (exact - that)
                                        # (two exact products: bf16 x bf16 fits float32's mantissa)
                                        for p in T.serial(ptr[chan + 1] - ptr[chan]):
                                            total[0] = total[0] + T.Cast("float32", x[row, col[ptr[chan] + p]]) * \
                                                T.reinterpret("float32", T.shift_left(
                                                    T.Cast("uint32", bits[ptr[chan] + p]), T.uint32(16))) \
                                                - T.Cast("float32", x[row, col[ptr[chan] + p]]) * \
                                                T.reinterpret("float32", T.shift_left(
                                                    T.Cast("uint32", base[chan]), T.uint32(23)))
                                        y[row, chan] = total[0]
    return launch


@lru_cache(maxsize=None)
def w12_mma(n_out: int, k_in: int, hi_only: bool = False, configs: tuple | None = None):
    """x[m, K] (bf16) . W[N, K]^T -> float32 y[m, N], W from its GPU planes (`compiler.w12.gpu_layout`) and
    escapes (CSR by row: ptr (N+1,), col, exact bits; any number of entries, at least one slot:
    the kernel does not depend on the weights' values, so seeded builds can use it).
    One configuration per range of m, chosen at run time; ``configs`` overrides `pick` (benchmarks)."""
    from specpilot.kernels.fast_frames import quick_stack
    with quick_stack():
        return _w12_mma(n_out, k_in, hi_only, configs)


def _w12_mma(n_out: int, k_in: int, hi_only: bool, configs: tuple | None):
    from tvm.script import tirx as T

    chosen = list(configs) if configs else pick(n_out, k_in)
    if chosen is None:
        raise ValueError(f"no W12 tensor-core configuration tiles N={n_out}, K={k_in}")
    for _, cfg in chosen:
        if not cfg.fits(n_out, k_in, BLOCK):
            raise ValueError(f"{cfg} does not tile N={n_out}, K={k_in}")
    launches = [(limit, _kernel(n_out, k_in, cfg, hi_only)) for limit, cfg in chosen]
    N, K = T.int64(n_out), T.int64(k_in)

    def dispatch(i: int):
        limit, launch = launches[i]
        if limit is None:
            return launch
        rest = dispatch(i + 1)

        @T.macro
        def pick_rows(x, hi, lo, base, ptr, col, bits, y, m):
            if m <= limit:
                launch(x, hi, lo, base, ptr, col, bits, y, m)
            else:
                rest(x, hi, lo, base, ptr, col, bits, y, m)
        return pick_rows

    run = dispatch(0)

    @T.prim_func(private=True)
    def mm(x_h: T.handle, hi: T.Buffer((N // 16, K * 4), "int32"), lo: T.Buffer((N // 16, K * 2), "int32"),
           base: T.Buffer((N,), "int32"), ptr: T.Buffer((N + 1,), "int32"), col_h: T.handle,
           bits_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8,
                     "w12.n": n_out, "w12.k": k_in, "w12.x_dtype": "bfloat16", "w12.gpu": True})
        m, e = T.int64(), T.int64()
        col = T.match_buffer(col_h, (e,), "int32")
        bits = T.match_buffer(bits_h, (e,), "int32")
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), "float32")
        run(x, hi, lo, base, ptr, col, bits, y, m)
    return mm
