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

import gc
import json
import random
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from specpilot.agent.adjudicate import adjudicate, measure_pairs, noise_level, paired_interval
from specpilot.agent.cost_model import engine_for, explain
from specpilot.agent.executor import make_executor
from specpilot.agent.proposers import BuiltinProposer, Candidate, from_memory, with_change
from specpilot.agent.reproduce import reproduce_hash
from specpilot.core.errors import SpecPilotError
from specpilot.passes.pipeline import Pipeline, parse


MEMORY_PICKS = 2    # a new deployment starts from stock plus the best verified entries legal for it
SYSTEMS_LOADED = 2  # loaded builds kept between measurements


def _release_memory() -> None:
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class RunLog:
    def __init__(self, path: Path):
        self.path = path
        self.events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.is_file() else []

    def add(self, event: str, **data) -> dict:
        rec = {"event": event, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **data}
        self.events.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def find(self, event: str, **match) -> dict | None:
        for e in reversed(self.events):
            if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                return e
        return None


def requests_for(vocab: int, n: int, seed: int, length: tuple[int, int] = (6, 14)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(n)]


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
                                   dtype=self.spec.deployment.dtype, weights_known=self.params == "file")
        self.scope = Applicability(family=tgt.cfg.architecture, hybrid=tgt.cfg.is_hybrid, target_kind=self.target.kind,
                                   arch=self.target.arch, dtype=self.spec.deployment.dtype,
                                   batch=(1, self.spec.deployment.max_batch), drafter_kind=self.spec.drafter.kind)
        cap = self.spec.deployment.max_seq_len
        self.dev = requests_for(tgt.cfg.vocab_size, dev_requests, seed=1)
        self.sealed = requests_for(tgt.cfg.vocab_size, sealed_requests, seed=2)
        self.dev_tokens = min(dev_tokens, cap - max(map(len, self.dev)) - 1)      # token forcing in the workers
        self.time_tokens = min(time_tokens, self.dev_tokens)                         # cost model and timing
        self.sealed_tokens = min(sealed_tokens, cap - max(map(len, self.sealed)) - 1)
        self.builds: list[str] = []          # candidate pipelines built, in order (stock excluded)
        self.systems: dict[str, object] = {}

    # ---- building (workers) and measuring (here)
    def _dir(self, pipeline: str) -> Path:
        import hashlib
        return self.out / "builds" / (hashlib.sha256(pipeline.encode()).hexdigest()[:10])

    def _with_fault(self, pipeline: str) -> str:
        if self.inject_fault is None or not pipeline:
            return pipeline
        return str(Pipeline(list(parse(pipeline)) + [parse(f"logit-bias-fault{{after={self.inject_fault}}}").passes[0]]))

    def build_all(self, candidates: list[Candidate]) -> dict[str, dict]:
        jobs, results = [], {}
        for c in candidates:
            done = self.log.find("built", pipeline=c.pipeline)
            if done and (Path(done["build_dir"]) / "manifest.json").is_file():
                results[c.pipeline] = done
                continue
            built = self._with_fault(c.pipeline)
            jobs.append({"spec": self.spec.model_dump(mode="json"), "spec_path": str(self.spec_path),
                         "target": self.target.text(), "pipeline": built, "build_dir": str(self._dir(c.pipeline)),
                         "engine": engine_for(built, self.spec.drafter.kind != "none"), "prompts": self.dev,
                         "max_new": self.dev_tokens, "candidate": c.pipeline, "params": self.params})
        if jobs:
            self.say(f"  building {len(jobs)} candidate(s) in {getattr(self.executor, 'workers', 1)} worker(s)")
        for job, res in zip(jobs, self.executor.map(jobs)):
            rec = self.log.add("built", pipeline=job["candidate"], built=job["pipeline"], **{
                k: v for k, v in res.to_dict().items() if k != "pipeline"})
            results[job["candidate"]] = rec
            if job["candidate"]:
                self.builds.append(job["candidate"])
            self.say(f"  {'ok ' if res.ok else 'REJ'} {job['candidate'] or '(stock)'}  "
                     f"{res.seconds:.0f} s{'' if res.ok else '  ' + str(res.error)}")
        return results

    def system(self, pipeline: str):
        """The loaded build of ``pipeline``; the two most recently used stay loaded (a paired
        measurement needs two; a realistic-shape build holds its weights twice on the device)."""
        from specpilot.runtime.systems import from_build
        if pipeline in self.systems:
            self.systems[pipeline] = self.systems.pop(pipeline)       # most recent last
        else:
            while len(self.systems) >= SYSTEMS_LOADED:
                del self.systems[next(iter(self.systems))]
                _release_memory()
            self.systems[pipeline] = from_build(self._dir(pipeline))
        return self.systems[pipeline]

    def _runner(self, pipeline: str, prompts, max_new):
        system = self.system(pipeline)
        engine = engine_for(pipeline, "compiled-spec" in system.engines)
        outputs = {}

        def run(request, _device):
            gc.collect()   # the previous run's cache rows come back here, not inside the timed run
            start = time.perf_counter()
            g = system.generate(engine, prompts[request], max_new)
            outputs.setdefault(request, g.tokens)
            return time.perf_counter() - start
        return run, outputs

    def measure(self, base: str, cand: str, prompts=None, max_new=None, key: str = "measured") -> dict:
        prompts, max_new = prompts or self.dev, max_new or self.time_tokens
        done = self.log.find(key, base=base, candidate=cand)
        if done:
            return done
        run_b, out_b = self._runner(base, prompts, max_new)
        run_c, out_c = self._runner(cand, prompts, max_new)
        run_b(0, None), run_c(0, None)     # warm-up
        b, c = measure_pairs(run_b, run_c, len(prompts), self.repeats)
        interval = paired_interval(b, c)
        differ = out_b != out_c
        verdict = adjudicate(interval, self.noise, differ) if base != cand else None
        base_median = sorted(b)[len(b) // 2]
        # the base's median against its own A/A run on the same requests: a large drift says the
        # conditions moved between the two (another build loaded, clocks) -- shown, not corrected
        aa = self.log.find("aa")
        drift = base_median / aa["base_median"] - 1 if aa and base == "" and prompts is self.dev and \
            max_new == self.time_tokens else None
        return self.log.add(key, base=base, candidate=cand, interval=interval.to_dict(),
                            verdict=verdict.to_dict() if verdict else None,
                            base_median=base_median, candidate_median=sorted(c)[len(c) // 2], base_drift=drift)

    # ---- the loop
    def run(self) -> dict:
        started = time.perf_counter()
        say = self.say
        say(f"search: {self.spec_path} on {self.target.text()}, {self.rounds} round(s); {len(self.dev)} development "
            f"requests (forced over {self.dev_tokens} tokens, timed over {self.time_tokens})")
        stock = Candidate("", "stock", "", 0.0, "the spec with no passes")
        built = self.build_all([stock])
        if not built[""]["ok"]:
            raise SpecPilotError(f"stock itself failed to build or force: {built['']['error']}")
        aa = self.measure("", "", key="aa")
        self.noise = noise_level(_interval(aa["interval"]))
        say(f"stock noise (A/A): {self.noise:.2%}; adoption needs a 95% lower bound above {0.01 + 2 * self.noise:.2%}")
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
                c for c in self.proposer.propose(*cost(current)) if c.direction != "kernel"])   # kernels: phase 3
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
                c for c in self.proposer.propose(*cost(current)) if c.direction == "kernel"])
            current, won = self._explore(current, kernel, f"round {rnd}")
            history += [{"round": rnd, "phase": "kernel tuning", "pipeline": p} for p in won]
            self.log.add("round_done", round=rnd, current=current, history=history)
        say(f"sealed validation of {current or 'stock'}: {len(self.sealed)} held-out requests, "
            f"token forcing over {self.sealed_tokens} new tokens")
        sealed = self.sealed_validation(current)
        final = current if sealed["passed"] else ""
        report = self._report(current, final, sealed, history, reused, time.perf_counter() - started)
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
                system = self.system(round_start)
                report = explain(self._dir(round_start), self.dev, self.time_tokens, system=system)
                self.log.add("cost_model", round=rnd, pipeline=round_start, factors=report["factors"],
                             bottleneck=report["bottleneck"], tree_acceptance=report["tree_acceptance"],
                             accepted_per_verification=report["accepted_per_verification"],
                             kernels=[{k: row[k] for k in ("name", "calls", "seconds", "bound_seconds", "ratio")}
                                      for row in report["kernels"][:12]])
                self.say("  factors: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["factors"].items())
                         + f" -> {report['bottleneck']}")
                refs = self._references(round_start)
            tried = {e["pipeline"] for e in self.log.events if e["event"] == "built"}
            return report, parse(current), self.context, self.system(current).draft_len, refs, tried
        return cost

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
        system = self.system(pipeline)
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
        results = self.build_all(cands)
        adopted = []
        best, best_lcb = current, None
        for c in cands:
            res = results[c.pipeline]
            if not res["ok"]:
                continue
            m = self.measure(current, c.pipeline)
            v = m["verdict"]
            drift = m.get("base_drift")
            self.say(f"    {c.pipeline}: gain {v['gain']:+.1%} [95% {v['lcb']:+.1%}, {v['ucb']:+.1%}] -> "
                     f"{'ADOPT' if v['adopt'] else 'reject'}"
                     + (f"  (stock's median {drift:+.1%} from its A/A run)" if drift is not None
                        and abs(drift) > 2 * self.noise else ""))
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
                      spec=self.spec.model_dump(mode="json"), spec_path=str(self.spec_path), target=self.target.text(),
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
            return self.log.add("sealed", pipeline=pipeline, passed=False, reason="no change over stock was adopted")
        from dataclasses import asdict

        from specpilot.runtime.decoding import Generation
        system = self.system(pipeline)
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
        speed = self.measure("", pipeline, prompts=self.sealed, max_new=min(self.time_tokens, self.sealed_tokens),
                             key="sealed_speed")
        v = speed["verdict"]
        return self.log.add("sealed", pipeline=pipeline, passed=bool(v["adopt"]), forcing=forcing.to_dict(),
                            speed=v, reason=("faster than stock and exact" if v["adopt"]
                                             else f"not faster than stock on held-out requests: {v['reason']}"))

    def _report(self, current, final, sealed, history, reused, seconds) -> dict:
        final_dir = self.out / "final"
        if final_dir.exists():
            shutil.rmtree(final_dir)
        shutil.copytree(self._dir(final), final_dir, ignore=shutil.ignore_patterns("job.json", "result.json",
                                                                                  "worker.log"))
        builds = [e["pipeline"] for e in self.log.events if e["event"] == "built" and e["pipeline"]]
        to_result = builds.index(final) + 1 if final in builds else 0
        vs_stock = self.log.find("sealed_speed", base="", candidate=final) if final else None
        report = {
            "spec": str(self.spec_path), "target": self.target.text(), "rounds": self.rounds,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 1),
            "noise": self.noise, "result": final or "(stock)", "best_before_sealed": current or "(stock)",
            "sealed": {k: v for k, v in sealed.items() if k not in ("event", "time")},
            "speedup_vs_stock": vs_stock["verdict"] if vs_stock else None,
            "candidate_builds": len(builds), "builds_to_result": to_result,
            "reused_entries": reused, "history": history,
            "memory": [e.id for e in self.memory.entries() if e.spec_path == str(self.spec_path)],
            "events": len(self.log.events), "final_build": str(final_dir),
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=2))
        (self.out / "report.md").write_text(render_markdown(report))
        return report


def _interval(d: dict):
    from specpilot.agent.adjudicate import Interval
    return Interval(**d)


def render_markdown(r: dict) -> str:
    lines = [f"# SpecPilot search: {r['spec']} on {r['target']}", "",
             f"- date: {r['date']}, {r['rounds']} round(s), {r['seconds']} s",
             f"- result: `{r['result']}` (best before sealed validation: `{r['best_before_sealed']}`)",
             f"- sealed validation: {'PASSED' if r['sealed'].get('passed') else 'FAILED'} -- {r['sealed'].get('reason')}",
             f"- stock timing noise (A/A): {r['noise']:.2%}",
             f"- candidate builds: {r['candidate_builds']} (the result was build #{r['builds_to_result']})",
             f"- reused memory entries: {', '.join(r['reused_entries']) or 'none'}"]
    if r["speedup_vs_stock"]:
        v = r["speedup_vs_stock"]
        lines.append(f"- vs stock on held-out requests: gain {v['gain']:+.1%} (95% lower bound {v['lcb']:+.1%}, "
                     f"threshold {v['threshold']:.1%})")
    lines += ["", "| round | phase | adopted |", "| --- | --- | --- |"]
    lines += [f"| {h['round']} | {h['phase']} | `{h['pipeline']}` |" for h in r["history"]]
    return "\n".join(lines) + "\n"
