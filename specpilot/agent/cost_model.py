"""Phase 0: where the time goes, as three factors of the gap to the ceiling.

    acceptance factor  accepted tokens per verification of a best-first tree at the best node
                       budget (replayed from recorded drafter lattices, no target runs) over
                       the current system's
    kernel factor      profiled kernel time / sum of the kernels' lower bounds
                       (compiler.costs: max(FLOPs at 60 % of peak, bytes at 90 % of bandwidth))
    overhead factor    wall time / profiled kernel time (what no kernel accounts for: the
                       Python loop, VM dispatch, host-device traffic)

The largest factor names the direction the proposers work on.  ``explain`` returns a plain
dict (the JSON of ``specpilot explain --json``).
"""

from __future__ import annotations

import time
from pathlib import Path

from specpilot.core.errors import SpecPilotError
from specpilot.core.manifest import read_manifest
from specpilot.passes.pipeline import parse

BUDGETS = (8, 16, 32, 64)
MAX_DEPTH = 16


def engine_for(pipeline: str, has_drafter: bool = True) -> str:
    """The engine that runs a build's pipeline as its authors meant."""
    names = parse(pipeline).names()
    if "two-level-verify" in names:
        return "compiled-two-level"
    if "tree-verify" in names and {"node-budget", "prompt-admission", "draft-length"} & set(names):
        return "compiled-tree-sched"     # the batch schedule the build chose
    if "tree-verify" in names:
        return "compiled-tree"
    return "compiled-spec" if has_drafter else "compiled"


class ExpansionRecorder:
    """Drafter expansions (path -> top-k (token, logprob)) per position, recorded once at the
    largest budget and replayed for every smaller one (best-first pops the same nodes first)."""

    def __init__(self):
        self.table: dict[int, dict[tuple, list]] = {}

    def expander(self, make_drafter, context: list[int], p: int):
        seen = self.table.setdefault(p, {})
        live = None

        def expand(path):
            nonlocal live
            key = tuple(path)
            if key not in seen:
                if live is None:
                    live = make_drafter().expander(context)
                seen[key] = [(int(t), float(lp)) for t, lp in live(list(path))]
            return seen[key]
        return expand

    def to_json(self) -> dict:
        return {str(p): [[list(k), v] for k, v in paths.items()] for p, paths in self.table.items()}


def tree_acceptance(system, prompts: list[list[int]], references: list[list[int]],
                    budgets=BUDGETS, max_depth: int = MAX_DEPTH) -> tuple[dict[int, float], list[dict]]:
    """Mean accepted tokens per verification of best-first trees at each budget, replayed on
    stock's own tokens with the reference drafter; and the recorded lattices."""
    from specpilot.runtime.tree import replay_acceptance

    make = system.engines["stock-spec"].drafter
    per_budget = {b: [] for b in budgets}
    lattices = []
    for prompt, ref in zip(prompts, references):
        rec = ExpansionRecorder()
        expanders = {}

        def expand_at(p, prompt=prompt, ref=ref, rec=rec, expanders=expanders):
            if p not in expanders:
                expanders[p] = rec.expander(make, prompt + ref[:p], p)
            return expanders[p]
        for b in sorted(budgets, reverse=True):          # largest first: records every expansion
            per_budget[b].extend(replay_acceptance(expand_at, ref, b, max_depth))
        lattices.append(rec.to_json())
    return {b: sum(v) / len(v) if v else 1.0 for b, v in per_budget.items()}, lattices


def explain(build_dir: Path, prompts: list[list[int]], max_new: int, engine: str | None = None,
            budgets=BUDGETS, context: int | None = None, system=None, progress=None) -> dict:
    """``system``: the build already loaded (`runtime.systems.from_build`), to avoid loading it again.
    ``progress(message)`` hears each stage (timing, profiling, the replayed trees)."""
    say = progress or (lambda message: None)
    from specpilot.agent.kernel_costs import KernelTable
    from specpilot.core.costs import device_peaks
    from specpilot.runtime.profile import profiling
    from specpilot.runtime.systems import from_build

    build_dir = Path(build_dir)
    system = system or from_build(build_dir)
    m = read_manifest(build_dir)
    has_drafter = "compiled-spec" in system.engines
    engine = engine or engine_for(m.pipeline, has_drafter)
    if engine not in system.engines or not engine.startswith("compiled"):
        raise SpecPilotError(f"explain profiles a compiled engine; {engine!r} is not one of this build's")
    table = KernelTable(build_dir)
    peaks = device_peaks(m.target)
    module = system.engines["compiled"].model.module
    runs, wall = _timed_runs(system, engine, prompts, max_new, say)
    steps = sum(len(g.accepted) - 1 for g in runs)                 # verifications (the first entry is prefill)
    tokens = sum(len(g.tokens) for g in runs)
    with profiling(module, set(table.kernels)) as prof:
        for i, p in enumerate(prompts):
            say(f"profiling kernels, request {i + 1}/{len(prompts)}")
            system.generate(engine, p, max_new)
    ctx = context or int(sum(len(p) for p in prompts) / len(prompts) + max_new / 2)
    rows = _kernel_rows(prof.calls, table, peaks, ctx)
    kernel_seconds = prof.kernel_seconds
    bound_seconds = sum(k["bound_seconds"] for k in rows)
    current = sum(sum(g.accepted[1:]) for g in runs) / steps if steps else 1.0
    if has_drafter:
        say("replaying best-first trees on the drafter's expansions")
        trees, lattices = tree_acceptance(system, prompts, [g.tokens for g in runs], budgets)
    else:
        trees, lattices = {}, []
    best_budget = max(trees, key=lambda b: (trees[b], -b)) if trees else None
    factors = {
        "acceptance": max(1.0, trees[best_budget] / current) if trees else 1.0,
        "kernel": kernel_seconds / bound_seconds if bound_seconds else 1.0,
        "overhead": wall / kernel_seconds if kernel_seconds else float("inf"),
    }
    bottleneck = max(factors, key=factors.get)
    return {
        "build": str(build_dir), "pipeline": m.pipeline, "engine": engine, "target": m.target,
        "drafter_kind": m.drafter.kind,
        "device": peaks, "requests": len(prompts), "max_new_tokens": max_new, "context": ctx,
        "tokens": tokens, "verifications": steps, "wall_seconds": wall, "kernel_seconds": kernel_seconds,
        "bound_seconds": bound_seconds, "kernel_calls": len(prof.calls), "other_vm_calls": prof.other_calls,
        "accepted_per_verification": current, "tree_acceptance": {str(b): v for b, v in trees.items()},
        "best_budget": best_budget, "factors": factors, "bottleneck": bottleneck,
        "kernels": rows, "lattices": lattices,
    }


def _timed_runs(system, engine: str, prompts: list[list[int]], max_new: int, say) -> tuple[list, float]:
    """One warm-up, then every prompt generated and timed: (the generations, wall seconds)."""
    say("warm-up")
    system.generate(engine, prompts[0], min(8, max_new))
    runs, wall = [], 0.0
    for i, p in enumerate(prompts):
        say(f"timing request {i + 1}/{len(prompts)}")
        start = time.perf_counter()
        runs.append(system.generate(engine, p, max_new))
        wall += time.perf_counter() - start
    return runs, wall


def _kernel_rows(calls, table, peaks: dict, ctx: int) -> list[dict]:
    """Per kernel: calls, measured seconds, the roofline's bound at ``ctx``, FLOPs and bytes, and the
    ratio of the two times; slowest first."""
    kernels: dict[str, dict] = {}
    for call in calls:
        cost = table.cost(call.name, call.shapes, ctx)
        k = kernels.setdefault(call.name, {"name": call.name, "calls": 0, "seconds": 0.0, "bound_seconds": 0.0,
                                           "flops": 0.0, "bytes": 0.0})
        k["calls"] += 1
        k["seconds"] += call.seconds
        k["bound_seconds"] += cost.bound(peaks["flops"], peaks["bandwidth"])
        k["flops"] += cost.flops
        k["bytes"] += cost.bytes
    rows = sorted(kernels.values(), key=lambda k: -k["seconds"])
    for k in rows:
        k["ratio"] = k["seconds"] / k["bound_seconds"] if k["bound_seconds"] else float("inf")
    return rows


def plot(report: dict, path: Path, label: int = 5) -> None:
    """Kernels against the device: those that compute at their arithmetic intensity and achieved FLOP/s
    under the roofline, those that only move bytes (copies, gathers) at their achieved bandwidth against
    the copy peak -- the ``label`` slowest of each named -- and the gap factors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak_f, peak_b = report["device"]["flops"], report["device"]["bandwidth"]
    timed = [k for k in report["kernels"] if k["bytes"] and k["seconds"]]
    computing, moving = [k for k in timed if k["flops"] > 0], [k for k in timed if k["flops"] <= 0]
    fig, (ax, bw, bars) = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [2, 1.2, 1]})
    xs = [10 ** (i / 10) for i in range(-30, 41)]
    ax.loglog(xs, [min(peak_f, x * peak_b) for x in xs], "k-", label="roofline")
    ax.loglog(xs, [min(0.6 * peak_f, x * 0.9 * peak_b) for x in xs], "k--", lw=0.8, label="bound (60% / 90%)")
    for i, k in enumerate(computing[:30]):
        x, y = k["flops"] / k["bytes"], k["flops"] / k["seconds"]
        ax.scatter(x, y, s=14)
        if i < label:
            ax.annotate(k["name"][:28], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("FLOP / byte")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"kernels of {report['pipeline'] or 'stock'} ({report['device']['name']})")
    ax.legend(loc="lower right")
    shown = moving[:max(label, 8)]
    bw.barh([k["name"][:24] for k in shown][::-1], [k["bytes"] / k["seconds"] / peak_b for k in shown][::-1],
            color="tab:blue")
    bw.axvline(1.0, color="k", lw=0.8)
    bw.set_xlabel("achieved bandwidth / copy peak")
    bw.set_title("kernels that only move bytes" if shown else "no bytes-only kernels")
    bw.tick_params(axis="y", labelsize=7)
    names = list(report["factors"])
    bars.bar(names, [report["factors"][n] for n in names],
             color=["tab:red" if n == report["bottleneck"] else "tab:gray" for n in names])
    bars.set_yscale("log")
    bars.set_title("gap factors (largest = bottleneck)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(report: dict, top: int = 12) -> str:
    f = report["factors"]
    lines = [f"{report['build']}  pipeline: {report['pipeline'] or '(stock)'}  engine: {report['engine']}  "
             f"device: {report['device']['name']}",
             f"{report['tokens']} tokens in {report['verifications']} verifications "
             f"({report['accepted_per_verification']:.2f} per verification), wall {report['wall_seconds']:.3f} s, "
             f"kernels {report['kernel_seconds']:.3f} s ({report['kernel_calls']} calls), "
             f"bounds {report['bound_seconds'] * 1e3:.2f} ms",
             "factors: " + ", ".join(f"{k} {v:.2f}x" for k, v in f.items()) + f"  -> bottleneck: {report['bottleneck']}"]
    if report["device"].get("note"):
        lines.append("note: " + report["device"]["note"])
    if report["tree_acceptance"]:
        lines.append("best-first tree acceptance (replayed): " + ", ".join(
            f"budget {b}: {v:.2f}" for b, v in report["tree_acceptance"].items()))
    lines.append(f"{'kernel':44s} {'calls':>6s} {'time ms':>9s} {'bound ms':>9s} {'ratio':>8s}")
    for k in report["kernels"][:top]:
        lines.append(f"{k['name'][:44]:44s} {k['calls']:6d} {k['seconds'] * 1e3:9.3f} {k['bound_seconds'] * 1e3:9.3f} "
                     f"{k['ratio']:8.1f}")
    return "\n".join(lines)
