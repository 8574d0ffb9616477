"""The W12 skinny GEMM as a Triton kernel: y[M, N] = x[M, K] . W[N, K]^T with W read from its
W12 planes (hi uint8 (N, K), lo nibbles (N, K/2)) and decoded in registers.

Any K (odd K reads the flat nibble plane byte by byte; even K loads half as many lo bytes).
Used by the PyTorch reference engine on GPUs (``ReferenceModel(..., weight_format="w12")``),
as a cross-check of the TIR kernels, and in ``bench/w12_gemm.py`` beside them.  The same
kernel reads plain bf16 weights when ``W12=False``, so the benchmark separates what the
decode costs from what the schedule costs.

Schedule: a program per (BN output rows, K split); each step loads a BN x BK tile of the hi
plane and the BN x BK/2 lo bytes, expands the nibbles next to their hi bytes
(``join`` + ``reshape``), builds the float32 bits with integer ops
(sign << 31 | (base + offset) << 23 | mantissa << 16) and accumulates x . w in float32:
by broadcasting for M < 16, with ``tl.dot`` on bf16 (exact: every weight is a bf16 value and
products of bf16 are exact in float32) from M = 16.  Split-K partials are summed after.

Escapes: their plane entries are 0, which decodes to the row's placeholder 2^(base-127);
after the GEMM each escape adds x[:, col] * (exact - placeholder) to its row -- every weight
enters with its exact value (the difference is exact in float32 for all but outliers more
than 2^15 times the placeholder, where it rounds like any float32 sum).

On the CPU (tests) the kernel runs under Triton's interpreter: set TRITON_INTERPRET=1
before Triton is imported.
"""

from __future__ import annotations

import os

import torch

from specpilot.core import w12

try:
    import triton
    import triton.language as tl
except ImportError:   # the engine then uses the decode-then-matmul path
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _gemm_kernel(x_ptr, hi_ptr, lo_ptr, base_ptr, w_ptr, y_ptr, M, N, K,
                     K_PER_SPLIT: tl.constexpr, W12: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     USE_DOT: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        n_ok = rn < N
        if W12:
            base = tl.load(base_ptr + rn, mask=n_ok, other=0).to(tl.int32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        for step in range(0, K_PER_SPLIT, BK):
            k0 = k_start + step
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
            tile_ok = n_ok[:, None] & k_ok[None, :]
            if W12:
                h = tl.load(hi_ptr + rn[:, None] * K + rk[None, :], mask=tile_ok, other=0).to(tl.int32)
                if EVEN_K:   # a row's nibbles start on a byte: load BK/2 bytes, put each nibble by its hi byte
                    rk2 = k0 // 2 + tl.arange(0, BK // 2)
                    lo = tl.load(lo_ptr + rn[:, None] * (K // 2) + rk2[None, :],
                                 mask=n_ok[:, None] & (rk2[None, :] < K // 2), other=0).to(tl.int32)
                    nib = tl.reshape(tl.join(lo & 15, lo >> 4), (BN, BK))
                else:        # odd K: weight (n, k) is nibble n*K + k of the flat plane
                    flat = rn[:, None].to(tl.int64) * K + rk[None, :]
                    nib = (tl.load(lo_ptr + flat // 2, mask=tile_ok, other=0).to(tl.int32)
                           >> ((flat % 2) * 4).to(tl.int32)) & 15
                bits = ((h >> 7) << 31) | ((base[:, None] + ((h >> 3) & 15)) << 23) | ((h & 7) << 20) | (nib << 16)
                w = tl.where(tile_ok, bits.to(tl.float32, bitcast=True), 0.0)
            else:
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            if USE_DOT:   # bf16 tensor cores on the GPU; exact float32 under the interpreter (no bf16 there)
                if INTERPRET:
                    acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
                else:
                    acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), out_dtype=tl.float32)
            else:
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        out = y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=(rm[:, None] < M) & n_ok[None, :])


class W12Matrix:
    """A bf16 (N, K) weight held as W12 planes on a device, ready for `gemm`."""

    def __init__(self, weight_bf16: torch.Tensor, device):
        n, k = weight_bf16.shape
        kl = w12.kernel_layout(w12.encode(weight_bf16.cpu()))
        self.shape = (n, k)
        self.hi = kl.hi.to(device)
        self.lo = kl.lo.to(device)    # flat: nibble n*K + k (for even K, row n is bytes n*K/2 ...)
        self.base = kl.base.to(device)
        count = int(kl.esc_ptr[-1])
        rows = torch.repeat_interleave(torch.arange(n), (kl.esc_ptr[1:] - kl.esc_ptr[:-1]).long())
        exact = (kl.esc_bits[:count] << 16).view(torch.float32)
        placeholder = (kl.base[rows].to(torch.int32) << 23).view(torch.float32)
        self.esc_rows = rows.to(device)
        self.esc_cols = kl.esc_col[:count].long().to(device)
        self.esc_delta = (exact - placeholder).to(device)   # exact in float32 (see module doc)
        self._esc_ptr, self._esc_col, self._esc_bits = kl.esc_ptr, kl.esc_col, kl.esc_bits
        self.nbytes = kl.nbytes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self)

    def decoded(self) -> torch.Tensor:
        """The exact bf16 matrix (for the CPU path and the tests)."""
        kl = w12.W12Kernel(self.hi.cpu(), self.lo.cpu(), self.base.cpu(), self._esc_ptr,
                           self._esc_col, self._esc_bits)
        return w12.decode_kernel_layout(kl)


def _config(m: int, n: int, k: int, x_dtype: torch.dtype) -> dict:
    """Tile shape and K split: enough programs to fill the GPU's SMs (a few per SM) for skinny M.
    Tensor cores (tl.dot on bf16) only for bf16 activations: a float32 x would be rounded."""
    use_dot = m >= 16 and x_dtype == torch.bfloat16
    bm = max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m)
    bn = 32 if use_dot else (16 if m <= 2 else 8)
    bk = 128 if use_dot else (512 if m <= 2 else 256)
    if m > 64:
        raise ValueError(f"the skinny-GEMM kernel takes M <= 64, got {m}")
    programs = triton.cdiv(n, bn)
    split = 1
    while programs * split < 4 * 132 and k // (split * 2) >= bk and (k // (split * 2)) % bk == 0:
        split *= 2
    return dict(BM=bm, BN=bn, BK=bk, USE_DOT=use_dot, split=split, num_warps=4)


def gemm(x: torch.Tensor, weight, config: dict | None = None) -> torch.Tensor:
    """x (M, K) bf16/fp32 -> float32 (M, N); ``weight`` a `W12Matrix` or a bf16 (N, K) tensor."""
    is_w12 = isinstance(weight, W12Matrix)
    n, k = weight.shape
    m = x.shape[0]
    cfg = dict(config or _config(m, n, k, x.dtype))
    split = cfg.pop("split")
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg["BK"]) * cfg["BK"]
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    dummy = partial
    if is_w12:
        args = (x, weight.hi, weight.lo, weight.base, dummy)
    else:
        args = (x, dummy, dummy, dummy, weight.contiguous())
    grid = (triton.cdiv(n, cfg["BN"]), split)
    _gemm_kernel[grid](*args, partial, m, n, k, K_PER_SPLIT=k_per_split, W12=is_w12,
                           INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", EVEN_K=k % 2 == 0, **cfg)
    y = partial.sum(0) if split > 1 else partial[0]
    if is_w12 and weight.esc_cols.numel():
        y.index_add_(1, weight.esc_rows, x.float()[:, weight.esc_cols] * weight.esc_delta[None, :])
    return y


def linear(x: torch.Tensor, weight: W12Matrix) -> torch.Tensor:
    """F.linear for a W12 weight: (..., K) -> (..., N) in x's dtype (float32 accumulation, one rounding)."""
    flat = x.reshape(-1, x.shape[-1])
    if available(x.device):   # a skinny kernel: longer inputs (prefill) go 64 rows at a time
        y = torch.cat([gemm(flat[i:i + 64], weight) for i in range(0, flat.shape[0], 64)])
    else:
        y = flat.float() @ weight.decoded().to(x.device).float().T
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
