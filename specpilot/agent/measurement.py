"""The search's measurements: candidates built and token-forced in workers (`agent.executor`), loaded
builds, and paired timing of two systems on the same requests (`agent.adjudicate`), every result in
the run log so a resumed search reuses it."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from specpilot.agent.adjudicate import adjudicate, measure_pairs, paired_interval
from specpilot.agent.cost_model import engine_for
from specpilot.agent.proposers import Candidate
from specpilot.agent.run_log import RunLog
from specpilot.passes.pipeline import Pipeline, parse

SYSTEMS_LOADED = 2  # loaded builds kept between measurements


def release_memory() -> None:
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Measurements:
    def __init__(self, out: Path, spec, spec_path: Path, target, params: str, executor, log: RunLog, say,
                 dev: list[list[int]], dev_tokens: int, time_tokens: int, repeats: int, inject_fault: int | None):
        self.out, self.spec, self.spec_path, self.target, self.params = out, spec, spec_path, target, params
        self.executor, self.log, self.say = executor, log, say
        self.dev, self.dev_tokens, self.time_tokens, self.repeats = dev, dev_tokens, time_tokens, repeats
        self.inject_fault = inject_fault
        self.noise = 0.0                     # stock's A/A timing noise, once measured
        self.builds: list[str] = []          # candidate pipelines built, in order (stock excluded)
        self.systems: dict[str, object] = {}

    def build_dir(self, pipeline: str) -> Path:
        import hashlib
        return self.out / "builds" / (hashlib.sha256(pipeline.encode()).hexdigest()[:10])

    def with_fault(self, pipeline: str) -> str:
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
            built = self.with_fault(c.pipeline)
            jobs.append({"spec": self.spec.model_dump(mode="json"), "spec_path": str(self.spec_path),
                         "target": self.target.text(), "pipeline": built, "build_dir": str(self.build_dir(c.pipeline)),
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
                release_memory()
            self.systems[pipeline] = from_build(self.build_dir(pipeline))
        return self.systems[pipeline]

    def _runner(self, pipeline: str, prompts, max_new):
        """A timed run per request; in a batch deployment, a burst of ``max_batch`` requests from that one
        on through one continuous batch (what the deployment serves, so batch schedules can win)."""
        system = self.system(pipeline)
        engine = engine_for(pipeline, "compiled-spec" in system.engines)
        batch = self.spec.deployment.max_batch
        outputs = {}

        def run(request, _device):
            gc.collect()   # the previous run's cache rows come back here, not inside the timed run
            start = time.perf_counter()
            if batch > 1 and engine != "compiled-two-level":     # two-level verification runs one at a time
                burst = [prompts[(request + i) % len(prompts)] for i in range(batch)]
                tokens = [g.tokens for g in system.generate_batch(engine, burst, [max_new] * batch)]
            else:
                tokens = system.generate(engine, prompts[request], max_new).tokens
            seconds = time.perf_counter() - start
            outputs.setdefault(request, tokens)
            return seconds
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
