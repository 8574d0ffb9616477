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
padded ones (but for the GPU recurrence, which stops at each sequence's last real token): with ``packed``, a pass is priced a + b x real rows + c x padded rows, fitted from both
counts once they have varied apart (on a 27B-class hybrid at batch 16 on an H100, c came out as large
as b or larger: bench/README "Batched"), and by its real rows alone until then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.97            # an observation's weight a pass later: load and context lengths drift
EXPLORE = 8             # every this many chosen passes one neighbouring length runs, so the fit keeps seeing rows vary
COLLINEAR = 0.05        # real and padded rows correlated past 1 - this (squared): one price for both


@dataclass
class _Fit:
    """Exponentially weighted least squares of y over x: y ~ a + b x."""
    n: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    seen: int = 0

    def add(self, x: float, y: float) -> None:
        self.n, self.sx, self.sxx = DECAY * self.n + 1, DECAY * self.sx + x, DECAY * self.sxx + x * x
        self.sy, self.sxy = DECAY * self.sy + y, DECAY * self.sxy + x * y
        self.seen += 1

    def line(self) -> tuple[float, float] | None:
        """(a, b), both >= 0; None until x has varied."""
        spread = self.n * self.sxx - self.sx * self.sx
        if self.seen < 3 or spread <= 1e-9 * max(1.0, self.n * self.sxx):
            return None
        b = max(0.0, (self.n * self.sxy - self.sx * self.sy) / spread)
        return max(0.0, (self.sy - b * self.sx) / self.n), b


class _Plane:
    """Exponentially weighted least squares of y over two counts: y ~ a + b x + c z, b and c >= 0, beside
    the fit ``x`` of y over x alone (fed the same passes by its owner)."""

    def __init__(self, x: _Fit):
        self.x, self.z = x, _Fit()                   # y over each count alone, for a coefficient held at 0
        self.sxz = self.sz = self.szz = self.szy = 0.0

    def add(self, x: float, z: float, y: float) -> None:
        """A pass's counts and seconds, ``self.x`` already holding (x, y)."""
        self.z.add(z, y)
        self.sxz, self.sz = DECAY * self.sxz + x * z, DECAY * self.sz + z
        self.szz, self.szy = DECAY * self.szz + z * z, DECAY * self.szy + z * y

    def plane(self) -> tuple[float, float, float] | None:
        """(a, b, c); None until the counts have varied apart (x alone then prices the rows)."""
        f = self.x
        if f.seen < 4:
            return None
        n = f.n
        vxx, vzz = f.sxx - f.sx * f.sx / n, self.szz - self.sz * self.sz / n
        vxz, vxy, vzy = self.sxz - f.sx * self.sz / n, f.sxy - f.sx * f.sy / n, self.szy - self.sz * f.sy / n
        if vxx <= 1e-9 * f.sxx or vzz <= 1e-9 * self.szz:   # a count that has not varied prices nothing
            return None
        det = vxx * vzz - vxz * vxz
        if det <= COLLINEAR * vxx * vzz:             # counts that move together (chains: real ~ padded) tell no c
            return None
        b, c = (vzz * vxy - vxz * vzy) / det, (vxx * vzy - vxz * vxy) / det
        if b < 0 or c < 0:                           # a count whose price comes out negative is held at 0
            line = self.z.line() if b < 0 else f.line()
            if line is None:
                return None
            return (line[0], 0.0, line[1]) if b < 0 else (line[0], line[1], 0.0)
        return max(0.0, (f.sy - b * f.sx - c * self.sz) / n), b, c


class PassCost:
    """Seconds of a batched pass: verification + commit as a + b x rows (+ c x padded rows for a packed
    build), drafting as c' + d x its drafter passes (c': the catch-up on accepted tokens, host work)."""

    def __init__(self):
        self.verify, self.draft = _Fit(), _Fit()
        self.padded = _Plane(self.verify)

    def observe(self, rows: int, verify_seconds: float, levels: int, draft_seconds: float,
                padded: int | None = None) -> None:
        """One pass: its verified ``rows`` (a packed build's real rows, with ``padded`` its padded ones,
        given for every pass or none)."""
        self.verify.add(rows, verify_seconds)
        self.draft.add(levels, draft_seconds)
        if padded is not None:
            self.padded.add(rows, padded, verify_seconds)

    def model(self) -> tuple[float, float, float, float] | None:
        """(a + c', b, d, c): c the price of a padded row beside a real row's b (0 for a padded build or
        while the counts have not varied apart); None while the passes seen do not yet tell a row's cost
        (d: 0 until the drafter passes a pass have varied too)."""
        line = self.verify.line()
        if line is None:
            return None
        plane = self.padded.plane()
        a, b, c = plane if plane is not None else (*line, 0.0)
        draft = self.draft.line()
        if draft is None:
            draft = (self.draft.sy / self.draft.n if self.draft.n else 0.0, 0.0)
        return a + draft[0], b, draft[1], c


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
    second of pass under ``cost`` = (a, b, d[, c]), rows counted as `verified_rows` (packed: c more a
    padded row); the shortest such K on ties."""
    a, b, d, c = (*cost, 0.0)[:4]
    c = c if packed else 0.0
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
    pass under ``cost`` = (a, b, d[, c]): verification of ``running`` x (1 + the largest request's nodes)
    rows (packed: b for ``running`` + the nodes, c for the padded rows); the pass's drafting (``drafted``
    seconds of levels, d x levels) ran for the whole order before the choice, so it is the same whatever
    is cut.  The fewest such nodes on ties."""
    a, b, _, c = (*cost, 0.0)[:4]
    c = c if packed else 0.0
    a += drafted
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
