"""The CUDA W12 GEMV: its word layout checked against the exact weights by emulating the
kernel's own indexing on the CPU, and the kernels compiled to real sm_90 code here (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from specpilot.compiler.w12 import STEP, cuda_word_layout


def emulate_kernel_decode(layout: dict, n: int, k: int) -> torch.Tensor:
    """What `w12_gemv` computes as W, with its index arithmetic (word h = s*128 + q*32 + tx)."""
    hi = layout["hi"].to(torch.int64) & 0xFFFFFFFF
    lo = layout["lo"].to(torch.int64) & 0xFFFFFFFF
    base = layout["base"].to(torch.int64)[:, None]
    out = torch.empty(n, k)
    for s in range(k // STEP):
        for q in range(4):
            h = s * 128 + q * 32 + torch.arange(32)
            for b in range(4):
                hb = (hi[:, h] >> (b * 8)) & 0xFF
                lb = (lo[:, h // 2] >> (((h % 2) * 4 + b) * 4)) & 0xF
                bits = ((hb >> 7) << 15) | ((base + ((hb >> 3) & 15)) << 7) | ((hb & 7) << 4) | lb
                out[:, h * 4 + b] = (bits << 16).to(torch.int32).view(torch.float32)
    ptr, col, exact = layout["ptr"], layout["col"], layout["bits"].to(torch.int64)
    for row in range(n):   # escapes: exact value minus the placeholder their planes decode to
        for p in range(int(ptr[row]), int(ptr[row + 1])):
            placeholder = (base[row, 0] << 23).to(torch.int32).view(torch.float32)
            value = (exact[p] << 16).to(torch.int32).view(torch.float32)
            out[row, col[p]] = out[row, col[p]] + (value - placeholder)
    return out


def test_word_layout_decodes_to_the_exact_weights():
    g = torch.Generator().manual_seed(4)
    n, k = 12, 2 * STEP
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16)[3, 17] = 0            # an escape: +0
    w[5, 100] = 300.0                          # an escape: far outside the row's window
    layout = cuda_word_layout(w)
    assert int(layout["ptr"][-1]) >= 2
    assert torch.equal(emulate_kernel_decode(layout, n, k), w.float())


def test_kernels_compile_to_sm90_code_without_a_gpu(tmp_path):
    """Through the stub driver, as `specpilot compile` does: the library embeds a fatbin, no CUDA source."""
    from specpilot.compiler.build import cuda_stub_env
    out = tmp_path / "gemv.so"
    code = (
        "import sys, tvm\n"
        "from specpilot.compiler.build import load_cuda_runtime\n"
        "from specpilot.schedules.w12_gemv_cuda import w12_gemv, bf16_gemv\n"
        "assert load_cuda_runtime()\n"
        "mod = tvm.IRModule({'w12': w12_gemv(2, 64, 1024).with_attr('global_symbol', 'w12'),\n"
        "                    'bf16': bf16_gemv(2, 64, 1024).with_attr('global_symbol', 'bf16')})\n"
        "t = tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90'}, host={'kind': 'llvm'})\n"
        "with t:\n"
        "    tvm.compile(mod, target=t).export_library(sys.argv[1])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=cuda_stub_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = out.read_bytes()
    assert data.count(b"\x50\xed\x55\xba") >= 1      # a CUDA fatbin
    assert b"__global__" not in data                  # not CUDA source


def test_specpilot_compile_for_cuda_embeds_device_code(tmp_path):
    from pathlib import Path
    spec = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"
    exe = Path(sys.executable).with_name("specpilot")
    env = {k: v for k, v in os.environ.items() if k != "SPECPILOT_CUDA_STUB"}
    # with CUDA graphs: the same build, plus the static decode's kernel runs lifted into capture functions
    proc = subprocess.run([str(exe), "compile", str(spec), "--target", "cuda", "-arch=sm_90", "-o",
                           str(tmp_path / "b"), "--passes", "kernel-schedule{graph=true}", "--json"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = (tmp_path / "b" / "model.so").read_bytes()
    assert data.count(b"\x50\xed\x55\xba") >= 1 and b"__global__" not in data
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["cuda_graph"] is True and manifest["pipeline"] == "kernel-schedule{graph=true}"
    assert "target_decode_cuda_graph_capture" in manifest["functions"]
