"""`specpilot bench --batch B1,B2,... --arrivals TRACE`: what continuous batching gives a server --
every engine of a build at each batch size on the same arrivals, in one run, wall clock, tokens
checked.

Per engine and batch size: throughput (generated tokens of all requests over the time from the
first arrival to the last token), per-request latency (arrival to last token), time to first
token and time a token after it (TPOT), p50 / p99, tokens per verification, and per pass the
requests, drafted nodes, admitted prompt tokens and padded rows; the speedup is over the
autoregressive engine at the same batch size in the same run.  With ``split``, where a pass's time
goes (a synchronised rerun).  Arrivals: a replayable trace (JSONL, `batching.read_trace`), ``burst`` (the
requests all at once) or ``poisson:RATE`` (seeded).

Tokens: a batched autoregressive run of every prompt first gives each request's reference
tokens; every row's are checked against them (bf16: near-ties below the tie tolerance excused and
listed, as in `runtime.bench`).  ``forced``: the speculative engines run token-forced onto the
reference tokens, their own choices checked at every position (what a replay drafter needs).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.batching import Arrival, BatchPolicy, BatchRun, StepClock, WallClock, poisson_trace
from specpilot.runtime.bench import TokenCheck, check_choices, check_tokens, label_for
from specpilot.runtime.cycle_timing import Clock, breakdown
from specpilot.runtime.engine import release_device_memory
from specpilot.runtime.forcing import tolerance_rule

FORMAT = "specpilot-batch-bench"
VERSION = 1


@dataclass
class BatchResult:
    engine: str
    label: str
    batch: int
    requests: int
    refused: int
    tokens: int
    seconds: float
    throughput: float                     # generated tokens a second, all requests
    latency: dict                         # seconds, arrival to last token: p50, p99, max
    ttft: dict                            # seconds, arrival to first token: p50, p99
    tpot: dict                            # seconds a token after the first (first token to last): p50, p99
    tokens_per_verification: float | None
    passes: int
    per_pass: dict                        # means over decoding passes: running, drafted, admitted, rows, levels
    check: TokenCheck
    speedup: float | None = None          # throughput over the autoregressive engine's at this batch size
    policy: dict = field(default_factory=dict)
    split: dict | None = None             # a synchronised rerun's parts: `cycle_timing.breakdown` + per pass ms
    prices: dict | None = None            # an adaptive row's fitted pass cost at its end, ms (`pass_cost.PassCost`)
    releases: int | None = None           # the timed run's hand-backs of pooled device memory (`keep_headroom`;
                                          # each waits for the device); None where the engine runs no build


def arrivals_for(spec: str, prompts: list[list[int]], max_new: int, trace=None, seed: int = 0) -> list[Arrival]:
    """``burst``, ``poisson:RATE`` (requests a second) or a trace (already read)."""
    if trace is not None:
        return trace
    if spec == "burst":
        return poisson_trace(prompts, max_new, 0.0)
    if spec.startswith("poisson:"):
        try:
            rate = float(spec.split(":", 1)[1])
        except ValueError:
            rate = -1.0
        if not rate > 0:
            raise SpecPilotError(f"--arrivals {spec}: poisson:RATE needs a positive rate (requests a second)")
        return poisson_trace(prompts, max_new, rate, seed)
    raise SpecPilotError(f"--arrivals {spec!r}: expected a trace file, burst or poisson:RATE")


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def parse_schedules(text: str | None) -> list[tuple[int, int]]:
    """``--schedules 256/64,192/32``: (nodes a pass, admission chunk) pairs."""
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        try:
            nodes, chunk = (int(v) for v in item.split("/"))
        except ValueError:
            nodes = chunk = 0
        if nodes < 1 or chunk < 1:
            raise SpecPilotError(f"--schedules {text!r}: expected NODES/CHUNK pairs of positive integers, "
                                 "comma-separated (e.g. 256/64)")
        out.append((nodes, chunk))
    return out


AUTO = "auto"       # --draft-lengths' chain length or tree nodes chosen by the pass's measured cost (`runtime.pass_cost`)


def with_lengths(policy: BatchPolicy, lengths: tuple[int, ...] | str, name: str) -> BatchPolicy:
    """``policy`` drafting one of ``lengths`` a request and pass (one: that length fixed), or with
    ``AUTO`` its chain length or tree nodes chosen by what its passes cost; refused past the longest
    draft the engine's build verifies."""
    if policy.mode == "ar":
        raise SpecPilotError(f"--draft-lengths: {name} drafts nothing")
    if lengths == AUTO:
        return replace(policy, adaptive=True)
    if max(lengths) > policy.nodes:
        raise SpecPilotError(f"--draft-lengths {':'.join(map(str, lengths))}: {name}'s build drafts at most "
                             f"{policy.nodes} tokens a request")
    return replace(policy, nodes=max(lengths), lengths=lengths if len(lengths) > 1 else None)


def parse_lengths(text: str | None) -> list[tuple[int, ...] | str]:
    """``--draft-lengths 6,8:6:4,auto``: sets of draft lengths (a request's drafted tokens a pass), each
    one fixed length or several to choose from by acceptance, or ``auto`` (`with_lengths`)."""
    out: list[tuple[int, ...] | str] = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        if item.strip() == AUTO:
            if AUTO in out:
                raise SpecPilotError(f"--draft-lengths {text!r}: auto is given twice")
            out.append(AUTO)
            continue
        try:
            choice = tuple(sorted({int(v) for v in item.split(":")}, reverse=True))
        except ValueError:
            choice = (0,)
        if min(choice) < 1:
            raise SpecPilotError(f"--draft-lengths {text!r}: expected sets of positive integers, ':' within a set "
                                 "and ',' between sets (e.g. 6,8:6:4)")
        if len({a - b for a, b in zip(choice, choice[1:])}) > 1:    # a schedule's lengths are a range with a step
            raise SpecPilotError(f"--draft-lengths {text!r}: {item.strip()} is not evenly spaced (e.g. 8:6:4)")
        if choice in out:
            raise SpecPilotError(f"--draft-lengths {text!r}: {item.strip()} is given twice")
        out.append(choice)
    if text is not None and not out:
        raise SpecPilotError(f"--draft-lengths {text!r}: no set of lengths")
    return out


class BatchBench:
    def __init__(self, system, engines: list[str], batches: list[int], make_arrivals, tie_tolerance="auto",
                 forced: bool = False, warmup: int = 1, progress=None, queue: int | None = None, partial=None,
                 schedules: list[tuple[int, int]] = (), split: bool = False,
                 lengths: list[tuple[int, ...] | str] = (), fill: bool = False):
        """``partial(run)``: hears the run so far after each batch size (a long run's results survive it).
        ``schedules``: (nodes a pass, admission chunk) pairs, each run as one more row of the last engine
        with a batch schedule (the runtime's choice for this batch size, the build's draft lengths kept).
        ``lengths``: draft-length sets, each run as one more row of every drafting engine (the
        runtime's choice; at most the build's own longest draft), or ``AUTO``: one more row of every
        drafting engine choosing its chain lengths or tree nodes by their cost.
        ``split``: every row run once more with a synchronisation after each part of a pass, for where
        a pass's time goes (the synchronisations cost time: the row's own numbers come from the first run).
        ``fill``: every row's drafts grown into the rows its passes pad them to (`BatchPolicy.fill`)."""
        self.partial, self.split, self.fill = partial or (lambda run: None), split, fill
        self.schedules, self.lengths = list(schedules), list(lengths)
        self.scheduled = next((n for n in reversed(engines) if getattr(system.engines[n], "batch", None) is not None
                               and system.engines[n].batch.chunk is not None), None)
        if self.schedules and self.scheduled is None:
            raise SpecPilotError("--schedules: no engine here runs a batch schedule (node-budget and "
                                 "prompt-admission passes)")
        self.drafting = [n for n in engines if system.engines[n].drafter is not None]
        if self.lengths and not self.drafting:
            raise SpecPilotError("--draft-lengths: no engine here drafts")
        for choice in self.lengths:      # refused before anything runs
            for name in self._lengths_engines(choice):
                with_lengths(system.batch_policy(name, 1, queue), choice, name)
        self.system, self.engines, self.batches = system, engines, batches
        self.make_arrivals, self.tie_tolerance, self.forced, self.warmup = make_arrivals, tie_tolerance, forced, warmup
        self.progress = progress or (lambda message, advance=0: None)
        self.queue = queue
        self.reference: dict[tuple[int, ...], object] = {}      # prompt -> the AR generation

    def run(self) -> dict:
        ar = self.engines[0]
        if self.system.engines[ar].drafter is not None:
            raise SpecPilotError(f"the first engine ({ar}) must be autoregressive: it is the baseline")
        everything = {a.prompt: a for b in self.batches for a in self.make_arrivals(b)}
        arrivals = list(everything.values())
        top = max(self.batches)
        ref = self.system.serve(ar, arrivals, self.system.batch_policy(ar, top), StepClock())
        for a, gen in zip(arrivals, ref.generations):
            self.reference[a.prompt] = gen
            self.system.oracle.register(list(a.prompt), gen.tokens)       # a replay drafter's continuation
        tolerance = 0.0
        if self.system.dtype != "float32":
            tolerance, _ = tolerance_rule(self.system, [list(a.prompt) for a in arrivals], ref.generations,
                                          self.tie_tolerance, None)
        rows = []
        for batch in self.batches:
            for name in self.engines:
                rows.append(self._row(name, batch, self.make_arrivals(batch), tolerance))
            for nodes, chunk in self.schedules:
                rows.append(self._row(self.scheduled, batch, self.make_arrivals(batch), tolerance, (nodes, chunk)))
            for choice in self.lengths:
                for name in self._lengths_engines(choice):
                    rows.append(self._row(name, batch, self.make_arrivals(batch), tolerance, lengths=choice))
            base = next(r for r in rows if r.engine == ar and r.batch == batch)
            for r in rows:
                if r.batch == batch:
                    r.speedup = r.throughput / base.throughput if base.throughput else None
            self.partial({"ar_engine": ar, "tie_tolerance": tolerance, "forced": self.forced, "rows": rows})
        return {"ar_engine": ar, "tie_tolerance": tolerance, "forced": self.forced, "rows": rows}

    def rows_per_batch(self) -> int:
        """Rows the run measures at each batch size: every engine, each --schedules pair, each
        --draft-lengths set on its engines."""
        return len(self.engines) + len(self.schedules) + sum(len(self._lengths_engines(c)) for c in self.lengths)

    def _lengths_engines(self, choice) -> list[str]:
        """The engines a --draft-lengths set runs on: every drafting one."""
        return self.drafting

    def _row(self, name: str, batch: int, arrivals: list[Arrival], tolerance: float,
             schedule: tuple[int, int] | None = None, lengths: tuple[int, ...] | str | None = None) -> BatchResult:
        policy = replace(self.system.batch_policy(name, batch, self.queue), fill=self.fill)
        if schedule is not None:
            policy = replace(policy, budget=schedule[0], chunk=schedule[1])
        if lengths is not None:
            policy = with_lengths(policy, lengths, name)
        speculative = self.system.engines[name].drafter is not None
        for _ in range(self.warmup):      # the same shapes once, untimed
            self.system.serve(name, [Arrival(0.0, a.prompt, 2) for a in arrivals[:batch]], policy, StepClock())
        forces = [self.reference[a.prompt].tokens[:a.max_new] for a in arrivals] \
            if self.forced and speculative else None
        self.progress(f"{name} at batch {batch}")
        release_device_memory()   # the last row's workspaces, TVM's and torch's
        module = getattr(getattr(self.system.engines[name], "model", None), "module", None)
        released = getattr(module, "releases", None)
        run = self.system.serve(name, arrivals, policy, WallClock(), forces)
        self.progress(f"{name} at batch {batch}", advance=1)
        result = self._result(name, batch, arrivals, run, policy, tolerance, speculative)
        result.releases = None if released is None else module.releases - released
        if self.split:
            result.split = self._split(name, arrivals, policy, forces)
        if schedule is not None:
            result.engine = f"{name}[{schedule[0]}/{schedule[1]}]"
        if lengths is not None:
            result.engine = f"{name}[draft {lengths if lengths == AUTO else ':'.join(map(str, lengths))}]"
        return result

    def _split(self, name: str, arrivals: list[Arrival], policy, forces) -> dict:
        """The row again, each pass's parts timed to their end on the device: seconds and shares of the
        decoding time (prefill passes apart), and milliseconds a decoding pass (with the drafter's
        catch-up and level passes within drafting)."""
        clock = Clock()
        release_device_memory()
        run = self.system.serve(name, arrivals, policy, WallClock(), forces, parts=clock)
        out = breakdown(clock, run.seconds)
        passes = max(1, sum(not s.prefill for s in run.steps))
        out["prefill_seconds"] = clock.seconds["prefill"]
        out["per_pass_ms"] = {k: 1e3 * v / passes for k, v in out["seconds"].items()}
        for part in ("draft_sync", "draft_blocks", "draft_levels"):       # within draft
            out["per_pass_ms"][part] = 1e3 * clock.seconds[part] / passes
        return out

    def _result(self, name, batch, arrivals, run: BatchRun, policy, tolerance, speculative) -> BatchResult:
        done = [(a, g, t) for a, g, t in zip(arrivals, run.generations, run.timings) if g is not None]
        refs = [self.reference[a.prompt] for a, _, _ in done]
        gens = [g for _, g, _ in done]
        check = (check_choices if self.forced and speculative else check_tokens)(refs, gens, tolerance)
        tokens = sum(len(g.tokens) for g in gens)
        end = max((t.done for _, _, t in done), default=0.0)
        seconds = end - min(a.at for a in arrivals)
        decoding = [s for s in run.steps if not s.prefill]
        verifications = [n for g in gens for n in g.accepted[1:]]
        mean = (lambda xs: statistics.fmean(xs) if xs else 0.0)
        return BatchResult(
            name, label_for(name, getattr(self.system.setup, "kind", "") or ""), batch, len(arrivals),
            len(run.refused), tokens, seconds, tokens / seconds if seconds > 0 else 0.0,
            percentiles([t.done - t.arrival for _, _, t in done]),
            percentiles([t.first - t.arrival for _, _, t in done]),
            percentiles([(t.done - t.first) / (len(g.tokens) - 1) for _, g, t in done if len(g.tokens) > 1]),
            sum(verifications) / len(verifications) if speculative and verifications else None,
            len(run.steps),
            {k: mean([getattr(s, k) for s in decoding]) for k in ("running", "drafted", "admitted", "rows", "levels")},
            check, policy=asdict(policy), prices=prices_ms(run.prices))


def prices_ms(prices: tuple | None) -> dict | None:
    """`PassCost.model`'s (a, b, d, c, e) in milliseconds: a pass, a verified row, a drafter level, a padded
    row, a running request."""
    if prices is None:
        return None
    return {name: 1e3 * v for name, v in zip(("pass", "row", "level", "padded_row", "request"), prices)}


def report(run: dict, meta: dict) -> dict:
    rows = []
    for r in run["rows"]:
        row = asdict(r)
        row["check"] = {**asdict(r.check), "passed": r.check.passed}
        rows.append(row)
    return {"format": FORMAT, "version": VERSION, **meta, "ar_engine": run["ar_engine"], "forced": run["forced"],
            "tie_tolerance": run["tie_tolerance"], "tokens_checked": all(r.check.passed for r in run["rows"]),
            "rows": rows}


def table(result: dict):
    from rich.table import Table

    t = Table(title=f"batched: {result['system']} ({result['arrivals']}, {result['max_new_tokens']} new tokens)")
    split = any(r.get("split") for r in result["rows"])
    for column in ("batch", "engine", "tok/s", "x AR", "latency p50/p99 s", "TTFT p50 s", "TPOT p50 ms", "tok/verif",
                   "drafted/pass", "rows/pass") + (("ms a pass: draft/verify/commit/host",) if split else ()) + ("tokens",):
        t.add_column(column, justify="left" if column == "engine" else "right")
    for r in result["rows"]:
        c = r["check"]
        ms = r.get("split", {}) and r["split"]["per_pass_ms"]
        parts = ("/".join(f"{ms[k]:.1f}" for k in ("draft", "verify", "commit", "host")) if ms else "-",) if split else ()
        t.add_row(str(r["batch"]), r["engine"], f"{r['throughput']:.1f}",
                  f"{r['speedup']:.2f}" if r["speedup"] else "-",
                  f"{r['latency']['p50']:.3f} / {r['latency']['p99']:.3f}", f"{r['ttft']['p50']:.3f}",
                  f"{1e3 * r['tpot']['p50']:.1f}" if r["tpot"]["p50"] is not None else "-",
                  f"{r['tokens_per_verification']:.2f}" if r["tokens_per_verification"] else "-",
                  f"{r['per_pass']['drafted']:.1f}", f"{r['per_pass']['rows']:.0f}", *parts,
                  ("ok" if c["passed"] else "FAIL") + (f" ({len(c['excused'])} excused)" if c["excused"] else ""))
    return t
