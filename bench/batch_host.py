"""The host's side of a continuous batch's passes: each part's wall time (draft, its batched block call,
verification, commit) less the time inside the build's calls, a pass, at each batch size.

    python bench/batch_host.py BUILD_DIR [--batches 16,32] [--engines compiled-spec] [--prompt-tokens 128]
                               [--new-tokens 64] [--reps 4] [--out DIR]

A burst of B requests of random token ids (seeded) runs through `System.serve` once untimed (it also records
the replay drafter's continuations), then --reps times with the parts timed; the best of the reps a part.  On
the CPU the build's calls run their kernels before they return, so what is left is the Python and array work
around them; on a GPU a part also holds its waits for the device.  JSON to --out.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from specpilot.runtime.batching import Arrival  # noqa: E402
from specpilot.runtime.engine import CompiledModule  # noqa: E402
from specpilot.runtime.systems import from_build  # noqa: E402

PARTS = ("draft", "draft_blocks", "verify", "commit")


class CallTimer:
    """Seconds spent inside a module's functions (its ``functions`` wrapped in place)."""

    def __init__(self, module):
        self.seconds = 0.0
        module.functions = {name: self._timed(fn) for name, fn in module.functions.items()}

    def _timed(self, fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
        return call


class HostParts:
    """A `cycle_timing.Clock`'s interface: each part's wall and build-call seconds, and its count."""

    def __init__(self, calls: CallTimer):
        self.calls = calls
        self.wall, self.inside, self.count = defaultdict(float), defaultdict(float), defaultdict(int)

    def timed(self, part: str, fn, *args, **kwargs):
        inside, start = self.calls.seconds, time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.wall[part] += time.perf_counter() - start
            self.inside[part] += self.calls.seconds - inside
            self.count[part] += 1


def burst(batch: int, prompt_tokens: int, new_tokens: int, vocab: int) -> list[Arrival]:
    rng = random.Random(batch)
    return [Arrival(0.0, tuple(rng.randrange(vocab) for _ in range(prompt_tokens)), new_tokens) for _ in range(batch)]


def measure(system, calls: CallTimer, engine: str, batch: int, args) -> dict:
    arrivals = burst(batch, args.prompt_tokens, args.new_tokens, system.vocab_size)
    policy = system.batch_policy(engine, batch)
    system.serve(engine, arrivals, policy)
    runs = []
    for _ in range(args.reps):
        parts = HostParts(calls)
        system.serve(engine, arrivals, policy, parts=parts)
        passes = parts.count["verify"]
        runs.append({"passes": passes, **{p: {"host_ms": 1e3 * (parts.wall[p] - parts.inside[p]) / passes,
                                               "calls_ms": 1e3 * parts.inside[p] / passes} for p in PARTS}})
    best = {p: min(r[p]["host_ms"] for r in runs) for p in PARTS}
    return {"engine": engine, "batch": batch, "passes": runs[0]["passes"], "host_ms_best": best,
            "host_ms_a_pass_best": best["draft"] + best["verify"] + best["commit"], "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build")
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--engines", default="compiled-spec")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    module = CompiledModule(Path(args.build))
    calls = CallTimer(module)          # before the system's models take their functions
    system = from_build(Path(args.build), module)
    rows = []
    for engine in args.engines.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = measure(system, calls, engine, batch, args)
            rows.append(row)
            best = row["host_ms_best"]
            print(f"{engine} at {batch}: {row['passes']} passes; host ms a pass (best of {args.reps}): "
                  + ", ".join(f"{p} {best[p]:.2f}" for p in PARTS) + f"; draft + verify + commit {row['host_ms_a_pass_best']:.2f}")
    print("wrote", write("batch-host", {"build": args.build, "args": {k: str(v) for k, v in vars(args).items()},
                                        "rows": rows}, args.out))


if __name__ == "__main__":
    main()
