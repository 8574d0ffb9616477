"""What every benchmark records beside its numbers: machine, GPU, versions, date."""

from __future__ import annotations

import json
import re
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from specpilot.core.files import atomic_write_text
from specpilot.runtime.environment import environment

RESULTS = Path(__file__).resolve().parent / "results"


WARMUP_S = 1.0     # calls before the timed ones: a shared CPU's first second of a pass ran ~15 % slow


def sync() -> None:
    """Wait for the GPU's queued work (a timer's edge); nothing on a CPU run."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write(name: str, payload: dict, out_dir: Path | None = None, path: Path | None = None) -> Path:
    """Write ``payload`` with the environment to bench/results/NAME-DATE.json (or to ``path``,
    to update a file written earlier in the same run)."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = path or out_dir / f"{name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}.json"
    atomic_write_text(path, json.dumps({"environment": environment(), **payload}, indent=2))   # a killed run leaves no half file
    return path


def quartiles(ms: list[float]) -> dict:
    """Median and quartiles of millisecond samples."""
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "samples": len(ms)}


def timed_calls(calls: dict, reps: int) -> dict:
    """Milliseconds per call of each ``calls`` entry (name -> (fn, args)), synchronised, round-robin
    after ``WARMUP_S`` seconds of calls of each: name -> `quartiles`."""
    for fn, args in calls.values():
        start = time.perf_counter()
        while time.perf_counter() - start < WARMUP_S:
            fn(*args)
            sync()
    ms = {name: [] for name in calls}
    for _ in range(reps):
        for name, (fn, args) in calls.items():
            sync()
            t0 = time.perf_counter()
            fn(*args)
            sync()
            ms[name].append((time.perf_counter() - t0) * 1e3)
    return {name: quartiles(samples) for name, samples in ms.items()}


def timed_rotating(fn, rotations: int, rounds: int = 7, iters: int = 20) -> list[float]:
    """Microseconds per call of ``fn(r)`` (CUDA events around ``iters`` calls, r cycling over
    ``rotations`` weight buffers so the L2 cannot hold them), ``rounds`` samples."""
    return timed_interleaved({0: fn}, rotations, rounds, iters)[0]


def timed_interleaved(fns: dict, rotations: int, rounds: int = 7, iters: int = 20) -> dict:
    """`timed_rotating` for several kernels at once (CUDA events around ``iters`` calls of fn(r), r
    cycling over ``rotations`` weight buffers), round-robin: each round times every ``fns`` entry
    (name -> fn(r)) once, in turn, so clock and power drift over the run reach all of them
    alike.  (Timed one after another, the same kernel measured 8 % apart as two variants of one run,
    320.5 vs 346.4 us: bench/README "Skinny GEMMs".)  Returns name -> samples."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for fn in fns.values():
        for r in range(rotations):
            fn(r)
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start.record()
            for i in range(iters):
                fn(i % rotations)
            end.record()
            torch.cuda.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / iters)
    return samples


def kernel_times(fn, args, top: int, module=None) -> list[dict]:
    """Time per kernel name over one call: on a GPU, device time from torch's profiler (every kernel the
    process launches); on the CPU, each of ``module``'s kernel calls timed by TVM's VM instrument hook
    (`runtime.profile`)."""
    import torch
    totals: dict[str, list] = {}
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            sync()
        for e in prof.events():
            if str(e.device_type).endswith("CUDA"):     # a kernel (or copy) on the device: its own span
                t = totals.setdefault(e.name, [0.0, 0])
                t[0] += e.time_range.elapsed_us()
                t[1] += 1
    elif module is not None:
        from specpilot.runtime.profile import AnyKernel, profiling
        with profiling(module, AnyKernel()) as prof:
            fn(*args)
        for c in prof.calls:
            t = totals.setdefault(c.name, [0.0, 0])
            t[0] += c.seconds * 1e6
            t[1] += 1
    if not totals:
        return []
    merge_copies(totals)
    whole = sum(t for t, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return [{"kernel": name[:120], "us": us, "calls": calls, "share": us / whole} for name, (us, calls) in ranked[:top]] \
        + [{"kernel": "(all)", "us": whole, "calls": sum(c for _, c in totals.values()), "share": 1.0}]


def merge_copies(totals: dict[str, list]) -> None:
    """A kernel's per-layer copies under one name: the names launched once a pass that differ only in a
    number before their end or before ``_kernel`` (`attention_decode3`, `gated_delta_rule82_kernel`)
    become ``stem*`` with their summed time and their count -- where more than two share the stem (not
    two kernels that happen to), so a --top list shows each kernel family whole."""
    copies: dict[str, list[str]] = {}
    for name, (_, calls) in totals.items():
        if calls == 1:
            copies.setdefault(re.sub(r"\d+(_kernel)?$", r"\1", name), []).append(name)
    for stem, names in copies.items():
        if len(names) > 2:
            base = stem[:-len("_kernel")] if stem.endswith("_kernel") else stem
            totals[base + "*"] = [sum(totals.pop(n)[0] for n in names), len(names)]


def export_kernels(funcs: dict, target, out: Path, schedule=None) -> None:
    """name -> PrimFunc compiled for ``target`` (through ``schedule``, a module pass, where given)
    into one library at ``out``."""
    import tvm
    with target:
        mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
        lib = tvm.compile(schedule(mod) if schedule is not None else mod, target=target)
    lib.export_library(str(out))
    print(f"wrote {out} ({len(funcs)} kernels)")


def load_kernels(path: Path):
    """A kernel library on the GPU machine (the runtime-only TVM): (module, tvm.runtime.from_dlpack)."""
    import tvm

    from specpilot.runtime.engine import import_tvm_runtime
    import_tvm_runtime(gpu=True)
    return tvm.runtime.load_module(str(path)), tvm.runtime.from_dlpack


def build_or_run(build, run) -> None:
    """The command line of a kernel-library bench: ``build LIB.so`` (here, no GPU needed) or
    ``run LIB.so [--out DIR]`` (on the GPU)."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["build", "run"])
    ap.add_argument("lib", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    build(args.lib) if args.mode == "build" else run(args.lib, args.out)
