"""Adjudication on synthetic timings with known gains and noise."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.agent.adjudicate import adjudicate, measure_pairs, noise_level, paired_interval


def _timings(rng, n: int, gain: float, noise: float):
    """Paired times: a per-request base cost, multiplicative lognormal noise on every run."""
    cost = rng.uniform(0.5, 2.0, n)
    base = cost * np.exp(rng.normal(0, noise, n))
    cand = cost / (1 + gain) * np.exp(rng.normal(0, noise, n))
    return base, cand


def _noise(rng, n=40, sigma=0.005):
    return noise_level(paired_interval(*_timings(rng, n, 0.0, sigma)))


def test_interval_recovers_a_known_gain():
    rng = np.random.default_rng(0)
    iv = paired_interval(*_timings(rng, 200, 0.10, 0.02))
    assert iv.lcb < 0.10 < iv.ucb and abs(iv.gain - 0.10) < 0.01 and iv.pairs == 200
    # exact data: the interval collapses on the gain
    base = np.linspace(1, 2, 9)
    exact = paired_interval(base, base / 1.25)
    assert exact.gain == pytest.approx(0.25) and exact.lcb == pytest.approx(0.25)


def test_adopts_real_gains_rejects_noise():
    rng = np.random.default_rng(1)
    adopted = rejected = 0
    for seed in range(20):
        r = np.random.default_rng(seed)
        noise = _noise(r)
        assert adjudicate(paired_interval(*_timings(r, 40, 0.08, 0.005)), noise).adopt   # 8 % >> 1 % + 2 x noise
        v = adjudicate(paired_interval(*_timings(r, 40, 0.0, 0.005)), noise)            # no gain: never
        adopted += v.adopt
        rejected += not adjudicate(paired_interval(*_timings(r, 40, 0.004, 0.005)), noise).adopt   # 0.4 %: below 1 %
    assert adopted == 0 and rejected == 20
    # noisy hardware raises the bar: a 3 % gain under 3 % jitter is not proven with 10 pairs
    noisy = _noise(rng, n=10, sigma=0.03)
    assert not adjudicate(paired_interval(*_timings(rng, 10, 0.03, 0.03)), noisy).adopt


def test_aa_run_adopts_nothing():
    hits = 0
    for seed in range(50):
        r = np.random.default_rng(100 + seed)
        noise = _noise(r)
        hits += adjudicate(paired_interval(*_timings(r, 40, 0.0, 0.005)), noise).adopt
    assert hits == 0


def test_different_outputs_need_about_three_percent():
    r = np.random.default_rng(7)
    iv = paired_interval(*_timings(r, 60, 0.02, 0.001))   # a clear 2 %
    noise = _noise(r, sigma=0.001)
    same, differ = adjudicate(iv, noise), adjudicate(iv, noise, outputs_differ=True)
    assert same.adopt and not differ.adopt and differ.threshold == pytest.approx(0.03 + 2 * noise)
    assert "3%" in differ.reason


def test_measure_pairs_alternates_order_and_swaps_devices():
    log = []

    def runner(name):
        def run(request, device):
            log.append((name, request, device))
            return 1.0
        return run

    base, cand = measure_pairs(runner("A"), runner("B"), n_requests=2, repeats=2, devices=("gpu0", "gpu1"))
    assert len(base) == len(cand) == 4
    firsts = [log[i][0] for i in range(0, 8, 2)]
    assert firsts == ["A", "B", "A", "B"]                     # who goes first alternates
    pairs = [tuple(sorted((log[i], log[i + 1]))) for i in range(0, 8, 2)]
    assert {(p[0][2], p[1][2]) for p in pairs} == {(0, 1), (1, 0)}   # both systems see both devices
    with pytest.raises(ValueError, match="equal lengths"):
        paired_interval([1.0, 2.0], [1.0])
