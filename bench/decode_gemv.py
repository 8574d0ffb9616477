"""The batch-1 decode GEMV on the GPU, side by side in one run: y[1, N] = x[1, K] . W[N, K]^T,
alone and with the RMSNorm before it.

    python bench/decode_gemv.py build LIB.so     # on the CPU machine, with the stub driver
    python bench/decode_gemv.py run LIB.so [--out DIR]

Per (K, N) of the Qwen3-8B and Qwen3.5-27B-style decode steps: `schedules.decode_gemv` (plain,
and with the norm as its prologue) vs what builds ran before it (dlight's GEMV for one static
row; the RMSNorm kernel dlight's GeneralReduction schedules, then that GEMV) vs torch (cuBLAS
linear; torch's norm then linear).  Medians over rotating weight buffers (more bytes than the L2
holds), 20 back-to-back calls a sample.  Checks: the plain kernel against the float32 product of
the same bf16 values; the norm form against `lower`'s RMSNorm arithmetic done by torch (h =
x / sqrt(mean(x^2) + eps) rounded to bf16, times g, rounded) then the float32 product, and against
the two-kernel path it replaces (a different float32 order of the sum of squares can move a
normalized element by one bf16 step).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EPS = 1e-6
# (K, N): Qwen3-8B qkv (fused), o, gate/up (fused), down, lm_head; 27B-style gate/up, down, lm_head
SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936),
          (5120, 34816), (17408, 5120), (5120, 248320)]
NORM = json.dumps({"eps": EPS, "zero_centered": False, "spelled": False})


def build(out: Path) -> None:
    import tvm
    from tvm import te

    from bench._common import export_kernels
    from specpilot.compiler.build import load_cuda_runtime
    from specpilot.kernels.norms import rms_norm_te
    from specpilot.schedules.decode_gemv import applicable, decode_gemv
    from specpilot.schedules.relax_pipeline import gpu_schedules
    from specpilot.schedules.tensor_core import nt_matmul
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    funcs = {}
    for k, n in SHAPES:
        if applicable(n, k):
            funcs[f"ours_{k}_{n}"] = decode_gemv(n, k)
            funcs[f"oursnorm_{k}_{n}"] = decode_gemv(n, k, NORM)
        funcs[f"dlight_{k}_{n}"] = nt_matmul(n, k, rows=1)
    for k in sorted({k for k, _ in SHAPES}):
        x, w = te.placeholder((1, k), "bfloat16", "x"), te.placeholder((k,), "bfloat16", "w")
        funcs[f"norm_{k}"] = te.create_prim_func([x, w, rms_norm_te(EPS, False, "bfloat16", False)(x, w)])
    export_kernels(funcs, target, out, gpu_schedules())


def run(lib_path: Path, out_dir: Path | None) -> None:
    import torch

    from bench._common import load_kernels, timed_rotating, write
    lib, to_tvm = load_kernels(lib_path)
    rows = []

    def rel(a, b):
        return float(((a - b).abs().max() / b.abs().max()).nan_to_num(float("inf")))

    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k * 7 + n)
        rotations = max(2, int(400e6 // (2 * n * k)) + 1)
        weights = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda() for _ in range(rotations)]
        weights_tvm = [to_tvm(w) for w in weights]
        x = (torch.randn(1, k, generator=gen) * 3).to(torch.bfloat16).cuda()
        g = (1 + 0.1 * torch.randn(k, generator=gen)).to(torch.bfloat16).cuda()
        h = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
        normed = (h.to(torch.bfloat16).float() * g.float()).to(torch.bfloat16)
        want, want_norm = x.float() @ weights[0].float().T, normed.float() @ weights[0].float().T
        y = torch.full((1, n), float("nan"), device="cuda")
        xn = torch.empty(1, k, dtype=torch.bfloat16, device="cuda")
        x_t, g_t, y_t, xn_t = to_tvm(x), to_tvm(g), to_tvm(y), to_tvm(xn)
        found = {}
        try:
            ours, ours_norm = lib[f"ours_{k}_{n}"], lib[f"oursnorm_{k}_{n}"]
        except Exception:    # not applicable to this shape: not built
            ours = ours_norm = None
        dlight, norm = lib[f"dlight_{k}_{n}"], lib[f"norm_{k}"]
        checks = {}
        if ours is not None:
            y.fill_(float("nan"))
            ours(x_t, weights_tvm[0], y_t)
            torch.cuda.synchronize()
            checks["ours"] = rel(y, want)
            found["ours"] = timed_rotating(lambda r: ours(x_t, weights_tvm[r], y_t), rotations)
            y.fill_(float("nan"))
            ours_norm(x_t, g_t, weights_tvm[0], y_t)
            torch.cuda.synchronize()
            got_norm = y.clone()
            checks["ours_norm"] = rel(got_norm, want_norm)
            found["ours_norm"] = timed_rotating(lambda r: ours_norm(x_t, g_t, weights_tvm[r], y_t), rotations)
        y.fill_(float("nan"))
        dlight(x_t, weights_tvm[0], y_t)
        torch.cuda.synchronize()
        checks["dlight"] = rel(y, want)
        found["dlight"] = timed_rotating(lambda r: dlight(x_t, weights_tvm[r], y_t), rotations)
        norm(x_t, g_t, xn_t)
        dlight(xn_t, weights_tvm[0], y_t)
        torch.cuda.synchronize()
        checks["norm_then_dlight"] = rel(y, want_norm)
        if ours is not None:
            checks["ours_norm_vs_norm_then_dlight"] = rel(got_norm, y)
        found["norm_then_dlight"] = timed_rotating(
            lambda r: (norm(x_t, g_t, xn_t), dlight(xn_t, weights_tvm[r], y_t)), rotations)
        found["cublas"] = timed_rotating(lambda r: torch.nn.functional.linear(x, weights[r]), rotations)
        checks["cublas"] = 0.0
        base = statistics.median(found["dlight"])
        for name, samples in found.items():
            med = statistics.median(samples)
            rows.append({"K": k, "N": n, "kernel": name, "median_us": med, "min_us": min(samples), "max_us": max(samples),
                         "weight_tb_per_s": 2 * n * k / med / 1e6, "vs_dlight": base / med,
                         "max_rel_error": checks.get(name)})
        line = "  ".join(f"{name} {statistics.median(s):7.1f}" for name, s in found.items())
        print(f"  K={k:6d} N={n:6d}  {line}  us   errors {json.dumps({a: f'{b:.1e}' for a, b in checks.items()})}",
              flush=True)
        del weights, weights_tvm
        torch.cuda.empty_cache()
    path = write("decode-gemv", {"shapes": SHAPES, "eps": EPS, "results": rows}, out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    from bench._common import build_or_run
    build_or_run(build, run)
