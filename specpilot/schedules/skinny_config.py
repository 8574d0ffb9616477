"""Which skinny-GEMM configuration runs a shape (`skinny_kernels`): tile layouts, pipeline depth and
K splits per range of rows, chosen to fill the GPU's block slots (one wave of blocks, a nearly
empty last wave split over K, 128-channel blocks where they fill the GPU).  The card's SM count,
shared memory per block and per SM and threads per SM come from the device table (``gpu``: the
target's `core.target.Device`); the candidate tables were measured on the H200 (`TUNED`), and on a
card with less shared memory per block the candidates whose ring does not fit give way to the
next ones (sm_89 / sm_120, 99 KiB: 72-row blocks of 32 channels, 96 KiB, not 64, 138 KiB)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specpilot.core.target import TUNED, Device


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
    rows_first: bool = True  # row blocks as blockIdx.x: the blocks sharing a weight tile launch together, so
                             # all but the first read it from the L2 (else every row block streams W again)

    def block_n(self) -> int:
        return 16 * self.a_tiles * self.wn

    def block_m(self) -> int:
        return 8 * self.m_tiles

    def fits(self, n_out: int, k_in: int, k_step: int = 32, gpu: Device = TUNED) -> bool:
        """Whether the configuration tiles N and K (each of the wk warps taking whole k steps) and,
        pipelined, its ring of chunks fits in a block's shared memory on ``gpu`` (wgmma: on sm_90a)."""
        if self.threads() > gpu.threads_per_block:
            return False
        if self.wgmma:
            # one to three 64-channel tiles per warpgroup (the last block of a ragged N clamps its
            # weight rows and stores only real channels), x rows as wgmma's N (a multiple of 8,
            # <= 256), 64-k chunks
            return (n_out % 8 == 0 and self.a_tiles in (4, 8, 12) and self.wk == 1 and self.stages >= 2 + self.overlap
                    and (self.tail == 1 or (self.tail > 1 and self.splits == 1 and k_in % (self.tail * WGMMA_K) == 0))
                    and self.block_m() * self.a_tiles <= 4 * 256   # <= 128 accumulators a thread
                    and self.block_m() <= 256 and k_in % (self.splits * WGMMA_K) == 0
                    and self.shared_bytes(k_in) <= gpu.shared_per_block)
        if n_out % self.block_n() or k_in % (self.splits * k_step * self.wk) or (self.splits > 1 and not self.stages):
            return False
        # pipelined: at least two chunks per block (the regime the H200 runs checked; one chunk takes
        # the register kernel) and a ring that fits in a block's shared memory
        return not self.stages or (k_in // self.splits >= 2 * self.chunk(k_in)
                                   and self.shared_bytes(k_in) <= gpu.shared_per_block)

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


def configs(n_out: int, wgmma: bool = False, gpu: Device = TUNED) -> tuple:
    """The (largest M, candidates) ranges for an N-channel GEMM; ``wgmma`` (sm_90a): the
    warpgroup kernel's candidates first (any N a multiple of 8: a ragged last block of channels).
    A 32-row tile of 128 channels pays from 64 channel blocks an SM (H200: N = 14336, 112 blocks),
    not at 5120 (40)."""
    wide = (Config(4, 2, 4, 1, 2, stages=4),) if n_out >= 64 * gpu.sms else ()
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
    few = n_out // 64 < gpu.sms

    def wg(mt, wn, stages, overlap=1):
        return Config(mt, 4, wn, 1, stages=stages, wgmma=True, overlap=overlap)
    hopper = {8: (wg(1, 1, 6), wg(1, 1, 4)),
              16: () if few else (wg(2, 1, 6), wg(2, 1, 4)),
              32: (wg(4, 1, 6), wg(4, 1, 4)),
              72: (wg(9, 1, 6), wg(9, 2, 4, overlap=0))}
    wide = (WIDE,) if wide_fills(n_out, gpu) else ()
    # 73-128 rows (long chains, small batched trees, a batch of 16 verifying packed): 128 rows of x a block
    # (gate / up 5120 -> 34816 at 128 rows 205 -> 154 us against the 72-row blocks), except where few
    # channel blocks leave SMs idle: there the split 72-row blocks (17408 -> 5120 at 128 rows: 113 us vs
    # 145); and with four to eight 64-channel blocks an SM (the paired gate / up, 544 blocks) two 80-row
    # blocks, `many_rows`' form up to 160 rows (H100, 98 / 114 / 126 rows: 162 / 168 / 171 us against
    # 172 / 175 / 178; bench/README "Skinny GEMMs").  Beyond: `many_rows`.
    ranges = [(limit or 72, (wide if limit is None else ()) + hopper[limit or 72] + candidates)
              for limit, candidates in mma]
    rest = hopper[72] + mma[-1][1]
    paired = (wg(10, 1, 6),) if 4 * gpu.sms <= n_out // 64 < 8 * gpu.sms else ()
    return tuple(ranges) + ((128, (rest if few else paired + (wg(16, 1, 4),) + rest)),)


def many_rows(n_out: int, k_in: int, gpu: Device = TUNED) -> list[tuple[int | None, Config]]:
    """sm_90a beyond 128 rows (batched verification: 144-272 rows a pass at batch 16, 160-544 at 32;
    prefill chunks): row blocks sized so that the batch's rows pad little and the blocks fill whole
    waves of the GPU's block slots, the channel blocks past the last whole wave with K in pieces
    (`tail_split`).  From the H200 sweep of bench/skinny_gemm.py at 152 / 200 / 272 / 330 rows (bench/README
    "Skinny GEMMs", the 27B-class shapes), by how many 64-channel blocks N makes:

    - at least eight an SM (a 248320-token head): as the next, but one 144-row block up to 144 rows and one
      256-row block at 161-256 (1081 us at 240 rows against 1543 for two 160-row blocks: two row blocks
      of a memory-bound head read its weights twice);
    - at least two an SM (5120 -> 17408): two 80-row blocks up to 160 rows (two blocks an SM, the row
      blocks sharing each weight tile through the L2: 78 us at 152 rows against 135 for one 256-row
      block), one 208-row block of two warpgroups up to 208, two 160-row blocks up to 320, two of 168
      up to 336;
    - one to two an SM (10240, 12288): one 160-row block of two warpgroups up to 160 (57 vs 67 us), 256 rows
      up to 256, two 160-row blocks of three stages (two an SM) up to 320, three 112-row blocks up to 336;
    - fewer than SMs (5120, 6144): two 80-row blocks up to 160 (34-39 vs 47-54 us; a K of 16384 or more:
      one 160-row block of two warpgroups, K split in two, 95 vs 142), three 72-row blocks up to 216
      where their blocks fit one wave of slots (else one 208-row block: 44 vs 48 at N = 6144), three
      128-row blocks of two warpgroups up to 288 where they fit one wave (else two of 160: 52 vs 89 us at
      272 rows, N = 6144), two 160-row blocks up to 320, three 112-row blocks up to 336 where they fit
      one wave (else two of 168).

    Beyond 336 rows, 144-row blocks up to 432, 192 up to 576 and 256 beyond; neighbouring ranges with one
    configuration are one range.  A shape of at most ``TINY_N`` channels (the hybrid's 48-channel gate
    projections) splits K over up to 16 blocks, else one or two blocks would run alone."""
    def wg(rows, wn, stages, splits=1):
        return Config(rows // 8, 4, wn, 1, stages=stages, wgmma=True, overlap=1, splits=splits)
    blocks = -(-n_out // 64)

    def one_wave(cfg, row_blocks):
        return row_blocks * -(-n_out // cfg.block_n()) * cfg.splits <= block_slots(cfg, k_in, gpu)
    r80, r72, r112, r160, r168 = wg(80, 1, 6), wg(72, 1, 6), wg(112, 1, 4), wg(160, 2, 4), wg(168, 2, 4)
    r128, r208, r256 = wg(128, 2, 4), wg(208, 2, 4), wg(256, 2, 4)
    if blocks >= 8 * gpu.sms:
        ranges = [(144, wg(144, 1, 4)), (160, r80), (256, r256), (320, r160), (336, r168)]
    elif blocks >= 2 * gpu.sms:
        ranges = [(160, r80), (208, r208), (320, r160), (336, r168)]
    elif blocks >= gpu.sms:
        ranges = [(160, r160), (256, r256), (320, wg(160, 2, 3)), (336, r112)]
    else:
        long_k = k_in >= WIDE_SPLIT_K
        ranges = [(160, wg(160, 2, 4, splits=2) if long_k else r80),
                  (216, (wg(80, 1, 6, splits=2) if long_k else r72) if one_wave(r72, 3) else wg(208, 1, 5)),
                  (288, r128 if one_wave(r128, 3) else r160), (320, r160),
                  (336, r112 if one_wave(r112, 3) else r168)]
    ranges = [(limit, tail_split(cfg, n_out, k_in, gpu)) for limit, cfg in ranges]
    ranges += [(432, wg(144, 1, 4)), (576, wg(192, 2, 4)), (None, wg(256, 2, 4))]
    if n_out <= TINY_N:
        ranges = [(limit, tiny_split(cfg, n_out, k_in, gpu)) for limit, cfg in ranges]
    return [(limit, cfg) for i, (limit, cfg) in enumerate(ranges) if i + 1 == len(ranges) or ranges[i + 1][1] != cfg]


TINY_N = 256        # channels up to which `many_rows` splits K over many blocks
TINY_SPLIT_K = 256  # k per block at least, there


def tiny_split(cfg: Config, n_out: int, k_in: int, gpu: Device = TUNED) -> Config:
    """``cfg`` with K split over the most blocks (<= 16) that keep >= ``TINY_SPLIT_K`` k each."""
    splits = [s for s in (16, 8, 4, 2) if k_in // s >= TINY_SPLIT_K and replace(cfg, splits=s).fits(n_out, k_in, gpu=gpu)]
    return replace(cfg, splits=splits[0]) if splits else cfg


# 33-72 rows: one warpgroup multiplying two 64-channel weight tiles by each x tile, 8 stages (one
# block an SM), where those 128-channel blocks fill the GPU -- one wave of at least 80 % of the SMs
# or at least 8 waves (`wide_fills`); elsewhere the last wave's few blocks run alone and it loses.
# H200, 65 rows (us, vs the 64-channel pick; bench/README "Skinny GEMMs"): 5120 -> 16480 (129
# blocks) 47.8 vs 52.2, -> 14336 (112) 43.6 vs 47.2, -> 248320 648.4 vs 656.7 (cuBLAS 46.9 / 42.1
# / 616.4); -> 34816 (272 blocks, 2.06 waves) 114.0 vs 108.0; with K split over blocks (N = 5120,
# 17408 -> 5120) two tiles lose too (6 stages, split 8: 72.1 vs 61.2).  Three
# tiles (192 channels, 6 stages) are no better where they fit (-> 248320 646.0, -> 16480 51.6).
WIDE = Config(9, 8, 1, 1, stages=8, wgmma=True, overlap=1)


def wide_fills(n_out: int, gpu: Device = TUNED) -> bool:
    """Whether `WIDE`'s blocks of an N-channel GEMM (one an SM) fill one wave to >= 80 % of the
    SMs or make >= 8 waves (a last partial wave then costs little)."""
    blocks = -(-n_out // WIDE.block_n())
    return 0.8 * gpu.sms <= blocks <= gpu.sms or blocks >= 8 * gpu.sms


WIDE_SPLIT_K = 16384   # k from which `wide_split` takes WIDE with K split in two


def wide_split(n_out: int, k_in: int, gpu: Device = TUNED) -> Config | None:
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
    if k_in < WIDE_SPLIT_K or n_out // 64 >= gpu.sms or not cfg.fits(n_out, k_in, gpu=gpu):
        return None
    return cfg


def block_slots(cfg: Config, k_in: int, gpu: Device = TUNED) -> int:
    """The blocks of ``cfg`` the GPU runs at once: SMs x blocks per SM (by shared memory -- each
    block also reserves 1 KiB -- and threads)."""
    per_sm = min(gpu.shared_per_sm // (cfg.shared_bytes(k_in) + 1024), gpu.threads_per_sm // cfg.threads())
    return gpu.sms * max(per_sm, 1)


def wave_efficiency(cfg: Config, n_out: int, k_in: int, gpu: Device = TUNED) -> float:
    """How well one row block of ``cfg``'s blocks fills the GPU's block slots (`block_slots`): 1
    when they fit in one wave, else waves / whole waves (a last wave with few blocks runs nearly
    alone)."""
    waves = -(-n_out // cfg.block_n()) * cfg.splits / block_slots(cfg, k_in, gpu)
    return 1.0 if waves <= 1 else waves / -(-waves // 1)


def tail_blocks(cfg: Config, n_out: int, k_in: int, gpu: Device = TUNED) -> tuple[int, int]:
    """(whole-K channel blocks, channel blocks past the last whole wave of `block_slots`) of one
    row block; (all, 0) within one wave.  The paired form has as many blocks (N / 2 pairs, block_n / 2
    a block)."""
    blocks, slots = -(-n_out // cfg.block_n()), block_slots(cfg, k_in, gpu)
    rest = blocks % slots if blocks > slots else 0
    return blocks - rest, rest


TAIL_MOST = 0.25    # split the last wave's K where it holds at most this share of the block slots


def with_tail(cfg: Config, n_out: int, k_in: int, gpu: Device = TUNED) -> Config:
    """An unsplit 72- or 80-row warpgroup configuration whose last wave of channel blocks is nearly empty
    (at most ``TAIL_MOST`` of the block slots) with those blocks' K in pieces (`tail_split`): 5120 -> 34816
    (the 27B gate / up, 544 blocks of 64 channels in 264 slots) runs 528 whole blocks and 16 x 8 eighths
    instead of 2 waves and 16 blocks alone.  H200, 65 rows round-robin (bench/README "Skinny GEMMs"):
    107.3 us vs 116.0 unsplit (cuBLAS 107.0; 2 / 4 / 16 pieces 108.0 / 107.5 / 108.3); the 27B-style
    tree verification 2054-2056 vs 2062-2068 us; bf16 forcing of bench/specs/tiny-llama-tail-mlp-bf16.yaml,
    paired form, passes."""
    if not cfg.wgmma or cfg.splits != 1 or cfg.a_tiles != 4 or cfg.block_m() not in (72, 80):
        return cfg
    _, rest = tail_blocks(cfg, n_out, k_in, gpu)
    if rest > TAIL_MOST * block_slots(cfg, k_in, gpu):
        return cfg
    return tail_split(cfg, n_out, k_in, gpu)


def tail_split(cfg: Config, n_out: int, k_in: int, gpu: Device = TUNED) -> Config:
    """An unsplit warpgroup configuration with the channel blocks past its last whole wave (`tail_blocks`)
    taking K in the most pieces (<= 8, whole 64-k chunks) that keep those pieces within one block an SM;
    their partial sums go to a float32 workspace that a second kernel adds in a fixed order
    (deterministic).  ``cfg`` itself where no wave is left partial or K does not divide."""
    if not cfg.wgmma or cfg.splits != 1:
        return cfg
    _, rest = tail_blocks(cfg, n_out, k_in, gpu)
    if not rest:
        return cfg
    pieces = [t for t in (8, 4, 2) if rest * t <= gpu.sms and replace(cfg, tail=t).fits(n_out, k_in, gpu=gpu)]
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


SPLIT_K_MIN = 2048   # k per block below which splitting K over more blocks costs more than it saves


def with_splits(cfg: Config, n_out: int, k_in: int, gpu: Device = TUNED) -> Config:
    """A pipelined configuration whose channel blocks alone leave SMs idle (fewer blocks than SMs,
    at one block of rows) with K split over the most blocks (<= 8) that keep >= ``SPLIT_K_MIN`` k
    each.  H200 (docs/bench-log.md): N = 5120 at 65 rows, K = 17408 111 -> 76 us (8 splits), K =
    6144 43.6 -> 32.3 (3); at 1 row 64.9 -> 51.1 / 28.5 -> 21.0; shapes with more channel blocks
    than SMs (N >= 14336) do not gain and keep one.  `pick` splits the mma
    kernels only beyond 16 rows: in decode batches of 4 / 8 (Qwen3-8B shapes) the second kernel's
    launch costs more than the split saves (3.17 -> 3.32 ms at batch 4, 3.32 -> 3.59 at 8), while
    tree verification gains (3495 -> 3319 us); the wgmma kernel's split pays at every row count
    (see `pick`)."""
    if not cfg.stages or n_out // cfg.block_n() >= gpu.sms:
        return cfg
    splits = [s for s in range(2, 9) if k_in // s >= SPLIT_K_MIN and replace(cfg, splits=s).fits(n_out, k_in, gpu=gpu)]
    return replace(cfg, splits=max(splits)) if splits else cfg


def pick(n_out: int, k_in: int, wgmma: bool = False, gpu: Device = TUNED) -> list[tuple[int | None, Config]] | None:
    """One configuration per M range for this shape, or None when no configuration tiles it.  K
    is split over blocks beyond 16 rows, and by the wgmma kernel at any row count (its split
    measured faster at 1-8 rows too: 17408 -> 5120 47 vs 76 us unsplit)."""
    out = []
    for limit, candidates in configs(n_out, wgmma, gpu):
        fitting = [with_splits(c, n_out, k_in, gpu) if (c.wgmma and c.block_m() <= 72 and c.a_tiles == 4) or
                   (not c.wgmma and (limit is None or limit > 16)) else c
                   for c in candidates if c.fits(n_out, k_in, gpu=gpu)]
        if not fitting:
            return None
        if fitting[0] == WIDE:      # offered only where its blocks fill the GPU (`wide_fills`)
            out.append((limit, WIDE))
            continue
        split = wide_split(n_out, k_in, gpu) if limit == 72 else None
        if split is not None:
            out.append((limit, split))
            continue
        # the wgmma candidate that fills the block slots best (the first of equals) among those
        # with the first one's rows a block, else the first configuration that tiles
        hopper = [c for c in fitting if c.wgmma and c.block_m() == next(h for h in fitting if h.wgmma).block_m()]
        out.append((limit, with_tail(max(hopper, key=lambda c: wave_efficiency(c, n_out, k_in, gpu)), n_out, k_in, gpu)
                    if hopper else fitting[0]))
    if wgmma and out[-1][0] is not None:
        many = many_rows(n_out, k_in, gpu)
        if not all(cfg.fits(n_out, k_in, gpu=gpu) for _, cfg in many):
            return out[:-1] + [(None, out[-1][1])]     # the 73-128-row choice for every larger m
        out += many
    return out


def applicable(n_out: int, k_in: int, wgmma: bool = False, gpu: Device = TUNED) -> bool:
    return pick(n_out, k_in, wgmma, gpu) is not None
