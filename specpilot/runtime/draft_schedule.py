"""Serving schedules: decisions about how much work each step does, never what it computes.

`DraftSchedule` -- how many tokens the drafter proposes before each verification (a chain's
length; a tree's nodes for a request in a batched pass).  Fixed (stock), or dynamic per request:
one of the lengths ``choices`` (default every length from min to max; the paper's 16 / 12 / 8),
the shortest that covers the drafts the request is expected to get accepted, plus one.  The
expectation is an exponential average of how many drafts the target accepted recently, averaged
with the drafter's own confidence in its last draft (the expected accepted length under its
probabilities) when it offers one.  A request whose drafts keep failing drafts little (little
wasted work); one whose drafts keep landing drafts the most.  Lossless either way: the target
accepts only its own tokens.
"""

from __future__ import annotations

import math

RATE_DECAY = 0.9    # a chain's weight in `rate` a verification later


def lengths(maximum: int, minimum: int = 1, step: int = 1) -> tuple[int, ...]:
    """maximum, maximum - step, ... >= minimum (16, 8, 4: 16, 12, 8)."""
    return tuple(range(maximum, max(minimum, 1) - 1, -max(step, 1)))


class DraftSchedule:
    def __init__(self, length: int, minimum: int = 1, dynamic: bool = False, decay: float = 0.5,
                 step: int = 1):
        if length < 1:
            raise ValueError(f"draft length must be >= 1, got {length}")
        self.max, self.min, self.dynamic, self.decay = length, min(max(minimum, 1), length), dynamic, decay
        self.choices = sorted(lengths(length, self.min, step))
        self.recent = float(length)   # optimistic start: the first step drafts the maximum
        self.confidence: float | None = None
        self.hits, self.misses = 1.0, 1.0     # drafts accepted / chains cut short, decayed (`rate`)

    def next(self) -> int:
        if not self.dynamic:
            return self.max
        expected = self.recent if self.confidence is None else (self.recent + self.confidence) / 2
        need = math.ceil(expected - 1e-9) + 1
        return next((n for n in self.choices if n >= need), self.max)

    def update(self, accepted_drafts: int, confidence: float | None = None, chain: int | None = None) -> None:
        """After a verification: how many of the drafted tokens the target accepted, and the drafter's
        expected accepted length for that draft (None: it offers none); ``chain``: the chain's length,
        where the draft was one (a chain cut short before its end is one miss)."""
        self.recent = self.decay * self.recent + (1 - self.decay) * accepted_drafts
        self.confidence = confidence
        if chain is not None:
            self.hits = RATE_DECAY * self.hits + accepted_drafts
            self.misses = RATE_DECAY * self.misses + (accepted_drafts < chain)

    def rate(self) -> float:
        """The chance a draft is accepted given the one before it was: accepted drafts over accepted
        drafts plus chains cut short, recent chains weighing most (one of each to start)."""
        return self.hits / (self.hits + self.misses)
