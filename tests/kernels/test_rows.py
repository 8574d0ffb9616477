"""A packed verification's row gathers (`kernels.rows.gather_rows_te`): against ``numpy.take(mode="clip")``
on fresh random rows and indices (out-of-range ones included), symbolic row counts, odd trailing shapes,
float32 and bfloat16; and fused by FuseOps with the slice and cast before it and the cast after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.kernels.rows import gather_rows_te


def _module(dtype: str, tail: tuple[int, ...], cast_after: bool, relax_take: bool = False):
    """main(x (R, *tail) float32, index (N,) int32): x cast to ``dtype``, its rows gathered (marked injective,
    as the lowering marks it; or Relax's ``take``), the result cast back to float32 when ``cast_after``."""
    from tvm import relax, tirx

    bb = relax.BlockBuilder()
    R, N = tirx.Var("R", "int64"), tirx.Var("N", "int64")
    x = relax.Var("x", relax.TensorType([R, *tail], "float32"))
    index = relax.Var("index", relax.TensorType([N], "int32"))
    with bb.function("main", [x, index]):
        with bb.dataflow():
            cast = bb.emit(relax.op.astype(x, dtype))
            if relax_take:
                rows = bb.emit(relax.op.take(cast, index, axis=0, mode="clip"))
            else:
                rows = bb.emit_te(gather_rows_te(), cast, index, primfunc_attrs={"op_pattern": 2})
            out = bb.emit(relax.op.astype(rows, "float32")) if cast_after else rows
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("dtype,rows,tail,n", [("float32", 7, (3,), 11), ("bfloat16", 13, (2, 5), 4),
                                                ("float32", 1, (9,), 3), ("bfloat16", 29, (37,), 29)])
def test_gathered_rows_are_numpy_take_with_clipped_indices(dtype, rows, tail, n):
    import tvm
    from tvm import relax
    rng = np.random.default_rng(rows * 31 + n)
    x = rng.standard_normal((rows, *tail)).astype("float32")
    index = rng.integers(-3, rows + 3, size=n).astype("int32")       # some below 0, some past the last row
    vm = relax.VirtualMachine(tvm.compile(_module(dtype, tail, cast_after=True), target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(index)).numpy()
    want = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy().take(index, axis=0, mode="clip")
    assert got.shape == (n, *tail)
    np.testing.assert_array_equal(got, want)


def test_the_gather_fuses_with_the_casts_around_it():
    """One kernel for cast -> gather -> cast, where Relax's ``take`` (opaque to FuseOps) leaves three."""
    from tvm import relax

    def kernels(relax_take):
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(
            relax.transform.LegalizeOps()(_module("bfloat16", (6,), cast_after=True, relax_take=relax_take)))))
        return [gv.name_hint for gv, f in mod.functions.items() if not isinstance(f, relax.Function)]
    (fused,) = kernels(relax_take=False)
    assert fused.startswith("fused_")
    assert len(kernels(relax_take=True)) == 3
