"""Proposers: from the cost report to candidate pipelines.

A candidate is the current best pipeline with one change (a pass added, or a pass's options
changed), put in a legal order by the z3 legality solver.  Each carries an estimated net gain
from the cheapest evidence there is:

- acceptance direction: best-first trees (``tree-verify{budget}``; ``gdn-path-recompute``
  rides along on hybrids) and draft lengths (``draft-length``), both replayed exactly on the
  recorded drafter expansions of the cost report -- accepted tokens per verification and
  drafter calls per verification, so the estimate is net of the drafting it costs;
- kernel direction: schedule sets (``kernel-schedule``) -- the report's time in the kernels
  the set removes (run-time weight transposes); ``fuse-projections`` -- half the time of NT
  matmuls more than 2x from their bound; ``w12-layout`` -- the weight bytes it saves,
  counted only where weight-reading kernels are near their bandwidth bound;
- overhead direction: fewer calls per token (shorter drafts).

Only candidates with an estimated net gain >= 3 % are built.  The LLM proposer
(`agent.llm`) answers the same question through a chat endpoint; its answers are data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specpilot.passes.base import Pass, PassContext
from specpilot.passes.legality import check, orderings
from specpilot.passes.pipeline import Pipeline, parse
from specpilot.passes.registry import REGISTRY

MIN_ESTIMATED_GAIN = 0.03
PER_DIRECTION = 3


@dataclass
class Candidate:
    pipeline: str
    direction: str
    change: str
    estimated_gain: float
    rationale: str
    source: str = "builtin"        # builtin | llm | memory
    entry: str | None = None       # the memory entry it reuses

    def to_dict(self) -> dict:
        return asdict(self)


def is_weight_gemm(kernel: str) -> bool:
    """A kernel that multiplies activations by a weight matrix: TVM's fused NT matmuls and the
    schedule sets' own GEMMs (``skinny_mma_N_K`` on sm_80+, which verification runs on CUDA)."""
    return "NT_matmul" in kernel or kernel.startswith("skinny_mma_")


def with_change(current: Pipeline, change: list[Pass], context: PassContext, drop: tuple[str, ...] = ()) -> Pipeline | None:
    """``current`` with ``change``'s passes added (replacing same-named ones), in a legal order;
    None when no order is legal."""
    names = {p.name for p in change} | set(drop)
    passes = [p for p in current if p.name not in names] + list(change)
    keep_order = Pipeline(passes)
    if not check(keep_order, context):
        return keep_order
    found = orderings(passes, context, limit=50)
    return found[0] if found else None


def replay_chain(expansions: dict, reference: list[int], length_at) -> tuple[float, float]:
    """(accepted tokens per verification, drafted tokens per verification) when a chain drafter
    proposes ``length_at(step, last_accepted)`` tokens per step along ``reference``, replayed
    from recorded expansions {position: {path tuple: [(token, logprob), ...]}}."""
    p, steps, accepted, drafted, last = 1, 0, 0, 0, None
    while p < len(reference):
        n = min(length_at(steps, last), len(reference) - p)
        table = expansions.get(p, {})
        path, ok = [], 0
        for _ in range(n):
            children = table.get(tuple(path))
            if not children:
                break
            tok = children[0][0]
            if tok != reference[p + len(path)]:
                path.append(tok)
                break
            path.append(tok)
            ok += 1
        drafted += n
        emitted = min(ok + 1, len(reference) - p)
        accepted += emitted
        steps += 1
        last = ok
        p += emitted
    return (accepted / steps if steps else 1.0), (drafted / steps if steps else 0.0)


def _expansions(report: dict) -> list[dict]:
    return [{int(p): {tuple(k): v for k, v in rows} for p, rows in lat.items()} for lat in report.get("lattices", [])]


class BuiltinProposer:
    name = "builtin"

    def propose(self, report: dict, current: Pipeline, context: PassContext, draft_len: int,
                references: list[list[int]], tried: set[str]) -> list[Candidate]:
        out: list[Candidate] = []
        # a step's cost in verifications: one, plus its drafter calls -- a model drafter's call is
        # counted as one (the cost report has no per-model split), an n-gram lookup as nothing
        call = 0.0 if report.get("drafter_kind") == "ngram" else 1.0
        chain_cost = draft_len * call + 1
        current_acc = report["accepted_per_verification"]
        step_s = report["wall_seconds"] / max(report["verifications"], 1)
        names = set(current.names())

        def add(direction: str, change: list[Pass], gain: float, why: str, drop=()):
            pipeline = with_change(current, change, context, drop)
            if pipeline is None or str(pipeline) == str(current) or str(pipeline) in tried:
                return
            out.append(Candidate(str(pipeline), direction, ",".join(map(str, change)), gain, why))

        exps = _expansions(report)
        if "tree-verify" not in names and "compiled-spec" in report.get("engine", "compiled-spec"):
            # chains of other lengths and the dynamic schedule, replayed
            from specpilot.runtime.draft_schedule import DraftSchedule
            for length in sorted({1, 2, 3, max(1, draft_len // 2), draft_len, 2 * draft_len}):
                for dynamic in (False, True):
                    if length == 1 and dynamic:
                        continue
                    acc, drafted = self._replay_chain(exps, references, length, dynamic, DraftSchedule)
                    cost_ratio = (drafted * call + 1) / chain_cost
                    gain = (acc / current_acc) / cost_ratio - 1
                    add("overhead" if length < draft_len else "acceptance",
                        [REGISTRY["draft-length"](length=length, dynamic=dynamic)], gain,
                        f"replayed: {acc:.2f} tokens/verification with {drafted:.2f} drafts (now {current_acc:.2f} "
                        f"with {draft_len})")
        for budget_text, acc in report.get("tree_acceptance", {}).items():
            budget = int(budget_text)
            cost_ratio = (budget * call + 1) / chain_cost      # node expansions are drafter calls
            gain = (acc / current_acc) / cost_ratio - 1
            change = [REGISTRY["tree-verify"](budget=budget)]
            if context.hybrid:
                change.append(REGISTRY["gdn-path-recompute"]())
            add("acceptance", change, gain, f"replayed best-first tree: {acc:.2f} tokens/verification "
                f"(now {current_acc:.2f}) for {budget} drafter expansions per step"
                + (" (n-gram lookups, not counted)" if not call else ""), drop=("draft-length",))
        # kernel direction
        transposes = sum(k["seconds"] for k in report["kernels"] if k["name"].startswith("transpose"))
        kernel_s = report["kernel_seconds"] or 1.0
        wall = report["wall_seconds"]
        from specpilot.schedules.relax_pipeline import runs_on
        sets = [s for s in {"llvm": ("cpu-nt", "tvm-default"), "cuda": ("skinny-mma", "nt-gemv", "tvm-default")}[
            context.target_kind] if runs_on(s, context.target_kind, context.arch)]
        # matmuls more than 2x from their bound: skinny-mma's tensor-core kernel brings the measured
        # ones (bench/README "Skinny GEMMs") to ~1.5x of cuBLAS, itself near the bytes bound -- count
        # what is above 2x of the bound as removable
        slow_mm = sum(max(0.0, k["seconds"] * (1 - 2.0 / k["ratio"])) for k in report["kernels"]
                      if is_weight_gemm(k["name"]) and k.get("ratio", 0) > 2.0)
        in_effect = next((p["set"] for p in current.passes if p.name == "kernel-schedule"), "default")
        if in_effect == "default":
            from specpilot.schedules.relax_pipeline import default_schedule
            in_effect = default_schedule(context.target_kind, context.arch)
        for s in sets:
            if s == in_effect:          # the set the current build already runs
                continue
            removed = transposes * (wall / kernel_s) if s in ("cpu-nt", "nt-gemv", "skinny-mma") else 0.0
            why = f"{transposes * 1e3:.1f} ms of {report['kernel_seconds'] * 1e3:.1f} ms kernel time is run-time " \
                  f"weight transposes, which {s} fuses away" if removed else f"{s}: no cheap evidence of a gain"
            if s == "skinny-mma" and slow_mm:
                removed += slow_mm * (wall / kernel_s)
                why = f"{slow_mm * 1e3:.1f} ms of NT matmul time is more than 2x from its bound (skinny-mma: " \
                      f"tensor-core GEMMs for few rows)" + (f"; {why}" if transposes else "")
            gain = wall / max(wall - removed, 1e-9) - 1
            add("kernel", [REGISTRY["kernel-schedule"](set=s)], gain, why)
        if context.target_kind == "cuda":
            # CUDA graphs replay the static-shape kernel runs: the host's launch work goes away
            now = next((p for p in current.passes if p.name == "kernel-schedule"), None)
            if now is None or not now["graph"]:
                host = max(wall - kernel_s, 0.0)
                gain = wall / max(wall - 0.5 * host, 1e-9) - 1
                add("overhead", [REGISTRY["kernel-schedule"](set=now["set"] if now else "default", graph=True)], gain,
                    f"{host * 1e3:.1f} ms of {wall * 1e3:.1f} ms is outside kernels (launches, host work); "
                    "CUDA graphs replay the static kernel runs")
        if "fuse-projections" not in names and slow_mm:
            # projections that read one activation (q/k/v, gate/up, GDN inputs): the narrow ones run
            # far from their bound (too few blocks to fill the device); stacked, one GEMM reads them
            # in one wide pass -- half the far-from-bound time counted (not every such matmul stacks)
            gain = wall / max(wall - 0.5 * slow_mm * (wall / kernel_s), 1e-9) - 1
            add("kernel", [REGISTRY["fuse-projections"]()], gain,
                f"{slow_mm * 1e3:.1f} ms of NT matmul time is more than 2x from its bound; stacking the "
                "projections that share an activation makes fewer, wider GEMMs")
        if "w12-layout" not in names:     # legality (with_change) says where it cannot go
            matmul = [k for k in report["kernels"] if is_weight_gemm(k["name"]) or "matmul" in k["name"]]
            near = [k for k in matmul if k["ratio"] < 2.0]
            saved = 0.25 * sum(k["seconds"] for k in near)
            gain = report["wall_seconds"] / max(report["wall_seconds"] - saved * report["wall_seconds"] / kernel_s, 1e-9) - 1
            add("kernel", [REGISTRY["w12-layout"]()], gain,
                f"W12 moves 0.75 of the weight bytes; {len(near)} of {len(matmul)} matmul kernels are within 2x "
                "of their bound (only those gain from fewer bytes)")
        # the largest factor's direction first, then by estimate; keep the best few per direction
        order = sorted(report["factors"], key=lambda f: -report["factors"][f])
        kept = []
        for direction in order:
            mine = sorted((c for c in out if c.direction == direction), key=lambda c: -c.estimated_gain)
            kept += [c for c in mine if c.estimated_gain >= MIN_ESTIMATED_GAIN][:PER_DIRECTION]
        return kept

    @staticmethod
    def _replay_chain(exps, references, length, dynamic, schedule_cls) -> tuple[float, float]:
        accs, drafts = [], []
        for table, ref in zip(exps, references):
            sched = schedule_cls(length, 1, dynamic)

            def length_at(step, last, sched=sched):
                if last is not None:
                    sched.update(last)
                return sched.next()
            a, d = replay_chain(table, ref, length_at)
            accs.append(a)
            drafts.append(d)
        n = max(len(accs), 1)
        return sum(accs) / n, sum(drafts) / n


def from_memory(entries, current: Pipeline, context: PassContext, tried: set[str]) -> list[Candidate]:
    """Verified entries that are legal here, as candidates (re-measured, never new discoveries)."""
    out = []
    for e in entries:
        try:
            pipeline = parse(e.pipeline)
        except Exception:   # noqa: BLE001 -- an entry from another version: skip it, say nothing new
            continue
        if pipeline.names() and not check(pipeline, context) and str(pipeline) not in tried and str(pipeline) != str(current):
            gain = float(e.results.get("gain", e.results.get("lcb", 0.0)) or 0.0)
            out.append(Candidate(str(pipeline), "memory", e.pipeline, gain,
                                 f"memory entry {e.id}: {gain:+.1%} on {e.applicability.family}", "memory", e.id))
    return out
