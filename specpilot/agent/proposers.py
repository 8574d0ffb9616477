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
- overhead direction: fewer calls per token (shorter drafts); on CUDA, graphs
  (``kernel-schedule{graph=true}``: half the time outside kernels) and then, for one sequence,
  a fixed-size verification (``tree-verify{fixed=true}``: a quarter of it).
- batch deployments (``deployment.max_batch`` > 1, with trees): packed verification
  (``tree-verify{packed=true}``, under a shared node budget: half the padded rows it skips) and the batch schedule --
  ``node-budget`` (half the rows of B trees of the budget each), ``draft-length`` (the budget, 3/4
  and 1/2 of it, by acceptance) and ``prompt-admission`` -- estimated from the replayed acceptance
  at the nodes a request gets on average, against the rows a pass no longer verifies (a batched
  verification of B x (budget + 1) rows is compute-bound on the GPUs measured: bench/README "Batched");
  with chains, lengths priced per pass (``draft-length{priced}``), estimated from the replayed tokens a
  verified row at the best fixed length against the current lengths'.

Only candidates with an estimated net gain >= 3 % are built.  The LLM proposer
(`agent.llm`) answers the same question through a chat endpoint; its answers are data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specpilot.core.schedule_sets import FOR_TARGET, FUSES_TRANSPOSES, default_schedule, runs_on
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


@dataclass
class Facts:
    """What the cost report says about the current pipeline, in the terms the proposals use."""
    report: dict
    current: Pipeline
    context: PassContext
    draft_len: int
    references: list[list[int]]
    call: float          # a drafter call in verifications: a model's counted as one, an n-gram lookup as none
    names: set
    slow_mm: float       # seconds of weight GEMMs beyond 2x their bound (the part counted as removable)

    @property
    def chain_cost(self) -> float:
        return self.draft_len * self.call + 1

    @property
    def accepted(self) -> float:
        return self.report["accepted_per_verification"]

    @property
    def wall(self) -> float:
        return self.report["wall_seconds"]

    @property
    def kernel_s(self) -> float:
        return self.report["kernel_seconds"] or 1.0

    def speedup_removing(self, kernel_seconds: float) -> float:
        """The estimated gain of removing ``kernel_seconds`` of kernel time (scaled to wall time)."""
        return self.wall / max(self.wall - kernel_seconds * (self.wall / self.kernel_s), 1e-9) - 1


Proposal = tuple   # (direction, passes, estimated gain, rationale, passes to drop)


class BuiltinProposer:
    """Candidates per cost factor (acceptance, kernel, overhead) from cheap evidence: replayed
    drafter expansions, the profile's kernels against their bounds, and host time."""

    name = "builtin"

    def propose(self, report: dict, current: Pipeline, context: PassContext, draft_len: int,
                references: list[list[int]], tried: set[str]) -> list[Candidate]:
        slow_mm = sum(max(0.0, k["seconds"] * (1 - 2.0 / k["ratio"])) for k in report["kernels"]
                      if is_weight_gemm(k["name"]) and k.get("ratio", 0) > 2.0)
        facts = Facts(report, current, context, draft_len, references,
                      0.0 if report.get("drafter_kind") == "ngram" else 1.0, set(current.names()), slow_mm)
        out: list[Candidate] = []
        for direction, change, gain, why, drop in [*self.acceptance(facts), *self.kernel(facts),
                                                   *self.overhead(facts)]:
            pipeline = with_change(current, change, context, drop)
            if pipeline is None or str(pipeline) == str(current) or str(pipeline) in tried:
                continue
            out.append(Candidate(str(pipeline), direction, ",".join(map(str, change)), gain, why))
        return _best_per_direction(out, report["factors"])

    def acceptance(self, f: Facts) -> list[Proposal]:
        """Longer chains and the dynamic schedule (replayed), and best-first trees of each budget."""
        found = [p for p in self._draft_lengths(f) if p[0] == "acceptance"]
        for budget_text, acc in f.report.get("tree_acceptance", {}).items():
            budget = int(budget_text)
            cost_ratio = (budget * f.call + 1) / f.chain_cost      # node expansions are drafter calls
            change = [REGISTRY["tree-verify"](budget=budget)]
            if f.context.hybrid:
                change.append(REGISTRY["gdn-path-recompute"]())
            found.append(("acceptance", change, (acc / f.accepted) / cost_ratio - 1,
                          f"replayed best-first tree: {acc:.2f} tokens/verification (now {f.accepted:.2f}) for "
                          f"{budget} drafter expansions per step" + (" (n-gram lookups, not counted)" if not f.call else ""),
                          ("draft-length",)))
        return found

    def overhead(self, f: Facts) -> list[Proposal]:
        """Shorter chains (replayed), and CUDA graphs where the host's launch work shows."""
        found = [p for p in self._draft_lengths(f) if p[0] == "overhead"]
        if f.context.target_kind == "cuda":
            now = next((p for p in f.current.passes if p.name == "kernel-schedule"), None)
            if now is None or not now["graph"]:
                host = max(f.wall - f.kernel_s, 0.0)
                found.append(("overhead", [REGISTRY["kernel-schedule"](set=now["set"] if now else "default", graph=True)],
                              f.wall / max(f.wall - 0.5 * host, 1e-9) - 1,
                              f"{host * 1e3:.1f} ms of {f.wall * 1e3:.1f} ms is outside kernels (launches, host work); "
                              "CUDA graphs replay the static kernel runs", ()))
            found += self._fixed_verify(f, now)
        return found

    def _fixed_verify(self, f: Facts, schedule) -> list[Proposal]:
        """On graphs, one sequence's trees verified at a fixed size so verification replays too.  Its
        share of the host's time is not in the report: a quarter of it is the estimate (on SmolLM2
        verification's time fell 17-31 %, bench/README "Feature and block drafters")."""
        tree = next((p for p in f.current.passes if p.name == "tree-verify"), None)
        if schedule is None or not schedule["graph"] or tree is None or tree["fixed"] or f.context.max_batch != 1:
            return []
        host = max(f.wall - f.kernel_s, 0.0)
        return [("overhead", [REGISTRY["tree-verify"](budget=tree["budget"], fixed=True)],
                 f.wall / max(f.wall - 0.25 * host, 1e-9) - 1,
                 f"{host * 1e3:.1f} ms of {f.wall * 1e3:.1f} ms is outside kernels; verification at a fixed "
                 f"{tree['budget'] + 1} tokens replays its kernels as CUDA graphs too", ())]

    def kernel(self, f: Facts) -> list[Proposal]:
        """Other schedule sets, stacked projections and W12, from the kernels' distance to their bounds;
        the batch schedule, from the verification rows it saves."""
        return [*self._schedule_sets(f), *self._fused_projections(f), *self._w12(f), *self._batch_schedule(f),
                *self._packed_verify(f), *self._priced_chains(f)]

    def _batch_schedule(self, f: Facts) -> list[Proposal]:
        tree = next((p for p in f.current.passes if p.name == "tree-verify"), None)
        batch = f.context.max_batch
        if tree is None or batch < 2 or "node-budget" in f.names:
            return []
        budget, acceptance = tree["budget"], {int(b): a for b, a in f.report.get("tree_acceptance", {}).items()}
        nodes = max(batch, batch * budget // 2)
        share = max(1, nodes // batch)
        have = [b for b in acceptance if b <= share]
        now = acceptance.get(budget, f.accepted)
        shared = acceptance[max(have)] if have else 1.0
        rows = batch * (budget + 1) / (batch + nodes)
        change = [REGISTRY["node-budget"](nodes=nodes),
                  REGISTRY["draft-length"](length=budget, min=max(1, budget // 2), step=max(1, budget // 4),
                                           dynamic=True),
                  REGISTRY["prompt-admission"](chunk=max(8, 2 * budget))]
        return [("kernel", change, (shared / now) * rows - 1,
                 f"batch {batch}: {nodes} nodes a pass shared best first instead of {batch} x {budget} verifies "
                 f"{rows:.2f}x fewer rows (counted as time: compute-bound batched verification), replayed "
                 f"acceptance {shared:.2f} at {share} nodes a request vs {now:.2f} at {budget}", ())]

    def _packed_verify(self, f: Facts) -> list[Proposal]:
        """A shared node budget gives the requests uneven trees, and a batched verification pads each to the
        longest: ``tree-verify{packed=true}`` runs the linear layers and head over the real rows only.  At
        most B x (budget + 1) rows against B + nodes are real; half that gap is the estimate (the largest
        tree usually stays under its cap), rows counted as time (a compute-bound batched verification)."""
        tree = next((p for p in f.current.passes if p.name == "tree-verify"), None)
        shared = next((p for p in f.current.passes if p.name == "node-budget"), None)
        batch = f.context.max_batch
        if tree is None or shared is None or tree["packed"] or batch < 2:
            return []
        padded, real = batch * (tree["budget"] + 1), batch + shared["nodes"]
        if padded <= real:
            return []
        return [("kernel", [REGISTRY["tree-verify"](**{**tree.values, "packed": True})], 0.5 * (padded / real - 1),
                 f"batch {batch}: {shared['nodes']} nodes shared over {batch} trees of up to {tree['budget']} verify "
                 f"{real} real rows of up to {padded} padded; packed verification skips the padding in the linear "
                 "layers and head", ())]

    def _priced_chains(self, f: Facts) -> list[Proposal]:
        """Batch deployments served by chains: each pass's chains cut to the length with the most expected
        tokens a second of pass, priced from the passes' measured cost (``draft-length{priced}``).
        Estimated as the batch schedule is, rows counted as time (a compute-bound batched verification):
        the replayed tokens a verified row at the best fixed length against the current lengths'."""
        now = next((p for p in f.current.passes if p.name == "draft-length"), None)
        exps = _expansions(f.report)
        if f.context.max_batch < 2 or "tree-verify" in f.names or (now is not None and now["priced"]) or not exps:
            return []
        from specpilot.runtime.draft_schedule import DraftSchedule
        length = now["length"] if now is not None and now["length"] else f.draft_len
        dynamic = now is not None and now["dynamic"]

        def per_row(k: int, dyn: bool, minimum: int = 1, step: int = 1) -> float:
            acc, drafted = self._replay_chain(exps, f.references, k, dyn, DraftSchedule, minimum, step)
            return acc / (drafted + 1)      # the drafted tokens and the last one: the rows a request verifies
        current = per_row(length, dynamic, *((now["min"], now["step"]) if dynamic else ()))
        rows = {k: per_row(k, False) for k in range(1, length + 1)}
        best = max(rows, key=rows.get)
        change = [REGISTRY["draft-length"](**{**(now.values if now is not None else {}), "length": length,
                                              "priced": True})]
        return [("kernel", change, rows[best] / current - 1,
                 f"batch {f.context.max_batch}: chains of {best} verify {rows[best]:.2f} replayed tokens a row against "
                 f"{current:.2f} at {length}{' (dynamic)' if dynamic else ''} (rows counted as time: compute-bound "
                 "batched verification); the engine picks each pass's length from its passes' measured cost", ())]

    def _draft_lengths(self, f: Facts) -> list[Proposal]:
        if "tree-verify" in f.names or "compiled-spec" not in f.report.get("engine", "compiled-spec"):
            return []
        from specpilot.runtime.draft_schedule import DraftSchedule
        exps, found = _expansions(f.report), []
        for length in sorted({1, 2, 3, max(1, f.draft_len // 2), f.draft_len, 2 * f.draft_len}):
            for dynamic in (False, True):
                if length == 1 and dynamic:
                    continue
                acc, drafted = self._replay_chain(exps, f.references, length, dynamic, DraftSchedule)
                gain = (acc / f.accepted) / ((drafted * f.call + 1) / f.chain_cost) - 1
                found.append(("overhead" if length < f.draft_len else "acceptance",
                              [REGISTRY["draft-length"](length=length, dynamic=dynamic)], gain,
                              f"replayed: {acc:.2f} tokens/verification with {drafted:.2f} drafts (now {f.accepted:.2f} "
                              f"with {f.draft_len})", ()))
        return found

    def _schedule_sets(self, f: Facts) -> list[Proposal]:
        kind, arch, found = f.context.target_kind, f.context.arch, []
        transposes = sum(k["seconds"] for k in f.report["kernels"] if k["name"].startswith("transpose"))
        sets = [s for s in FOR_TARGET[kind] if runs_on(s, kind, arch)]
        in_effect = next((p["set"] for p in f.current.passes if p.name == "kernel-schedule"), "default")
        in_effect = default_schedule(kind, arch) if in_effect == "default" else in_effect
        for s in sets:
            if s == in_effect:          # the set the current build already runs
                continue
            removed = transposes if s in FUSES_TRANSPOSES else 0.0
            why = f"{transposes * 1e3:.1f} ms of {f.report['kernel_seconds'] * 1e3:.1f} ms kernel time is run-time " \
                  f"weight transposes, which {s} fuses away" if removed else f"{s}: no cheap evidence of a gain"
            if s == "skinny-mma" and f.slow_mm:
                # matmuls more than 2x from their bound: skinny-mma's tensor-core kernel brings the measured
                # ones near cuBLAS (bench/README "Skinny GEMMs") -- what is above 2x of the bound counts
                removed += f.slow_mm
                why = f"{f.slow_mm * 1e3:.1f} ms of NT matmul time is more than 2x from its bound (skinny-mma: " \
                      f"tensor-core GEMMs for few rows)" + (f"; {why}" if transposes else "")
            found.append(("kernel", [REGISTRY["kernel-schedule"](set=s)], f.speedup_removing(removed), why, ()))
        return found

    def _fused_projections(self, f: Facts) -> list[Proposal]:
        if "fuse-projections" in f.names or not f.slow_mm:
            return []
        # projections that read one activation (q/k/v, gate/up, GDN inputs): the narrow ones run far
        # from their bound (too few blocks to fill the device); stacked, one GEMM reads them in one
        # wide pass -- half the far-from-bound time counted (not every such matmul stacks)
        return [("kernel", [REGISTRY["fuse-projections"]()], f.speedup_removing(0.5 * f.slow_mm),
                 f"{f.slow_mm * 1e3:.1f} ms of NT matmul time is more than 2x from its bound; stacking the "
                 "projections that share an activation makes fewer, wider GEMMs", ())]

    def _w12(self, f: Facts) -> list[Proposal]:
        if "w12-layout" in f.names:     # legality (with_change) says where it cannot go
            return []
        matmul = [k for k in f.report["kernels"] if is_weight_gemm(k["name"]) or "matmul" in k["name"]]
        near = [k for k in matmul if k["ratio"] < 2.0]
        return [("kernel", [REGISTRY["w12-layout"]()], f.speedup_removing(0.25 * sum(k["seconds"] for k in near)),
                 f"W12 moves 0.75 of the weight bytes; {len(near)} of {len(matmul)} matmul kernels are within 2x "
                 "of their bound (only those gain from fewer bytes)", ())]

    @staticmethod
    def _replay_chain(exps, references, length, dynamic, schedule_cls, minimum: int = 1,
                      step: int = 1) -> tuple[float, float]:
        accs, drafts = [], []
        for table, ref in zip(exps, references):
            sched = schedule_cls(length, minimum, dynamic, step=step)

            def length_at(step, last, sched=sched):
                if last is not None:
                    sched.update(last)
                return sched.next()
            a, d = replay_chain(table, ref, length_at)
            accs.append(a)
            drafts.append(d)
        n = max(len(accs), 1)
        return sum(accs) / n, sum(drafts) / n


def _best_per_direction(candidates: list[Candidate], factors: dict) -> list[Candidate]:
    """The largest factor's direction first, then by estimate; the best few per direction."""
    kept = []
    for direction in sorted(factors, key=lambda f: -factors[f]):
        mine = sorted((c for c in candidates if c.direction == direction), key=lambda c: -c.estimated_gain)
        kept += [c for c in mine if c.estimated_gain >= MIN_ESTIMATED_GAIN][:PER_DIRECTION]
    return kept


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
