"""`specpilot` command line.  Every command takes --json for machine-readable output; input
errors print one line (``error: ...``) and exit with status 2, divergence exits with 1."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_write_text
from specpilot.core.schedule_sets import SCHEDULES

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "import numpy as np\n\ndef softmax(x):",
    "User: What is speculative decoding?\nAssistant:",
)


def _load_system(spec_or_build: str):
    from specpilot.runtime.systems import load_system
    return load_system(spec_or_build)


def _default_engine(spec_or_build: str, engine: str | None) -> str:
    if engine is not None:
        return engine
    return "compiled-spec" if Path(spec_or_build).is_dir() else "stock-spec"


OUTPUT = {"quiet": False}     # -q: progress displays off in every command


def sampling_options(command):
    """--temperature / --top-p / --top-k / --seed, handed to the command as ``sampling`` (None: greedy)."""
    options = [
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="sample at this temperature (0: greedy); every engine draws the same tokens for the same seed"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="nucleus sampling's mass"),
        click.option("--top-k", type=int, default=0, show_default=True, help="sample among the k best tokens (0: all)"),
        click.option("--seed", type=int, default=0, show_default=True, help="the sampling seed (0 .. 2**64-1)"),
    ]

    def wrapped(temperature, top_p, top_k, seed, **kwargs):
        from pydantic import ValidationError

        from specpilot.core.sampling import SamplingParams
        try:
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        except ValidationError as e:
            first = e.errors()[0]
            raise SpecPilotError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
        return command(sampling=None if params.greedy else params, **kwargs)

    import functools
    wrapped = functools.update_wrapper(wrapped, command)
    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped


ENGINES = ["stock", "stock-spec", "stock-tree", "stock-tree-sched", "compiled", "compiled-spec", "compiled-tree",
           "compiled-tree-sched", "compiled-two-level"]


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SpecPilotError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None


def read_requests(path: Path | None, system, max_new: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max new tokens) per request, from JSONL or the built-in prompts."""
    if path is None:
        if system.vocab_size >= 256 or not hasattr(system.tokenizer, "vocab_size"):
            return [(system.tokenizer.encode(p), max_new) for p in DEFAULT_PROMPTS]
        return [([(7 * i + 3 * j) % system.vocab_size for j in range(8)], max_new) for i in range(4)]
    if not path.is_file():
        raise SpecPilotError(f"{path}: requests file not found")
    requests = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecPilotError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(req, dict) or ("prompt" in req) == ("prompt_ids" in req):
            raise SpecPilotError(f"{path}:{n}: expected an object with 'prompt' (text) or 'prompt_ids' (list)")
        if "prompt" in req:
            if not isinstance(req["prompt"], str):
                raise SpecPilotError(f"{path}:{n}: 'prompt' must be a string")
            ids = system.tokenizer.encode(req["prompt"])
        else:
            ids = req["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise SpecPilotError(f"{path}:{n}: 'prompt_ids' must be a list of integers")
        limit = req.get("max_new_tokens", max_new)
        if not isinstance(limit, int) or limit < 1:
            raise SpecPilotError(f"{path}:{n}: 'max_new_tokens' must be a positive integer")
        requests.append((ids, limit))
    if not requests:
        raise SpecPilotError(f"{path}: no requests")
    return requests


@click.group()
@click.version_option(package_name="specpilot")
@click.option("-v", "--verbose", is_flag=True, help="tracebacks for unexpected faults (as SPECPILOT_DEBUG=1)")
@click.option("-q", "--quiet", is_flag=True, help="no progress displays; results and errors only")
def cli(verbose, quiet):
    """SpecPilot: lossless speculative decoding, lowered to TVM and searched by agents."""
    OUTPUT["quiet"] = quiet
    if verbose:
        os.environ["SPECPILOT_DEBUG"] = "1"


@cli.command()
@click.argument("spec_or_build")
@click.option("--prompt", help="prompt text (tokenized with the target's tokenizer)")
@click.option("--prompt-ids", help="prompt as comma-separated token ids")
@click.option("--max-new-tokens", type=click.IntRange(1, 65536), default=64, show_default=True)
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="default: compiled-spec for a build directory, stock-spec for a spec")
@click.option("--ignore-eos", is_flag=True, help="keep generating past end-of-sequence tokens")
@click.option("--record-lattices", type=click.Path(dir_okay=False, path_type=Path),
              help="write every drafter lattice to this JSONL file")
@click.option("--replay-lattices", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="draft from a recorded lattice file instead of running the drafter")
@click.option("--json", "as_json", is_flag=True)
@sampling_options
def generate(spec_or_build, prompt, prompt_ids, max_new_tokens, engine, ignore_eos, record_lattices,
             replay_lattices, as_json, sampling=None):
    """Generate from a prompt, greedy or sampled (a spec: stock engines; a build directory: compiled ones too)."""
    if (prompt is None) == (prompt_ids is None):
        raise SpecPilotError("give exactly one of --prompt or --prompt-ids")
    engine = _default_engine(spec_or_build, engine)
    system = _load_system(spec_or_build)
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else system.tokenizer.encode(prompt)
    gen = system.generate(engine, ids, max_new_tokens, stop_at_eos=not ignore_eos,
                          record_lattices=record_lattices, replay_lattices=replay_lattices, sampling=sampling)
    text = system.tokenizer.decode(gen.tokens)
    if as_json:
        click.echo(json.dumps({"engine": engine, "prompt_tokens": len(ids), "tokens": gen.tokens, "text": text,
                               "tokens_per_s": round(gen.tokens_per_s, 3),
                               "mean_accepted": round(gen.mean_accepted, 4),
                               "verifications": len(gen.accepted)}))
    else:
        click.echo(text)
        click.echo(f"[{engine}: {len(gen.tokens)} tokens, {gen.tokens_per_s:.1f} tokens/s, "
                   f"{gen.mean_accepted:.2f} tokens per verification]", err=True)


def bench_prompts(prompts: str, system, limit: int | None) -> list[list[int]]:
    """A built-in prompt set by name, or a JSONL file of requests; the first ``limit`` of them."""
    from specpilot.runtime.prompt_sets import SETS, texts

    if prompts in SETS:
        if getattr(system.tokenizer, "vocab_size", 256) < 256:     # random models too small for bytes
            ids = [[(7 * i + 3 * j + 1) % system.vocab_size for j in range(6 + i % 5)] for i in range(16)]
        else:
            ids = [system.tokenizer.encode(t) for t in texts(prompts)]
    else:
        ids = [p for p, _ in read_requests(Path(prompts), system, 1)]
    return ids[:limit] if limit else ids


def _bench_engines(engines: str | None, system, reference: bool) -> tuple[list[str], list[str]]:
    """(engines, transformers rows): the named ones, or every engine the system has, AR first."""
    if engines:
        names = [e.strip() for e in engines.split(",") if e.strip()]
        unknown = [n for n in names if n not in system.engines and n not in system.hf_engines()]
        if unknown:
            raise SpecPilotError(f"--engines: unknown engine {unknown[0]!r}; this system has "
                                 f"{', '.join([*system.engines, *system.hf_engines()])}")
        ar = system.autoregressive_engine()
        own = [ar] + [n for n in names if n in system.engines and n != ar]
        return own, [n for n in names if n not in system.engines]
    own = [n for n in ("compiled", "compiled-spec", "compiled-tree", "compiled-two-level") if n in system.engines]
    stock = [n for n in ("stock", "stock-spec", "stock-tree") if n in system.engines]
    if not own:
        return stock, system.hf_engines() if reference else []
    return own + (stock if reference else []), system.hf_engines() if reference else []


def _replay_plans(system, alphas: str | None, profiles: tuple[Path, ...], confidence: Path | None = None) -> list:
    """The acceptance plans of --replay-alpha / --replay-profile (a replay drafter's only), each scored with
    --replay-confidence's drafter confidence, else the build's own where it has one.  --replay-confidence
    also scores the build's own plan (the rows without plans, and --batch)."""
    from specpilot.core.acceptance_profile import read_confidence, read_profile
    from specpilot.runtime.bench import ReplayPlan

    if not alphas and not profiles and not confidence:
        return []
    if system.setup is None or system.setup.kind != "replay":
        raise SpecPilotError("--replay-alpha / --replay-profile / --replay-confidence need a replay drafter "
                             "(drafter: {kind: replay})")
    own = system.setup.replay or {}
    pools = read_confidence(confidence) if confidence else own.get("confidence")
    if confidence:
        system.setup.replay = {**own, "confidence": pools}
    scored, suffix = ({"confidence": pools} if pools else {}), (f", confidence={confidence.name}" if confidence else "")
    seed = int(own.get("seed", 0))
    plans = []
    for text in (alphas or "").split(","):
        if not text.strip():
            continue
        try:
            alpha = float(text)
        except ValueError:
            raise SpecPilotError(f"--replay-alpha: {text.strip()!r} is not a number") from None
        if not 0 <= alpha <= 1:
            raise SpecPilotError(f"--replay-alpha: {alpha} is not a rate in [0, 1]")
        plans.append(ReplayPlan(f"alpha={alpha:g}{suffix}", {"alpha": alpha, "seed": seed, **scored}))
    return plans + [ReplayPlan(f"profile={p.name}{suffix}", {"accepted": read_profile(p), **scored}) for p in profiles]


def _confidence_source(system, given: Path | None) -> str | None:
    """What scores a replay drafter's proposals: the --replay-confidence file, the build's own
    recorded confidence ("build"), or None (the replay's certainty of its plan)."""
    if given:
        return str(given)
    plan = system.setup.replay if system.setup is not None else None
    return "build" if plan and plan.get("confidence") else None


def _recorded_confidence(best, path: Path, console) -> dict | None:
    """The pools --record-profile writes: the chain engine's, unless its runs gave too few to score with."""
    from specpilot.core.acceptance_profile import check_confidence

    if best.confidence is None:
        return None
    try:
        return check_confidence(best.confidence, str(path))
    except SpecPilotError as e:
        console.print(f"[yellow]--record-profile: the acceptance counts only, no drafter confidence ({e})")
        return None


@cli.command()
@click.argument("spec_or_build")
@click.option("--engines", help="comma-separated engines (default: every engine the build has, AR first, "
                                "then the stock and transformers reference rows)")
@click.option("--prompts", default="mixed", show_default=True,
              help="a built-in set (code, chat, mixed) or a JSONL requests file")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=None, help="use the first N prompts")
@click.option("--max-new-tokens", type=click.IntRange(2, 65536), default=64, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True, help="warm-up runs per engine")
@click.option("--no-reference", is_flag=True, help="skip the stock PyTorch and transformers reference rows")
@click.option("--breakdown-requests", type=click.IntRange(0), default=2, show_default=True,
              help="requests timed again, synchronised, for the cycle breakdown (0: none; with --batch, "
                   "any other value runs each row once more for a pass's split)")
@click.option("--tie-tolerance", default="auto", show_default=True,
              help="bf16/fp16: near-ties below this AR margin are excused (listed); 'auto' derives it")
@click.option("--record-profile", type=click.Path(dir_okay=False, path_type=Path),
              help="write the acceptance profile of the most speculative engine (for `drafter: {kind: replay}`)")
@click.option("--forced", is_flag=True, help="run the speculative engines token-forced onto AR's tokens, checking "
                                              "their own choices at every position (bf16 replay projections)")
@click.option("--replay-alpha", help="replay drafter: run the speculative engines once per per-token acceptance "
                                     "rate, comma-separated (e.g. 0.6,0.7,0.8,0.9)")
@click.option("--replay-profile", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="replay drafter: run the speculative engines once per recorded acceptance profile (repeatable)")
@click.option("--replay-confidence", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="replay drafter: score the proposals with the drafter confidences this profile recorded "
                   "(a real drafter's, instead of the replay's certainty of its own plan)")
@click.option("--batch", "batches", help="continuous batching at these batch sizes, comma-separated (e.g. "
                                        "1,2,4,8,16,32): throughput and latency per engine")
@click.option("--arrivals", default="burst", show_default=True,
              help="with --batch: a JSONL arrival trace, burst (all at once) or poisson:RATE (requests a second)")
@click.option("--queue", type=click.IntRange(0), default=None, help="with --batch: bound the waiting queue")
@click.option("--schedules", help="with --batch: more rows of the batch-scheduled engine, each under another "
                                  "NODES/CHUNK (nodes a pass / prompt-admission chunk), comma-separated (e.g. 256/64)")
@click.option("--draft-lengths", "draft_lengths",
              help="with --batch: more rows of each speculative engine, each drafting one of other lengths a "
                   "request and pass: ':' within a set, ',' between sets (e.g. 4,8:6:4); auto: each pass's "
                   "chain length or tree nodes chosen by what the engine's passes cost")
@click.option("--fill", is_flag=True, help="with --batch: drafts shorter than a pass's longest grown into the rows "
                                          "the pass pads them to, where that needs no drafter pass")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="write the JSON here")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="tokens/s and cycle breakdown, PNG")
@click.option("--json", "as_json", is_flag=True, help="print the JSON instead of the table")
@sampling_options
def bench(spec_or_build, engines, prompts, n_requests, max_new_tokens, warmup, no_reference, breakdown_requests,
          tie_tolerance, record_profile, forced, replay_alpha, replay_profile, replay_confidence, batches, arrivals,
          queue, schedules, draft_lengths, fill, output, plot, as_json, sampling=None):
    """The lossless speedup over autoregressive decoding, wall clock, tokens checked, in one run."""
    from rich.console import Console
    from rich.progress import Progress

    from specpilot.core.acceptance_profile import write_profile
    from specpilot.runtime.bench import Bench, report as bench_report
    from specpilot.runtime.bench_report import plot as draw, table
    from specpilot.runtime.environment import environment

    system = _load_system(spec_or_build)
    if batches:
        if sampling is not None or replay_alpha or replay_profile or record_profile or plot:
            raise SpecPilotError("--batch runs greedy on the build's own drafter plan; leave out sampling, "
                                 "--replay-alpha, --replay-profile, --record-profile and --plot")
        _replay_plans(system, None, (), replay_confidence)     # the build's own plan, scored as given
        _bench_batched(system, spec_or_build, engines, prompts, n_requests, max_new_tokens, warmup, tie_tolerance,
                       forced, batches, arrivals, queue, output, as_json, schedules, breakdown_requests > 0,
                       draft_lengths, replay_confidence, fill)
        return
    for given, option in ((schedules, "--schedules"), (draft_lengths, "--draft-lengths"), (fill or None, "--fill")):
        if given is not None:
            raise SpecPilotError(f"{option} needs --batch")
    ids = bench_prompts(prompts, system, n_requests)
    own, hf = _bench_engines(engines, system, not no_reference)
    replays = _replay_plans(system, replay_alpha, replay_profile, replay_confidence)
    if sampling is not None and not engines:
        hf = []       # transformers' sampling draws other tokens; its rows are greedy-only
    console = Console(stderr=True)
    kind = system.setup.kind if system.setup else ""
    with Progress(console=console, transient=True, disable=as_json or OUTPUT["quiet"]) as progress:
        task = progress.add_task("bench", total=len(ids) * (1 + (len(own) - 1) * max(1, len(replays)) + len(hf)))
        run = Bench(system, ids, max_new_tokens, warmup, lambda m, advance=0: progress.update(
            task, description=m, advance=advance), kind, tie_tolerance, sampling, forced,
            record_confidence=record_profile is not None).run(own, hf, breakdown_requests, replays)
    meta = {"environment": environment(), "system": str(spec_or_build), "prompts": str(prompts), "requests": len(ids),
            "max_new_tokens": max_new_tokens, "warmup": warmup, "dtype": system.dtype, "drafter": kind,
            "drafter_source": system.drafter_source, "replay_confidence": _confidence_source(system, replay_confidence),
            "sampling": sampling.model_dump() if sampling else None}
    result = bench_report(run, meta)
    if output:
        atomic_write_text(output, json.dumps(result, indent=2))
    if plot:
        draw(result, plot)
    if record_profile:
        best = [r for r in run["results"].values() if r.engine == own[-1]][-1]
        if not best.accepted:
            raise SpecPilotError(f"--record-profile: {best.engine} does not decode speculatively")
        write_profile(record_profile, best.accepted, f"{spec_or_build} {best.engine} on {prompts}",
                      _recorded_confidence(best, record_profile, console))
    if as_json:
        click.echo(json.dumps(result))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(table(result))
    sys.exit(0 if result["tokens_checked"] else 1)


def _bench_batched(system, spec_or_build, engines, prompts, n_requests, max_new_tokens, warmup, tie_tolerance,
                   forced, batches, arrivals, queue, output, as_json, schedules=None, split=False, draft_lengths=None,
                   replay_confidence=None, fill=False):
    """`bench --batch`: `runtime.batch_bench` at each batch size, one JSON."""
    from rich.console import Console
    from rich.progress import Progress

    from specpilot.runtime.batch_bench import (BatchBench, arrivals_for, parse_lengths, parse_schedules,
                                               report as batch_report, table)
    from specpilot.runtime.batching import read_trace
    from specpilot.runtime.environment import environment

    sizes = _int_list(batches, "--batch")
    extra, lengths = parse_schedules(schedules), parse_lengths(draft_lengths)
    if engines:
        names, _ = _bench_engines(engines, system, False)
    else:
        names = [n for n in ("compiled", "compiled-spec", "compiled-tree", "compiled-tree-sched")
                 if n in system.engines] or [n for n in ("stock", "stock-spec", "stock-tree", "stock-tree-sched")
                                             if n in system.engines]
    trace = read_trace(arrivals, system.tokenizer.encode) if Path(arrivals).is_file() else None
    ids = None if trace is not None else bench_prompts(prompts, system, None)
    if ids is not None and len(ids) < (n_requests or max(sizes)):
        raise SpecPilotError(f"--prompts {prompts}: {len(ids)} prompts, {n_requests or max(sizes)} requests wanted")
    arrivals_for(arrivals, [[1]], 1, trace)           # a bad --arrivals fails before anything runs

    def make(batch: int):
        return arrivals_for(arrivals, ids[:n_requests or batch], max_new_tokens, trace) if trace is None else trace

    meta = {"environment": environment(), "system": str(spec_or_build), "prompts": str(prompts),
            "arrivals": str(arrivals), "queue": queue, "max_new_tokens": max_new_tokens, "warmup": warmup,
            "dtype": system.dtype, "drafter": system.setup.kind if system.setup else "",
            "drafter_source": system.drafter_source,
            "replay_confidence": _confidence_source(system, replay_confidence)}

    def partial(run: dict) -> None:    # the batch sizes done so far, written as each one ends
        if output:
            atomic_write_text(output, json.dumps({**batch_report(run, meta), "complete": False}, indent=2))

    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=as_json or OUTPUT["quiet"]) as progress:
        bench = BatchBench(system, names, sizes, make, tie_tolerance, forced, warmup,
                           lambda m, advance=0: progress.update(task, description=m, advance=advance), queue,
                           partial, extra, split, lengths, fill)
        task = progress.add_task("bench", total=len(sizes) * bench.rows_per_batch())
        run = bench.run()
    result = {**batch_report(run, meta), "complete": True}
    if output:
        atomic_write_text(output, json.dumps(result, indent=2))
    if as_json:
        click.echo(json.dumps(result))
    else:
        Console(width=None if sys.stdout.isatty() else 160).print(table(result))
    sys.exit(0 if result["tokens_checked"] else 1)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SpecPilotError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SpecPilotError(f"{option}: expected positive integers, got {text!r}")
    return values


@cli.command()
@click.argument("spec_or_build")
@click.option("--requests", type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL, one request per line: {\"prompt\": ...} or {\"prompt_ids\": [...]}")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--engine", type=click.Choice(ENGINES), default=None,
              help="the system under test (default: compiled-spec for a build directory, stock-spec for a "
                   "spec); stock is always the reference's greedy autoregressive decoding")
@click.option("--tie-tolerance", default=None,
              help="a number, or 'auto' (the default in bf16/fp16): the largest error of stock's own top-2 "
                   "margin against the same model in float32 on these requests; 0 in fp32")
@click.option("--inject-fault-after", type=click.IntRange(0), default=None,
              help="from this generated position on, bias the system under test's runner-up token")
@click.option("--fault-bias", type=float, default=100.0, show_default=True)
@click.option("--batch", is_flag=True,
              help="run the system's requests as one continuous batch (AR, chain and tree engines, the "
                   "build's batch schedule included; at most deployment.max_batch at once)")
@click.option("--json", "as_json", is_flag=True)
@sampling_options
def verify(spec_or_build, requests, max_new_tokens, engine, tie_tolerance, inject_fault_after, fault_bias,
           batch, as_json, sampling=None):
    """Token forcing: check the system under test against stock decoding (greedy, or sampled with the same seed)."""
    from specpilot.runtime.forcing import force, runner_up_fault

    engine = _default_engine(spec_or_build, engine)
    system = _load_system(spec_or_build)
    reqs = read_requests(requests, system, max_new_tokens)
    hook = runner_up_fault(inject_fault_after, fault_bias) if inject_fault_after is not None else None
    report, _, system_runs = force(system, engine, reqs, tie_tolerance, logits_hook=hook, batch=batch,
                                   sampling=sampling)
    tie_tolerance = report.tie_tolerance
    summary = report.to_dict()
    summary.update(engine=engine, fault_injected_after=inject_fault_after,
                   sampling=sampling.model_dump() if sampling else None,
                   mean_accepted=round(sum(r.mean_accepted for r in system_runs) / len(system_runs), 4))
    if as_json:
        click.echo(json.dumps(summary))
    else:
        verdict = "PASS" if report.passed else "FAIL"
        how = f" sampled (T={sampling.temperature:g}, seed {sampling.seed})" if sampling else ""
        click.echo(f"{verdict}: {engine} vs stock{how} over {report.requests} requests, {report.positions} positions, "
                   f"tie tolerance {tie_tolerance:.4g}; excused near-ties: {len(report.excused)}")
        for e in report.excused:
            click.echo(f"  excused: request {e.request} position {e.position}: stock {e.stock_token}, "
                       f"system {e.system_token}, margin {e.stock_margin:.4g}")
        d = report.first_divergence
        if d is not None:
            tok = system.tokenizer
            click.echo(f"first divergence: request {d.request}, position {d.position}: stock token {d.stock_token} "
                       f"{tok.decode([d.stock_token])!r}, system token {d.system_token} "
                       f"{tok.decode([d.system_token])!r}, stock margin {d.stock_margin:.4g}; "
                       f"context {tok.decode(d.context)!r}")
        elif not report.passed:
            click.echo(report.reason)
    sys.exit(0 if report.passed else 1)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
def devices(as_json):
    """The device table: each card's arch, SMs, shared memory, tensor cores and the kernels' forms there."""
    from dataclasses import asdict

    from specpilot.core.target import DEFAULT_DEVICE, DEVICES
    if as_json:
        click.echo(json.dumps({name: {**asdict(d), "kernel_forms": d.kernel_forms,
                                      "default_for_arch": DEFAULT_DEVICE[d.arch] == name} for name, d in DEVICES.items()}))
        return
    click.echo(f"{'card':11s} {'arch':7s} {'SMs':>4s} {'smem/block':>10s} {'smem/SM':>8s} {'L2 MiB':>7s} "
               f"{'tensor cores':13s} kernels")
    for name, d in DEVICES.items():
        default = " (arch default)" if DEFAULT_DEVICE[d.arch] == name else ""
        click.echo(f"{name:11s} {d.arch:7s} {d.sms:4d} {d.shared_per_block // 1024:7d} KiB {d.shared_per_sm // 1024:4d} KiB "
                   f"{d.l2_bytes >> 20:7d} {d.tensor_cores:13s} {d.kernel_forms}{default}")


@cli.command("compile")
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--target", "target_text", default="llvm", show_default=True,
              help="llvm | 'cuda -arch=sm_XX [-device=NAME] [-schedule-for=NAME]' | TVM JSON {\"kind\": \"cuda\", ...}")
@click.option("--device", default=None, help="the card within the arch (the device table: specpilot devices); "
                                             "the same as -device=NAME in --target")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=Path("build"),
              show_default=True)
@click.option("--passes", default="", help="pipeline text; overrides the spec's passes")
@click.option("--print-ir-after", help="print the IR after this stage (lower, relax-pipeline, a pass) or 'all'")
@click.option("--dump-ir", type=click.Path(file_okay=False, path_type=Path), help="write the IR after every stage here")
@click.option("--schedule", type=click.Choice(SCHEDULES), default=None,
              help="kernel schedule set (default: skinny-mma on sm_80+ GPUs, nt-gemv on older ones, tvm-default on the CPU)")
@click.option("--params", "params_mode", type=click.Choice(["file", "seeded", "load"]), default="file",
              show_default=True, help="seeded: write no weights, seeded random models are redrawn at load; load: "
                                      "write none, the engine reads the referenced checkpoint (SPECPILOT_WEIGHTS "
                                      "elsewhere) and checks it")
@click.option("--json", "as_json", is_flag=True)
def compile_(spec, target_text, device, output, passes, print_ir_after, dump_ir, schedule, params_mode, as_json):
    """Lower a spec to TVM, apply the pipeline, build and export to a directory."""

    from rich.console import Console

    from specpilot.compiler.build import BuildRequest, build, cuda_runtime_loadable, cuda_stub_env
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target

    target = parse_target(target_text)
    if device is not None:
        if target.device is not None and target.device.lower() != device.lower():
            raise SpecPilotError(f"--device {device} and --target's -device={target.device} disagree")
        if target.device is None:
            target = parse_target(f"{target.text()} -device={device}")
    loaded_spec = load_spec(spec)
    if target.is_gpu and not cuda_runtime_loadable() and not os.environ.get("SPECPILOT_CUDA_STUB"):
        # TVM embeds device code only when its CUDA runtime loads: re-run with a stub driver
        env = cuda_stub_env()
        os.execve(sys.executable, [sys.executable, "-m", "specpilot.cli", *sys.argv[1:]], env)
    console = Console(stderr=True, quiet=as_json or OUTPUT["quiet"])
    with console.status("compiling") as status:
        request = BuildRequest(loaded_spec, target, output, passes or "", params_mode, schedule, print_ir_after, dump_ir)
        manifest = build(request, progress=lambda message: status.update(message))
    summary = {"output": str(output), "target": manifest.target, "functions": manifest.functions,
               "pipeline": manifest.pipeline, "build_seconds": manifest.build_seconds}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"built {output} for {manifest.target} in {manifest.build_seconds} s: "
                   f"{', '.join(manifest.functions)}")


@cli.command()
@click.argument("build_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="the new build folder")
def materialize(build_dir, output):
    """Copy a --params seeded / load build with its weights written in (params/params.safetensors):
    what the C++ runtime (libspecpilot) reads."""
    from specpilot.runtime.materialize import materialize as run_materialize
    click.echo(f"wrote {run_materialize(build_dir, output)}")


@cli.command()
@click.argument("build_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--prompt", help="prompt text")
@click.option("--prompt-ids", help="prompt as comma-separated token ids")
@click.option("--max-new-tokens", type=click.IntRange(1, 65536), default=64, show_default=True)
@click.option("--engine", type=click.Choice([e for e in ENGINES if e.startswith("compiled")]), default="compiled-spec",
              show_default=True, help="a compiled engine the build has (tree: tree-verify; two-level: two-level-verify)")
@click.option("--ignore-eos", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@sampling_options
@click.pass_context
def run(ctx, build_dir, prompt, prompt_ids, max_new_tokens, engine, ignore_eos, as_json, sampling=None):
    """Generate with a compiled build (the TVM runtime drives its step functions)."""
    if not build_dir.is_dir():
        raise SpecPilotError(f"{build_dir}: not a build directory; run `specpilot compile` first")
    ctx.invoke(generate, spec_or_build=str(build_dir), prompt=prompt, prompt_ids=prompt_ids,
               max_new_tokens=max_new_tokens, engine=engine, ignore_eos=ignore_eos, record_lattices=None,
               replay_lattices=None, as_json=as_json, **_sampling_arguments(sampling))


@cli.command()
@click.argument("build_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--engine", type=click.Choice([e for e in ENGINES if e.startswith("compiled")]), default=None,
              help="default: the build's best speculative engine (two-level, tree, chain)")
@click.option("--served-model-name", default=None,
              help="the model name clients use (default: the target's Hugging Face id, else the build's folder name)")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="a Jinja chat template (default: the one the build carries from its checkpoint)")
@click.option("--queue-size", type=click.IntRange(1), default=64, show_default=True,
              help="requests that may wait; beyond it the server answers 429")
@click.option("--seed", type=click.IntRange(0, 2 ** 64 - 1), default=0, show_default=True,
              help="the sampling seed of requests that give none")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
def serve(build_dir, host, port, engine, served_model_name, chat_template, queue_size, seed, log_level):
    """Serve a build over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    import uvicorn

    from specpilot.serve.app import create_app
    from specpilot.serve.launch import make_server

    server = make_server(build_dir, engine, served_model_name, chat_template, queue_size, seed)
    click.echo(f"serving {server.model_name} ({server.engine}) on http://{host}:{port}/v1", err=True)
    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level)


def _sampling_arguments(sampling) -> dict:
    """A parsed ``sampling`` back as the options `sampling_options` reads (for ctx.invoke)."""
    if sampling is None:
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    return sampling.model_dump()


@cli.group()
def w12():
    """The W12 lossless 12-bit weight layout."""


@w12.command("stats")
@click.argument("spec_or_checkpoint")
@click.option("--json", "as_json", is_flag=True)
def w12_stats(spec_or_checkpoint, as_json):
    """Bytes ratio (metadata and escapes included), escape rate, and a bit-exact round trip."""
    from specpilot.core import w12 as codec
    from specpilot.core.loader import model_weights

    result = codec.stats(model_weights(spec_or_checkpoint))
    if as_json:
        click.echo(json.dumps(result))
    else:
        for t in result["tensors"]:
            click.echo(f"{t['name']:56s} {str(tuple(t['shape'])):>16s} ratio {t['bytes_ratio']:.4f} "
                       f"escapes {100 * t['escape_rate']:.3f}% exact {t['bit_exact']}")
        click.echo(f"total: {result['bytes_ratio']:.4f} of bf16 bytes, escape rate {100 * result['escape_rate']:.4f}%, "
                   f"bit-exact round trip: {result['bit_exact']}")
        if not all(t["bf16_exact_cast"] for t in result["tensors"]):
            click.echo("note: some weights are not bf16 values (W12 packs bf16; casting them loses bits)")
    sys.exit(0 if result["bit_exact"] else 1)


@cli.group()
def drafter():
    """Drafters: train early-exit adapters, block (DFlash) and feature (EAGLE-3) drafters for a target."""


def _continuation_options(verb: str):
    """--seed, --device, --corpus, --holdout: how the target's own continuations are made."""
    options = [click.option("--seed", type=click.IntRange(0), default=0, show_default=True),
               click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto"),
               click.option("--corpus", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                            help="directory of .py files (default: the Python standard library)"),
               click.option("--holdout", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                            help=f"JSON list of prompt texts never to {verb} (a benchmark's)")]

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


@drafter.command("train")
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--kind", type=click.Choice(["early-exit", "block", "feature"]), default="early-exit", show_default=True)
@click.option("--layers", "exits", type=click.IntRange(1), multiple=True,
              help="early-exit: target layers the drafter keeps (repeat to train several adapters from the same "
                   "passes); block: the drafter's layers (default 1)")
@click.option("--block-size", type=click.IntRange(2, 64), default=8, show_default=True, help="block: positions per pass")
@click.option("--anchors", type=click.IntRange(1), default=32, show_default=True,
              help="block: blocks trained per sequence and teacher pass (distinct anchors)")
@click.option("--gamma", type=click.FloatRange(min=0, min_open=True), default=None,
              help="block: position weights exp(-(k - 1) / gamma) (default DFlash's for the block size: 4 for 8, "
                   "5 for 10, 7 for 16)")
@click.option("--target-layers", default=None, help="block / feature: target layers read, e.g. 1,15,27 "
              "(default: the published projects' choice)")
@click.option("--ttt", type=click.IntRange(1, 8), default=3, show_default=True,
              help="feature: draft steps trained on the drafter's own outputs")
@click.option("--draft-vocab", type=click.IntRange(1), default=None,
              help="block / feature: its head's vocabulary, the target's most used tokens (default: the whole "
                   "vocabulary; a block drafter's head is the target head's rows of them)")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="directory for the adapters (adapter-L<N>.safetensors) or the drafter (config.json + "
                   "model.safetensors, the published layout; training state in training/: a rerun resumes), "
                   "and training.json")
@click.option("--steps", type=click.IntRange(1), default=2000, show_default=True)
@click.option("--batch", type=click.IntRange(2), default=32, show_default=True)
@click.option("--seq-len", type=click.IntRange(16), default=256, show_default=True)
@click.option("--generate", "generated", type=click.IntRange(2), default=2048, show_default=True,
              help="target continuations to generate and train on (half code, half chat for chat models)")
@click.option("--lr", type=float, default=3e-4, show_default=True)
@_continuation_options("train on")
@click.option("--time-limit", type=float, default=None, help="seconds for the whole run, generating the target's continuations included")
@click.option("--dtype", "save_dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16",
              show_default=True, help="dtype the adapter files hold")
def drafter_train(spec, kind, exits, block_size, anchors, gamma, target_layers, ttt, draft_vocab, output, steps, batch, seq_len,
                  generated, lr, seed, device, corpus, holdout, time_limit, save_dtype):
    """Distil early-exit adapters from the spec's target (KL over the vocabulary on a code corpus
    and the target's own greedy continuations); use one with `drafter: {kind: early-exit,
    layers: N, adapter: FILE}`."""
    import torch

    from specpilot.core import adapter
    from specpilot.core.loader import load_source
    from specpilot.core.spec import load_spec
    from specpilot.runtime.drafter_training import train_adapters
    from specpilot.runtime.tokenizer import load_tokenizer

    s = load_spec(spec)
    target = load_source(s, s.target, "target")
    device = _training_device(device)
    texts = _holdout_texts(holdout)
    tok = load_tokenizer(target.tokenizer_path, target.cfg.vocab_size)
    if kind != "early-exit":
        _train_conditioned(spec, kind, target, tok, exits, block_size, target_layers, draft_vocab, output, save_dtype,
                           dict(steps=steps, batch=batch, seq_len=seq_len, generated=generated, lr=lr, seed=seed,
                                device=device, corpus=corpus, holdout=texts, time_limit=time_limit, ttt=ttt,
                                blocks=anchors, gamma=gamma))
        return
    if not exits:
        raise click.UsageError("--layers: early-exit training needs the target layers each adapter keeps")
    results, info = train_adapters(target.cfg, target.weights, tok, sorted(set(exits)), steps=steps, batch=batch,
                                   seq_len=seq_len, generated=generated, device=device, lr=lr, seed=seed,
                                   holdout=texts, corpus=corpus, time_limit=time_limit,
                                   log=lambda m: click.echo(m, err=True))
    output.mkdir(parents=True, exist_ok=True)
    report = {**info, "spec": str(spec), "adapters": []}
    for r in results:
        path = output / f"adapter-L{r.layers}.safetensors"
        adapter.save(path, {k: v.to(getattr(torch, save_dtype)) for k, v in r.tensors.items()}, r.layers, info["target_digest"],
                     {"steps": info["steps"], "heldout": r.heldout, "spec": str(spec)})
        report["adapters"].append({"file": path.name, "layers": r.layers, "heldout": r.heldout,
                                   "first_loss": r.losses[0] if r.losses else None,
                                   "last_loss": r.losses[-1] if r.losses else None})
        click.echo(f"{path}: held-out top-1 {r.heldout['top1']:.3f} (no adapter {r.heldout['top1_no_adapter']:.3f}), "
                   f"top-4 {r.heldout['top4']:.3f}")
    atomic_write_text(output / "training.json", json.dumps(report, indent=2))


def _training_device(device: str) -> str:
    import torch
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecPilotError(f"--device {device}: no CUDA device here (use --device cpu)")
    if device != "cpu" and not device.startswith("cuda"):
        raise SpecPilotError(f"--device {device}: expected cpu, cuda or auto")
    return device


def _holdout_texts(holdout: Path | None) -> list[str]:
    """A --holdout file's prompt texts (a JSON list of strings)."""
    if holdout is None:
        return []
    try:
        texts = json.loads(holdout.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecPilotError(f"{holdout}: not JSON ({e})") from None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise SpecPilotError(f"{holdout}: expected a JSON list of strings")
    return texts


@drafter.command("vocab")
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--size", type=click.IntRange(1), default=None, help="tokens in the draft vocabulary (counted)")
@click.option("--from", "source", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="take the draft vocabulary of another drafter of the same target (an EAGLE-3 drafter's d2t) "
                   "instead of counting")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="directory for the drafter with its vocabulary (the input is left as it is)")
@click.option("--generate", "generated", type=click.IntRange(2), default=512, show_default=True,
              help="target continuations whose tokens are counted (half code, half chat for chat models)")
@click.option("--seq-len", type=click.IntRange(16), default=256, show_default=True)
@_continuation_options("count")
def drafter_vocab(spec, directory, size, source, output, generated, seq_len, seed, device, corpus, holdout):
    """Give a trained block drafter (DIRECTORY, for SPEC's target) a draft vocabulary: its head becomes
    the target head's rows of the SIZE tokens the target's own continuations use most (or of another
    drafter's vocabulary, --from), so a drafting pass computes and ranks those logits a position
    instead of the whole vocabulary's.  Tokens stay the target's: verification decides."""
    import dataclasses

    from specpilot.core import feature_drafter as fd
    from specpilot.core.adapter import target_digest
    from specpilot.core.loader import load_source
    from specpilot.core.spec import load_spec

    if (size is None) == (source is None):
        raise click.UsageError("give one of --size (count the target's continuations) or --from (another drafter's)")
    s = load_spec(spec)
    target = load_source(s, s.target, "target")
    digest = target_digest(target.weights)
    cfg, tensors = fd.load(directory, target.cfg, digest)
    if cfg.kind != "block" or fd.sliced_head(cfg):
        raise SpecPilotError(f"{directory}: a {cfg.kind} drafter" + (" with a draft vocabulary already" if
                             cfg.kind == "block" else "; a feature drafter's vocabulary is chosen when it is trained"))
    if source is not None:
        ids, note = _vocabulary_of(source, target, digest)
    else:
        if size >= cfg.vocab_size:
            raise click.BadParameter(f"{size} is not smaller than the target's vocabulary ({cfg.vocab_size})",
                                     param_hint="--size")
        ids, note = _counted_vocabulary(target, size, dict(generated=generated, seq_len=seq_len, seed=seed,
                                                           device=device, corpus=corpus, holdout=holdout))
    fd.save_with_vocabulary(directory, output, dataclasses.replace(cfg, draft_vocab_size=len(ids)), fd.d2t_of(ids),
                            target.cfg.num_hidden_layers, digest)
    click.echo(f"{output}: a block drafter with a vocabulary of {len(ids)} tokens, {note}")


def _vocabulary_of(source: Path, target, digest: str):
    """Another drafter's draft vocabulary (target ids, ascending) for the same target."""
    from specpilot.core import feature_drafter as fd

    cfg, tensors = fd.load(source, target.cfg, digest)
    if "d2t" not in tensors or (cfg.draft_vocab_size or cfg.vocab_size) >= cfg.vocab_size:
        raise SpecPilotError(f"--from {source}: a {cfg.kind} drafter without a draft vocabulary")
    return fd.vocab_ids(tensors["d2t"]), f"{source}'s"


def _counted_vocabulary(target, size: int, options: dict):
    """The ``size`` tokens the target's own continuations use most, and what share of their tokens
    those cover."""
    import random

    import torch

    from specpilot.runtime.drafter_training import stdlib_files, target_sequences
    from specpilot.runtime.feature_drafter_training import draft_vocabulary
    from specpilot.runtime.tokenizer import load_tokenizer

    o = options
    if target.cfg.is_hybrid:
        raise SpecPilotError("--size: counting runs the target's continuations on attention-only targets (Llama, "
                             "Qwen2/3); this one has Gated DeltaNet layers (take another drafter's vocabulary: --from)")
    tok = load_tokenizer(target.tokenizer_path, target.cfg.vocab_size)
    weights = {k: v.to(_training_device(o["device"]), torch.float32) for k, v in target.weights.items()}
    sequences = target_sequences(target.cfg, weights, tok, o["generated"], o["seq_len"], stdlib_files(o["corpus"]),
                                 random.Random(o["seed"]), o["seed"], _holdout_texts(o["holdout"]),
                                 log=lambda m: click.echo(m, err=True))
    ids = draft_vocabulary(sequences, size)
    counted = torch.bincount(torch.tensor([t for q in sequences for t in q]), minlength=target.cfg.vocab_size)
    covered = float(counted[ids].sum()) / max(float(counted.sum()), 1.0)
    return ids, f"{covered:.2%} of the {int(counted.sum())} tokens of {len(sequences)} target sequences"


def _train_conditioned(spec, kind, target, tok, exits, block_size, target_layers, draft_vocab, output, save_dtype,
                       options):
    """`drafter train --kind block|feature`: the drafter in its published layout, resumable, with a progress bar."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from specpilot.core import feature_drafter as fd
    from specpilot.runtime.feature_drafter_training import Options, Trainer

    if len(exits) > 1:
        raise click.UsageError("--layers: a block drafter takes one layer count")
    try:
        picks = tuple(int(x) for x in target_layers.split(",")) if target_layers else None
    except ValueError:
        raise click.UsageError(f"--target-layers {target_layers!r}: expected comma-separated layer numbers") from None
    cfg = fd.for_target(fd.seeded_config(kind, target.cfg, exits[0] if exits else 1, block_size, picks,
                                         draft_vocab=draft_vocab), target.cfg)
    trainer = Trainer(cfg, target.cfg, target.weights, tok, Options(**options), output / "training",
                      log=lambda m: click.echo(m, err=True))
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(), transient=False,
                  console=_stderr_console()) as bar:
        task = bar.add_task(f"training a {kind} drafter", total=options["steps"], completed=trainer.step, loss="-")
        info = trainer.run(lambda done, total, loss: bar.update(task, completed=done, loss=f"{loss:.3f}"))
    fd.save(output, cfg, trainer.tensors(), target.cfg.num_hidden_layers, trainer.digest, getattr(torch, save_dtype))
    report = {**info, "kind": kind, "spec": str(spec), "config": cfg.to_dict()}
    atomic_write_text(output / "training.json", json.dumps(report, indent=2))
    click.echo(f"{output}: a {kind} drafter, held-out top-1 agreement "
               + ", ".join(f"{k} {v:.3f}" for k, v in info["heldout"].items()))


def _stderr_console():
    from rich.console import Console
    return Console(stderr=True)


@cli.group()
def passes():
    """The pass toolkit: what passes exist, and whether a pipeline is legal."""


@passes.command("list")
@click.option("--json", "as_json", is_flag=True)
def passes_list(as_json):
    """Name, options, requires, conflicts and a one-line doc of every registered pass."""
    from specpilot.passes.registry import REGISTRY

    rows = [{"name": cls.name, "doc": cls.doc,
             "options": [{"name": o.name, "type": o.type.__name__, "default": o.default, "doc": o.doc}
                         for o in cls.options],
             "requires": list(cls.requires), "conflicts": list(cls.conflicts), "after": list(cls.after),
             "targets": list(cls.targets), "proposable": cls.proposable} for cls in sorted(REGISTRY.values(), key=lambda c: c.name)]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no passes are registered")
    for r in rows:
        opts = ", ".join(f"{o['name']}: {o['type']} = {o['default']}" for o in r["options"]) or "-"
        click.echo(f"{r['name']:24s} {r['doc']}\n{'':24s} options: {opts}; requires: "
                   f"{', '.join(r['requires']) or '-'}; conflicts: {', '.join(r['conflicts']) or '-'}")


@passes.command("check")
@click.argument("pipeline_text")
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--target", "target_text", default="llvm", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def passes_check(pipeline_text, spec_path, target_text, as_json):
    """Exit 0 if the pipeline is legal for the spec and target, else 1 with the reasons."""
    from specpilot.core.target import parse_target
    from specpilot.passes.base import PassContext
    from specpilot.passes.legality import check
    from specpilot.passes.pipeline import parse

    target = parse_target(target_text)
    pipeline = parse(pipeline_text)
    context = PassContext(target_kind=target.kind, arch=target.arch)
    if spec_path is not None:
        from specpilot.core.loader import load_models
        from specpilot.core.spec import load_spec
        spec = load_spec(spec_path)
        cfg = load_models(spec, weights=False)[0].cfg if spec.target.architecture else load_models(spec)[0].cfg
        context = PassContext(target_kind=target.kind, arch=target.arch, architecture=cfg.architecture,
                              hybrid=cfg.is_hybrid, dtype=spec.deployment.dtype, max_batch=spec.deployment.max_batch)
    reasons = check(pipeline, context)
    if as_json:
        click.echo(json.dumps({"pipeline": str(pipeline), "legal": not reasons, "reasons": reasons}))
    elif reasons:
        click.echo(f"illegal: {pipeline}")
        for r in reasons:
            click.echo(f"  - {r}")
    else:
        click.echo(f"legal: {pipeline or '(empty pipeline)'}")
    sys.exit(1 if reasons else 0)


@cli.command()
@click.argument("build_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--requests", type=click.Path(dir_okay=False, path_type=Path), help="JSONL requests (default: built-in prompts)")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@click.option("--engine", type=click.Choice([e for e in ENGINES if e.startswith("compiled")]), default=None,
              help="default: the engine the build's pipeline is for")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="write a roofline + factors PNG")
@click.option("--json", "as_json", is_flag=True)
def explain(build_dir, requests, max_new_tokens, engine, plot_path, as_json):
    """Cost model: acceptance, kernel and overhead factors, per-kernel time vs bound, the bottleneck."""
    from specpilot.agent.cost_model import explain as run_explain, plot, render
    from specpilot.runtime.systems import from_build

    from rich.console import Console

    with Console(stderr=True, quiet=as_json or OUTPUT["quiet"]).status("loading the build") as status:
        system = from_build(build_dir)
        prompts = [p for p, _ in read_requests(requests, system, max_new_tokens)]
        report = run_explain(build_dir, prompts, max_new_tokens, engine, system=system,
                             progress=lambda message: status.update(message))
    if plot_path:
        plot(report, plot_path)
    if as_json:
        click.echo(json.dumps({k: v for k, v in report.items() if k != "lattices"}))
    else:
        click.echo(render(report))


@cli.command()
@click.argument("spec", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--target", "target_text", default="llvm", show_default=True)
@click.option("--rounds", type=click.IntRange(1, 20), default=2, show_default=True)
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=Path("search"), show_default=True)
@click.option("--proposer", type=click.Choice(["builtin", "llm"]), default="builtin", show_default=True)
@click.option("--llm-model", default=None, help="model name at OPENAI_BASE_URL (proposer llm)")
@click.option("--llm-timeout", type=click.FloatRange(1, 3600), default=60.0, show_default=True,
              help="seconds the LLM endpoint gets per request (then the phase goes on without it)")
@click.option("--workers", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option("--backend", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--memory", "memory_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--dev-requests", type=click.IntRange(2, 64), default=3, show_default=True)
@click.option("--dev-tokens", type=click.IntRange(4, 4096), default=48, show_default=True,
              help="token forcing length on development requests (every candidate)")
@click.option("--time-tokens", type=click.IntRange(4, 4096), default=48, show_default=True,
              help="tokens per timed request (cost model, paired measurement)")
@click.option("--sealed-tokens", type=click.IntRange(4, 8192), default=4096, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 50), default=3, show_default=True)
@click.option("--inject-fault", type=click.IntRange(0), default=None,
              help="TEST: every candidate gets logit-bias-fault{after=N} (sealed validation must reject it)")
@click.option("--params", "params", type=click.Choice(["auto", "file", "seeded"]), default="auto", show_default=True,
              help="candidates built with their weights (file) or redrawn from the spec's seeds at load (seeded); "
                   "auto: seeded for seeded random models on GPUs")
@click.option("--json", "as_json", is_flag=True)
def search(spec, target_text, rounds, output, proposer, llm_model, llm_timeout, workers, backend, memory_path, dev_requests,
           dev_tokens, time_tokens, sealed_tokens, repeats, inject_fault, params, as_json):
    """The optimization loop: cost model, proposals, parallel builds, paired adjudication, sealed validation."""
    from specpilot.agent.cycle import Search

    chosen = None
    if proposer == "llm":
        from specpilot.agent.llm import LLMProposer
        chosen = LLMProposer(model=llm_model, timeout=llm_timeout, retries=1)
    say = (lambda m: None) if OUTPUT["quiet"] else (lambda m: click.echo(m, err=True)) if as_json else click.echo
    result = Search(spec, target_text, output, rounds, workers, chosen, memory_path, dev_requests, dev_tokens,
                    sealed_tokens=sealed_tokens, repeats=repeats, inject_fault=inject_fault, backend=backend,
                    say=say, time_tokens=time_tokens, params=None if params == "auto" else params).run()
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo((output / "report.md").read_text())
    nothing = result["sealed"].get("adopted") is False     # a result (stock stays), not a failure
    if nothing:
        say("nothing was adopted: stock stays the best system here")
    sys.exit(0 if result["sealed"].get("passed") or nothing else 1)


_memory_option = click.option("--memory", "memory_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                              help="memory database (default: $SPECPILOT_MEMORY or ~/.local/share/specpilot/memory.sqlite)")


@cli.group()
def memory():
    """The memory of verified pass sequences (SQLite)."""


def _summary(e) -> dict:
    return {"id": e.id, "pipeline": e.pipeline, "applicability": e.applicability.model_dump(mode="json"),
            "results": e.results, "dependencies": e.dependencies, "updated": e.updated}


@memory.command("ls")
@_memory_option
@click.option("--json", "as_json", is_flag=True)
def memory_ls(memory_path, as_json):
    """List the entries."""
    from specpilot.memory.store import Memory, default_path
    if not Path(memory_path or default_path()).exists():
        rows = []                       # nothing added yet; a read command makes no file
    else:
        with Memory(memory_path, create=False) as mem:
            rows = [_summary(e) for e in mem.entries()]
            for problem in mem.unreadable:
                click.echo(f"warning: skipped unreadable entry {problem}", err=True)
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no entries")
    for r in rows:
        a, res = r["applicability"], r["results"]
        gain = f"{res['speedup']:.3f}x (95% lcb {res['lcb']:+.1%})" if "speedup" in res else "-"
        click.echo(f"{r['id']}  {r['pipeline'] or '(stock)':48s} {a['family']}/{a['target_kind']}/{a['dtype']}  {gain}")


@memory.command("show")
@click.argument("entry_id")
@_memory_option
@click.option("--json", "as_json", is_flag=True)
def memory_show(entry_id, memory_path, as_json):
    """One entry, in full."""
    from specpilot.memory.store import Memory
    with Memory(memory_path, create=False) as mem:
        entry = mem.get(entry_id)
    body = json.loads(entry.model_dump_json())
    click.echo(json.dumps(body) if as_json else json.dumps({k: v for k, v in body.items() if k != "spec"}, indent=2))


@memory.command("verify")
@click.argument("entry_id")
@_memory_option
@click.option("--json", "as_json", is_flag=True)
def memory_verify(entry_id, memory_path, as_json):
    """Re-apply the entry's pipeline to stock and compare structural hashes (exit 0: reproduces)."""
    from specpilot.agent.reproduce import reproduce_hash
    from specpilot.memory.store import Memory
    with Memory(memory_path, create=False) as mem:
        entry = mem.get(entry_id)
        problems = mem.verify(entry.id, reproduce_hash)
    if as_json:
        click.echo(json.dumps({"id": entry.id, "pipeline": entry.pipeline, "reproduces": not problems,
                               "problems": problems}))
    elif problems:
        click.echo(f"FAIL {entry.id} {entry.pipeline}")
        for p in problems:
            click.echo(f"  - {p}")
    else:
        click.echo(f"ok {entry.id} {entry.pipeline}: stock + pipeline reproduces IRModule {entry.source_hash}")
    sys.exit(1 if problems else 0)


@memory.command("export")
@_memory_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write here (default: stdout)")
def memory_export(memory_path, output):
    """All entries as one JSON file."""
    from specpilot.memory.store import Memory
    with Memory(memory_path, create=False) as mem:
        text = json.dumps(mem.export(), indent=2)
    if output:
        atomic_write_text(output, text)
    else:
        click.echo(text)


@memory.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_memory_option
def memory_import(file, memory_path):
    """Validate an export file and store its entries (each must reproduce)."""
    from specpilot.agent.reproduce import reproduce_hash
    from specpilot.memory.store import Memory
    if not file.is_file():
        raise SpecPilotError(f"{file}: not found")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecPilotError(f"{file}: not valid JSON ({e})") from None
    with Memory(memory_path) as mem:
        stored = mem.import_(data, reproduce_hash)
    click.echo(f"imported {len(stored)} entries into {mem.path}")


def join_target_flags(argv: list[str]) -> list[str]:
    """`--target cuda -arch=sm_90` (unquoted, as in the docs) -> `--target 'cuda -arch=sm_90'`."""
    out: list[str] = []
    for arg in argv:
        if arg.startswith(("-arch=", "-device=", "-schedule-for=")) and len(out) >= 2 and out[-2] == "--target":
            out[-1] = f"{out[-1]} {arg}"
        else:
            out.append(arg)
    return out


def main() -> None:
    try:
        cli(args=join_target_flags(sys.argv[1:]), prog_name="specpilot", standalone_mode=False)
    except SpecPilotError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except Exception as e:  # a fault nothing above named: still one line (SPECPILOT_DEBUG=1: the traceback)
        if os.environ.get("SPECPILOT_DEBUG"):
            raise
        message = " ".join(str(e).split())
        message = message if len(message) <= 300 else message[:300] + "..."
        click.echo(f"error: {type(e).__name__}: {message} (unexpected; SPECPILOT_DEBUG=1 shows where)", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
