"""The W12 tensor-core GEMM: its GPU planes decoded the way the kernel decodes them (word-wide,
two weights per 32-bit register) must give every exact bf16 weight at the k slot the x operand
holds for it; the kernel compiles to sm_90 mma code here, without a GPU."""

from __future__ import annotations

import pytest
import torch

from specpilot.core import w12
from specpilot.schedules.w12_mma import BLOCK, applicable, pick
from tests.kernel_helpers import sm90_source

M32 = 0xFFFFFFFF


def _decode_pair(hi_word: int, lo_word: int, base: int, p: int, hi_only: bool) -> tuple[int, int]:
    """The kernel's decode of pair p (0..3) of one 8-weight step, as Python integers."""
    w = (hi_word >> (8 * (p % 2))) & 0x00FF00FF
    low = 0x00080008 if hi_only else (lo_word >> (4 * p)) & 0x000F000F
    bits = (((w << 8) & 0x80008000) | ((((w & 0x007F007F) << 4) + ((base << 7) | (base << 23)) + low) & M32)) & M32
    return bits & 0xFFFF, bits >> 16


def emulate_a_operand(planes: dict, n: int, k: int, hi_only: bool = False) -> torch.Tensor:
    """W as the mma A fragments see it: for row r, k block j, lane slot t = lane % 4, step s, mma q,
    register h2 holds pair p = 2q + h2 -- elements 2 * h2 + {0, 1} of the 4 x values the B operand
    holds for that mma (x[64j + 16t + 8s + 4q + 0..3]).  Returns the decoded (N, K) bits as ints."""
    hi = planes["hi"].to(torch.int64) & M32
    lo = planes["lo"].to(torch.int64) & M32
    base = planes["base"].to(torch.int64)
    out = torch.zeros(n, k, dtype=torch.int64)
    for r in range(n):
        b = int(base[r])
        for j in range(k // BLOCK):
            for t in range(4):
                lane = (r % 8) * 4 + t
                at = j * 256 + ((r % 16) // 8) * 128 + lane * 4                 # one 16-byte load
                hw = hi[r // 16, at: at + 4].tolist()
                at = j * 128 + ((r % 16) // 8) * 64 + lane * 2                  # one 8-byte load
                lw = lo[r // 16, at: at + 2].tolist()
                for s in range(2):
                    for q in range(2):
                        for h2 in range(2):
                            p = 2 * q + h2
                            first, second = _decode_pair(hw[2 * s + q], lw[s], b, p, hi_only)
                            kk = j * BLOCK + 16 * t + 8 * s + 4 * q + 2 * h2
                            out[r, kk], out[r, kk + 1] = first, second
    return out


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 448)])
def test_gpu_planes_decode_to_the_exact_weights_in_the_slots_x_fills(n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=g) * 0.03).to(torch.bfloat16)
    w.view(torch.int16)[1, 5] = 0                    # +0
    w.view(torch.int16)[2, 7] = -32768               # -0
    w[3, 63] = 1e4                                    # far outside the row's window
    w[4, 0] = -float("inf")
    w.view(torch.int16)[5, 9] = 0x0003               # a subnormal
    layout = w12.kernel_layout(w12.encode(w))
    planes = vars(w12.gpu_layout(layout))
    assert planes["hi"].shape == (n // 16, 4 * k) and planes["lo"].shape == (n // 16, 2 * k)   # 16 rows a tile
    assert w12.layout_shape(w12.gpu_layout(layout)) == w12.layout_shape(layout) == (n, k)
    back = w12.cpu_layout(w12.gpu_layout(layout))                    # what the engine decodes for the reference
    assert all(torch.equal(getattr(back, f), getattr(layout, f)) for f in ("hi", "lo", "base", "esc_ptr"))
    assert torch.equal(w12.decode_kernel_layout(back), w)
    bits = emulate_a_operand(planes, n, k)
    inside = torch.ones(n, k, dtype=torch.bool)
    rows, cols = torch.repeat_interleave(torch.arange(n), (layout.esc_ptr[1:] - layout.esc_ptr[:-1]).long()), \
        layout.esc_col[: int(layout.esc_ptr[-1])].long()
    inside[rows, cols] = False
    assert int(layout.esc_ptr[-1]) >= 5
    exact = w.view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(bits[inside], exact[inside])                     # bit-exact where the window holds
    # escapes: zero planes decode to the placeholder 2**(base-127) the epilogue subtracts, and the
    # list holds the exact bits it adds
    placeholder = layout.base.to(torch.int64)[rows] << 7
    assert torch.equal(bits[rows, cols], placeholder)
    assert torch.equal(layout.esc_bits[: len(rows)].to(torch.int64), exact[rows, cols])


def test_hi_only_decode_is_the_nested_view():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(16, 128, generator=g) * 0.05).to(torch.bfloat16)
    pack = w12.encode(w)
    layout = w12.kernel_layout(pack)
    bits = emulate_a_operand(vars(w12.gpu_layout(layout)), 16, 128, hi_only=True)
    assert int(layout.esc_ptr[-1]) == 0
    assert torch.equal(bits, w12.decode_hi(pack).view(torch.int16).to(torch.int64) & 0xFFFF)


def test_configurations_need_whole_blocks():
    assert applicable(16, 64) and applicable(5120, 17408) and applicable(151936, 4096)
    assert not applicable(16, 96)        # K not a multiple of 64
    assert not applicable(24, 64)        # N not a multiple of 16
    for n, k in ((4096, 14336), (17408, 5120), (5120, 17408), (48, 64)):
        chosen = pick(n, k)
        assert [limit for limit, _ in chosen] == [8, 16, 32, None]
        for _, cfg in chosen:
            assert n % cfg.block_n() == 0 and k % (BLOCK * cfg.wk) == 0


def test_kernel_compiles_to_sm90_mma_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot.schedules.w12_mma import w12_mma",
                       "{'w': w12_mma(48, 256), 'v': w12_mma(48, 256, hi_only=True)}")
    assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 6   # per M configuration, both
    # the A registers are 32-bit words built by the decode; x is addressed in bf16 elements
    assert "uint af_ptr[" in text and "uint4 xb_ptr" not in text
    signatures = [line for line in text.splitlines() if "__global__" in line]
    assert all("lo_ptr" in s for s in signatures if " w_kernel" in s)
    assert all("lo_ptr" not in s for s in signatures if " v_kernel" in s)   # the view reads no lo plane
    assert "16711935" in text   # 0x00FF00FF: pairs decoded word-wide
