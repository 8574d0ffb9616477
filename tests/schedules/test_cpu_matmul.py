"""The cpu-nt matmul schedule (`schedules.cpu_matmul`) against NumPy on fresh random inputs: symbolic
row counts 1 / 7 / 33 and a batch axis (both loop orders, chosen at run time), static row counts (the
order chosen at build time), 8- and 4-column blocks, a fused epilogue, at the generic and this CPU's
level; a shape it does not fit keeps TVM's loops."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from specpilot.compiler.build import tvm_target
from specpilot.core.target import parse_target
from specpilot.schedules.cpu_matmul import cpu_matmuls
from specpilot.schedules.relax_pipeline import pipeline


def _module(n_out: int, k: int, rows=("b", "n")):
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((*rows, k), "float32"), w: R.Tensor((n_out, k), "float32"),
                 r: R.Tensor((*rows, n_out), "float32")):
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(w, [1, 0]))
                out = R.add(y, r)
                R.output(out)
            return out
    return Module


def _lowered(mod) -> str:
    target = tvm.target.Target("llvm")
    with target:
        lowered = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps(),
                                            relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                                            relax.transform.FuseTIR(), cpu_matmuls()])(mod)
    return "\n".join(str(f) for f in lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


def _check(mod, shapes, n_out, k, level):
    target = tvm_target(parse_target(f"llvm -mcpu={level}"))
    ex = tvm.compile(mod, target=target, relax_pipeline=pipeline(target, "cpu-nt"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(n_out + k + len(shapes))
    w = rng.standard_normal((n_out, k)).astype("float32")
    for b, n in shapes:
        x = rng.standard_normal((b, n, k)).astype("float32")
        r = rng.standard_normal((b, n, n_out)).astype("float32")
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(r)).numpy()
        np.testing.assert_allclose(got, x @ w.T + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", ["generic", parse_target("llvm").cpu])
@pytest.mark.parametrize("n_out,k,fits", [(44, 40, True), (48, 24, True), (30, 40, False), (44, 36, False)])
def test_cpu_nt_matmuls_equal_numpy(n_out, k, fits, level):
    mod = _module(n_out, k)
    text = _lowered(mod)
    assert ("NT_matmul_rf" in text) == fits     # 30 columns / K 36: not multiples of its tiles, left alone
    if fits:    # the row count is symbolic: both orders, chosen at run time, sharing the epilogue's input
        assert "T.unroll" in text and "if b * n == 1" in text.replace("T.int64(1)", "1"), text
        assert [line for line in text.splitlines() if "alloc_buffer" in line and "_rf" not in line] == \
            ["    NT_matmul_intermediate = T.sblock_alloc_buffer((b, n, T.int64(%d)))" % n_out], text
    _check(mod, ((1, 1), (1, 7), (2, 33)), n_out, k, level)


@pytest.mark.parametrize("rows,interleaved", [((1, 1), False), ((1, 5), True), ((3, 1), True)])
def test_static_row_counts_take_one_order(rows, interleaved):
    mod = _module(48, 32, rows)
    text = _lowered(mod)
    assert "NT_matmul_rf" in text and ("T.unroll" in text) == interleaved and "if " not in text
    # the interleaved order's accumulators on the stack (default scope), the one-row order's in "local"
    assert ("_rf_local = " in text) == (not interleaved), text
    _check(mod, (rows,), 48, 32, parse_target("llvm").cpu)


def test_both_orders_add_in_the_same_order():
    """A row's outputs are bit for bit the same alone (the one-row order) and among seven (the interleaved
    order): the orders differ in which loop is outside, not in the order each output's terms are added."""
    mod = _module(48, 40)
    target = tvm_target(parse_target("llvm"))
    vm = relax.VirtualMachine(tvm.compile(mod, target=target, relax_pipeline=pipeline(target, "cpu-nt")), tvm.cpu())
    rng = np.random.default_rng(3)
    w = tvm.runtime.tensor(rng.standard_normal((48, 40)).astype("float32"))
    x = rng.standard_normal((1, 7, 40)).astype("float32")
    r = np.zeros((1, 7, 48), "float32")
    many = vm["main"](tvm.runtime.tensor(x), w, tvm.runtime.tensor(r)).numpy()
    for i in range(7):
        one = vm["main"](tvm.runtime.tensor(x[:, i:i + 1]), w, tvm.runtime.tensor(r[:, i:i + 1])).numpy()
        assert np.array_equal(one[0, 0], many[0, i])
