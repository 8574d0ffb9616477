"""x86-64 instruction-set levels for CPU (llvm) builds: what each level's code needs, which level this
machine runs, and the check a build's loader makes before running code compiled for a level.

The levels are the x86-64 psABI's (LLVM takes their names as ``-mcpu``): code built for x86-64-v3
uses AVX2 and FMA, which a CPU without them stops on with an illegal instruction, so a build records
its level and refuses to load where the CPU lacks one of the level's features.  Features are read
from /proc/cpuinfo -- what the kernel (and a hypervisor) enables -- not from the CPU's model name.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path
from typing import Literal

from specpilot.core.errors import SpecPilotError

GENERIC = "generic"
# each level's features beyond the one before, in /proc/cpuinfo's names (pni is SSE3, abm LZCNT)
_ADDS = {
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
LEVELS = (GENERIC, *_ADDS)
Level = Literal["generic", "x86-64-v2", "x86-64-v3", "x86-64-v4"]     # LEVELS, for a manifest's field
DEFAULT_CAP = "x86-64-v3"    # the default build's highest level: AVX-512 (v4) ran the cpu-nt matmuls no faster


def needs(level: str) -> tuple[str, ...]:
    """Every CPU feature code built for ``level`` may use."""
    if level not in LEVELS:
        raise SpecPilotError(f"unknown CPU level {level!r}; known: {', '.join(LEVELS)}")
    upto = LEVELS[1:LEVELS.index(level) + 1]
    return tuple(f for name in upto for f in _ADDS[name])


def on_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """This machine's CPU features (empty off x86-64 Linux: then only generic code runs)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not on_x86() or not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text(errors="replace").splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def missing(level: str, features: frozenset[str] | None = None) -> list[str]:
    """The features ``level`` needs that this machine (or ``features``) lacks."""
    have = host_features() if features is None else features
    return [f for f in needs(level) if f not in have]


def host_level(cap: str = DEFAULT_CAP, features: frozenset[str] | None = None) -> str:
    """The highest level up to ``cap`` whose every feature this machine has."""
    best = GENERIC
    for level in LEVELS[1:LEVELS.index(cap) + 1]:
        if missing(level, features):
            break
        best = level
    return best


def require(level: str | None, what: str) -> None:
    """Refuse to run ``what`` (code built for ``level``) on a CPU that lacks a feature it needs."""
    if level is None or level == GENERIC:
        return
    lacking = missing(level)
    if lacking:
        raise SpecPilotError(f"{what}: built for {level}, and this CPU lacks {', '.join(lacking)}; rebuild it here "
                             f"with --target llvm (this CPU's level: {host_level(cap=LEVELS[-1])})")
