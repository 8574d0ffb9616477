"""Decode attention read straight from the KV pool (`kernels.attention_decode_partial` +
`attention_decode_combine`): the CPU form against softmax(q k^T / sqrt(d)) v computed in numpy
from the same pool rows, on odd sizes (head_dim 24, groups of 3, key counts that do not fill the
last split), masked keys, sequences on other pool rows than their batch index, and outputs
poisoned with NaN beforehand.  The GPU form compiles to sm_90 without a GPU; its numbers are
checked on the H200 by bf16 token forcing of decode builds (bench/gpu_forcing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.compiler import kernels
from tests.kernel_helpers import run_cpu as _run, sm90_source


@pytest.mark.parametrize("seed,L,d,group,masked", [(0, 70, 24, 3, 0.0), (1, 129, 16, 1, 0.3), (2, 5, 32, 4, 0.5),
                                                   (3, 64, 24, 2, 0.0)])
def test_decode_attention_from_the_pool_matches_softmax_attention(seed, L, d, group, masked):
    rng = np.random.default_rng(seed)
    n_layers, layer, rows, n_kv, cap, B = 3, 1, 4, 2, 160, 3
    kv = rng.standard_normal((n_layers, 2, rows, n_kv, cap, d)).astype("float32")
    q = rng.standard_normal((B, 1, n_kv * group, d)).astype("float32") * 2
    row = np.array([2, 0, 3], "int32")              # sequence b lives in pool row row[b]
    mask = rng.uniform(size=(B, 1, L)) >= masked
    mask[:, :, 0] = True                            # every query sees at least one key
    S = (L + kernels.ATTN_CHUNK - 1) // kernels.ATTN_CHUNK
    acc, ml = _run(kernels.attention_decode_partial(n_layers, layer, rows, n_kv, cap, d, group, "float32", False),
                   [q, kv, row, mask], [((B, n_kv, S, group, d), "float32"), ((B, n_kv, S, group, 2), "float32")])
    assert not np.isnan(acc).any() and not np.isnan(ml).any()
    (out,) = _run(kernels.attention_decode_combine(n_kv, d, group, "float32", False), [acc, ml],
                  [((B, 1, n_kv * group, d), "float32")])
    for b in range(B):
        for h in range(n_kv * group):
            keys = kv[layer, 0, row[b], h // group, :L].astype("float64")
            values = kv[layer, 1, row[b], h // group, :L].astype("float64")
            scores = keys @ q[b, 0, h].astype("float64") / np.sqrt(d)
            scores[~mask[b, 0]] = -np.inf
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ values
            np.testing.assert_allclose(out[b, 0, h], want, rtol=2e-5, atol=2e-6)


def test_decode_attention_gpu_form_compiles_to_sm90_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot.compiler import kernels",
                       "{'partial': kernels.attention_decode_partial(2, 1, 3, 8, 256, 128, 4, 'bfloat16', True), "
                       "'combine': kernels.attention_decode_combine(8, 128, 4, 'bfloat16', True)}")
    assert "__shfl_xor_sync" in text and "partial_kernel" in text and "combine_kernel" in text
