"""Counter-based random numbers that come out the same on every device: each value is a hash of
(seed, tensor name, element index), computed with 64-bit integer tensor ops that are exact on the
CPU and on a GPU alike, so a 27B-parameter seeded model can be drawn where it runs (seconds on a
GPU, in the build's dtype, no float32 copy on the host) and still equal the CPU reference's draw.

Normals are Irwin-Hall sums of four 16-bit uniforms (two hashes an element; the sum is exact in
float32), scaled to unit variance by one float32 multiply: bounded (|x| < 3.47) and near-normal,
which is what a seeded test model needs.  Values are rounded to bf16 values.
"""

from __future__ import annotations

import hashlib
import math

import torch

MASK = 0xFFFFFFFF
CHUNK = 1 << 25                   # elements drawn per pass (bounds the int64 temporaries)
NORMAL_SCALE = math.sqrt(3.0) / 2 ** 16


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow (products stay below 2**48)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & MASK


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int, name: str) -> int:
    """The 32-bit key of one tensor's stream."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def bits(key: int, counters: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """32 random bits per counter (int64 counters in [start, stop))."""
    if start >> 32 == (stop - 1) >> 32:       # one high word for the whole range: hashed once
        high = int(hash32(torch.tensor([(start >> 32) ^ key]))[0])
    else:
        high = hash32((counters >> 32) ^ key)
    return hash32((counters & MASK) ^ high)


def _normal_chunk(key: int, start: int, n: int, device) -> torch.Tensor:
    index = torch.arange(2 * start, 2 * (start + n), 2, dtype=torch.int64, device=device)
    a, b = (bits(key, index + j, 2 * start, 2 * (start + n)) for j in range(2))
    total = (a & 0xFFFF) + (a >> 16) + (b & 0xFFFF) + (b >> 16)           # four 16-bit uniforms, < 2**18
    return (total - (1 << 17)).to(torch.float32) * torch.tensor(NORMAL_SCALE, dtype=torch.float32, device=device)


def normal(seed: int, name: str, shape: tuple[int, ...], std: float = 1.0, device=None,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A near-normal tensor of ``std`` (bf16 values, held in ``dtype`` on ``device``)."""
    out = torch.empty(math.prod(shape), dtype=dtype, device=device)
    key, scale = stream_key(seed, name), torch.tensor(std, dtype=torch.float32, device=device)
    for start in range(0, out.numel(), CHUNK):
        n = min(CHUNK, out.numel() - start)
        out[start:start + n] = (_normal_chunk(key, start, n, device) * scale).to(torch.bfloat16).to(dtype)
    return out.reshape(shape)


def uniform(seed: int, name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    """Uniform on [low, high) in float64 on the host (small tensors: norms, decay parameters)."""
    n = math.prod(shape)
    words = bits(stream_key(seed, name), torch.arange(n, dtype=torch.int64), 0, n)
    return (low + (high - low) * words.to(torch.float64) / 2 ** 32).reshape(shape)
