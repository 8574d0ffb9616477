"""`kernels.argmax_rows` (the build's ``choose``): each row's argmax, ties to the lowest index --
against numpy on fresh random rows of odd widths, with planted ties, flat rows and -inf; and
`kernels.rank_rows` (a block drafter's ranking) against `drafters.ranked`."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from specpilot.kernels.choice import argmax_merge, argmax_parts, argmax_rows
from tests.kernel_helpers import sm90_source


def _rows(rng, n: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((n, vocab)).astype("float32")
    x[0, :] = 0.0                                   # all equal: index 0
    x[1, :] = -np.inf
    x[1, vocab - 1] = -1.0                          # one finite value, last
    top = float(x[2].max()) + 1.0
    hits = rng.choice(vocab, size=3, replace=False)
    x[2, hits] = top                                # a three-way tie: the lowest of them
    x[3] = np.round(x[3] * 2) / 2                   # many ties at coarse values
    return x


@pytest.mark.parametrize("vocab", [1, 7, 301, 384, 1031])
def test_cpu_form_matches_numpy(vocab):
    rng = np.random.default_rng(vocab)
    x = _rows(rng, 6, vocab) if vocab >= 4 else rng.standard_normal((5, vocab)).astype("float32")
    lib = tvm.compile(tvm.IRModule({"main": argmax_rows(vocab).with_attr("global_symbol", "main")}),
                      target="llvm")
    out = tvm.runtime.tensor(np.zeros(len(x), "int32"))
    lib["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), np.argmax(x, axis=1))   # numpy: first occurrence


def test_gpu_forms_compile_to_sm90_code_without_a_gpu(tmp_path):
    """Blocks over parts of a row, then a block a row over the parts; shared-memory halvings with
    ThreadSync's barriers (none under a condition).  Run on the H200 through bench/cpp_runtime.py's
    token checks (every choice the C++ runtime makes there is this kernel's)."""
    text = sm90_source(tmp_path, "from specpilot.kernels.choice import argmax_merge, argmax_parts",
                       "{'wide': argmax_parts(248320), 'odd': argmax_parts(301), 'merge': argmax_merge(301)}")
    assert "wide_kernel" in text and "odd_kernel" in text and "merge_kernel" in text and "__syncthreads()" in text


@pytest.mark.parametrize("vocab,k", [(7, 1), (7, 7), (301, 8), (1031, 3), (384, 16)])
def test_cpu_ranking_matches_the_drafters_rule(vocab, k):
    """`rank_rows` against `drafters.ranked` over the logits: the same indices in the same order
    (equal logits in index order; planted ties, flat rows and a row of -inf but one included), and
    torch's log_softmax at them within float32 rounding."""
    import torch

    from specpilot.kernels.choice import rank_rows
    from specpilot.runtime.drafters import ranked
    from tests.kernel_helpers import run_cpu
    rng = np.random.default_rng(vocab + k)
    x = _rows(rng, 6, vocab)
    got, = run_cpu(rank_rows(vocab, k, False), [x], [((len(x), k, 2), "float32")])
    logits = torch.from_numpy(x)
    indices, _ = ranked(logits, k)
    np.testing.assert_array_equal(got[..., 1].astype(np.int64), indices.numpy())
    np.testing.assert_allclose(got[..., 0], torch.log_softmax(logits, dim=-1).gather(-1, indices).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_gpu_ranking_compiles_to_sm90_code_without_a_gpu(tmp_path):
    """A block a row, k rounds of shared-memory halvings.  Its numbers are checked on a GPU by
    bench/drafter_cost.py (`ranking_check`: the build's ranks against `drafters.ranked` on the same
    logits; the bench fails on a difference)."""
    text = sm90_source(tmp_path, "from specpilot.kernels.choice import rank_rows",
                       "{'rank': rank_rows(49152, 8, True), 'odd': rank_rows(301, 3, True)}")
    assert "rank_kernel" in text and "odd_kernel" in text and "__syncthreads()" in text
