"""Token forcing: the correctness gate every optimized path passes.

Stock (the target's own greedy autoregressive decoding) produces tokens and, at each
position, its top-2 logit margin.  The system under test runs forced onto stock's tokens
and reports its own greedy choice at every position.  Exact means choice == stock token
everywhere.  In fp32 on the CPU nothing is excused.  In lower precision a mismatch is
excused only where stock's margin is below ``tie_tolerance``; each excused position is
listed in the report.

`force` is the one entry point (``specpilot verify``, the search's workers, sealed validation,
the GPU forcing benchmark and the tests) and `tolerance_rule` the one rule for what is excused.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.decoding import autoregressive, top2
from specpilot.runtime.sampling import controls, keys, reference_scores


@dataclass
class Divergence:
    request: int
    position: int          # index among the generated tokens, 0-based
    stock_token: int
    system_token: int
    stock_margin: float
    context: list[int]     # up to 8 stock tokens before the position
    kind: str = "near-tie"  # excused as: a near-tie of stock's top 2, or an open top-k / top-p "cut"


@dataclass
class ForcingReport:
    passed: bool
    requests: int
    positions: int
    tie_tolerance: float
    first_divergence: Divergence | None = None
    excused: list[Divergence] = field(default_factory=list)
    max_excused: int | None = None      # the near-tie budget, when one applies
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def compare(stock_tokens: list[int], stock_margins: list[float], system_choices: list[int],
            tie_tolerance: float = 0.0, request: int = 0, open_cut=None) -> tuple[Divergence | None, list[Divergence]]:
    """First unexcused divergence (or None) and the excused near-ties, for one request.  ``open_cut(position,
    stock token, system token)``: sampled runs -- True where the two differ on a top-k / top-p cut that
    stock's precision leaves open (`open_cut_rule`)."""
    if len(system_choices) != len(stock_tokens):
        raise ValueError(f"system produced {len(system_choices)} choices for {len(stock_tokens)} positions")
    excused = []
    for pos, (want, got, margin) in enumerate(zip(stock_tokens, system_choices, stock_margins)):
        if want == got:
            continue
        d = Divergence(request, pos, want, got, margin, stock_tokens[max(0, pos - 8):pos])
        if margin < tie_tolerance:
            excused.append(d)
            continue
        if open_cut is not None and open_cut(pos, want, got):
            d.kind = "cut"
            excused.append(d)
            continue
        return d, excused
    return None, excused


def force_requests(stock_runs, system_runs, tie_tolerance: float = 0.0, max_excused: int | None = None,
                   open_cuts=None) -> ForcingReport:
    """stock_runs / system_runs: per request, objects with tokens, margins / choices.  With
    ``max_excused``, more excused near-ties than that fail too (a wrong build under a loose
    tolerance mismatches nearly everywhere, every mismatch a "near-tie")."""
    report = ForcingReport(True, len(stock_runs), 0, tie_tolerance, max_excused=max_excused)
    for r, (stock, system) in enumerate(zip(stock_runs, system_runs)):
        report.positions += len(stock.tokens)
        first, excused = compare(stock.tokens, stock.margins, system.choices, tie_tolerance, r,
                                 open_cuts[r] if open_cuts else None)
        report.excused.extend(excused)
        if first is not None and report.first_divergence is None:
            report.first_divergence = first
            report.passed = False
            report.reason = (f"request {first.request}, new token {first.position}: stock {first.stock_token}, "
                             f"system {first.system_token} (stock's margin {first.stock_margin:.4g} >= tolerance "
                             f"{tie_tolerance:.4g})")
    if report.passed and max_excused is not None and len(report.excused) > max_excused:
        report.passed = False
        report.reason = (f"{len(report.excused)} excused near-ties in {report.positions} positions, more than "
                         f"stock's own precision explains (at most {max_excused})")
    return report


def against_baseline(report: ForcingReport, baseline: ForcingReport, factor: float = 2.0, slack: int = 16) -> ForcingReport:
    """Fail ``report`` when it excuses far more near-ties than ``baseline`` did on the same
    requests -- e.g. a build's tree engine against its own autoregressive engine: the same
    arithmetic per token, so a multiple of the near-ties means a different computation."""
    limit = int(factor * len(baseline.excused)) + slack
    if report.passed and len(report.excused) > limit:
        report.passed = False
        report.reason = (f"{len(report.excused)} excused near-ties, more than {factor:g} x the "
                         f"{len(baseline.excused)} of the baseline + {slack}")
    return report


def runner_up_fault(after: int, bias: float):
    """A logits hook that adds ``bias`` to the second-ranked token from position ``after`` on:
    a fault any gate must catch at ``after`` once the bias exceeds the margin there."""
    def hook(position: int, logits):
        if position < after:
            return logits
        logits = logits.clone()
        logits[top2(logits)[3]] += bias
        return logits
    return hook


def tolerance_rule(system, prompts: list[list[int]], stock_runs, setting="auto",
                   sampling=None) -> tuple[float, int | None]:
    """(tie tolerance, near-tie budget) for forcing ``system`` on these requests.  ``auto``: derived
    from stock's own arithmetic (`System.derived_near_ties`: 0 and no budget in float32); a number is
    taken as given, with no budget."""
    if setting is None or setting == "auto":
        if sampling is not None and not sampling.greedy:
            return system.derived_near_ties(prompts, stock_runs, sampling)
        return system.derived_near_ties(prompts, stock_runs)
    try:
        value = float(setting)
    except (TypeError, ValueError):
        raise SpecPilotError(f"tie tolerance: expected a number or 'auto', got {setting!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise SpecPilotError(f"tie tolerance must be a finite number >= 0, got {setting!r}")
    return value, None


def force(system, engine: str, requests: list[tuple[list[int], int]], tolerance="auto", logits_hook=None,
          batch: bool = False, stock_runs=None, sampling=None):
    """Token forcing of ``engine`` against stock decoding on ``requests`` ((prompt ids, new tokens)
    each): greedy, or sampled with ``sampling`` (`core.sampling.SamplingParams`: stock draws with the
    same seed, choices are the argmax of the same scores).  Returns (report, stock runs, system
    runs); ``stock_runs`` given are reused."""
    prompts = [ids for ids, _ in requests]
    if stock_runs is None:
        stock_runs = [system.generate("stock", ids, limit, sampling=sampling) for ids, limit in requests]
    tie_tolerance, max_excused = tolerance_rule(system, prompts, stock_runs, tolerance, sampling)
    forced = [s.tokens for s in stock_runs]
    if batch:
        runs = system.generate_batch(engine, prompts, [limit for _, limit in requests], forces=forced,
                                     logits_hook=logits_hook, sampling=sampling)
    else:
        runs = [system.generate(engine, ids, limit, force=tokens, logits_hook=logits_hook, sampling=sampling)
                for (ids, limit), tokens in zip(requests, forced)]
    cuts = None
    if sampling is not None and not sampling.greedy and tie_tolerance > 0 and (sampling.top_p < 1 or sampling.top_k):
        cuts = [open_cut_rule(system, ids, run.tokens, sampling, tie_tolerance) for ids, run in zip(prompts, stock_runs)]
    return force_requests(stock_runs, runs, tie_tolerance, max_excused, cuts), stock_runs, runs


def open_cut_rule(system, prompt: list[int], stock_tokens: list[int], sampling, tolerance: float):
    """For a sampled low-precision run: whether stock and the system may differ at a position because
    top-k / top-p cut differently there -- a decision stock's own precision leaves open.  With every
    score (logit / T) off by at most ``tolerance``, a token's unnormalised probability moves by at most
    a factor e^tolerance and a cumulative mass by e^(2 tolerance); so the system's token, cut by stock,
    is open when stock's mass before it is under top_p x e^(2 tolerance) (top-k: its logit within
    2 tolerance T of the k-th), and it must then be the token the draw picks with it kept (its noisy
    score within the tolerance of the best).  Stock's raw logits are replayed once, on demand."""
    rows: list = []
    start = len(prompt)

    def logits():
        if not rows:
            model = system.engines["stock"].model
            autoregressive(model, prompt, len(stock_tokens), system.capacity, force=stock_tokens,
                           logits_hook=lambda pos, row: rows.append(row.float().clone()) or row)
        return rows

    def mass_before(row, order, rank: int, k: int) -> float:
        probs = torch.softmax(row[order[:k]] / sampling.temperature, 0)
        return float(probs[:rank].sum())

    def near_cut(row, order, token: int, kept: bool) -> bool:
        """Could scores off by the tolerance flip ``token``'s kept / cut status?"""
        vocab = row.shape[0]
        rank = int((order == token).nonzero()[0, 0])
        k = sampling.top_k if 0 < sampling.top_k < vocab else vocab
        reach = 2 * tolerance * sampling.temperature
        if kept:
            by_k = k < vocab and float(row[token]) <= float(row[order[k]]) + reach
            by_p = sampling.top_p < 1 and mass_before(row, order, rank, k) >= sampling.top_p * math.exp(-2 * tolerance)
            return by_k or by_p
        by_k = rank < k or float(row[token]) >= float(row[order[k - 1]]) - reach
        by_p = sampling.top_p >= 1 or (rank <= k and mass_before(row, order, rank, min(k + 1, vocab))
                                       < sampling.top_p * math.exp(2 * tolerance))
        return by_k and by_p

    def is_open(pos: int, want: int, got: int) -> bool:
        row = logits()[pos]
        order = torch.argsort(row, descending=True, stable=True)
        kept = controls(row[None], sampling)[0, 1] <= row
        free = reference_scores(row[None], keys(sampling, [start + pos]),
                                torch.tensor([[1.0 / sampling.temperature, float("-inf")]], device=row.device))[0]
        if not bool(kept[got]):     # the system kept a token stock cut, and the draw picked it
            return near_cut(row, order, got, kept=False) and float(free[got]) >= float(free[kept].max()) - tolerance
        # the system cut stock's token, and the draw picked the best of the rest
        rest = kept.clone()
        rest[want] = False
        return bool(kept[want]) and near_cut(row, order, want, kept=True) and bool(rest.any()) and \
            float(free[got]) >= float(free[rest].max()) - tolerance

    return is_open
