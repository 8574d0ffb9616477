"""Skinny bf16 GEMMs on tensor cores: y[M, N] = x[M, K] . W[N, K]^T for the few rows of
decode (M <= 8), chain and tree verification (M up to ~72), where dlight's schedules are
GEMVs (one weight read per row group, CUDA cores) or 128-row tensor-core tiles (most of the
tile wasted, weights re-read): 0.11-0.28x cuBLAS on the H200 (docs/bench-log.md).

The kernel swaps the operands: ``mma.sync.m16n8k16`` with W as the 16-row A operand and x as
the 8-column B operand, so the long side N fills the tensor core's M and a group of 8 rows of x
its N.  Two kernels feed it.  The register kernel (`_kernel`) streams weights from global
memory straight into registers, 16 bytes per lane per load, rows of x from L1/L2; with 9 row
tiles it holds ~200 registers, 8 warps per SM, and waits on DRAM every iteration (latency-bound:
~116 us for a 17408 x 5120 weight even at M = 1).  The pipelined kernel (`_pipelined_kernel`,
``Config.stages``) copies chunks of W and x into a ring in shared memory with ``cp.async``,
``stages - 1`` chunks ahead, so the weight stream stays in flight without registers.  On
Hopper (sm_90a) a third, `_wgmma_kernel` (``Config.wgmma``), reads the same kind of ring with
warpgroup MMAs straight from shared memory: the mma kernels are issue-bound at 65 rows.

The K permutation: the dot product over K does not care about the order of its terms, so
a lane's four k-slots of one mma ({2t, 2t+1, 2t+8, 2t+9}, t = lane % 4) may stand for any
four physical k's, as long as A and B agree.  Slot -> physical map: {2t, 2t+1, 2t+8, 2t+9} ->
{8t, 8t+1, 8t+2, 8t+3} for the first mma of a 32-wide k step and {8t+4 .. 8t+7} for the
second, so each lane's A and B operands for a whole 32-wide step are 8 consecutive bf16 --
one 16-byte load per row.  Products are float32 and accumulate in float32, as the
legalized matmul does (the order of the float32 sums differs, as any schedule's does).

Layout per block: ``wn`` x ``wk`` warps; a warp owns ``a_tiles`` x 16 output channels and
``m_tiles`` x 8 rows of x, over its 1/``wk`` share of K; the ``wk`` partial sums meet in
shared memory.  Grid: (N / (16 a_tiles wn), ceil(M / (8 m_tiles))).  `skinny_nt_matmul`
picks a configuration by M at run time (`configs`).  Static row counts (the one-sequence decode
step) go to `decode_gemv`, its GEMV with the norm before it as prologue.

SwiGLU over a fused gate / up projection (`fuse_pairs`, after FuseTIR): where every configuration
of the shape is an unsplit warpgroup kernel, the paired form loads a block's weight rows as 32 of
the gate half and the same 32 of the up half, and each thread stores silu(gate) * up once from its
two accumulators -- the float32 [m, 2 H] output and the activation's kernel gone; every output bit
the unfused build's (H200, the 27B-style hybrid's prefill, AR steps, tree-verify logits, conv states
and records: bench/README "Build comparison").
"""

from __future__ import annotations

from functools import lru_cache

from specpilot.core.target import TUNED, Device
from specpilot.schedules.skinny_config import SWIZZLE_ALIGN, WGMMA_K, Config, pick, tail_blocks


def x_bytes(row, m):
    """cp.async's source size for a 16-byte piece of x row ``row``: 16 below ``m``, else 0 -- a
    row block's rows past the last one are zero-filled without a read, not copies of row m - 1 that
    every such thread of every block would fetch from the same bytes of the L2."""
    from tvm.script import tirx as T
    return T.if_then_else(row < m, T.uint32(16), T.uint32(0))


def _split_k_store(cfg: Config):
    """A macro: the ``wk`` warps' partial sums meet in ``red`` (shared memory), are added in a
    fixed order and stored to y (rows below m); C fragment order: channel g (+8), row 2t (+1)."""
    from tvm.script import tirx as T

    MT, AT, WN, WK = cfg.m_tiles, cfg.a_tiles, cfg.wn, cfg.wk
    BN, BM = cfg.block_n(), cfg.block_m()
    slots = cfg.slots()
    threads = cfg.threads()

    @T.macro
    def store(red, acc, y, m, bx, by, kw, nw, lane, row0):
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
                if row < m:
                    y[row0 + row, bx * BN + (o // (128 * MT)) * 16 + ((o // 32) % 4) // 2 * 8 + (o % 32) // 4] = total[0]
    return store


def _kernel(n_out: int, k_in: int, cfg: Config):
    """A macro launching one configuration over all M rows of x (``m`` symbolic)."""
    from tvm.script import tirx as T

    MT, AT, WN, WK = cfg.m_tiles, cfg.a_tiles, cfg.wn, cfg.wk
    BN, BM = cfg.block_n(), cfg.block_m()
    steps = k_in // (32 * WK)           # 32-wide k steps per warp
    U = cfg.unroll_for(k_in)
    k_share = k_in // WK
    slots = cfg.slots()
    store = _split_k_store(cfg)

    @T.macro
    def launch(x, w, y, m):
        for bx in T.thread_binding(n_out // BN, thread="blockIdx.x"):
            for by in T.thread_binding((m + BM - 1) // BM, thread="blockIdx.y"):
                for kw in T.thread_binding(WK, thread="threadIdx.z"):
                    for nw in T.thread_binding(WN, thread="threadIdx.y"):
                        for lane in T.thread_binding(32, thread="threadIdx.x"):
                            wa = T.alloc_buffer((U, AT, 2, 8), "bfloat16", scope="local")
                            af = T.alloc_buffer((2, AT, 8), "bfloat16", scope="local")
                            xb = T.alloc_buffer((U, MT, 8), "bfloat16", scope="local")
                            bf = T.alloc_buffer((U, MT, 8), "bfloat16", scope="local")
                            acc = T.alloc_buffer((AT, MT, 4), "float32", scope="local")
                            red = T.alloc_buffer((WK, slots), "float32", scope="shared")
                            for a, t, c in T.grid(AT, MT, 4):
                                acc[a, t, c] = T.float32(0)
                            for so in T.serial(steps // U):
                                # U steps' loads issued before any of their multiplies
                                for u, a, h in T.grid(U, AT, 2):
                                    for v in T.vectorized(8):
                                        wa[u, a, h, v] = w[bx * BN + nw * (16 * AT) + a * 16 + h * 8 + lane // 4,
                                                           kw * k_share + (so * U + u) * 32 + (lane % 4) * 8 + v]
                                for u, t in T.grid(U, MT):
                                    for v in T.vectorized(8):
                                        xb[u, t, v] = x[T.min(by * BM + t * 8 + lane // 4, m - 1),
                                                        kw * k_share + (so * U + u) * 32 + (lane % 4) * 8 + v]
                                # element copies (registers after nvcc): the mma operand is addressed in
                                # bf16 elements, and TVM types a buffer only ever vector-loaded as uint4
                                for u, t, v in T.grid(U, MT, 8):
                                    bf[u, t, v] = xb[u, t, v]
                                for u in T.unroll(U):
                                    # A fragments: {a0 a1 | a2 a3 | a4 a5 | a6 a7} = rows {g, g+8, g, g+8}
                                    for q, a in T.grid(2, AT):
                                        for h2, h, e in T.grid(2, 2, 2):
                                            af[q, a, h2 * 4 + h * 2 + e] = wa[u, a, h, q * 4 + h2 * 2 + e]
                                    for q, a, t in T.grid(2, AT, MT):
                                        T.evaluate(T.ptx_legacy.mma(
                                            "m16n8k16", "row", "col", "bf16", "bf16", "fp32",
                                            af.data, (q * AT + a) * 8, bf.data, (u * MT + t) * 8 + q * 4,
                                            acc.data, (a * MT + t) * 4, False, dtype="float32"))
                            store(red, acc, y, m, bx, by, kw, nw, lane, 0)
    return launch


def _pipelined_kernel(n_out: int, k_in: int, cfg: Config):
    """The same tiles and mma operands, fed through shared memory: every thread of the block
    copies chunks of W (``block_n`` rows) and of x (``block_m`` rows) with ``cp.async`` into a ring
    of ``stages`` buffers, ``stages - 1`` chunks ahead of the multiplies, so the weight stream
    stays in flight without holding registers and each row of x is read once per block.  A chunk
    is ``wk`` x ``unroll`` k steps of 32; odd rows' 16-byte pieces are swizzled (XOR 4) so a
    quarter-warp's operand reads of two rows hit distinct banks.  The ``wk`` partial sums meet in
    shared memory as in `_kernel` (`_split_k_store`)."""
    from tvm.script import tirx as T

    MT, AT, WN, WK, S, SPL = cfg.m_tiles, cfg.a_tiles, cfg.wn, cfg.wk, cfg.stages, cfg.splits
    BN, BM = cfg.block_n(), cfg.block_m()
    U = cfg.unroll_for(k_in)
    KC = cfg.chunk(k_in)                # k per chunk
    chunks = k_in // SPL // KC          # chunks per block
    VR = KC // 8                        # 16-byte pieces per row of a chunk
    SW = 4 if VR >= 8 else 0            # piece XOR (row & 1) * SW: rows g, g+1 of a read 64 bytes apart in banks
    threads = cfg.threads()
    w_rounds, x_rounds = -(-BN * VR // threads), -(-BM * VR // threads)
    slots = cfg.slots()
    copy = "cp.async.cg.shared.global"
    store = _split_k_store(cfg)

    def piece(kw, u, lane):
        """The swizzled 16-byte piece holding a lane's 8 k's of step u (its row's parity is lane // 4's)."""
        return T.bitwise_xor((kw * U + u) * 4 + lane % 4, (lane // 4) % 2 * SW)

    @T.macro
    def issue(ring, w, x, m, bx, by, tid, stage, chunk):
        for r in T.serial(w_rounds):
            if r * threads + tid < BN * VR:
                i = T.meta_var(r * threads + tid)
                T.evaluate(T.ptx[copy](T.address_of(ring[stage, i // VR, T.bitwise_xor(i % VR, (i // VR) % 2 * SW) * 8]),
                                       T.address_of(w[bx * BN + i // VR, chunk * KC + (i % VR) * 8]), 16))
        for r in T.serial(x_rounds):
            if r * threads + tid < BM * VR:
                i = T.meta_var(r * threads + tid)
                T.evaluate(T.ptx[copy](T.address_of(ring[stage, BN + i // VR, T.bitwise_xor(i % VR, (i // VR) % 2 * SW) * 8]),
                                       T.address_of(x[T.min(by * BM + i // VR, m - 1), chunk * KC + (i % VR) * 8]),
                                       16, x_bytes(by * BM + i // VR, m)))

    @T.macro
    def block(x, w, y, part, m, bx, by, bz, kw, nw, lane, row0):
        """One block's share: rows by * BM.., channels bx * BN.., chunks bz * chunks.. of K; its sums
        go to y rows row0 + ..."""
        # one buffer: TVM's shared-memory planner does not count the cp.async writes
        # (addresses) as uses, so two buffers read in different statements (one chunk
        # in all) get the same bytes -- W rows first, then the rows of x
        ring = T.alloc_buffer((S, BN + BM, KC), "bfloat16", scope="shared.dyn")
        wa = T.alloc_buffer((AT, 2, 8), "bfloat16", scope="local")
        af = T.alloc_buffer((2, AT, 8), "bfloat16", scope="local")
        xb = T.alloc_buffer((MT, 8), "bfloat16", scope="local")
        bf = T.alloc_buffer((MT, 8), "bfloat16", scope="local")
        acc = T.alloc_buffer((AT, MT, 4), "float32", scope="local")
        tid = T.meta_var((kw * WN + nw) * 32 + lane)
        for a, t, c in T.grid(AT, MT, 4):
            acc[a, t, c] = T.float32(0)
        for s in T.unroll(S - 1):
            if s < chunks:
                issue(ring, w, x, m, bx, by, tid, s, bz * chunks + s)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for c in T.serial(chunks):
            T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
            T.tvm_storage_sync("shared")
            for u in T.unroll(U):
                for a, h in T.grid(AT, 2):
                    for v in T.vectorized(8):
                        wa[a, h, v] = ring[c % S, nw * (16 * AT) + a * 16 + h * 8 + lane // 4,
                                         piece(kw, u, lane) * 8 + v]
                for t in T.serial(MT):
                    for v in T.vectorized(8):
                        xb[t, v] = ring[c % S, BN + t * 8 + lane // 4, piece(kw, u, lane) * 8 + v]
                for t, v in T.grid(MT, 8):
                    bf[t, v] = xb[t, v]
                for q, a in T.grid(2, AT):
                    for h2, h, e in T.grid(2, 2, 2):
                        af[q, a, h2 * 4 + h * 2 + e] = wa[a, h, q * 4 + h2 * 2 + e]
                for q, a, t in T.grid(2, AT, MT):
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", "bf16", "bf16", "fp32",
                        af.data, (q * AT + a) * 8, bf.data, t * 8 + q * 4,
                        acc.data, (a * MT + t) * 4, False, dtype="float32"))
            # the ring slot the next chunk goes to was read in the previous
            # iteration, which every thread finished before the barrier above
            if c + S - 1 < chunks:
                issue(ring, w, x, m, bx, by, tid, (c + S - 1) % S, bz * chunks + c + S - 1)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        if WK == 1:
            # C fragment: channel g (+8 for c >= 2), row 2 (lane % 4) (+1 for odd c)
            for a, t, c in T.grid(AT, MT, 4):
                if by * BM + t * 8 + (lane % 4) * 2 + c % 2 < m:
                    y[row0 + by * BM + t * 8 + (lane % 4) * 2 + c % 2,
                      bx * BN + (nw * AT + a) * 16 + (c // 2) * 8 + lane // 4] = acc[a, t, c]
        else:
            red = T.alloc_buffer((WK, slots), "float32", scope="shared.dyn")
            T.evaluate(T.ptx["cp.async.wait_group"](0))
            T.tvm_storage_sync("shared")
            store(red, acc, y, m, bx, by, kw, nw, lane, row0)

    return _launch_blocks(n_out, cfg, block, 32)


def _wgmma_kernel(n_out: int, k_in: int, cfg: Config, paired: bool = False, gpu: Device = TUNED):
    """Hopper's warpgroup MMA (sm_90a): a block of ``wn`` warpgroups, each ``wgmma.m64nRk16``
    with 64 channels of W as A and the block's R = ``block_m`` rows of x as B, both read by the
    tensor cores straight from shared memory through matrix descriptors; with ``a_tiles`` 8 or 12
    a warpgroup multiplies two or three such 64-channel tiles by each x tile (x, which every
    block reads whole, paid once per 128 / 192 channels; R / 2 accumulators a thread per tile).  Every thread copies
    chunks of 64 k (W's ``block_n`` rows, then x's R rows: 128 bytes a row) with ``cp.async``
    into a ring of ``stages`` such tiles, laid out in the 128-byte swizzle (16-byte piece c of
    row r at piece c ^ (r % 8), tiles 1024-byte aligned) that the descriptors name; a chunk is
    four wgmma k steps (start address + 32 bytes each).  Where mma.sync needs a register load
    per operand fragment and an instruction per 16 x 8 x 16 product (the register and pipelined
    kernels: issue-bound at 65 rows on the H200, Nsight Compute: 'wait' stalls, 8 warps per SM),
    one wgmma multiplies 64 x R x 16 and the accumulators (R / 2 floats a thread) are the only
    registers it holds.  cp.async writes through the generic proxy and wgmma reads through the
    async one: each thread fences the proxies between its copies landing and the barrier.  With
    ``overlap`` = 1 a chunk's wgmmas are waited for one iteration later (after the next chunk's
    are issued) and the copies run ``stages - 2`` chunks ahead, so no slot is refilled before
    every warpgroup has finished reading it.

    ``paired`` (N even, H = N / 2; `fuse_pairs`): each 16-row slice of a block's 64 channels is 8
    rows c.. of W's first half and the same 8 of its second (c + H..), so a thread's accumulators
    i and i + 2 (i % 4 < 2) hold y[r, c] and y[r, c + H], stored one after the other for a
    SwiGLU-like consumer of both; a block covers block_n / 2 such pairs."""
    from tvm.script import tirx as T

    WG, MT, S, OV = cfg.wn, cfg.m_tiles, cfg.stages, cfg.overlap
    TPW = cfg.a_tiles // 4              # 64-channel A tiles a warpgroup multiplies by the same x tile
    H = n_out // 2
    D = S - 1 - OV                      # chunks the copies run ahead of the wgmmas
    BN, BM = cfg.block_n(), cfg.block_m()
    KC = WGMMA_K
    chunks = k_in // cfg.splits // KC   # chunks per block
    STAGE = (BN + BM) * KC              # bf16 elements per ring slot: W rows, then x rows
    threads = cfg.threads()
    w_rounds, x_rounds = -(-BN * 8 // threads), -(-BM * 8 // threads)
    NREG = BM // 2                      # accumulator floats per thread and A tile: 64 x R over 128 threads
    copy = "cp.async.cg.shared.global"
    mma = f"wgmma.mma_async.sync.aligned.m64n{BM}k16.f32.bf16.bf16"
    FULL, REST = tail_blocks(cfg, n_out, k_in, gpu)
    TAIL = cfg.tail if REST else 1      # with_tail: blocks FULL.. take K in TAIL pieces
    TAILC = REST * BN                   # the workspace's columns: the tail blocks' channels (paired: gates, ups)

    def desc(addr):
        """A K-major, 128-byte-swizzled operand at shared address ``addr``: 8-row groups 1024
        bytes apart (stride offset 64 x 16 bytes; the leading offset is unused when swizzled)."""
        # one literal for the constant fields: a constant expression would be hoisted out of the
        # kernel as a uint64 launch argument, which TVM's runtime cannot pass
        return T.bitwise_or(T.Cast("uint64", T.shift_right(T.bitwise_and(addr, T.uint32(0x3FFFF)), T.uint32(4))),
                            T.uint64((1 << 62) | (64 << 32) | (1 << 16)))

    def wgmma(acc, t, a_desc, b_desc):
        return T.ptx[mma](*[acc[t * NREG + i] for i in range(NREG)], a_desc, b_desc, True, 1, 1, 0, 0)

    def swizzled(row, piece):
        """Element offset of 16-byte ``piece`` of tile ``row`` within a ring slot."""
        return row * KC + T.bitwise_xor(piece, row % 8) * 8

    def w_row(bx, slot):
        """The weight row of the block's channel ``slot``."""
        if not paired:
            return T.min(bx * BN + slot, n_out - 1)
        c = T.min(bx * (BN // 2) + slot // 16 * 8 + slot % 8, H - 1)
        return T.if_then_else(slot % 16 < 8, c, c + H)

    def chunk_count(bx):
        """The chunks of K block column ``bx`` takes."""
        return T.if_then_else(bx < FULL, chunks, chunks // TAIL) if TAIL > 1 else chunks

    @T.macro
    def issue(ring, w, x, m, bx, by, tid, base, stage, chunk):
        for r in T.serial(w_rounds):
            if r * threads + tid < BN * 8:
                i = T.meta_var(r * threads + tid)
                T.evaluate(T.ptx[copy](T.address_of(ring[base + stage * STAGE + swizzled(i // 8, i % 8)]),
                                       T.address_of(w[w_row(bx, i // 8), chunk * KC + (i % 8) * 8]),
                                       16))
        for r in T.serial(x_rounds):
            if r * threads + tid < BM * 8:
                i = T.meta_var(r * threads + tid)
                T.evaluate(T.ptx[copy](T.address_of(ring[base + stage * STAGE + swizzled(BN + i // 8, i % 8)]),
                                       T.address_of(x[T.min(by * BM + i // 8, m - 1), chunk * KC + (i % 8) * 8]), 16,
                                       x_bytes(by * BM + i // 8, m)))

    @T.macro
    def block(x, w, y, part, m, bx, by, bz, kw, wg, lane, row0):
        # chunks bz * nch.. of K: every block's share (the split form), or with a tail, the whole of K
        # in the first FULL channel blocks and a TAIL-th in the rest (their sums to the workspace)
        nch = T.meta_var(chunk_count(bx))
        ring = T.alloc_buffer((S * STAGE + SWIZZLE_ALIGN // 2,), "bfloat16", scope="shared.dyn")
        acc = T.alloc_buffer((TPW * NREG,), "float32", scope="local")
        at = T.alloc_buffer((2,), "uint32", scope="local")     # the ring's shared address, aligned; its offset
        tid = T.meta_var(wg * 128 + lane)
        at[0] = T.cuda.cvta_generic_to_shared(T.address_of(ring[0]))
        at[1] = T.bitwise_and(T.uint32(SWIZZLE_ALIGN) - T.bitwise_and(at[0], T.uint32(SWIZZLE_ALIGN - 1)),
                              T.uint32(SWIZZLE_ALIGN - 1))
        base = T.meta_var(T.Cast("int32", at[1]) // 2)        # bf16 elements up to the aligned start
        for i in T.unroll(TPW * NREG):       # unrolled: the accumulators stay registers
            acc[i] = T.float32(0)
        for s in T.unroll(D):
            if s < nch:
                issue(ring, w, x, m, bx, by, tid, base, s, bz * nch + s)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        for c in T.serial(nch):
            T.evaluate(T.ptx["cp.async.wait_group"](D - 1))
            T.evaluate(T.ptx["fence.proxy.async.shared::cta"]())
            T.tvm_storage_sync("shared")
            T.evaluate(T.ptx["wgmma.fence.sync.aligned"]())
            for j in T.unroll(KC // 16):
                for t in T.unroll(TPW):
                    T.evaluate(wgmma(acc, t, desc(at[0] + at[1] + T.Cast("uint32", ((c % S) * STAGE + (wg * TPW + t) * 64 * KC
                                                                                     + j * 16) * 2)),
                                     desc(at[0] + at[1] + T.Cast("uint32", ((c % S) * STAGE + BN * KC + j * 16) * 2))))
            T.evaluate(T.ptx["wgmma.commit_group.sync.aligned"]())
            T.evaluate(T.ptx["wgmma.wait_group.sync.aligned"](OV))
            # the slot chunk c + D goes to held chunk c + D - S = c - 1 - OV, whose wgmmas every
            # warpgroup waited for before the barrier above
            if c + D < nch:
                issue(ring, w, x, m, bx, by, tid, base, (c + D) % S, bz * nch + c + D)
            T.evaluate(T.ptx["cp.async.commit_group"]())
        if OV > 0:
            T.evaluate(T.ptx["wgmma.wait_group.sync.aligned"](0))
        # D fragment of m64nRk16: warp q of the warpgroup holds channels 16 q.., register i is
        # channel g (+8 for i % 4 >= 2) and row 8 (i // 4) + 2 t (+1 for odd i); g, t = lane // 4, lane % 4
        # (tile t of warpgroup wg: the block's channels (wg * TPW + t) * 64..)
        for t in T.unroll(TPW):
            for i in T.unroll(NREG):
                row = T.meta_var(by * BM + (i // 4) * 8 + (lane % 4) * 2 + i % 2)
                if paired:
                    pair = T.meta_var(bx * (BN // 2) + ((wg * TPW + t) * 4 + lane // 32) * 8 + (lane % 32) // 4)
                    if i % 4 < 2:
                        if row < m and pair < H:
                            if TAIL > 1:
                                if bx >= FULL:      # the workspace: gates, then ups
                                    part[row0 + row, pair - FULL * (BN // 2)] = acc[t * NREG + i]
                                    part[row0 + row, pair - FULL * (BN // 2) + TAILC // 2] = acc[t * NREG + i + 2]
                                else:
                                    y[row0 + row, pair] = acc[t * NREG + i]
                                    y[row0 + row, pair + H] = acc[t * NREG + i + 2]
                            else:
                                y[row0 + row, pair] = acc[t * NREG + i]
                                y[row0 + row, pair + H] = acc[t * NREG + i + 2]
                else:
                    channel = T.meta_var(bx * BN + (wg * TPW + t) * 64 + (lane // 32) * 16 + ((i % 4) // 2) * 8
                                         + (lane % 32) // 4)
                    if row < m and channel < n_out:
                        if TAIL > 1:
                            if bx >= FULL:
                                part[row0 + row, channel - FULL * BN] = acc[t * NREG + i]
                            else:
                                y[row0 + row, channel] = acc[t * NREG + i]
                        else:
                            y[row0 + row, channel] = acc[t * NREG + i]

    @T.macro
    def merge(part, y, m):
        """The tail: y = the TAIL pieces' partial sums added in order (the paired form: gate and up
        of a pair stored one after the other, as the blocks store them)."""
        cols = T.meta_var(TAILC // 2 if paired else n_out - FULL * BN)
        for bi in T.thread_binding((m * cols + 255) // 256, thread="blockIdx.x"):
            for tx in T.thread_binding(256, thread="threadIdx.x"):
                if bi * 256 + tx < m * cols:
                    r = T.meta_var((bi * 256 + tx) // cols)
                    c = T.meta_var((bi * 256 + tx) % cols)
                    total = T.alloc_buffer((2,), "float32", scope="local")
                    total[0] = part[r, c]
                    if paired:
                        total[1] = part[r, c + TAILC // 2]
                    for z in T.unroll(TAIL - 1):
                        total[0] = total[0] + part[(z + 1) * m + r, c]
                        if paired:
                            total[1] = total[1] + part[(z + 1) * m + r, c + TAILC // 2]
                    if paired:
                        if FULL * (BN // 2) + c < H:
                            y[r, FULL * (BN // 2) + c] = total[0]
                            y[r, FULL * (BN // 2) + c + H] = total[1]
                    else:
                        y[r, FULL * BN + c] = total[0]

    tail = (FULL, REST * TAIL, TAILC, merge) if TAIL > 1 else None
    return _launch_blocks(n_out, cfg, block, 128, blocks_n=-(-H // (BN // 2)) if paired else None, tail=tail)


def _launch_blocks(n_out: int, cfg: Config, block, lanes: int, blocks_n: int | None = None, tail=None):
    """A macro launching ``block`` over (channel blocks, row blocks) with threads (wk, wn,
    ``lanes``) as threadIdx (z, y, x); with ``cfg.splits`` > 1 over K pieces too (blockIdx.z),
    each writing its partial sums to rows bz * m.. of a float32 workspace that a second kernel
    adds in a fixed order (deterministic, unlike atomics).  ``tail`` = (whole blocks F, tail
    blocks, workspace columns, merge macro): channel blocks F.. as ``cfg.tail`` blocks each (K
    piece bz to workspace rows bz * m..), then ``merge(part, y, m)``."""
    from tvm.script import tirx as T

    WN, WK, SPL = cfg.wn, cfg.wk, cfg.splits
    BN, BM = cfg.block_n(), cfg.block_m()
    NB = blocks_n or (n_out + BN - 1) // BN      # channel blocks (the paired form: pairs / (block_n / 2))
    FULL, TB, TC, merge = tail or (NB, 0, 0, None)
    TL = cfg.tail
    ON, OM = ("blockIdx.y", "blockIdx.x") if cfg.rows_first else ("blockIdx.x", "blockIdx.y")   # channel, row blocks

    @T.macro
    def launch(x, w, y, m):
        if tail is not None:
            part = T.alloc_buffer((TL * m, TC), "float32")
            for b in T.thread_binding(FULL + TB, thread=ON):
                for by in T.thread_binding((m + BM - 1) // BM, thread=OM):
                    for kw in T.thread_binding(WK, thread="threadIdx.z"):
                        for nw in T.thread_binding(WN, thread="threadIdx.y"):
                            for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                                bz = T.meta_var(T.if_then_else(b < FULL, 0, (b - FULL) % TL))
                                block(x, w, y, part, m, T.if_then_else(b < FULL, b, FULL + (b - FULL) // TL), by,
                                      bz, kw, nw, lane, bz * m)
            merge(part, y, m)
        elif SPL == 1:
            for bx in T.thread_binding(NB, thread=ON):
                for by in T.thread_binding((m + BM - 1) // BM, thread=OM):
                    for kw in T.thread_binding(WK, thread="threadIdx.z"):
                        for nw in T.thread_binding(WN, thread="threadIdx.y"):
                            for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                                block(x, w, y, y, m, bx, by, 0, kw, nw, lane, 0)
        else:
            part = T.alloc_buffer((SPL * m, n_out), "float32")
            for bx in T.thread_binding((n_out + BN - 1) // BN, thread=ON):
                for by in T.thread_binding((m + BM - 1) // BM, thread=OM):
                    for bz in T.thread_binding(SPL, thread="blockIdx.z"):
                        for kw in T.thread_binding(WK, thread="threadIdx.z"):
                            for nw in T.thread_binding(WN, thread="threadIdx.y"):
                                for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                                    block(x, w, part, part, m, bx, by, bz, kw, nw, lane, bz * m)
            for bi in T.thread_binding((m * n_out + 255) // 256, thread="blockIdx.x"):
                for tx in T.thread_binding(256, thread="threadIdx.x"):
                    if bi * 256 + tx < m * n_out:
                        total = T.alloc_buffer((1,), "float32", scope="local")
                        total[0] = part[(bi * 256 + tx) // n_out, (bi * 256 + tx) % n_out]
                        for z in T.unroll(SPL - 1):
                            total[0] = total[0] + part[(z + 1) * m + (bi * 256 + tx) // n_out, (bi * 256 + tx) % n_out]
                        y[(bi * 256 + tx) // n_out, (bi * 256 + tx) % n_out] = total[0]
    return launch


SKINNY_ATTR = "specpilot.skinny_mma"   # on the kernels: JSON of `skinny_nt_matmul`'s (n_out, k_in, wgmma)


def pairable(n_out: int, k_in: int, wgmma: bool, gpu: Device = TUNED) -> bool:
    """Whether `skinny_nt_matmul` has a ``paired`` form for this shape: every configuration `pick`
    chooses is an unsplit warpgroup kernel (the paired store pairs its accumulators), N even."""
    chosen = pick(n_out, k_in, wgmma, gpu) if wgmma and n_out % 2 == 0 else None
    return bool(chosen) and all(cfg.wgmma and cfg.splits == 1 for _, cfg in chosen)


@lru_cache(maxsize=None)
def skinny_nt_matmul(n_out: int, k_in: int, configs: tuple | None = None, wgmma: bool = False, paired: bool = False,
                     gpu: Device = TUNED):
    """x[m, k] . W[n, k]^T -> float32 y[m, n] (m symbolic) on tensor cores, one configuration per
    range of m chosen at run time.  ``configs``: ((largest m or None, Config), ...), ascending,
    the last unbounded, to use instead of `pick`'s (benchmarks); ``wgmma``: `pick` may choose the
    sm_90a warpgroup kernel (build for sm_90a then); ``paired`` (`pairable` shapes): the kernels
    store y[r, c] and y[r, c + N / 2] one after the other (`fuse_pairs`); ``gpu``: the card the
    configurations are sized for."""
    from specpilot.kernels.fast_frames import quick_stack
    if paired and (configs is not None or not pairable(n_out, k_in, wgmma, gpu)):
        raise ValueError(f"N={n_out}, K={k_in}: no paired form (it needs unsplit warpgroup kernels throughout)")
    with quick_stack():
        return _skinny_nt_matmul(n_out, k_in, configs, wgmma, paired, gpu)


def _skinny_nt_matmul(n_out: int, k_in: int, configs: tuple | None, wgmma: bool, paired: bool, gpu: Device):
    from tvm.script import tirx as T

    chosen = list(configs) if configs else pick(n_out, k_in, wgmma, gpu)
    if chosen is None:
        raise ValueError(f"no skinny tensor-core configuration tiles N={n_out}, K={k_in}")
    if chosen[-1][0] is not None or any(limit is None for limit, _ in chosen[:-1]):
        raise ValueError("configs: ascending row limits, the last one None (every larger m)")
    for _, cfg in chosen:
        if cfg.stages == 1 or cfg.stages < 0:
            raise ValueError(f"{cfg}: a pipelined configuration needs stages >= 2 (0: the register kernel)")
        if not cfg.fits(n_out, k_in, gpu=gpu):
            raise ValueError(f"{cfg} does not tile N={n_out}, K={k_in} within {gpu.name}'s limits")
    launches = [(limit, _wgmma_kernel(n_out, k_in, cfg, paired, gpu) if cfg.wgmma else
                 (_pipelined_kernel if cfg.stages else _kernel)(n_out, k_in, cfg)) for limit, cfg in chosen]
    N, K = T.int64(n_out), T.int64(k_in)

    def dispatch(i: int):
        limit, launch = launches[i]
        if limit is None:
            return launch
        rest = dispatch(i + 1)

        @T.macro
        def pick_rows(x, w, y, m):
            if m <= limit:
                launch(x, w, y, m)
            else:
                rest(x, w, y, m)
        return pick_rows

    run = dispatch(0)

    @T.prim_func(private=True)
    def mm(x_h: T.handle, w: T.Buffer((N, K), "bfloat16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), "float32")
        run(x, w, y, m)
    return mm
