"""Token forcing of compiled GPU builds against the stock reference on the same GPU.

    python bench/gpu_forcing.py BUILD_DIR [BUILD_DIR ...] [--max-new-tokens 256] [--prompt-tokens 16] [--out DIR]

Builds are made anywhere (`specpilot compile SPEC --target cuda -arch=sm_90`, cross-compiled
on a CPU machine is fine) and loaded here with the TVM runtime alone.  In bf16 a mismatch is
excused only where stock's top-2 margin is below the tie tolerance, and at most as many as
stock's own precision explains (`System.derived_near_ties`); every excused position is listed
in the JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from specpilot.runtime.forcing import against_baseline, force_requests  # noqa: E402
from specpilot.runtime.systems import from_build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tie-tolerance", default="auto",
                    help="a number, or auto: stock's own bf16-vs-fp32 margin error on these requests")
    ap.add_argument("--prompt-tokens", type=int, default=16,
                    help="the shortest of the four prompts (the others 8, 16, 24 longer): long prompts put "
                         "verification at long contexts -- many key splits in the rows attention")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for build in args.builds:
        started = time.perf_counter()
        system = from_build(build)
        prompts = [[(37 * i + 11 * r) % system.vocab_size for i in range(args.prompt_tokens + 8 * r)] for r in range(4)]
        baseline = None
        for engine in [e for e in ("compiled", "compiled-spec", "compiled-tree", "compiled-two-level")
                       if e in system.engines]:
            stock_runs, runs = [], []
            for prompt in prompts:
                stock = system.generate("stock", prompt, args.max_new_tokens)
                stock_runs.append(stock)
                runs.append(system.generate(engine, prompt, args.max_new_tokens, force=stock.tokens))
            tolerance, budget = (system.derived_near_ties(prompts, stock_runs) if args.tie_tolerance == "auto"
                                 else (float(args.tie_tolerance), None))
            report = force_requests(stock_runs, runs, tolerance, budget)
            if engine == "compiled":
                baseline = report
            elif baseline is not None:   # the same build's AR engine: the same arithmetic per token
                report = against_baseline(report, baseline)
            rows.append({"build": build.name, "engine": engine, "dtype": system.dtype, **report.to_dict(),
                         "mean_accepted": sum(r.mean_accepted for r in runs) / len(runs),
                         "seconds": round(time.perf_counter() - started, 1)})
            print(f"{build.name:28s} {engine:14s} passed={report.passed} positions={report.positions} "
                  f"excused={len(report.excused)}/{report.max_excused} first={report.first_divergence}"
                  + (f" ({report.reason})" if report.reason else ""), flush=True)
    path = write("gpu-forcing", {"tie_tolerance": args.tie_tolerance, "max_new_tokens": args.max_new_tokens,
                                 "prompt_tokens": args.prompt_tokens,
                                 "results": rows}, args.out)
    print(f"wrote {path}")
    sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    main()
