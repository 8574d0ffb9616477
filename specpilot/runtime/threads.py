"""How a CPU build's process splits its cores between TVM's kernels and torch's host work.

TVM's thread pool, unless told (``TVM_NUM_THREADS``, else ``OMP_NUM_THREADS``), takes half the
logical CPUs on x86, assuming two hardware threads a core, which leaves half the cores idle on a
machine without SMT (most VMs and containers).  And torch's intra-op threads, busy-waiting between
the host's small ops (argmax, top-k over a logits row), take cores from TVM's workers, which spin
between kernels.  So a CPU build's kernels get every physical core and its host work one torch
thread, while the stock PyTorch engines keep torch's own setting (bench/README "End to end").
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

TVM_THREADS = "TVM_NUM_THREADS"
OMP_THREADS = "OMP_NUM_THREADS"     # TVM's pool reads this one when the first is unset


def cores_in_cpuinfo(cpus: set[int], text: str) -> int | None:
    """Distinct (physical id, core id) among ``cpus`` in /proc/cpuinfo's ``text`` (None without them)."""
    cores, cpu, package = set(), None, None
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            cpu, package = int(value), None
        elif key == "physical id":
            package = value
        elif key == "core id" and cpu in cpus:
            cores.add((package, value))
    return len(cores) or None


def quota_cpus(text: str) -> int | None:
    """The CPUs a cgroup v2 ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD") allows, rounded up (cgroup v1's
    quota files and a parent cgroup's quota are not read)."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def physical_cores(cpuinfo: Path = Path("/proc/cpuinfo"), cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The physical cores this process may run on: the CPUs it is pinned to, one per core where
    /proc/cpuinfo pairs hardware threads, at most the cgroup's CPU quota."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    count = len(cpus)
    if cpuinfo.is_file():
        count = cores_in_cpuinfo(cpus, cpuinfo.read_text(errors="replace")) or count
    if cpu_max.is_file():
        count = min(count, quota_cpus(cpu_max.read_text()) or count)
    return max(1, count)


def claim_cores_for_tvm() -> None:
    """Every physical core to TVM's thread pool, unless ``TVM_NUM_THREADS`` or ``OMP_NUM_THREADS``
    already says; effective before the pool's first parallel kernel (it reads them once)."""
    if TVM_THREADS not in os.environ and OMP_THREADS not in os.environ:
        os.environ[TVM_THREADS] = str(physical_cores())


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``count`` inside the block (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if count is not None and count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
