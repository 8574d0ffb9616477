"""libspecpilot (the C++ runtime) beside the Python engine on the same builds, in one run.

    python bench/cpp_runtime.py BUILD_DIR [BUILD_DIR ...] --programs build/cpp/examples
        [--tokens 128] [--timing-tokens 256] [--repeats 5] [--out DIR]

Per build: every compiled engine's tokens from specpilot-generate (the C API) against the Python
engine's, four prompts, greedy (tokens and accepted tokens per verification) and seeded sampling
(tokens against Python's compiled AR); then batch-1 autoregressive decoding timed both ways
(tokens/s over the same request, median of --repeats after a warm-up) beside the step function
alone (the Python engine's decode call repeated on fixed arguments), so each loop's host time per
step is (seconds a token) - (step alone).  Builds must carry their weights (`specpilot materialize`
writes them into a seeded build).  Exit status 1 when any tokens differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from specpilot.core.sampling import SamplingParams  # noqa: E402
from specpilot.runtime.systems import from_build  # noqa: E402

SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 12345}


def prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i) % vocab for i in range(11)] * 2, [5, 9, 13, 17] * 3, [(31 * i + 3) % vocab for i in range(23)], [42]]


def cpp(programs: Path, build: Path, prompt_sets, engines, tokens: int, sampling: dict | None = None) -> list[dict]:
    cmd = [str(programs / "specpilot-generate"), str(build), "--max-new-tokens", str(tokens), "--no-verify"]
    for p in prompt_sets:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    for e in engines:
        cmd += ["--engine", e]
    for k, v in (sampling or {}).items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"specpilot-generate failed on {build}: {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines()]


def compare(got: list[int], want, ar) -> dict:
    """C++ tokens against the Python engine's run ``want``: identical, or where they part and AR's
    top-2 margin there (a bf16 near-tie lets two exact engines part; see bench/README)."""
    if got == want.tokens:
        return {"identical": True, "same_accepted": None}
    d = next((i for i, (a, b) in enumerate(zip(got, want.tokens)) if a != b), min(len(got), len(want.tokens)))
    return {"identical": False, "first_divergence": d, "ar_margin": ar.margins[d] if d < len(ar.margins) else None}


def tokens_check(system, programs: Path, build: Path, n: int) -> dict:
    """Every engine's C++ tokens against the same Python engine's, greedy and sampled."""
    engines = [e for e in system.engines if e.startswith("compiled")]
    sets = prompts(system.vocab_size)
    out = {"engines": engines}
    for mode, sampling in (("greedy", None), ("sampled", SAMPLING)):
        params = SamplingParams(**sampling) if sampling else None
        runs = {(r["engine"], r["prompt"]): r for r in cpp(programs, build, sets, engines, n, sampling)}
        ar = [system.generate("compiled", p, n, sampling=params) for p in sets]
        out[mode] = {}
        for e in engines:
            rows = []
            for i, p in enumerate(sets):
                want = system.generate(e, p, n, sampling=params)
                row = compare(runs[(e, i)]["tokens"], want, ar[i])
                if row["identical"]:
                    row["same_accepted"] = runs[(e, i)]["accepted"] == want.accepted
                rows.append(row)
            out[mode][e] = rows
    out["identical"] = all(r["identical"] for mode in ("greedy", "sampled") for rs in out[mode].values() for r in rs)
    return out


def step_alone(system, prompt: list[int], calls: int = 200) -> float:
    """Seconds a call of the decode step function on fixed arguments (synchronised at the ends)."""
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    model = system.engines["compiled"].model
    state = model.new_state(system.capacity)
    model.forward(prompt, state)
    fn, args, *_ = model.step_call([([prompt[-1]], state)])
    for _ in range(10):
        fn(*args)
    best = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        sync()
        best.append((time.perf_counter() - t0) / calls)
    state.close()
    return statistics.median(best)


def timing(system, programs: Path, build: Path, n: int, repeats: int) -> dict:
    prompt = prompts(system.vocab_size)[2]
    runs = cpp(programs, build, [prompt] * (repeats + 1), ["compiled"], n)[1:]
    cpp_s = [r["seconds"] / len(r["tokens"]) for r in runs]
    system.generate("compiled", prompt, n)                                  # warm-up
    py_s = []
    for _ in range(repeats):
        g = system.generate("compiled", prompt, n)
        py_s.append(g.seconds / len(g.tokens))
    step = step_alone(system, prompt)
    c, p = statistics.median(cpp_s), statistics.median(py_s)
    return {"tokens": n, "cpp_s_per_token": cpp_s, "python_s_per_token": py_s, "step_alone_s": step,
            "cpp_tokens_per_s": 1 / c, "python_tokens_per_s": 1 / p, "cpp_over_step_us": (c - step) * 1e6,
            "python_over_step_us": (p - step) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+", type=Path)
    ap.add_argument("--programs", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timing-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-check", action="store_true", help="timing only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results, ok = {}, True
    for build in args.builds:
        system = from_build(build)
        entry = {} if args.no_check else {"check": tokens_check(system, args.programs, build, args.tokens)}
        ok &= entry.get("check", {}).get("identical", True)
        entry["timing"] = timing(system, args.programs, build, args.timing_tokens, args.repeats)
        results[build.name] = entry
        t = entry["timing"]
        check = entry.get("check", {})
        same = sum(r["identical"] for m in ("greedy", "sampled") for rs in check.get(m, {}).values() for r in rs)
        total = sum(len(rs) for m in ("greedy", "sampled") for rs in check.get(m, {}).values())
        print(f"{build.name:28s} identical {same:2d}/{total:2d}"
              f"  AR tok/s C++ {t['cpp_tokens_per_s']:8.1f}  Python {t['python_tokens_per_s']:8.1f}"
              f"  step {t['step_alone_s'] * 1e6:8.1f} us  host/step C++ {t['cpp_over_step_us']:7.1f} us"
              f"  Python {t['python_over_step_us']:7.1f} us", flush=True)
    path = write("cpp-runtime", {"builds": results, "sampling": SAMPLING}, args.out)
    print(f"wrote {path}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
