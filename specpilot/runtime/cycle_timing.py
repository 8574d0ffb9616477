"""Where a verification cycle's time goes: the model and drafter wrapped so that every call is timed
to its end on the device (a synchronisation after each), split into prefill, draft, verify and
commit; host is the rest of the wall time.  The synchronisations cost time themselves, so this runs
apart from the timed runs and its shares, not its totals, are what is reported."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, part: str, fn, *args, **kwargs):
        synchronize()
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
            synchronize()
            return out
        finally:
            self.seconds[part] += time.perf_counter() - start


class TimedState:
    """A model state whose commits (truncate, drop_history) are timed; everything else passes through."""

    def __init__(self, state, clock: Clock):
        self.inner, self.clock = state, clock

    def truncate(self, *args, **kwargs):
        return self.clock.timed("commit", self.inner.truncate, *args, **kwargs)

    def drop_history(self, *args, **kwargs):
        return self.clock.timed("commit", self.inner.drop_history, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class TimedModel:
    """The target: its first forward of a state is the prefill, later ones verification passes."""

    def __init__(self, model, clock: Clock):
        self.inner, self.clock = model, clock

    def new_state(self, capacity: int):
        return TimedState(self.inner.new_state(capacity), self.clock)

    def forward(self, tokens, state, *args, **kwargs):
        part = "prefill" if state.length == 0 else "verify"
        return self.clock.timed(part, self.inner.forward, tokens, state.inner, *args, **kwargs)

    def forward_view(self, tokens, state, *args, **kwargs):
        return self.clock.timed("verify", self.inner.forward_view, tokens, state.inner, *args, **kwargs)

    def accept_path(self, state, *args, **kwargs):
        return self.clock.timed("commit", self.inner.accept_path, state.inner, *args, **kwargs)

    def settle(self, states):
        return self.clock.timed("commit", self.inner.settle, [s.inner for s in states])

    def __getattr__(self, name):
        return getattr(self.inner, name)


class TimedDrafter:
    def __init__(self, drafter, clock: Clock):
        self.inner, self.clock, self.name = drafter, clock, drafter.name

    def reset(self) -> None:
        self.clock.timed("draft", self.inner.reset)

    def propose(self, context, n):
        return self.clock.timed("draft", self.inner.propose, context, n)

    def scored_chain(self, context, n):
        return self.clock.timed("draft", self.inner.scored_chain, context, n)

    def expander(self, context):
        expand = self.clock.timed("draft", self.inner.expander, context)

        def timed(path):
            return self.clock.timed("draft", expand, path)
        if getattr(expand, "batch", None) is not None:
            timed.batch = lambda paths: self.clock.timed("draft", expand.batch, paths)
        return timed

    def __getattr__(self, name):
        return getattr(self.inner, name)


def breakdown(clock: Clock, wall: float) -> dict:
    """Seconds per part of the cycles (prefill excluded) and their shares of the cycle time."""
    cycle = max(wall - clock.seconds["prefill"], 1e-12)
    parts = {part: clock.seconds[part] for part in ("draft", "verify", "commit")}
    parts["host"] = max(cycle - sum(parts.values()), 0.0)
    return {"seconds": parts, "shares": {k: v / cycle for k, v in parts.items()}, "cycle_seconds": cycle}
