"""Serving schedules: decisions about how much work each step does, never what it computes.

`DraftSchedule` -- how many tokens the drafter proposes before each verification.  Fixed
(stock), or dynamic per request: an exponential average of how many drafts the target
accepted recently, plus one, clamped to [min, max].  A request whose drafts keep failing
drafts one token (little wasted drafter work); one whose drafts keep landing drafts up to
max.  Lossless either way: the target accepts only its own greedy tokens.
"""

from __future__ import annotations

import math


class DraftSchedule:
    def __init__(self, length: int, minimum: int = 1, dynamic: bool = False, decay: float = 0.5):
        if length < 1:
            raise ValueError(f"draft length must be >= 1, got {length}")
        self.max, self.min, self.dynamic, self.decay = length, min(max(minimum, 1), length), dynamic, decay
        self.recent = float(length)   # optimistic start: the first step drafts the maximum

    def next(self) -> int:
        if not self.dynamic:
            return self.max
        return max(self.min, min(self.max, math.ceil(self.recent - 1e-9) + 1))

    def update(self, accepted_drafts: int) -> None:
        """After a verification: how many of the drafted tokens the target accepted."""
        self.recent = self.decay * self.recent + (1 - self.decay) * accepted_drafts
