"""Rows of a tensor picked by an index, as a tensor expression (a packed verification's move between
the batch's real tokens and its padded positions: `compiler.layers.StepInputs`)."""

from __future__ import annotations


def gather_rows_te():
    """(x[R, ...], index[N] int32) -> [N, ...]: row i is x's row index[i], clamped into [0, R) as
    ``take(mode="clip")`` clamps.  The lowering marks it injective, so FuseOps fuses it with the
    slices and casts that make x and the injective kernel that reads it (a gated norm, the attention
    heads, the logits' cast): one kernel where Relax's ``take`` (opaque to fusion) ran two or three."""
    from tvm import te, tirx

    def compute(x: te.Tensor, index: te.Tensor) -> te.Tensor:
        rows = x.shape[0]

        def row(i, *rest):
            at = tirx.max(tirx.min(index[i], rows - 1), 0)
            return x[(at, *rest)]
        return te.compute((index.shape[0], *x.shape[1:]), row, name="gather_rows")
    return compute
