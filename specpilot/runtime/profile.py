"""Per-kernel profiling of a compiled build: TVM's VM instrument hook times every kernel call.

The hook runs before and after each VM call instruction; kernel calls (the build's TIR
functions) are timed between the two, with a device synchronization on GPUs so the time is
the kernel's own.  VM built-ins (allocation, tuple handling) are counted as calls but not as
kernels.  The wall time of the same work without the hook comes from the caller.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class KernelCall:
    name: str
    shapes: tuple[tuple[int, ...], ...]
    seconds: float
    arg_bytes: int = 0        # the sizes of its arguments (an upper bound on what it reads and writes)


@dataclass
class Profile:
    calls: list[KernelCall] = field(default_factory=list)
    other_calls: int = 0      # VM built-ins seen

    @property
    def kernel_seconds(self) -> float:
        return sum(c.seconds for c in self.calls)

    def by_kernel(self) -> dict[str, list[KernelCall]]:
        out = defaultdict(list)
        for c in self.calls:
            out[c.name].append(c)
        return dict(out)


def _itemsize(dtype) -> int:
    text = str(dtype)
    if text == "bool":
        return 1
    bits = re.search(r"(\d+)(x\d+)?$", text)
    return max(1, int(bits.group(1)) // 8) if bits else 4


class AnyKernel:
    """``kernel_names`` for `profiling` where the kernels' names are not at hand (a runtime-only
    TVM cannot read a build's kernels.json): every call that is not a VM built-in."""

    def __contains__(self, symbol) -> bool:
        return not str(symbol).startswith(("vm.", "relax.", "runtime."))


@contextmanager
def profiling(module, kernel_names):
    """Within the block, every call of ``module``'s VM to a kernel in ``kernel_names`` is timed
    into the yielded `Profile`."""
    profile = Profile()
    gpu = module.device.dlpack_device_type() != 1
    sync = module.device.sync if gpu else (lambda: None)
    started: list[float] = []

    def instrument(func, symbol, before, ret, *args):
        if symbol not in kernel_names:
            if before:
                profile.other_calls += 1
            return 0
        if before:
            sync()
            started.append(time.perf_counter())
            return 0
        sync()
        seconds = time.perf_counter() - started.pop()
        arrays = [a for a in args if hasattr(a, "shape")]
        shapes = tuple(tuple(int(d) for d in a.shape) for a in arrays)
        profile.calls.append(KernelCall(str(symbol), shapes, seconds,
                                        sum(math.prod(s) * _itemsize(a.dtype) for s, a in zip(shapes, arrays))))
        return 0

    set_instrument = module.vm["set_instrument"]
    set_instrument(instrument)
    try:
        yield profile
    finally:
        set_instrument(None)
