"""Device bounds for the cost model: peak FLOP/s and bytes/s of the target (the device table, or on
the CPU measured once and cached), and the fractions of them a kernel's lower bound assumes:
max(flops / (0.6 x peak FLOP/s), bytes / (0.9 x peak bytes/s))."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from specpilot.core.files import atomic_write_text

FLOP_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.9


@lru_cache(maxsize=None)
def _cpu_peaks_cached(cache_file: str) -> tuple[float, float]:
    path = Path(cache_file)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            flops, bandwidth = float(data["flops"]), float(data["bandwidth"])
            if flops > 0 and bandwidth > 0:
                return flops, bandwidth
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            pass                 # a broken cache (a crashed writer, an edit): measure again
    flops, bandwidth = measure_cpu_peaks()
    atomic_write_text(path, json.dumps({"flops": flops, "bandwidth": bandwidth}))
    return flops, bandwidth


def measure_cpu_peaks() -> tuple[float, float]:
    """(fp32 GEMM FLOP/s, copy bytes/s) of this CPU, best of a few runs (torch: MKL/OpenBLAS)."""
    import time

    import torch

    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * 1024 ** 3 / (time.perf_counter() - start))
    src = torch.empty(64 * 2 ** 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = 0.0
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        copy = max(copy, 2 * src.numel() / (time.perf_counter() - start))   # read + write
    return best, copy


def device_peaks(target_text: str) -> dict:
    """Peak dense FLOP/s (bf16 on GPUs -- datasheet; fp32 on the CPU -- measured once and
    cached) and bytes/s for the cost model."""
    import os

    from specpilot.core.target import parse_target

    target = parse_target(target_text)
    device, sized = target.device_info(), target.schedule_device()
    if device is not None:
        peaks = {"name": device.name, "flops": device.bf16_flops, "bandwidth": device.bandwidth, "measured": False}
        if sized.kernel_forms != device.tensor_cores:   # the bound assumes instructions the kernels do not use
            peaks["note"] = (f"{device.name}'s {device.tensor_cores} tensor cores: the GEMM kernels use "
                             f"{sized.kernel_forms} (sized for {sized.name}), so the bf16 peak is above what they reach")
        return peaks
    cache = Path(os.environ.get("SPECPILOT_CACHE_DIR") or Path.home() / ".cache" / "specpilot") / "cpu-peaks.json"
    flops, bandwidth = _cpu_peaks_cached(str(cache))
    return {"name": "this CPU (measured)", "flops": flops, "bandwidth": bandwidth, "measured": True}
