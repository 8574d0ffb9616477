"""W12 decode-fused GEMV vs the same schedule over bf16 vs torch bf16 (cuBLAS), side by side:
the TIR CUDA kernels (`schedules/w12_gemv_cuda.py`) and the Triton ones (`schedules/w12_triton.py`,
W12 and its bf16 twin; the best of a few tile configs at M = 1, the default elsewhere).

    python bench/w12_gemm.py build OUT.so            # any machine with nvcc: the kernels, sm_90
    python bench/w12_gemm.py run OUT.so [--out DIR]  # on the GPU, TVM runtime only

Shapes x[M, K] . W[N, K]^T for (K, N) in SHAPES and M in MS; weights seeded random bf16
(N(0, 0.02)), rotated over several buffers so L2 holds none of them; results checked against
x.float() @ W.float().T; medians of 7 timed loops of 20 calls, with the spread.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(5120, 17408), (17408, 5120), (5120, 5120), (4096, 14336)]
MS = [1, 2, 4, 8, 16, 32, 64]


def _triton_configs(m: int, n: int, k: int) -> list[dict]:
    """The default config, plus a few tile / split variants at M = 1."""
    from specpilot.schedules import w12_triton as wt
    default = wt._config(m, n, k, torch_bf16())
    if m != 1:
        return [default]
    out = [default]
    for bn, bk, split, warps in ((8, 512, 1, 4), (16, 256, 2, 4), (32, 256, 4, 8), (64, 128, 4, 8)):
        if m >= 16:
            bk = min(bk, 128)
        if k % (split * bk) == 0:
            out.append({**default, "BN": bn, "BK": bk, "split": split, "num_warps": warps})
    return out


def torch_bf16():
    import torch
    return torch.bfloat16


def build(out: Path) -> None:
    import tvm

    from specpilot.compiler.build import load_cuda_runtime
    from specpilot.schedules.w12_gemv_cuda import bf16_gemv, w12_gemv
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    funcs = {}
    for k, n in SHAPES:
        for m in MS:
            funcs[f"w12_{k}_{n}_{m}"] = w12_gemv(m, n, k).with_attr("global_symbol", f"w12_{k}_{n}_{m}")
            funcs[f"bf16_{k}_{n}_{m}"] = bf16_gemv(m, n, k).with_attr("global_symbol", f"bf16_{k}_{n}_{m}")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    with target:
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
    lib.export_library(str(out))
    print(f"wrote {out} ({len(funcs)} kernels)")


def run(lib_path: Path, out_dir: Path | None) -> None:
    import torch
    import tvm

    from bench._common import timed_rotating, write
    from specpilot.runtime.engine import _import_tvm_runtime
    from specpilot.compiler.w12 import cuda_word_layout
    from specpilot.schedules import w12_triton as wt
    _import_tvm_runtime(gpu=True)
    lib = tvm.runtime.load_module(str(lib_path))
    dev = torch.device("cuda")
    to_tvm = tvm.runtime.from_dlpack
    rows = []


    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k * 7 + n)
        weight = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        layout = cuda_word_layout(weight)
        w12_bytes = sum(t.numel() * t.element_size() for t in layout.values())
        rotations = max(2, int(400e6 // (2 * n * k)) + 1)
        weights = [weight.to(dev) for _ in range(rotations)]
        planes = [{name: t.to(dev) for name, t in layout.items()} for _ in range(rotations)]
        planes_tvm = [{name: to_tvm(t) for name, t in p.items()} for p in planes]
        weights_tvm = [to_tvm(w) for w in weights]
        reference_w = weights[0].float()
        tri_w12 = [wt.W12Matrix(w, dev) for w in weights[:min(rotations, 4)]] if wt.triton is not None else []
        for m in MS:
            x = (torch.randn(m, k, generator=gen)).to(torch.bfloat16).to(dev)
            x_tvm = to_tvm(x)
            y = torch.empty(m, n, dtype=torch.float32, device=dev)
            y_tvm = to_tvm(y)
            want = x.float() @ reference_w.T
            f_w12, f_bf16 = lib[f"w12_{k}_{n}_{m}"], lib[f"bf16_{k}_{n}_{m}"]

            def w12(r):
                p = planes_tvm[r]
                f_w12(x_tvm, p["hi"], p["lo"], p["base"], p["ptr"], p["col"], p["bits"], y_tvm)

            def ours_bf16(r):
                f_bf16(x_tvm, weights_tvm[r], y_tvm)

            def cublas(r):
                torch.nn.functional.linear(x, weights[r])

            w12(0)
            torch.cuda.synchronize()
            err_w12 = ((y - want).abs().max() / want.abs().max()).item()
            ours_bf16(0)
            torch.cuda.synchronize()
            err_bf16 = ((y - want).abs().max() / want.abs().max()).item()
            candidates = [("w12", w12, w12_bytes, err_w12, None), ("bf16 (ours)", ours_bf16, 2 * n * k, err_bf16, None),
                          ("cublas bf16", cublas, 2 * n * k, 0.0, None)]
            if tri_w12:
                for label, mats, nbytes in (("triton w12", tri_w12, tri_w12[0].nbytes), ("triton bf16", weights, 2 * n * k)):
                    best = None
                    for cfg in _triton_configs(m, n, k):
                        try:
                            got = wt.gemm(x, mats[0], cfg)
                            torch.cuda.synchronize()
                            err = ((got - want).abs().max() / want.abs().max()).item()
                            samples = timed_rotating(lambda r, c=cfg: wt.gemm(x, mats[r % len(mats)], c),
                                                     rotations)
                        except Exception as e:   # a config Triton cannot compile is skipped, and said
                            print(f"  {label} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                            continue
                        if best is None or statistics.median(samples) < statistics.median(best[1]):
                            best = (cfg, samples, err)
                    if best is not None:
                        candidates.append((label, best[1], nbytes, best[2], best[0]))
            for name, fn, nbytes, err, cfg in candidates:
                samples = fn if isinstance(fn, list) else timed_rotating(fn, rotations)
                med = statistics.median(samples)
                rows.append({"K": k, "N": n, "M": m, "kernel": name, "median_us": med, "min_us": min(samples),
                             "max_us": max(samples), "weight_bytes": nbytes, "tb_per_s": nbytes / med / 1e6,
                             "max_rel_error": err, **({"config": cfg} if cfg else {})})
            base = next(r for r in rows if r["K"] == k and r["N"] == n and r["M"] == m and r["kernel"] == "cublas bf16")
            for r in rows:
                if r["K"] == k and r["N"] == n and r["M"] == m:
                    r["speedup_vs_cublas"] = base["median_us"] / r["median_us"]
        del weights, planes, planes_tvm, weights_tvm, tri_w12
        torch.cuda.empty_cache()
    path = write("w12-gemm", {"shapes": SHAPES, "ms": MS, "results": rows}, out_dir)
    print(f"{'K':>6s} {'N':>6s} {'M':>3s} {'kernel':12s} {'us':>8s} {'TB/s':>6s} {'vs cuBLAS':>9s} {'rel err':>8s}")
    for r in rows:
        print(f"{r['K']:6d} {r['N']:6d} {r['M']:3d} {r['kernel']:12s} {r['median_us']:8.1f} {r['tb_per_s']:6.2f} "
              f"{r['speedup_vs_cublas']:9.2f} {r['max_rel_error']:8.1e}")
    print(f"wrote {path}")


if __name__ == "__main__":
    from bench._common import build_or_run
    build_or_run(build, run)
