"""The cpu-nt matmul schedule (`schedules.cpu_matmul`) against NumPy on fresh random inputs: row counts
1 / 7 / 33 and a batch axis, with a fused epilogue; a shape it does not fit keeps TVM's loops."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from specpilot.schedules.cpu_matmul import cpu_matmuls
from specpilot.schedules.relax_pipeline import pipeline


def _module(n_out: int, k: int):
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("b", "n", k), "float32"), w: R.Tensor((n_out, k), "float32"),
                 r: R.Tensor(("b", "n", n_out), "float32")):
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(w, [1, 0]))
                out = R.add(y, r)
                R.output(out)
            return out
    return Module


def _scheduled(mod) -> bool:
    target = tvm.target.Target("llvm")
    with target:
        lowered = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps(),
                                            relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                                            relax.transform.FuseTIR(), cpu_matmuls()])(mod)
    return any("NT_matmul_rf" in str(f) for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


@pytest.mark.parametrize("n_out,k,fits", [(44, 40, True), (30, 40, False), (44, 36, False)])
def test_cpu_nt_matmuls_equal_numpy(n_out, k, fits):
    mod = _module(n_out, k)
    assert _scheduled(mod) == fits          # 30 columns / K 36: not multiples of its tiles, left alone
    target = tvm.target.Target("llvm")
    ex = tvm.compile(mod, target=target, relax_pipeline=pipeline(target, "cpu-nt"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(n_out + k)
    w = rng.standard_normal((n_out, k)).astype("float32")
    for b, n in ((1, 1), (1, 7), (2, 33)):
        x = rng.standard_normal((b, n, k)).astype("float32")
        r = rng.standard_normal((b, n, n_out)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(r)).numpy()
        np.testing.assert_allclose(got, x @ w.T + r, rtol=1e-5, atol=1e-5)
