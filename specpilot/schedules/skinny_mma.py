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

import json
from dataclasses import dataclass, replace
from functools import lru_cache


@dataclass(frozen=True)
class Config:
    m_tiles: int    # groups of 8 rows of x per block
    a_tiles: int    # 16-channel A tiles per warp
    wn: int         # warps along N
    wk: int         # warps along K (split-K inside the block)
    unroll: int = 4  # k steps whose loads are in flight together
    stages: int = 0  # >= 2: the pipelined kernel (cp.async into shared memory, this many chunks in flight)
    splits: int = 1  # pipelined: K split over this many blocks too (partial sums summed by a second kernel)
    wgmma: bool = False  # sm_90a warpgroup kernel (`_wgmma_kernel`): wn warpgroups of a_tiles / 4 x 64 channels, wk 1
    overlap: int = 0     # wgmma: groups left in flight past the next barrier (1: copies run stages - 2 ahead)
    tail: int = 1        # wgmma, unsplit: the channel blocks past the last whole wave of block slots take K in
                         # this many pieces, a block each, summed in a fixed order by a second kernel (`with_tail`)

    def block_n(self) -> int:
        return 16 * self.a_tiles * self.wn

    def block_m(self) -> int:
        return 8 * self.m_tiles

    def fits(self, n_out: int, k_in: int, k_step: int = 32) -> bool:
        """Whether the configuration tiles N and K (each of the wk warps taking whole k steps) and,
        pipelined, its ring of chunks fits in a block's shared memory."""
        if self.wgmma:
            # one to three 64-channel tiles per warpgroup (the last block of a ragged N clamps its
            # weight rows and stores only real channels), x rows as wgmma's N (a multiple of 8,
            # <= 256), 64-k chunks
            return (n_out % 8 == 0 and self.a_tiles in (4, 8, 12) and self.wk == 1 and self.stages >= 2 + self.overlap
                    and (self.tail == 1 or (self.tail > 1 and self.splits == 1 and k_in % (self.tail * WGMMA_K) == 0))
                    and self.block_m() * self.a_tiles <= 4 * 256   # <= 128 accumulators a thread
                    and self.block_m() <= 256 and k_in % (self.splits * WGMMA_K) == 0
                    and self.shared_bytes(k_in) <= MAX_SHARED)
        if n_out % self.block_n() or k_in % (self.splits * k_step * self.wk) or (self.splits > 1 and not self.stages):
            return False
        # pipelined: at least two chunks per block (the regime the H200 runs checked; one chunk takes
        # the register kernel) and a ring that fits in a block's shared memory
        return not self.stages or (k_in // self.splits >= 2 * self.chunk(k_in)
                                   and self.shared_bytes(k_in) <= MAX_SHARED)

    def chunk(self, k_in: int) -> int:
        """Pipelined: k per chunk (each of the wk warps takes ``unroll_for`` steps of 32); wgmma:
        one 128-byte swizzle atom per row."""
        return WGMMA_K if self.wgmma else 32 * self.wk * self.unroll_for(k_in)

    def unroll_for(self, k_in: int) -> int:
        """The k steps per warp per iteration: ``unroll``, or the largest of 2, 1 that divides."""
        steps = k_in // (32 * self.wk * self.splits)
        return next(u for u in (self.unroll, 2, 1) if steps % u == 0)

    def shared_bytes(self, k_in: int) -> int:
        """Pipelined: the ring of W and x chunks plus the split-K partial sums."""
        ring = self.stages * (self.block_n() + self.block_m()) * self.chunk(k_in) * 2
        if self.wgmma:
            return ring + SWIZZLE_ALIGN    # room to align the ring to the swizzle pattern's 1024 bytes
        return ring + (self.wk * self.slots() * 4 if self.wk > 1 else 0)

    def threads(self) -> int:
        """Threads per block: wn x wk warps, or wn warpgroups of four warps (wgmma)."""
        return 32 * self.wn * self.wk * (4 if self.wgmma else 1)

    def slots(self) -> int:
        """Accumulator values per block per k share (the split-K partial sums)."""
        return self.wn * self.a_tiles * self.m_tiles * 4 * 32


MAX_SHARED = 227 * 1024     # opt-in shared memory per block on sm_90 (the runtime raises the limit)
WGMMA_K = 64                # wgmma kernel: k per chunk, 64 bf16 = one 128-byte swizzled row
SWIZZLE_ALIGN = 1024        # the 128-byte swizzle repeats every 8 rows: tiles start 1024-byte aligned


# (largest M the configuration serves, candidates in order of preference), from the H200 runs of
# bench/skinny_gemm.py (docs/bench-log.md).  The pipelined kernel leads at every M measured (1.2-2x
# the register kernel at 16-65 rows, at or above cuBLAS at 16 rows): 16 rows x 64 channels per
# block with 4 warps along N up to 8 rows, 8 warps splitting K at 9-16, 32 rows x 128 channels at
# 17-32 where N gives half the SMs a block (else 16-row blocks), 72 rows with 3 stages beyond.  The
# register kernel stays as the fallback for shapes those do not tile.
REGISTER = (
    (16, (Config(2, 1, 1, 8, 4), Config(2, 1, 1, 4, 4), Config(2, 1, 1, 2, 4), Config(2, 1, 1, 1, 4))),
    (32, (Config(4, 2, 2, 2, 2), Config(4, 1, 2, 2, 2), Config(4, 1, 1, 2, 2), Config(4, 1, 1, 1, 2))),
    (None, (Config(9, 2, 2, 2, 2), Config(9, 1, 2, 2, 2), Config(9, 1, 1, 2, 2), Config(9, 1, 1, 1, 2))),
)
SMS = 132    # H200 SMs: a 32-row tile of 128 channels paid from N = 14336 (112 blocks), not at 5120 (40)


def configs(n_out: int, wgmma: bool = False) -> tuple:
    """The (largest M, candidates) ranges for an N-channel GEMM; ``wgmma`` (sm_90a): the
    warpgroup kernel's candidates first (any N a multiple of 8: a ragged last block of channels)."""
    wide = (Config(4, 2, 4, 1, 2, stages=4),) if n_out >= 64 * SMS else ()
    mma = (
        (8, (Config(2, 1, 4, 1, 4, stages=4),) + REGISTER[0][1]),
        (16, (Config(2, 1, 1, 8, 1, stages=4),) + REGISTER[0][1]),
        (32, wide + (Config(2, 1, 4, 1, 4, stages=4),) + REGISTER[1][1]),
        # N not a multiple of 64 (the 27B hybrid's stacked GDN projections: 16480): 32-channel blocks
        (None, (Config(9, 2, 2, 2, 2, stages=3), Config(9, 1, 2, 2, 2, stages=3)) + REGISTER[2][1]),
    )
    if not wgmma:
        return mma
    # H200, 27B and 8B shapes at 4-65 rows (docs/bench-log.md): the wgmma kernel 1.1-1.5x the mma
    # kernels (lm_head at 65 rows 931 -> 657 us, cuBLAS 610; 17408 x 5120 88 -> 59, cuBLAS 48).  Per
    # range two wgmma candidates; `pick` takes the one whose blocks fill the GPU's block slots best
    # (`wave_efficiency`): 6 stages with one wgmma group in flight past the barrier lead in most
    # shapes, 4 stages (more blocks per SM) or two warpgroups (fewer blocks) where 6 stages would
    # leave a nearly empty last wave (17408 channels at 65 rows: 272 blocks for 264 slots, 69 us vs
    # 59).  At 9-16 rows with few channel blocks mma's in-block K split leads (17408 -> 5120: 46.7 vs
    # 48.1 us) and stays.
    few = n_out // 64 < SMS

    def wg(mt, wn, stages, overlap=1):
        return Config(mt, 4, wn, 1, stages=stages, wgmma=True, overlap=overlap)
    hopper = {8: (wg(1, 1, 6), wg(1, 1, 4)),
              16: () if few else (wg(2, 1, 6), wg(2, 1, 4)),
              32: (wg(4, 1, 6), wg(4, 1, 4)),
              72: (wg(9, 1, 6), wg(9, 2, 4, overlap=0))}
    wide = (WIDE,) if wide_fills(n_out) else ()
    # Beyond 72 rows (prefill, long chains) the 72-row blocks re-read W once per 72 rows: 128 and
    # 256 rows of x a block, unsplit (27B gate/up and down at 128-1024 rows: 1.3-1.9x the 72-row
    # dispatch, e.g. 5120 -> 34816 at 512 rows 825 -> 441 us; cuBLAS 238).  Where few channel blocks leave SMs idle, the split 72-row blocks stay up to 128
    # rows (17408 -> 5120 at 128 rows: 113 us vs 145).
    r128, r256 = wg(16, 1, 4), Config(32, 4, 2, 1, stages=3, wgmma=True)
    ranges = [(limit or 72, (wide if limit is None else ()) + hopper[limit or 72] + candidates)
              for limit, candidates in mma]
    rest = hopper[72] + mma[-1][1]
    return tuple(ranges) + ((128, (rest if few else (r128,) + rest)), (256, (r128,) + rest), (None, (r256,) + rest))


# 33-72 rows: one warpgroup multiplying two 64-channel weight tiles by each x tile, 8 stages (one
# block an SM), where those 128-channel blocks fill the GPU -- one wave of at least 80 % of the SMs
# or at least 8 waves (`wide_fills`); elsewhere the last wave's few blocks run alone and it loses.
# H200, 65 rows (us, vs the 64-channel pick; bench/README "Skinny GEMMs"): 5120 -> 16480 (129
# blocks) 47.8 vs 52.2, -> 14336 (112) 43.6 vs 47.2, -> 248320 648.4 vs 656.7 (cuBLAS 46.9 / 42.1
# / 616.4); -> 34816 (272 blocks, 2.06 waves) 114.0 vs 108.0; with K split over blocks (N = 5120,
# 17408 -> 5120) two tiles lose too (6 stages, split 8: 72.1 vs 61.2).  Three
# tiles (192 channels, 6 stages) are no better where they fit (-> 248320 646.0, -> 16480 51.6).
WIDE = Config(9, 8, 1, 1, stages=8, wgmma=True, overlap=1)


def wide_fills(n_out: int) -> bool:
    """Whether `WIDE`'s blocks of an N-channel GEMM (one an SM) fill one wave to >= 80 % of the
    SMs or make >= 8 waves (a last partial wave then costs little)."""
    blocks = -(-n_out // WIDE.block_n())
    return 0.8 * SMS <= blocks <= SMS or blocks >= 8 * SMS


WIDE_SPLIT_K = 16384   # k from which `wide_split` takes WIDE with K split in two


def wide_split(n_out: int, k_in: int) -> Config | None:
    """33-72 rows, few channel blocks (fewer 64-channel blocks than SMs: K split over blocks anyway)
    and a long K (the down projection 17408 -> 5120): `WIDE` with K split over two blocks (so its
    blocks, doubled, fit one wave) -- x paid once per 128 channels and two float32 partials a
    channel to add, where the 64-channel kernel splits K eight ways (eight partials).  H200, 65 rows:
    58.0 us vs 61.5 (8 splits of 64-channel blocks; three tiles split 4 58.4), round-robin 55.0 vs
    66.4 (cuBLAS 59.4); the 27B-style tree verification 1999-2020 us vs 2037-2057 with the tail form
    alone (1.28-1.29x vs 1.30x the AR step; bench/README "Skinny GEMMs", "Tree verification"); bf16
    forcing of bench/specs/tiny-llama-tail-mlp-bf16.yaml (its 17408 -> 512 down projection takes it)
    passes.  None elsewhere."""
    cfg = replace(WIDE, splits=2)
    if k_in < WIDE_SPLIT_K or n_out // 64 >= SMS or not cfg.fits(n_out, k_in):
        return None
    return cfg


SM_SHARED = 228 * 1024      # shared memory per SM on sm_90 (each block also reserves 1 KB)


def block_slots(cfg: Config, k_in: int) -> int:
    """The blocks of ``cfg`` the GPU runs at once: SMs x blocks per SM (by shared memory and threads)."""
    return SMS * max(min(SM_SHARED // (cfg.shared_bytes(k_in) + 1024), 2048 // cfg.threads()), 1)


def wave_efficiency(cfg: Config, n_out: int, k_in: int) -> float:
    """How well one row block of ``cfg``'s blocks fills the GPU's block slots (`block_slots`): 1
    when they fit in one wave, else waves / whole waves (a last wave with few blocks runs nearly
    alone)."""
    waves = -(-n_out // cfg.block_n()) * cfg.splits / block_slots(cfg, k_in)
    return 1.0 if waves <= 1 else waves / -(-waves // 1)


def tail_blocks(cfg: Config, n_out: int, k_in: int) -> tuple[int, int]:
    """(whole-K channel blocks, channel blocks past the last whole wave of `block_slots`) of one
    row block; (all, 0) within one wave.  The paired form has as many blocks (N / 2 pairs, block_n / 2
    a block)."""
    blocks, slots = -(-n_out // cfg.block_n()), block_slots(cfg, k_in)
    rest = blocks % slots if blocks > slots else 0
    return blocks - rest, rest


TAIL_MOST = 0.25    # split the last wave's K where it holds at most this share of the block slots


def with_tail(cfg: Config, n_out: int, k_in: int) -> Config:
    """An unsplit 72-row warpgroup configuration whose last wave of channel blocks is nearly empty
    (at most ``TAIL_MOST`` of the block slots) with those blocks' K split over the most pieces (<= 8,
    whole 64-k chunks) that keep one block an SM: 5120 -> 34816 (the 27B gate / up, 544 blocks of 64
    channels in 264 slots) runs 528 whole blocks and 16 x 8 eighths instead of 2 waves and 16
    blocks alone.  The eighths' partial sums go to a float32 workspace that a second kernel adds in a
    fixed order (deterministic).  H200, 65 rows round-robin (bench/README "Skinny GEMMs"): 107.3 us
    vs 116.0 unsplit (cuBLAS 107.0; 2 / 4 / 16 pieces 108.0 / 107.5 / 108.3); the 27B-style tree
    verification 2054-2056 vs 2062-2068 us; bf16 forcing of bench/specs/tiny-llama-tail-mlp-bf16.yaml,
    paired form, passes."""
    if not cfg.wgmma or cfg.splits != 1 or cfg.a_tiles != 4 or cfg.block_m() != 72:
        return cfg
    _, rest = tail_blocks(cfg, n_out, k_in)
    if not rest or rest > TAIL_MOST * block_slots(cfg, k_in):
        return cfg
    pieces = [t for t in (8, 4, 2) if rest * t <= SMS and replace(cfg, tail=t).fits(n_out, k_in)]
    return replace(cfg, tail=pieces[0]) if pieces else cfg


def choose(ranges, fits) -> list[tuple[int | None, Config]] | None:
    """The first configuration that ``fits`` in each (largest M, candidates) range, or None when
    some range has none."""
    out = []
    for limit, candidates in ranges:
        chosen = next((c for c in candidates if fits(c)), None)
        if chosen is None:
            return None
        out.append((limit, chosen))
    return out


SPLIT_K_MIN = 2048   # k per block below which splitting K over more blocks stopped paying


def with_splits(cfg: Config, n_out: int, k_in: int) -> Config:
    """A pipelined configuration whose channel blocks alone leave SMs idle (fewer blocks than SMs,
    at one block of rows) with K split over the most blocks (<= 8) that keep >= ``SPLIT_K_MIN`` k
    each.  H200 (docs/bench-log.md): N = 5120 at 65 rows, K = 17408 111 -> 76 us (8 splits), K =
    6144 43.6 -> 32.3 (3); at 1 row 64.9 -> 51.1 / 28.5 -> 21.0; shapes with more channel blocks
    than SMs (N >= 14336) do not gain and keep one.  `pick` splits the mma
    kernels only beyond 16 rows: in decode batches of 4 / 8 (Qwen3-8B shapes) the second kernel's
    launch costs more than the split saves (3.17 -> 3.32 ms at batch 4, 3.32 -> 3.59 at 8), while
    tree verification gains (3495 -> 3319 us); the wgmma kernel's split pays at every row count
    (see `pick`)."""
    if not cfg.stages or n_out // cfg.block_n() >= SMS:
        return cfg
    splits = [s for s in range(2, 9) if k_in // s >= SPLIT_K_MIN and replace(cfg, splits=s).fits(n_out, k_in)]
    return replace(cfg, splits=max(splits)) if splits else cfg


def pick(n_out: int, k_in: int, wgmma: bool = False) -> list[tuple[int | None, Config]] | None:
    """One configuration per M range for this shape, or None when no configuration tiles it.  K
    is split over blocks beyond 16 rows, and by the wgmma kernel at any row count (its split
    measured faster at 1-8 rows too: 17408 -> 5120 47 vs 76 us unsplit)."""
    out = []
    for limit, candidates in configs(n_out, wgmma):
        fitting = [with_splits(c, n_out, k_in) if (c.wgmma and c.block_m() <= 72 and c.a_tiles == 4) or
                   (not c.wgmma and (limit is None or limit > 16)) else c
                   for c in candidates if c.fits(n_out, k_in)]
        if not fitting:
            return None
        if fitting[0] == WIDE:      # offered only where its blocks fill the GPU (`wide_fills`)
            out.append((limit, WIDE))
            continue
        split = wide_split(n_out, k_in) if limit == 72 else None
        if split is not None:
            out.append((limit, split))
            continue
        # the wgmma candidate that fills the block slots best (the first of equals) among those
        # with the first one's rows a block, else the first configuration that tiles
        hopper = [c for c in fitting if c.wgmma and c.block_m() == next(h for h in fitting if h.wgmma).block_m()]
        out.append((limit, with_tail(max(hopper, key=lambda c: wave_efficiency(c, n_out, k_in)), n_out, k_in)
                    if hopper else fitting[0]))
    return out


def applicable(n_out: int, k_in: int, wgmma: bool = False) -> bool:
    return pick(n_out, k_in, wgmma) is not None


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
                                       16))

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


def _wgmma_kernel(n_out: int, k_in: int, cfg: Config, paired: bool = False):
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
    FULL, REST = tail_blocks(cfg, n_out, k_in)
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
                                       T.address_of(x[T.min(by * BM + i // 8, m - 1), chunk * KC + (i % 8) * 8]), 16))

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

    @T.macro
    def launch(x, w, y, m):
        if tail is not None:
            part = T.alloc_buffer((TL * m, TC), "float32")
            for b in T.thread_binding(FULL + TB, thread="blockIdx.x"):
                for by in T.thread_binding((m + BM - 1) // BM, thread="blockIdx.y"):
                    for kw in T.thread_binding(WK, thread="threadIdx.z"):
                        for nw in T.thread_binding(WN, thread="threadIdx.y"):
                            for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                                bz = T.meta_var(T.if_then_else(b < FULL, 0, (b - FULL) % TL))
                                block(x, w, y, part, m, T.if_then_else(b < FULL, b, FULL + (b - FULL) // TL), by,
                                      bz, kw, nw, lane, bz * m)
            merge(part, y, m)
        elif SPL == 1:
            for bx in T.thread_binding(NB, thread="blockIdx.x"):
                for by in T.thread_binding((m + BM - 1) // BM, thread="blockIdx.y"):
                    for kw in T.thread_binding(WK, thread="threadIdx.z"):
                        for nw in T.thread_binding(WN, thread="threadIdx.y"):
                            for lane in T.thread_binding(lanes, thread="threadIdx.x"):
                                block(x, w, y, y, m, bx, by, 0, kw, nw, lane, 0)
        else:
            part = T.alloc_buffer((SPL * m, n_out), "float32")
            for bx in T.thread_binding((n_out + BN - 1) // BN, thread="blockIdx.x"):
                for by in T.thread_binding((m + BM - 1) // BM, thread="blockIdx.y"):
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


def pairable(n_out: int, k_in: int, wgmma: bool) -> bool:
    """Whether `skinny_nt_matmul` has a ``paired`` form for this shape: every configuration `pick`
    chooses is an unsplit warpgroup kernel (the paired store pairs its accumulators), N even."""
    chosen = pick(n_out, k_in, wgmma) if wgmma and n_out % 2 == 0 else None
    return bool(chosen) and all(cfg.wgmma and cfg.splits == 1 for _, cfg in chosen)


@lru_cache(maxsize=None)
def skinny_nt_matmul(n_out: int, k_in: int, configs: tuple | None = None, wgmma: bool = False, paired: bool = False):
    """x[m, k] . W[n, k]^T -> float32 y[m, n] (m symbolic) on tensor cores, one configuration per
    range of m chosen at run time.  ``configs``: ((largest m or None, Config), ...), ascending,
    the last unbounded, to use instead of `pick`'s (benchmarks); ``wgmma``: `pick` may choose the
    sm_90a warpgroup kernel (build for sm_90a then); ``paired`` (`pairable` shapes): the kernels
    store y[r, c] and y[r, c + N / 2] one after the other (`fuse_pairs`)."""
    from specpilot.kernels.fast_frames import quick_stack
    if paired and (configs is not None or not pairable(n_out, k_in, wgmma)):
        raise ValueError(f"N={n_out}, K={k_in}: no paired form (it needs unsplit warpgroup kernels throughout)")
    with quick_stack():
        return _skinny_nt_matmul(n_out, k_in, configs, wgmma, paired)


def _skinny_nt_matmul(n_out: int, k_in: int, configs: tuple | None, wgmma: bool = False, paired: bool = False):
    from tvm.script import tirx as T

    chosen = list(configs) if configs else pick(n_out, k_in, wgmma)
    if chosen is None:
        raise ValueError(f"no skinny tensor-core configuration tiles N={n_out}, K={k_in}")
    if chosen[-1][0] is not None or any(limit is None for limit, _ in chosen[:-1]):
        raise ValueError("configs: ascending row limits, the last one None (every larger m)")
    for _, cfg in chosen:
        if cfg.stages == 1 or cfg.stages < 0:
            raise ValueError(f"{cfg}: a pipelined configuration needs stages >= 2 (0: the register kernel)")
        if not cfg.fits(n_out, k_in):
            raise ValueError(f"{cfg} does not tile N={n_out}, K={k_in}")
    launches = [(limit, _wgmma_kernel(n_out, k_in, cfg, paired) if cfg.wgmma else
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

def nt_matmul_shape(func) -> tuple[int, int] | None:
    """(N, K) when ``func`` is exactly the legalized ``x[m, K] . W[N, K]^T`` with a symbolic row
    count m (bf16 inputs, float32 products and sums, one block, nothing fused), else None."""
    parts = nt_matmul_parts(func)
    if parts is None or isinstance(parts[0], int):
        return None     # a static row count (the single-sequence decode step): `decode_gemv`'s
    return parts[1], parts[2]


def nt_matmul_parts(func) -> tuple | None:
    """(m, N, K) when ``func`` is exactly the legalized ``x[m, K] . W[N, K]^T`` (bf16 inputs, float32
    products and sums, one block, nothing fused; m an int where static, else its Var), else None."""
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import get_root_block

    if not isinstance(func, tirx.PrimFunc) or "tirx.is_scheduled" in (func.attrs or {}):
        return None
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
    except Exception:   # not a schedulable function: not ours to replace
        return None
    if len(blocks) != 1:
        return None
    block = sch.get(blocks[0])
    if len(block.reads) != 2 or len(block.writes) != 1 or len(block.iter_vars) != 3:
        return None
    (x, w), y = (r.source for r in block.reads), block.writes[0].source
    if (str(x.dtype), str(w.dtype), str(y.dtype)) != ("bfloat16", "bfloat16", "float32") or \
            len(x.shape) != 2 or len(w.shape) != 2 or len(y.shape) != 2 or \
            not all(isinstance(d, tirx.IntImm) for d in (*w.shape, x.shape[1], y.shape[1])):
        return None
    i, j, k = (iv.var for iv in block.iter_vars)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    def at(region, *vs):
        return len(region) == len(vs) and all(r.min.same_as(v) and int(r.extent) == 1 for r, v in zip(region, vs))
    if kinds != [0, 0, 2] or not (at(block.reads[0].region, i, k) and at(block.reads[1].region, j, k)
                                  and at(block.writes[0].region, i, j)):
        return None
    n, kk = int(w.shape[0]), int(w.shape[1])
    if int(x.shape[1]) != kk or int(y.shape[1]) != n:
        return None
    m = int(x.shape[0]) if isinstance(x.shape[0], tirx.IntImm) else x.shape[0]
    return (m, n, kk) if _is_plain_product(block, x, w, y) else None


def _is_plain_product(block, x, w, y) -> bool:
    """The block computes y[i, j] += f32(x[i, k]) * f32(w[j, k]) from a zero init."""
    from tvm import tirx
    from tvm.ir.expr import TensorLoad
    body, init = block.body, block.init
    if not (isinstance(init, tirx.BufferStore) and init.buffer.same_as(y) and isinstance(init.value, tirx.FloatImm)
            and init.value.value == 0):
        return False
    if not (isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add)):
        return False
    acc, prod = body.value.a, body.value.b
    if not (body.buffer.same_as(y) and isinstance(acc, TensorLoad) and acc.source.same_as(y)
            and isinstance(prod, tirx.Mul)):
        return False
    loads = []
    for side in (prod.a, prod.b):
        if not (isinstance(side, tirx.Cast) and str(side.ty) == "float32" and isinstance(side.value, TensorLoad)):
            return False
        loads.append(side.value.source)
    return loads[0].same_as(x) and loads[1].same_as(w)


def substitute(mod, wgmma: bool = False):
    """Point every call_tir of a plain bf16 NT matmul whose shape a configuration tiles at the
    tensor-core kernel (one PrimFunc per (N, K), marked scheduled so dlight leaves it alone, and
    opaque so FuseOps fuses nothing into it; `epilogue.fuse_epilogues` fuses elementwise consumers after FuseTIR)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from specpilot.schedules.epilogue import ATTR as EPILOGUE_OUTPUT, rewrite_functions
    shapes = {gv: nt_matmul_shape(f) for gv, f in mod.functions.items()}
    shapes = {gv: s for gv, s in shapes.items() if s is not None and applicable(*s, wgmma)}
    if not shapes:
        return mod, 0
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @mutator
    class _Swap(PyExprMutator):
        def __init__(self, m):
            super().__init__(m)
            self.kernels, self.swapped = {}, 0

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(call_tir) and call.args[0] in shapes:
                shape = shapes[call.args[0]]
                if shape not in self.kernels:
                    kernel = skinny_nt_matmul(*shape, wgmma=wgmma).with_attr("op_pattern", 8)   # kOpaque
                    kernel = kernel.with_attr(EPILOGUE_OUTPUT, 2)    # y: `epilogue.fuse_epilogues` may fuse its consumer
                    kernel = kernel.with_attr(SKINNY_ATTR, json.dumps({"n_out": shape[0], "k_in": shape[1],
                                                                       "wgmma": wgmma}))
                    self.kernels[shape] = self.builder_.add_func(kernel, f"skinny_mma_{shape[0]}_{shape[1]}")
                args = call.args[1].fields[:2] if isinstance(call.args[1], relax.Tuple) else call.args[1:3]
                self.swapped += 1
                return relax.call_tir(self.kernels[shape], list(args), call.ty)
            return call

    swap = _Swap(mod)
    return rewrite_functions(mod, swap, lambda: swap.swapped)


def fuse_pairs(mod):
    """After FuseTIR: a skinny kernel call whose one user maps its columns c and c + N / 2 to the
    user's c (SwiGLU over a fused gate / up projection at verification's row counts:
    `epilogue.paired_epilogue`) becomes one kernel -- the paired form (`skinny_nt_matmul` with
    ``paired``), each thread's two accumulators going straight into the user's expression, stored
    once: the activation's kernel and the float32 [m, N] between them gone (as
    `decode_gemv.fuse_pairs` does for the one-row step).  Returns (module, number fused)."""
    from specpilot.schedules.epilogue import fuse_paired_users

    def paired(spec):
        if not pairable(spec["n_out"], spec["k_in"], spec["wgmma"]):
            return None
        return skinny_nt_matmul(spec["n_out"], spec["k_in"], wgmma=spec["wgmma"], paired=True)
    return fuse_paired_users(mod, SKINNY_ATTR, paired)
