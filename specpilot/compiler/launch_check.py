"""The build's launch-limit check: every CUDA kernel a build embeds, checked against the limits of
the cards it is for (`core.target.Device`), so that a build that would fail to launch -- too much
shared memory for the card, too many threads a block -- fails to build instead, naming the kernel.

The kernels are read where TVM hands them to code generation: a pass instrument keeps the last
form of every device function (``calling_conv`` 2) that TVM's TIR pipeline produces, so nothing is
compiled twice.  A kernel's shared memory is its static ``shared`` plus its dynamic
``shared.dyn`` allocations (TVM merges the dynamic ones into one buffer, sized at build time here:
every SpecPilot kernel's ring has a static size); its threads are the product of its
``threadIdx`` extents.  Registers are not checked: TVM marks every kernel ``__launch_bounds__``
with its block size, so ptxas fits the registers to it (spilling rather than failing to launch).
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.core.errors import SpecPilotError
from specpilot.core.target import STATIC_SHARED, Device

DEVICE_KERNEL = 2       # TVM's calling_conv of a kernel launched from the host (kDeviceKernelLaunch)


@dataclass(frozen=True)
class KernelUsage:
    name: str
    threads: int | None         # None: a thread extent that is not a constant
    static_shared: int          # bytes
    dynamic_shared: int         # bytes

    @property
    def shared(self) -> int:
        return self.static_shared + self.dynamic_shared


def launch_check(devices: list[Device]):
    """A TVM pass instrument that checks every device kernel in its final form (after the device's
    last pass before code generation, so before nvcc runs) against ``devices`` (`check_usages`);
    its ``summary()`` is what a manifest records."""
    import tvm
    from tvm.ir.instrument import pass_instrument

    @pass_instrument
    class LaunchCheck:
        def __init__(self):
            self.usages: dict[str, KernelUsage] = {}
            self.failure: SpecPilotError | None = None   # raised again by the caller: TVM rewraps it

        def run_after_pass(self, mod, info):
            if not info.name.endswith("LowerIntrin"):
                return
            found = [kernel_usage(gv.name_hint, func) for gv, func in mod.functions.items()
                     if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None
                     and int(func.attrs.get("calling_conv", 0)) == DEVICE_KERNEL]
            try:
                check_usages(found, devices)
            except SpecPilotError as e:
                self.failure = e
                raise
            self.usages.update((u.name, u) for u in found)

        def summary(self) -> dict:
            return usage_summary(list(self.usages.values()), devices)

    return LaunchCheck()


def _thread_extents(stmt, out: dict) -> None:
    """threadIdx.* -> extent, from the launch attributes at the top of a kernel's body (they are
    never inside loops or branches)."""
    kind = type(stmt).__name__
    if kind == "SeqStmt":
        for item in stmt.seq:
            _thread_extents(item, out)
        return
    if kind == "AttrStmt" and stmt.attr_key == "thread_extent":
        tag = str(getattr(stmt.node, "thread_tag", ""))
        if tag.startswith("threadIdx"):
            out[tag] = int(stmt.value) if hasattr(stmt.value, "value") else None
    if kind in ("AttrStmt", "LetStmt", "Allocate", "DeclBuffer", "AllocBuffer") and getattr(stmt, "body", None) is not None:
        _thread_extents(stmt.body, out)


def kernel_usage(name: str, func) -> KernelUsage:
    """One kernel's threads a block and shared memory (static, dynamic)."""
    from tvm.s_tir.analysis import calculate_allocated_bytes

    sizes = {str(scope): int(b) for scope, b in calculate_allocated_bytes(func)["main"].items()}
    extents: dict[str, int | None] = {}
    _thread_extents(func.body, extents)
    threads: int | None = 1
    for extent in extents.values():
        threads = None if extent is None or threads is None else threads * extent
    return KernelUsage(name, threads, sizes.get("shared", 0), sizes.get("shared.dyn", 0))


def violations(usage: KernelUsage, device: Device) -> list[str]:
    """What about ``usage`` would make its launch fail on ``device`` (empty: it launches)."""
    out = []
    if usage.threads is None:
        out.append("a thread extent that is not a constant (its block size is unknown at build time)")
    elif usage.threads > device.threads_per_block:
        out.append(f"{usage.threads} threads a block > {device.threads_per_block}")
    if usage.static_shared > STATIC_SHARED:
        out.append(f"{usage.static_shared} bytes of static shared memory > {STATIC_SHARED}")
    if usage.shared > device.shared_per_block:
        out.append(f"{usage.shared} bytes of shared memory a block (static {usage.static_shared}, dynamic "
                   f"{usage.dynamic_shared}) > {device.name}'s {device.shared_per_block}")
    return out


def check_usages(usages: list[KernelUsage], devices: list[Device]) -> None:
    """Raises SpecPilotError naming each kernel that would not launch on one of ``devices``, and why."""
    problems = [f"{u.name} on {d.name}: {why}" for d in devices for u in usages for why in violations(u, d)]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise SpecPilotError(f"{len(problems)} kernel launch limit(s) exceeded -- this build would fail to launch: "
                             f"{shown}")


def usage_summary(usages: list[KernelUsage], devices: list[Device]) -> dict:
    """The cards checked, the number of kernels, and the kernels with the most shared memory and threads."""
    most_shared = max(usages, key=lambda u: u.shared, default=None)
    most_threads = max(usages, key=lambda u: u.threads or 0, default=None)
    return {"devices": [d.name for d in devices], "kernels": len(usages),
            "shared_limit": min((d.shared_per_block for d in devices), default=0),
            "most_shared": {"kernel": most_shared.name, "bytes": most_shared.shared} if most_shared else None,
            "most_threads": {"kernel": most_threads.name, "threads": most_threads.threads} if most_threads else None}
