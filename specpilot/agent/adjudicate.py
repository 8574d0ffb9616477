"""Paired adjudication: does a candidate beat the current best by more than noise?

Both systems serve the same requests; each pair of runs alternates which goes first (and,
with two devices, which device each uses), so drift and warm-up hit both alike.  The gain of
one pair is ``t_base / t_candidate``; the estimate is the geometric mean over pairs with a
95 % Student-t interval on the log ratios.  Stock's own noise comes from an A/A run (stock
against itself, same protocol): the largest gain stock appears to have over itself, i.e.
the farther end of its 95 % interval.  A candidate is adopted only if the lower bound of its
gain exceeds ``1 % + 2 x noise`` -- ``3 % + 2 x noise`` when its output differs from the
current best's (a different output needs stronger evidence to be worth a re-validation).

The controller that measures is not the code that built the candidate: builders hand over a
build directory, `measure_pairs` runs it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import stats

BASE_MARGIN = 0.01          # a kept change must clear 1 % + 2 x noise ...
DIFFERENT_OUTPUT_MARGIN = 0.03   # ... or about 3 % + 2 x noise when its tokens differ from the current best's


@dataclass
class Interval:
    gain: float      # estimated relative gain: base time / candidate time - 1
    lcb: float       # 95 % lower confidence bound of the gain
    ucb: float
    pairs: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Verdict:
    adopt: bool
    gain: float
    lcb: float
    ucb: float
    noise: float
    threshold: float
    pairs: int
    outputs_differ: bool
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def paired_interval(base: Sequence[float], candidate: Sequence[float], confidence: float = 0.95) -> Interval:
    """Gain of ``candidate`` over ``base`` from paired times (same request, same repeat)."""
    b, c = np.asarray(base, dtype=float), np.asarray(candidate, dtype=float)
    if b.shape != c.shape or b.ndim != 1:
        raise ValueError(f"paired samples need equal lengths, got {b.shape} and {c.shape}")
    if len(b) < 2:
        raise ValueError("at least two pairs are needed for an interval")
    if (b <= 0).any() or (c <= 0).any():
        raise ValueError("times must be positive")
    d = np.log(b / c)
    mean, sem = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    half = float(stats.t.ppf(0.5 + confidence / 2, len(d) - 1)) * sem
    return Interval(math.expm1(mean), math.expm1(mean - half), math.expm1(mean + half), len(d))


def noise_level(aa: Interval) -> float:
    """Stock's own timing noise from an A/A interval: the largest gain it shows over itself."""
    return max(abs(aa.lcb), abs(aa.ucb))


def adjudicate(result: Interval, noise: float, outputs_differ: bool = False) -> Verdict:
    threshold = (DIFFERENT_OUTPUT_MARGIN if outputs_differ else BASE_MARGIN) + 2 * noise
    adopt = result.lcb > threshold
    why = (f"95% lower bound {result.lcb:+.2%} {'>' if adopt else '<='} threshold {threshold:.2%} "
           f"({'3%' if outputs_differ else '1%'} + 2 x noise {noise:.2%})")
    return Verdict(adopt, result.gain, result.lcb, result.ucb, noise, threshold, result.pairs, outputs_differ, why)


def measure_pairs(run_base: Callable[[int, int], float], run_candidate: Callable[[int, int], float],
                  n_requests: int, repeats: int, devices: Sequence[object] = (None,)) -> tuple[list[float], list[float]]:
    """Paired wall times: for every repeat and request, both systems once, alternating which
    goes first; with two devices, the systems swap devices every other pair.  ``run_x(request,
    device_index)`` serves one request and returns its seconds (or is timed here if it returns None)."""
    base, cand = [], []
    k = 0
    for rep in range(repeats):
        for r in range(n_requests):
            swap = (k // 2) % 2 if len(devices) > 1 else 0
            order = [("base", run_base, swap), ("cand", run_candidate, 1 - swap if len(devices) > 1 else 0)]
            if k % 2:
                order.reverse()
            for which, fn, dev in order:
                start = time.perf_counter()
                seconds = fn(r, dev)
                seconds = seconds if seconds is not None else time.perf_counter() - start
                (base if which == "base" else cand).append(seconds)
            k += 1
    return base, cand
