"""Helpers for kernel tests: run a TIR kernel on the CPU on numpy inputs, and compile kernels
for sm_90 without a GPU (in a subprocess with the stub CUDA driver) to read the CUDA source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def run_cpu(kernel, args, outs):
    """Build ``kernel`` for llvm, call it on ``args``; outputs (shape, dtype) start as NaN."""
    import tvm
    lib = tvm.compile(kernel.with_attr("global_symbol", "k"), target="llvm")
    arrays = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]
    poisoned = [tvm.runtime.tensor(np.full(shape, np.nan, dtype)) for shape, dtype in outs]
    lib["k"](*arrays, *poisoned)
    return [p.numpy() for p in poisoned]


def sm90_source(tmp_path: Path, setup: str, funcs: str, arch: str = "sm_90") -> str:
    """The CUDA source of ``funcs`` (a Python expression: dict name -> PrimFunc, after ``setup``)
    compiled for ``arch`` (sm_90, or sm_90a for wgmma) on this machine, no GPU or driver needed;
    nvcc assembles it, so PTX the architecture rejects fails here."""
    from specpilot.compiler.build import cuda_stub_env
    src = tmp_path / "kernels.cu"
    code = (
        "import sys, tvm\n"
        "from specpilot.compiler.build import load_cuda_runtime\n"
        f"{setup}\n"
        "assert load_cuda_runtime()\n"
        f"t = tvm.target.Target({{'kind': 'cuda', 'arch': '{arch}'}}, host={{'kind': 'llvm'}})\n"
        f"funcs = {funcs}\n"
        "with t:\n"
        "    lib = tvm.compile(tvm.IRModule({n: f.with_attr('global_symbol', n) for n, f in funcs.items()}), target=t)\n"
        "todo, found = [lib.mod], []\n"
        "while todo:\n"
        "    m = todo.pop(); todo.extend(m.imports)\n"
        "    found += [m.inspect_source()] if m.kind == 'cuda' else []\n"
        "open(sys.argv[1], 'w').write(''.join(found))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(src)], env=cuda_stub_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return src.read_text()
