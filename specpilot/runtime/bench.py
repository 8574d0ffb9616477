"""`specpilot bench`: the lossless speedup a user gets -- every engine of a build (or spec) on the same
requests in one run, wall clock, tokens checked against the autoregressive engine's.

Per engine and request: decode tokens/s (new tokens after the first, over the time after the first
token), time to first token (timed apart: a run of one token), tokens per verification; per engine:
medians and spread over requests, the speedup over the autoregressive engine of the same run, and
where a verification cycle's time goes (`cycle_timing`, a separate synchronised run).  Reference rows
on the same weights: stock PyTorch decoding (`stock`, `stock-spec`, ...) and Hugging Face
transformers' ``generate`` (greedy; with a static cache under ``torch.compile``; assisted generation
where it supports the pair).  A replay drafter's speculative engines may run once per acceptance plan
(`ReplayPlan`: rates alpha or recorded profiles), the autoregressive engine once for all of them.

Tokens: each engine's must equal the autoregressive engine's.  In float32 any difference fails.  In
bf16 / fp16 an unforced run may leave the autoregressive one at a near-tie: excused (and listed) when
the autoregressive engine's own top-2 margin there is below the forcing rule's tie tolerance
(`forcing.tolerance_rule`); the rest of that request is not comparable and says so.  ``forced``: the
other engines run token-forced onto the autoregressive engine's tokens (the same work a step; what a
replay drafter needs where a deep bf16 model's near-ties would take a run off its recorded
continuation), and their own choices are checked at every position by the forcing rule.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

from specpilot.core.acceptance_profile import confidence_pools
from specpilot.core.errors import SpecPilotError
from specpilot.runtime.cycle_timing import Clock, TimedDrafter, TimedModel, breakdown
from specpilot.runtime.forcing import compare, tolerance_rule
from specpilot.runtime.lattice import LatticeKeeper
from specpilot.runtime.systems import Engine

FORMAT = "specpilot-bench"
VERSION = 1


@dataclass
class TokenCheck:
    identical: int = 0                  # requests with exactly the autoregressive tokens
    excused: list = field(default_factory=list)      # {request, position, ar_margin}: near-ties (bf16)
    failed: list = field(default_factory=list)       # {request, position, ar_token, token, ar_margin}

    @property
    def passed(self) -> bool:
        return not self.failed


@dataclass
class EngineResult:
    engine: str
    label: str
    decode_tokens_per_s: list[float]
    seconds: list[float]
    ttft_seconds: list[float]
    new_tokens: list[int]
    tokens_per_verification: float | None
    check: TokenCheck
    accepted: list[list[int]] = field(default_factory=list)   # tokens per verification, per request
    cycle: dict | None = None
    replay: str | None = None                    # the acceptance plan a replay row ran under
    # chain engines, when asked: the drafter's confidence pools (`core.acceptance_profile`; not in the JSON)
    confidence: dict | None = None
    speedup: float | None = None                 # median decode tokens/s over the AR engine's
    end_to_end_speedup: float | None = None      # total wall time of the AR engine over this one's

    def summary(self) -> dict:
        rates = sorted(self.decode_tokens_per_s)
        return {"median": statistics.median(rates), "min": rates[0], "max": rates[-1],
                "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0}


@dataclass(frozen=True)
class ReplayPlan:
    """An acceptance plan for a replay drafter's rows: ``plan`` as `runtime.replay` takes it."""
    name: str          # "alpha=0.8" or "profile=FILE"
    plan: dict


def label_for(engine: str, drafter_kind: str, replay: str | None = None) -> str:
    if engine.startswith("hf-"):
        return {"hf-generate": "transformers generate (greedy)",
                "hf-compiled": "transformers generate, static cache + torch.compile (greedy)",
                "hf-assisted": "transformers assisted generation"}[engine]
    kind = "AR" if engine in ("stock", "compiled") else engine.split("-", 1)[1]
    where = "stock PyTorch" if engine.startswith("stock") else "compiled"
    drafter = "" if kind == "AR" else f", {drafter_kind} drafter" + \
        (f" (REPLAY{' ' + replay if replay else ''}: acceptance replayed, drafting cost real)"
         if drafter_kind == "replay" else "")
    return f"{where} {kind}{drafter}"


def check_tokens(ar_runs, runs, tolerance: float) -> TokenCheck:
    check = TokenCheck()
    for r, (ar, run) in enumerate(zip(ar_runs, runs)):
        tokens = run if isinstance(run, list) else run.tokens
        position = next((i for i, (a, b) in enumerate(zip(ar.tokens, tokens)) if a != b), None)
        if position is None and len(tokens) == len(ar.tokens):
            check.identical += 1
            continue
        position = min(len(ar.tokens), len(tokens)) if position is None else position
        margin = ar.margins[position] if position < len(ar.margins) else float("inf")
        entry = {"request": r, "position": position, "ar_margin": margin}
        if margin < tolerance:
            check.excused.append(entry)
        else:
            check.failed.append({**entry, "ar_token": ar.tokens[position] if position < len(ar.tokens) else None,
                                 "token": tokens[position] if position < len(tokens) else None})
    return check


def check_choices(ar_runs, runs, tolerance: float) -> TokenCheck:
    """Forced runs: each run's own choices against the autoregressive tokens at every position."""
    check = TokenCheck()
    for r, (ar, run) in enumerate(zip(ar_runs, runs)):
        first, excused = compare(ar.tokens, ar.margins, run.choices, tolerance, r)
        check.excused += [{"request": r, "position": d.position, "ar_margin": d.stock_margin} for d in excused]
        if first is not None:
            check.failed.append({"request": r, "position": first.position, "ar_token": first.stock_token,
                                 "token": first.system_token, "ar_margin": first.stock_margin})
        elif not excused:
            check.identical += 1
    return check


class Bench:
    """One benchmark run over a loaded `System`."""

    def __init__(self, system, prompts: list[list[int]], max_new: int, warmup: int = 1, progress=None,
                 drafter_kind: str = "", tie_tolerance="auto", sampling=None, forced: bool = False,
                 record_confidence: bool = False):
        for prompt in prompts:
            system.check_prompt(prompt)
            if len(prompt) + max_new > system.capacity:
                raise SpecPilotError(f"a prompt of {len(prompt)} tokens + {max_new} new exceeds the build's "
                                     f"max_seq_len {system.capacity}")
        self.system, self.prompts, self.max_new, self.warmup = system, prompts, max_new, warmup
        self.progress = progress or (lambda message, advance=0: None)
        self.drafter_kind, self.tie_tolerance = drafter_kind, tie_tolerance
        self.sampling = sampling      # core.sampling.SamplingParams, or None: greedy
        self.forced = forced
        self.record_confidence = record_confidence     # chain engines' drafter confidence (--record-profile)
        self.ar_tokens: dict[tuple[int, ...], list[int]] = {}    # per prompt, for forced runs

    def run(self, engines: list[str], hf: list[str] = (), breakdown_requests: int = 2,
            replays: list[ReplayPlan] = ()) -> dict:
        if hf and self.sampling is not None:
            raise SpecPilotError("the transformers rows decode greedily; leave them out of a sampled bench")
        ar = engines[0]
        ar_runs = [self._timed(ar, p, self.max_new) for p in self.prompts]   # registers the oracle
        for prompt, run in zip(self.prompts, ar_runs):
            self.system.oracle.register(prompt, run.tokens)
            self.ar_tokens[tuple(prompt)] = run.tokens
        tolerance, _ = tolerance_rule(self.system, self.prompts, ar_runs, self.tie_tolerance, self.sampling) \
            if self.system.dtype != "float32" else (0.0, None)
        results = {}
        for name in engines:
            if not replays or self.system.engines[name].drafter is None:
                results[name] = self._engine(name, ar_runs, tolerance, breakdown_requests)
                continue
            for replay in replays:
                with self._plan(replay):
                    results[f"{name} {replay.name}"] = self._engine(name, ar_runs, tolerance, breakdown_requests,
                                                                    replay.name)
        for name in hf:
            results[name] = self._hf(name, ar_runs, tolerance)
        base = results[ar]
        for r in results.values():
            r.speedup = r.summary()["median"] / base.summary()["median"]
            r.end_to_end_speedup = sum(base.seconds) / sum(r.seconds)
        return {"ar_engine": ar, "tie_tolerance": tolerance, "results": results, "forced": self.forced}

    def _timed(self, engine: str, prompt: list[int], max_new: int):
        return self.system.generate(engine, prompt, max_new, force=self._force(engine, prompt, max_new),
                                    sampling=self.sampling)

    def _force(self, engine: str, prompt: list[int], max_new: int) -> list[int] | None:
        """The autoregressive tokens a forced run emits (None: unforced; the AR engine never is)."""
        if not self.forced or self.system.engines.get(engine) is None or self.system.engines[engine].drafter is None:
            return None
        tokens = self.ar_tokens.get(tuple(prompt))
        return tokens[:max_new] if tokens is not None else None

    @contextlib.contextmanager
    def _plan(self, replay: ReplayPlan):
        setup = self.system.setup
        if setup is None or setup.kind != "replay":
            raise SpecPilotError("replay plans need a build or spec whose drafter is a replay drafter")
        kept, setup.replay = setup.replay, replay.plan
        try:
            yield
        finally:
            setup.replay = kept

    def _engine(self, name: str, ar_runs, tolerance: float, breakdown_requests: int,
                replay: str | None = None) -> EngineResult:
        for _ in range(self.warmup):
            self._timed(name, self.prompts[0], min(16, self.max_new))
        runs, ttft, kept = [], [], []
        for prompt in self.prompts:
            with self._keeping(name) as lattices:
                runs.append(self._timed(name, prompt, self.max_new))
            kept.append(lattices)
            ttft.append(self._timed(name, prompt, 1).seconds)
            self.progress(f"{name}: request {len(runs)}/{len(self.prompts)}", advance=1)
        verifications = [a for run in runs for a in run.accepted[1:]]
        speculative = self.system.engines[name].drafter is not None
        return EngineResult(
            name, label_for(name, self.drafter_kind, replay),
            [(len(r.tokens) - 1) / max(r.seconds - t, 1e-9) for r, t in zip(runs, ttft)],
            [r.seconds for r in runs], ttft, [len(r.tokens) for r in runs],
            sum(verifications) / len(verifications) if speculative and verifications else None,
            (check_choices if self.forced else check_tokens)(ar_runs, runs, tolerance),
            [r.accepted[1:] for r in runs] if speculative else [],
            self._cycle(name, breakdown_requests) if speculative and breakdown_requests else None, replay,
            self._confidence(runs, kept) if any(kept) else None)

    @contextlib.contextmanager
    def _keeping(self, name: str):
        """With --record-profile, a chain engine's run under ``name`` keeps its drafter's lattices (yielded,
        as (context length, lattice) per verification); otherwise the engine as it is, nothing kept."""
        engine, kept = self.system.engines[name], []
        if not self.record_confidence or engine.drafter is None or engine.tree_budget:
            yield kept
            return
        self.system.engines[name] = replace(engine, drafter=lambda sampling=None: LatticeKeeper(engine.drafter(sampling),
                                                                                                kept))
        try:
            yield kept
        finally:
            self.system.engines[name] = engine

    def _confidence(self, runs, kept) -> dict:
        """A chain engine's confidence pools (`core.acceptance_profile`): each verification's lattice and
        the target's token after its accepted drafts (the run's own token there)."""
        drafts = []
        for prompt, run, lattices in zip(self.prompts, runs, kept):
            rows = []
            for (context, lattice), committed in zip(lattices, run.accepted[1:]):
                at = context - len(prompt) + committed - 1
                rows.append((lattice.logprobs.tolist(), lattice.tokens.tolist(),
                             run.tokens[at] if at < len(run.tokens) else None))
            drafts.append(rows)
        return confidence_pools([r.accepted for r in runs], drafts)

    def _cycle(self, name: str, requests: int) -> dict:
        """The cycle breakdown of ``name`` on the first requests, under a synchronising clock."""
        engine, clock = self.system.engines[name], Clock()
        timed_name = f"{name} (timed)"
        self.system.engines[timed_name] = Engine(TimedModel(engine.model, clock),
                                                 lambda sampling=None: TimedDrafter(engine.drafter(sampling), clock),
                                                 engine.tree_budget, engine.two_level, host_threads=engine.host_threads)
        try:
            wall = 0.0
            for prompt in self.prompts[:requests]:
                start = time.perf_counter()
                self.system.generate(timed_name, prompt, self.max_new, force=self._force(name, prompt, self.max_new),
                                     sampling=self.sampling)
                wall += time.perf_counter() - start
        finally:
            del self.system.engines[timed_name]
        return breakdown(clock, wall)

    def _hf(self, name: str, ar_runs, tolerance: float) -> EngineResult:
        from specpilot.runtime.hf_reference import hf_generate

        model, assist = self.system.hf_models(name)
        if name == "hf-compiled":     # one static cache size for every call: compiled once, in the warm-up
            assist = {**assist, "compiled": True, "cache_length": max(map(len, self.prompts)) + self.max_new}
        hf_generate(model, self.prompts[0], min(16, self.max_new), **assist)     # warm-up
        tokens, seconds, ttft = [], [], []
        for prompt in self.prompts:
            out, s = hf_generate(model, prompt, self.max_new, **assist)
            tokens.append(out)
            seconds.append(s)
            ttft.append(hf_generate(model, prompt, 1, **assist)[1])
            self.progress(f"{name}: request {len(tokens)}/{len(self.prompts)}", advance=1)
        return EngineResult(name, label_for(name, self.drafter_kind),
                            [(len(t) - 1) / max(s - f, 1e-9) for t, s, f in zip(tokens, seconds, ttft)],
                            seconds, ttft, [len(t) for t in tokens], None, check_tokens(ar_runs, tokens, tolerance))


def report(run: dict, meta: dict) -> dict:
    """The JSON a bench run writes (schema ``FORMAT`` / ``VERSION``)."""
    engines = []
    for r in run["results"].values():
        row = asdict(replace(r, confidence=None))
        del row["confidence"]
        row["check"] = {**asdict(r.check), "passed": r.check.passed}
        row["decode_tokens_per_s_summary"] = r.summary()
        # speedup per token a verification commits: 1.0 would mean a cycle costs one AR step
        row["efficiency"] = r.speedup / r.tokens_per_verification if r.tokens_per_verification else None
        engines.append(row)
    passed = all(r.check.passed for r in run["results"].values())
    return {"format": FORMAT, "version": VERSION, **meta, "ar_engine": run["ar_engine"], "forced": run["forced"],
            "tie_tolerance": run["tie_tolerance"], "tokens_checked": passed, "engines": engines}
