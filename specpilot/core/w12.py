"""W12: a lossless 12-bit layout for bf16 weights, with a nested 8-bit view.

A bf16 weight is sign (1) | exponent (8) | mantissa (7).  Within one output channel (a row
of W[N, K]) the exponents of trained weights crowd into a narrow band, so each row picks a
base exponent b and stores every weight whose exponent e lies in [b, b + 15] as

    sign (1) | e - b (4) | mantissa (7)                       = 12 bits

in two planes:

    hi plane, uint8:  sign | offset (4) | mantissa bits 6..4  -> alone, the nested 8-bit view
    lo plane, 4 bits: mantissa bits 3..0, two weights a byte  -> hi + lo restore the bits exactly

Weights the window cannot hold (±0, subnormals, exponents outside it, ±inf, NaN with its
payload) go to a sparse list of (flat index, exact bf16 bits); their plane entries are 0.
The base is the window start that holds the most normal exponents of the row (lowest start
on ties).  Decoding restores every bit pattern, which the tests check for all 65,536.

Bytes: N*K (hi) + ceil(N*K/2) (lo) + N (bases) + 6 per escape, i.e. 0.75 of bf16 plus a
little.  Packs are stored as safetensors with a checksum of the source bits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specpilot.core.errors import CheckpointError, SpecPilotError

WINDOW = 16
FORMAT = "specpilot-w12"
VERSION = 1


@dataclass
class W12Pack:
    shape: tuple[int, ...]        # the original tensor's shape; rows = shape[0]
    hi: torch.Tensor              # (N, K) uint8
    lo: torch.Tensor              # (ceil(N*K/2),) uint8, element 2i in the low nibble
    base: torch.Tensor            # (N,) uint8 base exponent per row
    escape_index: torch.Tensor    # (E,) int64 flat indices
    escape_bits: torch.Tensor     # (E,) int16 exact bf16 bit patterns
    source_sha256: str            # of the original bf16 bits

    @property
    def numel(self) -> int:
        return self.hi.numel()

    @property
    def nbytes(self) -> int:
        """Bytes as stored: both planes, the bases and the escape list (int32 index + 16-bit value)."""
        return self.hi.numel() + self.lo.numel() + self.base.numel() + 6 * self.escape_index.numel()

    @property
    def escape_rate(self) -> float:
        return self.escape_index.numel() / max(self.numel, 1)


def _bits(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.bfloat16:
        raise SpecPilotError(f"W12 packs bf16 weights, got {weight.dtype}")
    return weight.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _rows(weight: torch.Tensor) -> tuple[int, int]:
    n = weight.shape[0] if weight.dim() >= 1 else 1
    return n, weight.numel() // max(n, 1)


def _sha256(bits16: torch.Tensor) -> str:
    return hashlib.sha256(bits16.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def encode(weight: torch.Tensor) -> W12Pack:
    """Pack a bf16 tensor (any shape; rows along dim 0).  `encode_cached` keeps the result."""
    n, k = _rows(weight)
    bits = _bits(weight).reshape(n, k)
    sign, exponent, mantissa = bits >> 15, (bits >> 7) & 0xFF, bits & 0x7F
    normal = (exponent > 0) & (exponent < 255)
    # histogram of normal exponents per row, then the 16-wide window holding the most
    counts = torch.zeros(n, 256 + WINDOW, dtype=torch.int64, device=weight.device)
    counts.scatter_add_(1, exponent.to(torch.int64), normal.to(torch.int64))
    csum = torch.nn.functional.pad(counts.cumsum(1), (1, 0))
    window_counts = csum[:, WINDOW:WINDOW + 256] - csum[:, :256]       # window starting at b = 0..255
    base = window_counts.argmax(1).clamp(1, 254 - WINDOW + 1)           # argmax: lowest start on ties
    offset = exponent - base[:, None]
    inside = normal & (offset >= 0) & (offset < WINDOW)
    hi = torch.where(inside, (sign << 7) | (offset.clamp(0, WINDOW - 1) << 3) | (mantissa >> 4), 0).to(torch.uint8)
    lo4 = torch.where(inside, mantissa & 0xF, 0).to(torch.uint8).reshape(-1)
    if lo4.numel() % 2:
        lo4 = torch.cat([lo4, lo4.new_zeros(1)])
    lo = lo4[0::2] | (lo4[1::2] << 4)
    escape_index = (~inside).reshape(-1).nonzero().squeeze(1)
    escape_bits = bits.reshape(-1)[escape_index].to(torch.int16)
    return W12Pack(tuple(weight.shape), hi, lo, base.to(torch.uint8), escape_index, escape_bits,
                   _sha256(bits.to(torch.int16)))


def decode(pack: W12Pack) -> torch.Tensor:
    """The exact bf16 tensor back."""
    n, k = pack.hi.shape
    hi = pack.hi.to(torch.int32)
    lo4 = torch.stack([pack.lo & 0xF, pack.lo >> 4], dim=1).reshape(-1)[: n * k].to(torch.int32).reshape(n, k)
    exponent = pack.base.to(torch.int32)[:, None] + ((hi >> 3) & 0xF)
    bits = ((hi >> 7) << 15) | (exponent << 7) | (((hi & 0x7) << 4) | lo4)
    bits = bits.reshape(-1)
    bits[pack.escape_index] = pack.escape_bits.to(torch.int32) & 0xFFFF
    return bits.to(torch.int16).view(torch.bfloat16).reshape(pack.shape)


def decode_hi(pack: W12Pack) -> torch.Tensor:
    """The nested 8-bit view: hi plane only, the missing low mantissa bits taken at their midpoint.

    An approximation (relative error at most 2**-4); escaped weights keep their exact value.
    """
    n, k = pack.hi.shape
    hi = pack.hi.to(torch.int32)
    exponent = pack.base.to(torch.int32)[:, None] + ((hi >> 3) & 0xF)
    bits = (((hi >> 7) << 15) | (exponent << 7) | ((hi & 0x7) << 4) | 0x8).reshape(-1)
    bits[pack.escape_index] = pack.escape_bits.to(torch.int32) & 0xFFFF
    return bits.to(torch.int16).view(torch.bfloat16).reshape(pack.shape)


def save_pack(packs: dict[str, W12Pack], path: Path) -> None:
    tensors, meta = {}, {}
    for name, p in packs.items():
        tensors.update({f"{name}::hi": p.hi, f"{name}::lo": p.lo, f"{name}::base": p.base,
                        f"{name}::escape_index": p.escape_index.to(torch.int32),
                        f"{name}::escape_bits": p.escape_bits})
        meta[name] = {"shape": list(p.shape), "source_sha256": p.source_sha256}
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": str(VERSION), "tensors": json.dumps(meta)})


def load_pack(path: Path, verify: bool = True) -> dict[str, W12Pack]:
    """Read a pack; with ``verify``, decode each tensor and check its source checksum."""
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read W12 pack ({e})") from None
    if metadata.get("format") != FORMAT or metadata.get("version") != str(VERSION):
        raise CheckpointError(f"{path}: not a {FORMAT} v{VERSION} pack")
    try:
        meta = json.loads(metadata["tensors"])
        packs = {name: W12Pack(tuple(m["shape"]), tensors[f"{name}::hi"], tensors[f"{name}::lo"],
                               tensors[f"{name}::base"], tensors[f"{name}::escape_index"].to(torch.int64),
                               tensors[f"{name}::escape_bits"], m["source_sha256"]) for name, m in meta.items()}
    except (KeyError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(f"{path}: W12 pack is incomplete ({e})") from None
    if verify:
        for name, p in packs.items():
            if _sha256(decode(p).view(torch.int16)) != p.source_sha256:
                raise CheckpointError(f"{path}: tensor {name} does not decode to its source (checksum mismatch); "
                                      "the pack is corrupt or from other weights")
    return packs


def cache_dir() -> Path | None:
    """Where converted packs are kept: $SPECPILOT_CACHE_DIR (``off`` disables), else
    $XDG_CACHE_HOME/specpilot or ~/.cache/specpilot."""
    env = os.environ.get("SPECPILOT_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specpilot"


def encode_cached(weight: torch.Tensor, cache: Path | None = None) -> W12Pack:
    """`encode`, converted once: packs are cached by the SHA-256 of the bf16 bits.  A cached
    pack that fails its checksum (corrupt, truncated) is reported on stderr and rebuilt."""
    import sys
    cache = cache_dir() if cache is None else cache
    if cache is None:
        return encode(weight)
    digest = _sha256(_bits(weight).to(torch.int16))
    path = cache / "w12" / f"{digest}.safetensors"
    if path.is_file():
        try:
            pack = load_pack(path)["w"]
            if pack.source_sha256 == digest and pack.shape == tuple(weight.shape):
                return pack
            print(f"warning: {path}: cached W12 pack is for other weights; rebuilding it", file=sys.stderr)
        except CheckpointError as e:
            print(f"warning: {e}; rebuilding it", file=sys.stderr)
    elif path.exists():         # not a file where a pack belongs (left by something else): make room
        print(f"warning: {path}: not a cached W12 pack; replacing it", file=sys.stderr)
        shutil.rmtree(path, ignore_errors=True)
    pack = encode(weight)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_pack({"w": pack}, tmp)
    tmp.replace(path)        # atomic: concurrent builds never see half a file
    return pack


def to_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the bf16 tensor, whether it equals the input exactly)."""
    bf = weight.to(torch.bfloat16)
    return bf, bool(torch.equal(bf.to(weight.dtype), weight)) if weight.dtype != torch.bfloat16 else True


def stats(weights: dict[str, torch.Tensor], check_round_trip: bool = True) -> dict:
    """Per-tensor and total W12 statistics over a model's matrices (>= 2-D); 1-D tensors stay bf16."""
    rows, packed, bf16_bytes, escapes, numel = [], 0, 0, 0, 0
    all_exact = True
    for name in sorted(weights):
        w = weights[name]
        if w.dim() < 2:
            continue
        bf, exact_cast = to_bf16(w)
        pack = encode(bf)
        # exact means the model's own weights come back: bf16 round trip, and nothing lost casting to bf16
        ok = bool(torch.equal(decode(pack).view(torch.int16), bf.view(torch.int16))) and exact_cast \
            if check_round_trip else None
        all_exact &= bool(ok) if check_round_trip else True
        rows.append({"name": name, "shape": list(w.shape), "bytes_ratio": pack.nbytes / (2 * pack.numel),
                     "escape_rate": pack.escape_rate, "bit_exact": ok, "source_dtype": str(w.dtype).split(".")[-1],
                     "bf16_exact_cast": exact_cast})
        packed += pack.nbytes
        bf16_bytes += 2 * pack.numel
        escapes += pack.escape_index.numel()
        numel += pack.numel
    if not rows:
        raise SpecPilotError("no matrices (>= 2-D tensors) to pack")
    return {"bytes_ratio": packed / bf16_bytes, "escape_rate": escapes / numel,
            "bit_exact": all_exact if check_round_trip else None, "tensors": rows,
            "packed_bytes": packed, "bf16_bytes": bf16_bytes}


@dataclass
class W12Kernel:
    """A pack in the layout the decode-fused GEMM reads: planes, bases, and escapes as CSR by row
    (row pointer, column, exact bits), each row's escapes in column order."""
    hi: torch.Tensor        # (N, K) uint8
    lo: torch.Tensor        # (ceil(N*K/2),) uint8
    base: torch.Tensor      # (N,) uint8
    esc_ptr: torch.Tensor   # (N+1,) int32
    esc_col: torch.Tensor   # (max(E,1),) int32; a padding entry (-1) when E == 0
    esc_bits: torch.Tensor  # (max(E,1),) int32, the bf16 bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hi, self.lo, self.base, self.esc_ptr,
                                                          self.esc_col, self.esc_bits))


def kernel_layout(pack: W12Pack) -> W12Kernel:
    n, k = pack.hi.shape
    rows, cols = pack.escape_index // k, pack.escape_index % k
    ptr = torch.zeros(n + 1, dtype=torch.int32, device=pack.hi.device)
    ptr[1:] = torch.bincount(rows, minlength=n).cumsum(0).to(torch.int32)
    bits = pack.escape_bits.to(torch.int32) & 0xFFFF
    if pack.escape_index.numel() == 0:
        cols = torch.full((1,), -1, dtype=torch.int64, device=pack.hi.device)
        bits = torch.zeros(1, dtype=torch.int32, device=pack.hi.device)
    return W12Kernel(pack.hi, pack.lo, pack.base, ptr, cols.to(torch.int32), bits)


def decode_kernel_layout(k: W12Kernel) -> torch.Tensor:
    """The exact bf16 matrix back from the kernel layout."""
    n, kk = k.hi.shape
    count = int(k.esc_ptr[-1])
    rows = torch.repeat_interleave(torch.arange(n, device=k.esc_ptr.device), (k.esc_ptr[1:] - k.esc_ptr[:-1]).long())
    pack = W12Pack((n, kk), k.hi, k.lo, k.base, rows * kk + k.esc_col[:count].long(),
                   k.esc_bits[:count].to(torch.int16), "")
    return decode(pack)


def gemm_reference(x: torch.Tensor, k: W12Kernel) -> torch.Tensor:
    """y = x @ W^T in float32 with W decoded from the kernel layout (what the TIR kernel computes)."""
    return x.float() @ decode_kernel_layout(k).float().T


def gpu_layout(k: W12Kernel) -> W12Kernel:
    """The planes the GPU kernel (`schedules.w12_mma`) reads, tiled so that every load of a warp is
    one contiguous run: per 16-row tile and 64-wide k block, the 16 x 64 hi bytes (1 KB) in the
    order the 32 lanes read them -- rows r and r + 8 (lane // 4 = r % 8) as two 512-byte halves,
    lane t = lane % 4 taking weights 16t .. 16t + 15 -- and likewise the 512 bytes of lo.

    hi: int32 (N/16, K/64 * 256), word (tile, 256 b + 128 h + 4 lane + v) = weights
    16t + 4v .. + 3 of row 16 tile + 8 h + lane // 4 in k block b, bytes in the order (0, 2, 1, 3);
    lo: int32 (N/16, K/64 * 128), word (tile, 128 b + 64 h + 2 lane + s) = the nibbles of weights
    16t + 8s .. + 7 in the order (0, 2, 4, 6, 1, 3, 5, 7).  Those orders put a pair of neighbouring
    weights at bits 0-7 / 16-23 (or 8-15 / 24-31) and 0-3 / 16-19 (shifted by 4p) of one word,
    so the kernel decodes two weights per 32-bit operation.  Bases int32, escapes as they are.
    Same bytes per weight as the CPU layout; the hi plane alone is still the 8-bit view."""
    n, kk = k.hi.shape
    if n % 16 or kk % 64:
        raise SpecPilotError(f"W12 GPU layout: N={n} must be a multiple of 16 and K={kk} of 64")
    # (tile, h, g, block, t, v, byte) -> (tile, block, h, g, t, v, byte [0, 2, 1, 3])
    hi = k.hi.reshape(n // 16, 2, 8, kk // 64, 4, 4, 4)[..., [0, 2, 1, 3]].permute(0, 3, 1, 2, 4, 5, 6)
    hi = hi.contiguous().view(torch.int32).reshape(n // 16, kk // 64 * 256)
    lo4 = torch.stack([k.lo & 0xF, k.lo >> 4], dim=1).reshape(-1)[: n * kk].to(torch.int64)
    lo4 = lo4.reshape(n // 16, 2, 8, kk // 64, 4, 2, 8)[..., [0, 2, 4, 6, 1, 3, 5, 7]]
    words = (lo4 << (4 * torch.arange(8, device=lo4.device))).sum(-1).permute(0, 3, 1, 2, 4, 5)   # < 2**32
    lo = (words - ((words >> 31) << 32)).to(torch.int32).contiguous().reshape(n // 16, kk // 64 * 128)
    return W12Kernel(hi, lo, k.base.to(torch.int32), k.esc_ptr, k.esc_col, k.esc_bits)


def cpu_layout(k: W12Kernel) -> W12Kernel:
    """`gpu_layout` undone: the planes in the CPU layout (row-major hi bytes, packed nibbles)."""
    n, kk = layout_shape(k)
    hi = k.hi.contiguous().view(torch.uint8).reshape(n // 16, kk // 64, 2, 8, 4, 4, 4)[..., [0, 2, 1, 3]]
    hi = hi.permute(0, 2, 3, 1, 4, 5, 6).reshape(n, kk)
    words = (k.lo.to(torch.int64) & 0xFFFFFFFF).reshape(n // 16, kk // 64, 2, 8, 4, 2).permute(0, 2, 3, 1, 4, 5)
    stored = (words[..., None] >> (4 * torch.arange(8, device=words.device))) & 0xF
    nibbles = torch.empty_like(stored)
    nibbles[..., [0, 2, 4, 6, 1, 3, 5, 7]] = stored
    nibbles = nibbles.reshape(-1)
    lo = (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)
    return W12Kernel(hi.contiguous(), lo, k.base.to(torch.uint8), k.esc_ptr, k.esc_col, k.esc_bits)


def layout_shape(k: W12Kernel) -> tuple[int, int]:
    """(N, K) of the matrix a layout holds (either layout: the hi plane is a byte a weight)."""
    n = k.base.numel()
    return n, k.hi.numel() * k.hi.element_size() // n


LAYOUTS = ("cpu", "gpu")     # what `kernels.w12_gemm` reads / what `schedules.w12_mma` reads
PLANES = ("w12_lo", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_bits")   # suffixes after the hi plane


def convert(weight: torch.Tensor, layout: str, device: str | None = None, keep_on_device: bool = False) -> W12Kernel:
    """One bf16-exact matrix in the kernel layout ``layout`` (packs cached by content).  With
    ``device`` (e.g. "cuda", for the engine converting redrawn weights) the conversion runs there,
    uncached, and the planes come back to the host unless ``keep_on_device``."""
    if layout not in LAYOUTS:
        raise SpecPilotError(f"unknown W12 layout {layout!r}; known: {', '.join(LAYOUTS)}")
    weight = weight.to(torch.bfloat16)
    k = kernel_layout(encode(weight.to(device)) if device else encode_cached(weight))
    k = gpu_layout(k) if layout == "gpu" else k
    if not device or keep_on_device:
        return k
    return W12Kernel(*(t.cpu() for t in (k.hi, k.lo, k.base, k.esc_ptr, k.esc_col, k.esc_bits)))


def convert_params(params: dict, names, layout: str, done: dict | None = None, device: str | None = None,
                   keep_on_device: bool = False) -> dict:
    """Packed parameters with each weight named in ``names`` replaced by its hi plane, and its
    other planes appended under ``NAME.w12_lo`` etc. (what a W12 build's manifest lists).  Values
    may be None (a seeded build knows its names, not its weights): the names come out the same.
    ``done``: layouts already converted, by name."""
    names = set(names)
    missing = names - set(params)
    if missing:
        raise SpecPilotError(f"W12 weights not among the parameters: {', '.join(sorted(missing))}")
    out, extra = {}, {}
    for name, value in params.items():
        if name not in names:
            out[name] = value
            continue
        k = (done or {}).get(name)
        if k is None and value is not None:
            k = convert(value, layout, device, keep_on_device)
        out[name] = None if k is None else k.hi
        for suffix, plane in zip(PLANES, (None,) * 5 if k is None else (k.lo, k.base, k.esc_ptr, k.esc_col,
                                                                          k.esc_bits)):
            extra[f"{name}.{suffix}"] = plane
    return {**out, **extra}


def plain_names(names) -> list[str]:
    """The parameter names before W12 conversion (the planes' own names dropped)."""
    return [n for n in names if not n.endswith(tuple("." + s for s in PLANES))]

