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


def gdn_inputs(rng, B: int, n: int, H: int, dk: int, dv: int):
    """Random Gated DeltaNet recurrence inputs as the layer makes them: q (scaled), k (unit rows),
    v, g < 0, beta in (0, 1), all float32."""
    q = rng.standard_normal((B, n, H, dk)).astype("float32") * dk ** -0.5
    k = rng.standard_normal((B, n, H, dk)).astype("float32")
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, n, H, dv)).astype("float32")
    g = (-np.abs(rng.standard_normal((B, n, H))) * 0.3).astype("float32")
    beta = rng.uniform(0.05, 0.95, (B, n, H)).astype("float32")
    return q, k, v, g, beta


def loads_out_of_bounds(func) -> list[str]:
    """The loads of a PrimFunc (te's, before scheduling; constant shapes) whose indices can leave
    their buffers, as the hardware evaluates them: both sides of a ``Select`` are loaded, only the
    side taken of an ``if_then_else`` (checked under its condition).  Each found: the buffer, the
    axis, the index and the range it can take."""
    import tvm
    from tvm.sym.analyzer import Analyzer
    analyzer, found = Analyzer(), []
    leaves = {"Var", "SizeVar", "IntImm", "FloatImm", "StringImm"}

    def expr(e):
        kind = type(e).__name__
        if kind in ("BufferLoad", "TensorLoad"):     # TensorLoad: TVM 0.27's name for a buffer load
            buffer = e.buffer if kind == "BufferLoad" else e.source
            for axis, (index, extent) in enumerate(zip(e.indices, buffer.shape)):
                if not (analyzer.can_prove(index >= 0) and analyzer.can_prove(index < extent)):
                    bound = analyzer.const_int_bound(index)
                    found.append(f"{buffer.name}[axis {axis}]: {index} in [{bound.min_value}, "
                                 f"{bound.max_value}], extent {extent}")
                expr(index)
        elif kind == "Call" and str(e.op.name).endswith("if_then_else"):
            cond, then, other = e.args
            expr(cond)
            with analyzer.constraint_scope(cond):
                expr(then)
            with analyzer.constraint_scope(tvm.tirx.Not(cond)):
                expr(other)
        elif kind == "Select":
            for part in (e.condition, e.true_value, e.false_value):
                expr(part)
        elif kind == "Call":
            for arg in e.args:
                expr(arg)
        elif kind in ("Cast", "Not"):
            expr(e.value if kind == "Cast" else e.a)
        elif hasattr(e, "a") and hasattr(e, "b"):
            expr(e.a)
            expr(e.b)
        elif kind not in leaves:
            raise TypeError(f"loads_out_of_bounds: no rule for {kind}")

    def stmt(s):
        kind = type(s).__name__
        if kind == "SeqStmt":
            for part in s.seq:
                stmt(part)
        elif kind == "For":
            analyzer.bind(s.loop_var, tvm.ir.Range.from_min_extent(s.min, s.extent))
            stmt(s.body)
        elif kind == "SBlockRealize":
            stmt(s.block)
        elif kind == "SBlock":
            for iv in s.iter_vars:
                analyzer.bind(iv.var, iv.dom)
            if s.init is not None:
                stmt(s.init)
            stmt(s.body)
        elif kind in ("BufferStore", "TensorStore"):
            for index in s.indices:
                expr(index)
            expr(s.value)
        else:
            raise TypeError(f"loads_out_of_bounds: no rule for {kind}")

    stmt(func.body)
    return found


def random_parents(n: int, max_depth: int, rng) -> list[int]:
    """A random tree of n nodes as parent indices (-1: the root's child), no path deeper than max_depth."""
    parents, depth = [], []
    for i in range(n):
        options = [-1] + [j for j in range(i) if depth[j] < max_depth]
        p = int(rng.choice(options))
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
    assert max(depth) <= max_depth
    return parents


def root_path(parents, i):
    """Node i's path from the root, itself last."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]
