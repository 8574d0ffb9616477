"""Skinny bf16 GEMMs on the GPU, side by side in one run: y[M, N] = x[M, K] . W[N, K]^T.

    python bench/skinny_gemm.py build LIB.so     # on the CPU machine, with the stub driver
    python bench/skinny_gemm.py run LIB.so [--out DIR]

For the issue-4 shapes and the 27B-style lm_head, M in {1, 2, 4, 8, 16, 32, 65}:
`schedules.skinny_mma` (its configurations, each alone, and the shipped M dispatch) vs what the
``nt-gemv`` set runs (dlight's low-batch GEMV for decode batches, the bf16 WMMA schedule or
dlight's CUDA-core Matmul for more rows, dlight's GEMV for one static row) vs torch bf16
(cuBLAS).  Medians over rotating weight buffers (more bytes than the L2 holds), every kernel of a
shape timed round-robin with the others (`timed_interleaved`, since session 19); every kernel
checked against the float32 product of the same bf16 values.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SKINNY_SHAPES"].split(",")] \
    if os.environ.get("SKINNY_SHAPES") else [(5120, 17408), (17408, 5120), (5120, 5120), (4096, 14336), (5120, 248320)]
# SKINNY_SHAPES=KxN,...: other (K, N) pairs, e.g. a tiny test model's (the same at build and run)
MS = [int(m) for m in os.environ.get("SKINNY_MS", "1,2,4,8,16,32,65").split(",")]   # SKINNY_MS: a subset
# SKINNY_SPLITS=2,4,...: also the shipped dispatch with K split over that many blocks (`Config.splits`)
# wherever the configuration still tiles; SKINNY_VARIANTS=name,...: only these single variants;
# SKINNY_PREVIOUS=1: also `previous_dispatch` (hopper_prev)
SPLITS = [int(v) for v in os.environ.get("SKINNY_SPLITS", "").split(",") if v]
ONLY = [v for v in os.environ.get("SKINNY_VARIANTS", "").split(",") if v]
# SKINNY_PROFILE=1: each kernel launched once after its check, untimed (under ncu: one launch each)
PROFILE = os.environ.get("SKINNY_PROFILE") == "1"


def variants():
    """name -> ((limit, Config), ...) for single configurations, plus the shipped dispatch (None)."""
    every = _variants()
    return {name: cfgs for name, cfgs in every.items() if not ONLY or name in ONLY or name in ("mma", "hopper")}


def split_variants(n: int, k: int) -> dict:
    """mma_s{S}: the shipped dispatch with each configuration's K split over S blocks where it tiles."""
    from dataclasses import replace

    from specpilot.schedules.skinny_config import pick
    out = {}
    for splits in SPLITS:
        cfgs = tuple((limit, replace(cfg, splits=splits) if replace(cfg, splits=splits).fits(n, k) else cfg)
                     for limit, cfg in pick(n, k))
        out[f"mma_s{splits}"] = cfgs
    return out


def previous_dispatch(n: int, k: int) -> dict:
    """SKINNY_PREVIOUS=1, to run beside the shipped sm_90a dispatch: ``hopper_prev``, the shipped one up to
    128 rows and beyond the ranges before `skinny_config.many_rows` sized row blocks to the batch's rows
    (144-row blocks to 144 rows, one 256-row block of two warpgroups to 256 -- where channel blocks are
    few, 72-row blocks, K split in two for a long K, to 144 and 128-row blocks to 288 -- 144-row blocks to
    432, 192 to 576, 256 beyond; no tail pieces)."""
    from specpilot.schedules.skinny_config import WIDE_SPLIT_K, Config, pick
    if os.environ.get("SKINNY_PREVIOUS") != "1":
        return {}

    def wg(mt, wn, stages, splits=1):
        return Config(mt, 4, wn, 1, stages=stages, wgmma=True, overlap=1, splits=splits)
    upto = [(limit, cfg) for limit, cfg in pick(n, k, wgmma=True) if limit is not None and limit <= 128]
    if n // 64 < 132:
        first = wg(18, 1, 4, splits=2) if k >= WIDE_SPLIT_K else wg(9, 1, 6)
        beyond = [(144, first), (288, wg(16, 2, 4))]
    else:
        beyond = [(144, wg(18, 1, 4)), (256, wg(32, 2, 4))]
    beyond += [(432, wg(18, 1, 4)), (576, wg(24, 2, 4)), (None, wg(32, 2, 4))]
    return {"hopper_prev": tuple(upto + beyond)}


def _variants():
    from specpilot.schedules.skinny_config import Config
    # "mma": the dispatch of `pick` for GPUs before Hopper; "hopper": `pick(wgmma=True)` (sm_90a)
    return {"mma": None, "hopper": None,
            "mma_1x1x8": ((None, Config(1, 1, 1, 8, 4)),), "mma_1x2x4": ((None, Config(1, 2, 1, 4, 4)),),
            "mma_2x1x8": ((None, Config(2, 1, 1, 8, 4)),), "mma_4x2x2": ((None, Config(4, 2, 2, 2, 2)),),
            "mma_9x2x2": ((None, Config(9, 2, 2, 2, 2)),), "mma_9x1x2": ((None, Config(9, 1, 2, 2, 2)),),
            # the pipelined kernel (Config.stages): cp.async chunks of W and x in a ring in shared memory
            "p2_9x2x2x2": ((None, Config(9, 2, 2, 2, 2, stages=2)),),
            "p3_9x2x2x2": ((None, Config(9, 2, 2, 2, 2, stages=3)),),
            "p3_9x2x2x1": ((None, Config(9, 2, 2, 1, 4, stages=3)),),
            "p4_9x2x4x1": ((None, Config(9, 2, 4, 1, 2, stages=4)),),
            "p4_9x1x4x1": ((None, Config(9, 1, 4, 1, 2, stages=4)),),
            "p3_9x1x2x2": ((None, Config(9, 1, 2, 2, 2, stages=3)),),
            "p4_4x2x4x1": ((None, Config(4, 2, 4, 1, 2, stages=4)),),
            "p4_2x1x4x1": ((None, Config(2, 1, 4, 1, 4, stages=4)),),
            "p4_2x1x1x8": ((None, Config(2, 1, 1, 8, 1, stages=4)),),
            # wider channel blocks at many rows: x (re-read by every block) amortized over 128-256 channels
            "p3_9x2x8x1": ((None, Config(9, 2, 8, 1, 2, stages=3)),),
            "p3_9x4x4x1": ((None, Config(9, 4, 4, 1, 2, stages=3)),),
            "p4_9x1x8x1": ((None, Config(9, 1, 8, 1, 2, stages=4)),),
            # sm_90a wgmma (Config.wgmma): per M range R = 8 / 16 / 32 / 72 rows of x as wgmma's N,
            # wn warpgroups of 64 channels, S stages of 64 k; "k": K split where channel blocks < SMs
            **{f"wg{wn}s{st}{'k' if split else ''}{'o' if ov else ''}": _wgmma_ranges(wn, st, split, ov)
               for wn, st, split, ov in ((1, 4, False, 0), (1, 6, False, 0), (2, 4, False, 0), (1, 4, True, 0),
                                         (2, 4, True, 0), (1, 4, True, 1), (2, 4, True, 1), (1, 6, True, 1),
                                         (2, 6, True, 1))},
            # many rows (prefill): 256 rows of x per block (wgmma's largest N), W re-read once per
            # 256 rows instead of per 72 -- not in the shipped dispatch until measured (SKINNY_MS=256,...)
            "wg2s3r256": ((None, Config(32, 4, 2, 1, stages=3, wgmma=True)),),
            "wg1s4r128": ((None, Config(16, 4, 1, 1, stages=4, wgmma=True, overlap=1)),),
            # batched verification (136-544 rows): row blocks of 72-256 rows, one or two warpgroups,
            # one or two 64-channel tiles a warpgroup: "wg{wn}s{S}r{rows}", "w{wn}t{T}s{S}r{rows}"
            **{f"wg{wn}s{st}r{8 * mt}": ((None, Config(mt, 4, wn, 1, stages=st, wgmma=True, overlap=1)),)
               for wn, st, mt in ((1, 6, 9), (1, 4, 18), (2, 4, 16), (2, 4, 24), (2, 4, 32))},
            **{f"w{wn}t2s{st}r{8 * mt}": ((None, Config(mt, 8, wn, 1, stages=st, wgmma=True, overlap=1)),)
               for wn, st, mt in ((1, 4, 16), (2, 3, 16))},
            # the same with K split over X blocks, where few channel blocks (N = 5120) leave SMs idle
            **{f"wg{wn}s4r{8 * mt}x{x}": ((None, Config(mt, 4, wn, 1, stages=4, wgmma=True, overlap=1, splits=x)),)
               for wn, mt, x in ((1, 16, 2), (1, 16, 4), (2, 16, 2), (1, 18, 2))},
            # 72 rows, each warpgroup multiplying T 64-channel weight tiles by the same x tile
            # (x, re-read by every block, amortized over T x 64 channels): "w{wn}t{T}s{S}[k]o"
            **{f"w{wn}t{t}s{st}{'k' if split else ''}o": ((None, Config(9, 4 * t, wn, 1, stages=st, wgmma=True,
                                                                        splits=-1 if split else 1, overlap=1)),)
               for wn, t, st, split in ((1, 2, 4, False), (1, 2, 6, False), (1, 2, 8, False), (1, 3, 4, False),
                                        (1, 3, 6, False), (2, 2, 4, False), (2, 2, 5, False), (1, 2, 4, True),
                                        (1, 3, 4, True), (1, 3, 6, True), (1, 2, 6, True))},
            # 72 rows, wn warpgroups of T 64-channel tiles, K split over X blocks: "w{wn}t{T}s{S}x{X}[o]"
            # (2 x 3 tiles: 384 channels a block, 91 blocks for 34816 channels -- one wave, as
            # cuBLAS's 192 x 72 tiles for 17408; overlap 0 at 3 stages keeps two chunks in flight)
            **{f"w{wn}t{t}s{st}x{x}{'o' if ov else ''}": ((None, Config(9, 4 * t, wn, 1, stages=st, wgmma=True,
                                                                         splits=x, overlap=ov)),)
               for wn, t, st, x, ov in ((2, 3, 3, 1, 0), (2, 3, 3, 1, 1), (1, 3, 6, 4, 1), (1, 3, 5, 4, 1),
                                        (1, 2, 8, 4, 1), (1, 2, 6, 2, 1), (1, 3, 6, 2, 1), (2, 3, 3, 2, 0),
                                        (1, 2, 8, 2, 1))},
            # 72 rows, 64 channels a block, K split over X blocks, S stages: "wg1s{S}x{X}o"
            **{f"wg1s{st}x{x}o": ((None, Config(9, 4, 1, 1, stages=st, wgmma=True, splits=x, overlap=1)),)
               for st in (4, 6, 8) for x in (2, 4, 8, 16)},
            # 72 rows, 64 channels a block, the blocks past the last whole wave with K in T pieces
            # (`Config.tail`; the shipped form where `with_tail` takes it): "wg1s{S}t{T}o"
            **{f"wg1s{st}t{t}o": ((None, Config(9, 4, 1, 1, stages=st, wgmma=True, overlap=1, tail=t)),)
               for st in (4, 6) for t in (2, 4, 8, 16)},
            **many_row_blocks()}


# batched verification (72-336 rows): row blocks sized to the batch's rows (one block of 160 for 152
# rows, two of 136 for 272, ...), one or two warpgroups of 64 channels, S stages (1 or 2 blocks an SM),
# the channel blocks past the last whole wave with K in 8 pieces ("t"), or K split over X blocks
MANY = {160: ("w1s4t", "w1s6t", "w2s4t", "w2s3", "w1s4x2", "w2s4x2", "w2s4x4"),
        208: ("w1s3t", "w1s5t", "w2s4t", "w2s3t", "w2s3x2"),
        136: ("w1s4t", "w2s4t", "w2s4x2"),
        168: ("w1s3t", "w1s5t", "w2s3t", "w2s4t", "w2s3x2"),
        112: ("w1s4t", "w2s4t"),
        80: ("w1s6t", "w2s6t", "w1s6x2"),
        # 73-128 rows (a batch of 16 verifying packed: 98-126 real rows a pass)
        64: ("w1s6t", "w1s8t", "w1s6x2"), 96: ("w1s4t", "w1s6t"), 104: ("w1s4t", "w2s4t"),
        120: ("w1s4t", "w2s4t"), 128: ("w1s3t", "w2s3t")}


def many_row_blocks() -> dict:
    """"m{rows}w{wn}s{S}[t][x{X}]" -> one configuration (`MANY`)."""
    import re

    from specpilot.schedules.skinny_config import Config
    out = {}
    for rows, forms in MANY.items():
        for form in forms:
            wn, st, rest = re.fullmatch(r"w(\d)s(\d)(.*)", form).groups()
            out[f"m{rows}{form}"] = ((None, Config(rows // 8, 4, int(wn), 1, stages=int(st), wgmma=True, overlap=1,
                                                   tail=8 if rest == "t" else 1,
                                                   splits=int(rest[1:]) if rest.startswith("x") else 1)),)
    return out


def _wgmma_ranges(wn: int, stages: int, split: bool, overlap: int = 0):
    """"o": one wgmma group left in flight past the next barrier (`Config.overlap`)."""
    from specpilot.schedules.skinny_config import Config
    return tuple((limit, Config(mt, 4, wn, 1, stages=stages, wgmma=True, splits=-1 if split else 1, overlap=overlap))
                 for limit, mt in ((8, 1), (16, 2), (32, 4), (None, 9)))


def resolve(cfgs, n: int, k: int):
    """A variant's configurations for one shape: splits=-1 stands for `with_splits`' choice."""
    from dataclasses import replace

    from specpilot.schedules.skinny_config import with_splits
    if cfgs is None:
        return None
    return tuple((limit, with_splits(replace(cfg, splits=1), n, k) if cfg.splits == -1 else cfg) for limit, cfg in cfgs)


def build(out: Path) -> None:
    import tvm
    from tvm.s_tir import dlight as dl

    from bench._common import export_kernels
    from specpilot.compiler.build import load_cuda_runtime
    from specpilot.schedules.skinny_kernels import skinny_nt_matmul
    from specpilot.schedules.tensor_core import BF16Matmul, nt_matmul
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host={"kind": "llvm"})   # wgmma: sm_90a
    funcs = {}
    with target:
        for k, n in SHAPES:
            for name, cfgs in {**variants(), **split_variants(n, k), **previous_dispatch(n, k)}.items():
                try:
                    funcs[f"{name}_{k}_{n}"] = skinny_nt_matmul(n, k, resolve(cfgs, n, k), wgmma=name == "hopper")
                except ValueError as e:
                    print(f"  {name} {k}x{n}: {e}")
            for name, func, rule in () if ONLY else (("lowbatch", nt_matmul(n, k), dl.gpu.LowBatchGEMV()),
                                                     ("tc", nt_matmul(n, k), BF16Matmul()),
                                                     ("gemv", nt_matmul(n, k, rows=1), dl.gpu.GEMV())):
                mod = dl.ApplyDefaultSchedule(rule, dl.gpu.Matmul(), dl.gpu.Fallback())(tvm.IRModule({"main": func}))
                funcs[f"{name}_{k}_{n}"] = mod["main"]
    export_kernels(funcs, target, out)


def run(lib_path: Path, out_dir: Path | None) -> None:
    import torch

    from bench._common import load_kernels, timed_interleaved, write
    lib, to_tvm = load_kernels(lib_path)
    rows = []

    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k * 3 + n)
        rotations = min(256, max(2, int(400e6 // (2 * n * k)) + 1))   # tiny shapes: timed within the L2
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda() for _ in range(rotations)]
        weights_tvm = [to_tvm(w) for w in weights]
        for m in MS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            want = x.float() @ weights[0].float().T
            y = torch.full((m, n), float("nan"), device="cuda")    # a row left unwritten shows as NaN
            x_tvm, y_tvm = to_tvm(x), to_tvm(y)
            names = [v for v in variants()] + [f"mma_s{s}" for s in SPLITS] + list(previous_dispatch(n, k)) + ([] if ONLY else
                (["lowbatch"] if m <= 8 else []) + ["tc"] + (["gemv"] if m == 1 else []))
            calls, errors = {}, {}
            for name in names:
                try:
                    fn = lib[f"{name}_{k}_{n}"]
                except Exception:   # a configuration that does not tile this shape was not built
                    continue
                y.fill_(float("nan"))
                fn(x_tvm, weights_tvm[0], y_tvm)
                torch.cuda.synchronize()
                errors[name] = float(((y - want).abs().max() / want.abs().max()).nan_to_num(float("inf")))
                calls[name] = lambda r, fn=fn: fn(x_tvm, weights_tvm[r], y_tvm)
                if PROFILE:
                    _once(calls[name])
            calls["cublas"], errors["cublas"] = (lambda r: torch.nn.functional.linear(x, weights[r])), 0.0
            if PROFILE:
                continue
            # every kernel of this shape timed round-robin (`timed_interleaved`), cuBLAS among them
            timings = timed_interleaved(calls, rotations)
            found = [(name, timings[name], errors[name]) for name in calls]
            base = statistics.median(found[-1][1])
            for name, samples, err in found:
                med = statistics.median(samples)
                rows.append({"K": k, "N": n, "M": m, "kernel": name, "median_us": med, "min_us": min(samples),
                             "max_us": max(samples), "tb_per_s": 2 * n * k / med / 1e6, "max_rel_error": err,
                             "speedup_vs_cublas": base / med})
            best = min((r for r in rows[-len(found):] if r["kernel"] != "cublas"), key=lambda r: r["median_us"])
            # the shipped dispatch: sm_90a's where it was built, else the mma.sync one
            ship = next(r for name in ("hopper", "mma") for r in rows[-len(found):] if r["kernel"] == name)
            print(f"  K={k:6d} N={n:6d} M={m:3d}  {ship['kernel']} {ship['median_us']:8.1f} us "
                  f"({ship['speedup_vs_cublas']:.2f}x cuBLAS, "
                  f"err {ship['max_rel_error']:.1e})  best {best['kernel']} {best['median_us']:.1f}  "
                  f"cublas {base:.1f}  worst err {max(r['max_rel_error'] for r in rows[-len(found):]):.1e}", flush=True)
        del weights, weights_tvm
        torch.cuda.empty_cache()
    if PROFILE:     # no timings to record: the profiler's report is the result
        return
    path = write("skinny-gemm", {"shapes": SHAPES, "ms": MS, "results": rows}, out_dir)
    print(f"wrote {path}")


def _once(fn) -> None:
    """SKINNY_PROFILE: one launch, no timing (a profiler times it)."""
    import torch
    fn(0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    from bench._common import build_or_run
    build_or_run(build, run)
