"""The Triton W12 GEMM (under Triton's interpreter here; on the H200 in bench/w12_gemm.py):
against a float64 GEMM over the exact weights, against the TIR W12 kernel, and inside the
reference engine, where it must not change a token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.core import w12
from specpilot import kernels
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.reference import w12_triton as wt
from tests.conftest import HYBRID, tiny_config


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16 weights with every kind of escape: zeros, a subnormal, outliers far above the window."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    flat = w.view(-1)
    idx = torch.randperm(n * k, generator=g)[:6]
    flat[idx[0]], flat[idx[1]] = 0.0, -0.0
    flat[idx[2]] = torch.tensor(1e-39).to(torch.bfloat16)      # subnormal
    flat[idx[3]], flat[idx[4]], flat[idx[5]] = 37.5, -1.0e4, 3e-12
    return w


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2e-6 + 1e-30   # float32 accumulation, any order
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("m,n,k", [(1, 37, 131), (2, 64, 512), (3, 20, 91), (5, 19, 258), (16, 33, 1024),
                                   (17, 9, 65)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_w12_and_bf16_kernels_match_an_exact_gemm(m, n, k, x_dtype):
    w = _weight(n, k, seed=m * 1000 + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(x_dtype)
    matrix = wt.W12Matrix(w, "cpu")
    assert matrix.esc_cols.numel() >= 6
    assert torch.equal(matrix.decoded().view(torch.int16), w.view(torch.int16))
    _check(wt.gemm(x, matrix), x, w)
    _check(wt.gemm(x, w), x, w)


def test_split_k_and_tile_configs_agree():
    w, x = _weight(24, 1024, 3), torch.randn(4, 1024)
    matrix = wt.W12Matrix(w, "cpu")
    ys = [wt.gemm(x, matrix, dict(BM=4, BN=bn, BK=bk, USE_DOT=False, split=split, num_warps=4))
          for bn, bk, split in [(8, 128, 1), (16, 256, 2), (8, 512, 2), (32, 128, 8)]]
    for y in ys:
        _check(y, x, w)


def test_matches_the_tir_w12_kernel():
    """Cross-check: the TIR decode-fused GEMM (the w12-layout pass's CPU kernel) and the Triton
    kernel read the same planes and agree to float32 accumulation order."""
    import tvm
    from tvm import relax

    n, k, m = 29, 77, 3
    w = _weight(n, k, seed=9)
    layout = w12.kernel_layout(w12.encode(w))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    bb = relax.BlockBuilder()
    gv = bb.add_func(kernels.w12_gemm(n, k, int(layout.esc_ptr[-1]), "float32"), "w12_gemm")
    mod = bb.get()
    lib = tvm.compile(mod[gv].with_attr("global_symbol", "w12_gemm"), target="llvm")
    dev = tvm.cpu()
    arrays = [tvm.runtime.tensor(t.numpy(), dev) for t in
              (x, layout.hi, layout.lo, layout.base, layout.esc_ptr, layout.esc_col, layout.esc_bits)]
    y_tir = tvm.runtime.tensor(np.zeros((m, n), "float32"), dev)
    lib["w12_gemm"](*arrays, y_tir)
    y_triton = wt.gemm(x, wt.W12Matrix(w, "cpu"))
    torch.testing.assert_close(y_triton, torch.from_numpy(y_tir.numpy()), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_reference_engine_with_w12_weights_keeps_every_token():
    from specpilot.core.weights import random_weights
    from specpilot.runtime.reference.model import ReferenceModel

    cfg = tiny_config(HYBRID)
    weights = random_weights(cfg, 4, round_to="bfloat16")
    dense = ReferenceModel(cfg, weights)
    packed = ReferenceModel(cfg, weights, weight_format="w12")
    assert isinstance(packed.w["model.layers.0.mlp.down_proj.weight"], wt.W12Matrix)
    prompt = [5, 17, 200, 3, 99]
    stock = autoregressive(dense, prompt, 12, 64)
    forced = autoregressive(packed, prompt, 12, 64, force=stock.tokens)
    assert forced.choices == stock.tokens
    with pytest.raises(Exception, match="not bf16-representable"):
        ReferenceModel(cfg, random_weights(cfg, 4), weight_format="w12")
