"""`kernels.argmax_rows` (the build's ``choose``): each row's argmax, ties to the lowest index --
against numpy on fresh random rows of odd widths, with planted ties, flat rows and -inf."""

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
