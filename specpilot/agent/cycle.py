"""The optimization loop (`specpilot search`): rounds of phases 0-3, then sealed validation.

    stock       the spec with no passes: built, forced, and measured against itself (A/A) for
                the noise level adjudication needs
    memory      verified entries legal for this deployment are tried first (re-measured,
                reported as reused, never as discoveries)
    per round   0 cost model of the current best (`agent.cost_model`)
                1 exploration: proposer candidates with >= 3 % estimated gain, built and forced
                  in parallel workers (`agent.executor`), then measured here, paired against
                  the current best (`agent.adjudicate`)
                2 integration: the round's adopted changes stacked, measured the same way
                3 kernel tuning: schedule sets of the current best (`kernel-schedule`)
    sealed      held-out requests: token forcing up to 4096 new tokens and a paired speed
                test against stock; a failure rejects the result (the report says why)

Every event goes to ``run.jsonl`` in the output directory; a rerun with the same directory
resumes (builds, forcing results and verdicts already there are reused).  The result is
``final/`` (a build directory) and ``report.json`` + ``report.md``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from specpilot.agent.adjudicate import Interval, noise_level
from specpilot.agent.cost_model import engine_for, explain
from specpilot.agent.executor import make_executor
from specpilot.agent.measurement import Measurements
from specpilot.agent.proposers import BuiltinProposer, Candidate, from_memory, with_change
from specpilot.agent.reproduce import reproduce_hash
from specpilot.agent.run_log import RunLog, requests_for
from specpilot.agent.search_report import write_report
from specpilot.core.errors import SpecPilotError
from specpilot.passes.pipeline import Pipeline, parse


MEMORY_PICKS = 2    # a new deployment starts from stock plus the best verified entries legal for it


class Search:
    def __init__(self, spec_path: Path, target: str, out: Path, rounds: int = 2, workers: int = 1,
                 proposer=None, memory_path: Path | None = None, dev_requests: int = 3, dev_tokens: int = 48,
                 sealed_requests: int = 2, sealed_tokens: int = 4096, repeats: int = 3,
                 inject_fault: int | None = None, backend: str = "local", say=print, time_tokens: int = 48,
                 params: str | None = None):
        from specpilot.core.spec import load_spec
        from specpilot.core.target import parse_target
        from specpilot.memory.store import Applicability, Memory

        self.spec_path, self.spec = Path(spec_path), load_spec(spec_path)
        self.target = parse_target(target)
        from specpilot.compiler.build import seeded_models
        # candidates of seeded random models on a GPU are built without their weights (the engine
        # redraws them, converting W12 planes on the device): small, fast builds; elsewhere with them
        self.params = params or ("seeded" if self.target.is_gpu and seeded_models(self.spec) else "file")
        if self.params == "seeded" and not seeded_models(self.spec):
            raise SpecPilotError(f"{spec_path}: --params seeded needs seeded random models (init: {{seed: N}}) "
                                 "for the target and a model drafter")
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rounds, self.repeats, self.say = rounds, repeats, say
        self.proposer = proposer or BuiltinProposer()
        self.executor = make_executor(workers, backend=backend)
        self.memory = Memory(memory_path)
        self.log = RunLog(self.out / "run.jsonl")
        self.inject_fault = inject_fault
        from specpilot.core.loader import load_models
        tgt, _ = load_models(self.spec, weights=False)
        self.cfg = tgt.cfg
        from specpilot.passes.base import PassContext
        self.context = PassContext(target_kind=self.target.kind, arch=self.target.arch,
                                   architecture=tgt.cfg.architecture, hybrid=tgt.cfg.is_hybrid,
                                   dtype=self.spec.deployment.dtype, max_batch=self.spec.deployment.max_batch,
                                   weights_known=self.params == "file")
        self.scope = Applicability(family=tgt.cfg.architecture, hybrid=tgt.cfg.is_hybrid, target_kind=self.target.kind,
                                   arch=self.target.arch, dtype=self.spec.deployment.dtype,
                                   batch=(1, self.spec.deployment.max_batch), drafter_kind=self.spec.drafter.kind)
        cap = self.spec.deployment.max_seq_len
        self.dev = requests_for(tgt.cfg.vocab_size, dev_requests, seed=1)
        self.sealed = requests_for(tgt.cfg.vocab_size, sealed_requests, seed=2)
        self.dev_tokens = min(dev_tokens, cap - max(map(len, self.dev)) - 1)      # token forcing in the workers
        self.time_tokens = min(time_tokens, self.dev_tokens)                         # cost model and timing
        self.sealed_tokens = min(sealed_tokens, cap - max(map(len, self.sealed)) - 1)
        self.lab = Measurements(self.out, self.spec, self.spec_path, self.target, self.params, self.executor, self.log,
                                say, self.dev, self.dev_tokens, self.time_tokens, repeats, inject_fault)

    # ---- the loop
    def run(self) -> dict:
        started = time.perf_counter()
        say = self.say
        say(f"search: {self.spec_path} on {self.target.text()}, {self.rounds} round(s); {len(self.dev)} development "
            f"requests (forced over {self.dev_tokens} tokens, timed over {self.time_tokens})")
        stock = Candidate("", "stock", "", 0.0, "the spec with no passes")
        built = self.lab.build_all([stock])
        if not built[""]["ok"]:
            raise SpecPilotError(f"stock itself failed to build or force: {built['']['error']}")
        aa = self.lab.measure("", "", key="aa")
        self.lab.noise = noise_level(Interval(**aa["interval"]))
        say(f"stock noise (A/A): {self.lab.noise:.2%}; adoption needs a 95% lower bound above {0.01 + 2 * self.lab.noise:.2%}")
        state = self.log.find("round_done")
        current = state["current"] if state else ""
        history = state["history"] if state else []
        first_round = state["round"] + 1 if state else 1
        reused = []
        if not state:
            mem = self._proposals(0, "memory", lambda: from_memory(self.memory.applicable(self.scope), parse(current),
                                                                   self.context, set())[:MEMORY_PICKS])
            if mem:
                say(f"memory: {len(mem)} verified entr{'y' if len(mem) == 1 else 'ies'} legal here: "
                    + ", ".join(c.pipeline for c in mem))
                current, adopted = self._explore(current, mem, "memory")
                reused = [c.entry for c in mem if c.pipeline in adopted]
                history += [{"round": 0, "phase": "memory", "pipeline": p} for p in adopted]
        for rnd in range(first_round, self.rounds + 1):
            round_start = current
            cost = self._cost_model(rnd, current)
            cands = self._proposals(rnd, "exploration", lambda: [
                c for c in self._propose(cost, current) if c.direction != "kernel"])   # kernels: phase 3
            say(f"round {rnd}: phase 1 ({len(cands)} candidate(s) with >= 3% estimated gain)")
            for c in cands:
                say(f"    {c.pipeline}: est {c.estimated_gain:+.0%} ({c.rationale})")
            current, adopted = self._explore(current, cands, f"round {rnd}")
            history += [{"round": rnd, "phase": "exploration", "pipeline": p} for p in adopted]
            stacked = self._stack(round_start, adopted) if len(adopted) > 1 else None
            if stacked:
                say(f"round {rnd}: phase 2 (integration: {stacked})")
                if stacked != current:
                    current, won = self._explore(current, [Candidate(stacked, "integration", "+".join(adopted), 0.0,
                                                                     "adopted changes stacked")], f"round {rnd}")
                    history += [{"round": rnd, "phase": "integration", "pipeline": p} for p in won]
            say(f"round {rnd}: phase 3 (kernel tuning)")
            kernel = self._proposals(rnd, "kernel tuning", lambda: [
                c for c in self._propose(cost, current) if c.direction == "kernel"])
            current, won = self._explore(current, kernel, f"round {rnd}")
            history += [{"round": rnd, "phase": "kernel tuning", "pipeline": p} for p in won]
            self.log.add("round_done", round=rnd, current=current, history=history)
        say(f"sealed validation of {current or 'stock'}: {len(self.sealed)} held-out requests, "
            f"token forcing over {self.sealed_tokens} new tokens")
        sealed = self.sealed_validation(current)
        final = current if sealed["passed"] else ""
        report = write_report(self, current, final, sealed, history, reused, time.perf_counter() - started)
        return report

    def _cost_model(self, rnd: int, round_start: str):
        """Phase 0, run when a proposal first needs it (a resumed round whose proposals are in
        the log runs none): ``cost(current)`` gives the proposer's arguments for ``current``
        -- the round-start report, the pipeline, the context, the draft length, stock's tokens
        on the development requests, and the pipelines already built."""
        report, refs = None, None

        def cost(current: str):
            nonlocal report, refs
            if report is None:
                self.say(f"round {rnd}: phase 0 (cost model of {round_start or 'stock'})")
                system = self.lab.system(round_start)
                report = explain(self.lab.build_dir(round_start), self.dev, self.time_tokens, system=system)
                self.log.add("cost_model", round=rnd, pipeline=round_start, factors=report["factors"],
                             bottleneck=report["bottleneck"], tree_acceptance=report["tree_acceptance"],
                             accepted_per_verification=report["accepted_per_verification"],
                             kernels=[{k: row[k] for k in ("name", "calls", "seconds", "bound_seconds", "ratio")}
                                      for row in report["kernels"][:12]])
                self.say("  factors: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["factors"].items())
                         + f" -> {report['bottleneck']}")
                refs = self._references(round_start)
            tried = {e["pipeline"] for e in self.log.events if e["event"] == "built"}
            return report, parse(current), self.context, self.lab.system(current).draft_len, refs, tried
        return cost

    def _propose(self, cost, current: str) -> list[Candidate]:
        """The proposer's candidates; a proposer that fails (a dead or garbling LLM endpoint) costs
        this phase its candidates, not the search; what it proposed and was refused is said and logged."""
        try:
            cands = self.proposer.propose(*cost(current))
        except SpecPilotError as e:
            self.say(f"    proposer failed: {e}; going on without its candidates")
            self.log.add("proposer_failed", error=str(e))
            return []
        rejected = list(getattr(self.proposer, "rejected", []))
        for reason in rejected:
            self.say(f"    rejected: {reason}")
        if rejected:
            self.log.add("rejected", reasons=rejected)
        return cands

    def _proposals(self, rnd: int, phase: str, propose) -> list[Candidate]:
        """A phase's candidates: from the run log when an interrupted run already proposed them
        (so its builds get measured, and entries it remembered are not picked up as reuse),
        else ``propose()``'s, logged before anything is built."""
        done = self.log.find("proposed", round=rnd, phase=phase)
        if done:
            return [Candidate(**c) for c in done["candidates"]]
        cands = propose()
        self.log.add("proposed", round=rnd, phase=phase, candidates=[c.to_dict() for c in cands])
        return cands

    def _references(self, pipeline: str) -> list[list[int]]:
        system = self.lab.system(pipeline)
        return [system.generate("stock", p, self.time_tokens).tokens for p in self.dev]

    def _stack(self, base: str, adopted: list[str]) -> str | None:
        """The adopted changes to ``base`` stacked, best first, one per pass (two settings of one
        pass do not stack); None when fewer than two distinct changes were adopted."""
        def lcb(p):
            m = self.log.find("measured", base=base, candidate=p)
            return m["verdict"]["lcb"] if m else -1.0
        base_passes = {str(p) for p in parse(base)}
        passes, changed = {p.name: p for p in parse(base)}, set()
        for text in sorted(adopted, key=lambda t: -lcb(t)):
            delta = [p for p in parse(text) if str(p) not in base_passes]
            if not delta or any(p.name in changed for p in delta):
                continue
            changed |= {p.name for p in delta}
            passes.update({p.name: p for p in delta})
        if len(changed) < 2:
            return None
        stacked = with_change(Pipeline([]), list(passes.values()), self.context)
        return str(stacked) if stacked is not None else None

    def _explore(self, current: str, cands: list[Candidate], where: str) -> tuple[str, list[str]]:
        """Build + force candidates (workers), measure each passing one against ``current``
        (here); the best adopted one becomes current.  Returns (current, adopted pipelines)."""
        if not cands:
            return current, []
        results = self.lab.build_all(cands)
        adopted = []
        best, best_lcb = current, None
        for c in cands:
            res = results[c.pipeline]
            if not res["ok"]:
                continue
            m = self.lab.measure(current, c.pipeline)
            v = m["verdict"]
            drift = m.get("base_drift")
            self.say(f"    {c.pipeline}: gain {v['gain']:+.1%} [95% {v['lcb']:+.1%}, {v['ucb']:+.1%}] -> "
                     f"{'ADOPT' if v['adopt'] else 'reject'}"
                     + (f"  (stock's median {drift:+.1%} from its A/A run)" if drift is not None
                        and abs(drift) > 2 * self.lab.noise else ""))
            if v["adopt"]:
                adopted.append(c.pipeline)
                self._remember(c, current, m, res)
                if best_lcb is None or v["lcb"] > best_lcb:
                    best, best_lcb = c.pipeline, v["lcb"]
        return best, adopted

    def _remember(self, c: Candidate, base: str, m: dict, res: dict) -> None:
        if self.inject_fault is not None:
            return          # a faulty system is never remembered
        from specpilot.memory.store import Entry
        deps = []
        base_entry = self.memory.find(base, self.scope) if base else None
        if base_entry:
            deps.append(base_entry.id)
        v = m["verdict"]
        entry = Entry(pipeline=c.pipeline, dependencies=deps, applicability=self.scope, source_hash=res["ir_hash"],
                      spec=self.spec.model_dump(mode="json"), spec_path=str(self.spec_path.resolve()),
                      target=self.target.text(),
                      constraints={"token_forcing": "exact" if self.spec.deployment.dtype == "float32" else "tie-tolerant",
                                   "forced_tokens": self.dev_tokens, "requests": len(self.dev), "params": self.params},
                      results={"gain": v["gain"], "lcb": v["lcb"], "ucb": v["ucb"], "noise": v["noise"],
                               "speedup": 1 + v["gain"], "baseline": base, "forcing": "passed",
                               "source": c.source, "reused_entry": c.entry},
                      untested=[f"dtype other than {self.scope.dtype}", f"batch > {self.scope.batch[1]}",
                                f"targets other than {self.target.text()}"])
        try:
            stored = self.memory.add(entry, reproduce_hash)
            self.log.add("remembered", pipeline=c.pipeline, id=stored.id)
        except SpecPilotError as e:
            self.log.add("not_remembered", pipeline=c.pipeline, reason=str(e))
            self.say(f"    memory: {e}")

    def sealed_validation(self, pipeline: str) -> dict:
        done = self.log.find("sealed", pipeline=pipeline)
        if done:
            return done
        from specpilot.runtime.forcing import force_requests, tolerance_rule
        if not pipeline:
            return self.log.add("sealed", pipeline=pipeline, passed=False, adopted=False,
                                reason="no change over stock was adopted")
        from specpilot.runtime.decoding import Generation
        system = self.lab.system(pipeline)
        engine = engine_for(pipeline, "compiled-spec" in system.engines)
        stock, runs = [], []
        for i, p in enumerate(self.sealed):     # request by request, logged: a resumed run goes on from here
            rec = self.log.find("sealed_request", pipeline=pipeline, request=i, tokens=self.sealed_tokens)
            if rec is None:
                ref = system.generate("stock", p, self.sealed_tokens)
                run = system.generate(engine, p, self.sealed_tokens, force=ref.tokens)
                rec = self.log.add("sealed_request", pipeline=pipeline, request=i, tokens=self.sealed_tokens,
                                   stock=asdict(ref), run=asdict(run))
            stock.append(Generation(**rec["stock"]))
            runs.append(Generation(**rec["run"]))
        forcing = force_requests(stock, runs, *tolerance_rule(system, self.sealed, stock))
        if not forcing.passed:
            d = forcing.first_divergence
            return self.log.add("sealed", pipeline=pipeline, passed=False, forcing=forcing.to_dict(),
                                reason=f"token forcing failed on held-out request {d.request} at new token {d.position} "
                                       f"(stock {d.stock_token}, system {d.system_token})")
        speed = self.lab.measure("", pipeline, prompts=self.sealed, max_new=min(self.time_tokens, self.sealed_tokens),
                             key="sealed_speed")
        v = speed["verdict"]
        return self.log.add("sealed", pipeline=pipeline, passed=bool(v["adopt"]), forcing=forcing.to_dict(),
                            speed=v, reason=("faster than stock and exact" if v["adopt"]
                                             else f"not faster than stock on held-out requests: {v['reason']}"))

