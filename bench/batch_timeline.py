"""Where the device waits for the host in a continuous batch's passes: each part's wall time (draft, its
batched block call, verification, commit) split into the time the device ran kernels or copies and the time
it sat idle, a pass, from a profiler trace (torch.profiler: CUPTI's kernel records and the parts' ranges on
one clock).  Of a part's idle time, what fell inside the build's calls is the device waiting for kernels to be
launched (or for the call's allocations); the rest waits for the runtime's Python, its copies and its reads.

    python bench/batch_timeline.py BUILD_DIR [--batches 16] [--engines compiled-spec,compiled-tree-sched]
                                   [--priced off|on|both] [--prompt-tokens 128] [--new-tokens 64]
                                   [--ranges MODULE:QUALNAME,...|runtime] [--out DIR]

A burst of B requests of random token ids (seeded) runs on batched AR first (its tokens force the
speculative engines, so the replay drafter follows them), then each engine once untimed and once under
the profiler.  ``--priced on`` prices chains and trees by cost (`BatchPolicy.adaptive`, the build's
``draft-length{priced=true}``).  Also recorded: the host's processor and a single-thread Python loop's
time, so hosts compare.  ``--ranges``: runtime functions (``specpilot.runtime.engine:CompiledModel.settle``)
timed the same way, each call a range of its own name: where inside a part the device waits (a function
called inside another counts in both; ``runtime``: `RUNTIME_RANGES`).  On a CPU build nothing runs on a
device: every part is idle time.  JSON to --out.
"""

from __future__ import annotations

import argparse
import bisect
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from bench.batch_host import burst  # noqa: E402

PARTS = ("draft", "draft_blocks", "draft_sync", "verify", "commit")
# `--ranges runtime`: the runtime's host work around a batched pass's calls
_E, _B = "specpilot.runtime.engine", "specpilot.runtime.batching"
RUNTIME_RANGES = (
    f"{_E}:CompiledModel._step_inputs", f"{_E}:CompiledModel.settle", f"{_E}:CompiledModel._pass_states",
    f"{_E}:CompiledModel._logits", f"{_E}:CompiledModel._stacked_states", f"{_E}:CompiledModule.tensors",
    f"{_E}:CompiledModule.keep_headroom", f"{_E}:step_rows", f"{_B}:_chains_ahead", f"{_B}:top2_rows",
    f"{_B}:draft_blocks", f"{_B}:_Scheduler._commit", f"{_B}:_Scheduler._retire", f"{_B}:_Scheduler._chunks",
    "specpilot.runtime.compiled_draft_nets:CompiledBlockNet._cycle_inputs")
CALL = "build call"          # the range of each call of a build's function (`calls_ranged`)
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")        # trace categories of device work


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals (start, end) merged into disjoint ones, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered(merged: list[tuple[float, float]], starts: list[float], start: float, end: float) -> float:
    """How much of [start, end] the disjoint sorted intervals ``merged`` cover (``starts``: their starts)."""
    total, i = 0.0, max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(merged) and merged[i][0] < end:
        total += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
        i += 1
    return total


def in_range(fn, name: str):
    """``fn`` run inside a profiler range called ``name``."""
    import functools

    from torch.profiler import record_function

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return call


class Ranges:
    """A `cycle_timing.Clock`'s interface: each part a named profiler range."""

    def timed(self, part: str, fn, *args, **kwargs):
        from torch.profiler import record_function
        with record_function(part):
            return fn(*args, **kwargs)


def calls_ranged(module) -> None:
    """Each of a loaded build's functions (``module.functions``) called inside a `CALL` range: the host's
    time in the build (the VM launching kernels) apart from its Python around them."""
    module.functions = {name: in_range(fn, CALL) for name, fn in module.functions.items()}


def functions_ranged(names: list[str]) -> list[str]:
    """Each function ``module:qualname`` of ``names`` replaced where it is defined by one that runs it
    inside a profiler range of that name (module-level functions are looked up by name when called, so
    their callers in that module take the wrapper).  Returns the range names."""
    import importlib

    for name in names:
        module_name, _, qualname = name.partition(":")
        owner = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, in_range(getattr(owner, attr), name))
    return names


def split(trace: dict, extra: tuple[str, ...] = ()) -> dict:
    """Per part of a trace's passes (and per range named in ``extra``), milliseconds a pass: wall,
    device-busy and idle time; of them, the build's calls' wall and the device's idle time inside them;
    launches a pass."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    merged = union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE])
    starts = [s for s, _ in merged]
    launches = sorted(e["ts"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                      and "Launch" in e.get("name", ""))
    ranges = {p: [(e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "user_annotation" and e.get("name") == p] for p in (*PARTS, *extra, CALL)}
    calls = sorted(ranges.pop(CALL))
    call_starts = [s for s, _ in calls]
    passes = max(len(ranges["verify"]), 1)
    out = {}
    for part, windows in ranges.items():
        wall = sum(e - s for s, e in windows)
        busy = sum(covered(merged, starts, s, e) for s, e in windows)
        inside = [(cs, min(ce, e)) for s, e in windows
                  for cs, ce in calls[bisect.bisect_left(call_starts, s):bisect.bisect_left(call_starts, e)]]
        in_calls = sum(e - s for s, e in inside)
        idle_in_calls = in_calls - sum(covered(merged, starts, s, e) for s, e in inside)
        count = sum(bisect.bisect_right(launches, e) - bisect.bisect_left(launches, s) for s, e in windows)
        out[part] = {"wall_ms": wall / 1e3 / passes, "busy_ms": busy / 1e3 / passes,
                     "idle_ms": (wall - busy) / 1e3 / passes, "in_calls_ms": in_calls / 1e3 / passes,
                     "idle_in_calls_ms": idle_in_calls / 1e3 / passes, "launches": count / passes}
    span = (min(s for s, _ in ranges["draft"]), max(e for _, e in ranges["commit"])) if ranges["draft"] else (0, 0)
    busy = covered(merged, starts, *span)
    out["passes"] = {"count": passes, "wall_ms": (span[1] - span[0]) / 1e3 / passes, "busy_ms": busy / 1e3 / passes,
                     "idle_ms": (span[1] - span[0] - busy) / 1e3 / passes}
    return out


def python_loop_ms() -> float:
    """A single-thread Python loop's best time of 5 (a host's speed at the runtime's kind of work)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i & 7
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def host() -> dict:
    name = platform.processor()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"processor": name, "python_loop_ms": python_loop_ms()}


def profiled(system, engine: str, arrivals, policy, forces, extra: tuple[str, ...] = ()) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    system.serve(engine, arrivals, policy, forces=forces)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    module = system.engines[engine].model.module
    released = module.releases
    with profile(activities=activities) as prof:
        system.serve(engine, arrivals, policy, forces=forces, parts=Ranges())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        # each hand-back of pooled memory (`keep_headroom`) waits for the device and empties TVM's pool
        return {**split(json.loads(path.read_text()), extra), "releases": module.releases - released}


def measure(system, engine: str, batch: int, args) -> dict:
    arrivals = burst(batch, args.prompt_tokens, args.new_tokens, system.vocab_size)
    forces = [g.tokens for g in system.serve(system.autoregressive_engine(), arrivals,
                                              system.batch_policy(system.autoregressive_engine(), batch)).generations]
    policy = system.batch_policy(engine, batch)
    start = time.perf_counter()
    system.serve(engine, arrivals, policy, forces=forces)
    plain = time.perf_counter() - start
    row = {"engine": engine, "batch": batch, "priced": policy.adaptive, "plain_seconds": plain,
           **profiled(system, engine, arrivals, policy, forces, tuple(args.ranges))}
    return row


def report(row: dict) -> dict:
    print(f"{row['engine']}{' priced' if row['priced'] else ''} at {row['batch']}: {row['passes']['count']} passes, "
          f"{row['passes']['wall_ms']:.2f} ms a pass, device idle {row['passes']['idle_ms']:.2f}; "
          + "; ".join(f"{p} {row[p]['wall_ms']:.2f} (idle {row[p]['idle_ms']:.2f}, of it in the build's calls "
                      f"{row[p]['idle_in_calls_ms']:.2f}; {row[p]['launches']:.0f} launches)" for p in PARTS)
          + f"; {row['releases']} memory hand-backs")
    for name in (k for k in row if ":" in k):
        r = row[name]
        print(f"  {name}: {r['wall_ms']:.2f} ms a pass, device idle {r['idle_ms']:.2f} "
              f"(in the build's calls {r['idle_in_calls_ms']:.2f})")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--batches", default="16")
    ap.add_argument("--engines", default="compiled-spec,compiled-tree-sched")
    ap.add_argument("--priced", choices=("off", "on", "both"), default="off")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ranges", type=lambda text: list(RUNTIME_RANGES) if text == "runtime" else
                    [n for n in text.split(",") if n], default=[],
                    help="runtime functions MODULE:QUALNAME, comma-separated, each timed as a range of its own "
                         "('runtime': the runtime's host work around a pass's calls)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    functions_ranged(args.ranges)   # before the runtime's objects are made
    from specpilot.runtime.engine import CompiledModule
    from specpilot.runtime.systems import from_build
    module = CompiledModule(Path(args.build))
    calls_ranged(module)            # before the system's models take their functions
    system = from_build(Path(args.build), module)
    rows = []
    for priced in {"off": (False,), "on": (True,), "both": (False, True)}[args.priced]:
        system.draft_priced = priced
        for engine in args.engines.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(report(measure(system, engine, batch, args)))
    machine = host()
    print(f"host: {machine['processor']}; a 1M-iteration Python loop {machine['python_loop_ms']:.1f} ms")
    print("wrote", write("batch-timeline", {"build": args.build, "host": machine,
                                            "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, args.out))


if __name__ == "__main__":
    main()
