"""What every kernel factory shares: `memo`, one parse of each (factory, arguments) a process."""

from __future__ import annotations

import functools

from specpilot.kernels.fast_frames import quick_stack


def memo(factory):
    """Kernels are immutable IR: make each (factory, arguments) once per process (a lowering
    asks for the same kernels per layer), parsed under `quick_stack` (which spares TVMScript's own
    ``inspect.stack`` calls, most of a kernel's parse time)."""
    cache: dict = {}

    @functools.wraps(factory)
    def make(*args, **kwargs):
        key = tuple((type(a).__name__, a if isinstance(a, (bool, int, float, str)) else str(a))
                    for a in (*args, *sorted(kwargs.items())))
        if key not in cache:
            with quick_stack():
                cache[key] = factory(*args, **kwargs)
        return cache[key]
    return make
