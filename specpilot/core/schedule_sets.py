"""The schedule sets a build can lower kernels with (`schedules.relax_pipeline` implements them), which
targets each runs on, and the default per target: written once, read by the pipeline, the
kernel-schedule pass, the search's proposer and the command line."""

from __future__ import annotations

SCHEDULES = ("tvm-default", "nt-gemv", "skinny-mma", "cpu-nt")
DEFAULT = {"llvm": "tvm-default", "cuda": "nt-gemv"}   # by target kind; `default_schedule` adds the arch
FOR_TARGET = {"llvm": ("cpu-nt", "tvm-default"), "cuda": ("skinny-mma", "nt-gemv", "tvm-default")}
FUSES_TRANSPOSES = ("cpu-nt", "nt-gemv", "skinny-mma")    # sets that fold run-time weight transposes away


def sm_version(arch: str | None) -> int:
    """80 for "sm_80", 90 for "sm_90a"; 0 when unknown."""
    digits = "".join(ch for ch in (arch or "").removeprefix("sm_") if ch.isdigit())
    return int(digits) if digits else 0


def runs_on(schedule: str, kind: str, arch: str | None) -> bool:
    """Whether ``schedule`` can run on this target: the one place for the sets' target rules
    (skinny-mma needs bf16 mma.sync, sm_80 or later)."""
    return schedule != "skinny-mma" or (kind == "cuda" and sm_version(arch) >= 80)


def default_schedule(kind: str, arch: str | None = None) -> str:
    """The set a build uses when nothing chose one: on sm_80+ GPUs ``skinny-mma`` (measured on the
    H200 against ``nt-gemv``: batch-1 decode the same, batch 4 / 8 decode 1.3x / 1.5x faster,
    64-node tree verification 1.9x faster; docs/bench-log.md)."""
    if runs_on("skinny-mma", kind, arch):
        return "skinny-mma"
    return DEFAULT[kind]
