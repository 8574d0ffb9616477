"""A batched chain pass's length chosen by what it costs: the runtime's choice per step under a shared
node budget (`BatchPolicy.adaptive`).

A batched chain pass pads every request's chain to the longest, so its verification has B x (K + 1)
rows for a longest chain K, and drafting costs a catch-up pass and K batched drafter passes.  What one pass buys is each
request's expected accepted tokens, sum over i <= k_r of rate_r ** i (its drafts landing one after
another at its recent per-token rate, plus the target's own token).  `chain_length` picks the K with
the most expected tokens per second of pass, from `PassCost`: the run's own passes fitted as
a + b x rows for the verification and commit, and c + d x K for the drafting.  At batch 1 a row is nearly free
and the longest chain wins; at batch 16-32 each drafted row costs compute and shorter chains do
(bench/README "Batched": draft 4 beat the build's 8-16 at batch 8 on the H200).  The choice changes
how much is drafted, never which tokens are emitted.

A batched tree pass the same way (`tree_nodes`): its nodes are a prefix of the best-first order over
every request's candidates (`tree.best_first_shared`), so what n nodes buy is, per request, 1 + the
path probabilities of its nodes among them (each node is accepted exactly when its whole path is), and
what they cost is the padded verification of B x (1 + the largest request's share) rows.

A build that packs its verification (`tree-verify{packed=true}`) runs the linear layers and head over
the real rows only (B + the drafted tokens), but its attention and Gated DeltaNet layers still over the
padded ones (but for the GPU recurrence, which stops at each sequence's last real token): with
``packed``, a pass is priced a + b x real rows + c x padded rows, fitted from both counts once they have
varied apart (on a 27B-class hybrid at batch 16 on an H100, c came out as large as b or larger:
bench/README "Batched"), and by its real rows alone until then.

A running request also costs something whatever it drafts -- a hybrid's recurrent state (151 MB a
request at 27B-class shapes) read by the verification and read and written by the commit -- so the fit
prices the running requests too, once they have varied apart from the rows: a burst's tail, where rows
and requests fall together, would otherwise charge the states to the rows and draft too little.
"""

from __future__ import annotations

import math

import numpy as np

DECAY = 0.97            # an observation's weight a pass later: load and context lengths drift
EXPLORE = 8             # every this many chosen passes one neighbouring length runs, so the fit keeps seeing rows vary
COLLINEAR = 0.05        # a count the counts before it explain past 1 - this (squared): priced with them, not apart
FLAT = 1e-9             # a count whose spread is below this share of its mean square has not varied (rounding noise)


class _Fit:
    """Exponentially weighted least squares of y over k counts: y ~ a + sum_i b_i x_i, every b_i >= 0."""

    def __init__(self, counts: int):
        self.m = np.zeros((counts + 2, counts + 2))   # weighted sums of z z^T, z = (1, x_1 .. x_k, y)
        self.seen = 0

    def add(self, xs, y: float) -> None:
        z = np.array([1.0, *map(float, xs), float(y)])
        self.m = DECAY * self.m + np.outer(z, z)
        self.seen += 1

    def prices(self) -> tuple[float, list[float]] | None:
        """(a, [b_i]); None until the first count has varied.  A count priced 0 and left out: one that has not
        varied, one the counts before it explain (`COLLINEAR`: counts that move together keep the first's
        price), one whose price comes out negative (the rest refitted without it)."""
        k = self.m.shape[0] - 2
        n = self.m[0, 0]
        if self.seen < 3 or n <= 0:
            return None
        mean = self.m[0, 1:] / n
        cov = self.m[1:, 1:] / n - np.outer(mean, mean)      # the counts' and y's (co)variances, y last
        spread = [cov[i, i] > FLAT * max(1.0, self.m[i + 1, i + 1] / n) for i in range(k)]
        if not spread[0]:
            return None
        use: list[int] = []
        for i in (i for i in range(k) if spread[i]):
            if use and _unexplained(cov, use, i) <= COLLINEAR * cov[i, i]:
                continue
            use.append(i)
        b = np.zeros(k)
        while use:
            fit = np.linalg.solve(cov[np.ix_(use, use)], cov[use, k])
            if (fit >= 0).all():
                b[use] = fit
                break
            use.pop(int(np.argmin(fit)))
        return max(0.0, float(mean[k] - b @ mean[:k])), [float(v) for v in b]

    def mean_y(self) -> float:
        """y's weighted mean over the passes seen (0 before any)."""
        return float(self.m[0, -1] / self.m[0, 0]) if self.m[0, 0] > 0 else 0.0


def _unexplained(cov: np.ndarray, use: list[int], i: int) -> float:
    """Count i's variance left after regressing it on the counts ``use``."""
    sub = cov[np.ix_(use, use)]
    return float(cov[i, i] - cov[i, use] @ np.linalg.solve(sub, cov[use, i]))


class PassCost:
    """Seconds of a batched pass: verification + commit as a + b x rows + c x padded rows (a packed build)
    + e x running requests (what a request costs whatever it drafts: its recurrent state read and written,
    its commit), drafting as c' + d x its drafter passes (c': the catch-up on accepted tokens, host work)."""

    def __init__(self):
        self.verify, self.draft = _Fit(3), _Fit(1)

    def observe(self, rows: int, verify_seconds: float, levels: int, draft_seconds: float,
                padded: int | None = None, running: int | None = None) -> None:
        """One pass: its verified ``rows`` (a packed build's real rows, with ``padded`` its padded ones) and
        its ``running`` requests (each given for every pass or none)."""
        self.verify.add((rows, rows if padded is None else padded, 0 if running is None else running), verify_seconds)
        self.draft.add((levels,), draft_seconds)

    def model(self) -> tuple[float, float, float, float, float] | None:
        """(a + c', b, d, c, e): c the price of a padded row beside a real row's b (0 for a padded build or
        while the counts have not varied apart), e a running request's (0 while the requests have not
        varied apart from the rows); None while the passes seen do not yet tell a row's cost (d: 0 until
        the drafter passes a pass have varied too)."""
        verify = self.verify.prices()
        if verify is None:
            return None
        a, (b, c, e) = verify
        draft = self.draft.prices() or (self.draft.mean_y(), [0.0])     # levels not yet varied: their mean
        return a + draft[0], b, draft[1][0], c, e


def expected_tokens(rate: float, k: int) -> float:
    """A request's expected tokens from a chain of k drafts accepted one after another at ``rate``,
    plus the target's own: 1 + rate + ... + rate ** k."""
    return sum(rate ** i for i in range(k + 1))


def verified_rows(sizes: list[int], packed: bool) -> int:
    """Rows a batched pass verifies for requests drafting ``sizes`` tokens each: every request's last
    token and drafts, padded to the longest unless the build packs."""
    return len(sizes) + sum(sizes) if packed else len(sizes) * (1 + max(sizes, default=0))


def chain_length(rates: list[float], caps: list[int], cost: tuple, packed: bool = False) -> int:
    """The longest chain K (request r drafting min(K, caps[r])) with the most expected tokens a
    second of pass under ``cost`` = (a, b, d[, c[, e]]), rows counted as `verified_rows` (packed: c more a
    padded row), e a request; the shortest such K on ties."""
    a, b, d, c, e = (*cost, 0.0, 0.0)[:5]
    c = c if packed else 0.0
    a += e * len(caps)
    if a + (b + c) * len(caps) <= 0:    # passes that seem to cost nothing say nothing: the caps stand
        return max(caps, default=0)
    best, best_k = -1.0, 0
    for k in range(max(caps, default=0) + 1):
        drafts = [min(k, cap) for cap in caps]
        longest = max(drafts, default=0)
        seconds = a + b * verified_rows(drafts, packed) + c * verified_rows(drafts, False) + d * longest
        value = sum(expected_tokens(r, n) for r, n in zip(rates, drafts)) / seconds
        if value > best * (1 + 1e-12):
            best, best_k = value, k
    return best_k


def tree_nodes(order: list[tuple[int, float, int]], running: int, cost: tuple,
               drafted: float = 0.0, packed: bool = False) -> int:
    """How many nodes of a shared tree pass's best-first ``order`` ((request, path log-probability,
    depth) per node, requests numbered below ``running``) give the most expected tokens a second of
    pass under ``cost`` = (a, b, d[, c[, e]]): verification of ``running`` x (1 + the largest request's nodes)
    rows (packed: b for ``running`` + the nodes, c for the padded rows), e a request; the pass's drafting
    (``drafted`` seconds of levels, d x levels) ran for the whole order before the choice, so it is the same
    whatever is cut.  The fewest such nodes on ties."""
    a, b, _, c, e = (*cost, 0.0, 0.0)[:5]
    c = c if packed else 0.0
    a += drafted + e * running
    if a + (b + c) * running <= 0:  # passes that seem to cost nothing say nothing: the budget stands
        return len(order)
    sizes, value, largest = [0] * running, float(running), 0
    best, best_n = running / (a + (b + c) * running), 0
    for n, (request, score, _) in enumerate(order, 1):
        sizes[request] += 1
        largest = max(largest, sizes[request])
        value += math.exp(score)
        padded = running * (1 + largest)
        seconds = a + (b * (running + n) + c * padded if packed else b * padded)
        if value / seconds > best * (1 + 1e-12):
            best, best_n = value / seconds, n
    return best_n
