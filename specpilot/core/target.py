"""Targets: what `--target` accepts, turned into TVM 0.27 targets, plus the device table the
cost model reads.

Accepted forms: ``llvm`` (this CPU's x86-64 level, `core.cpu_level`) or ``llvm -mcpu=x86-64-v2`` (a
level, or ``generic``); ``cuda -arch=sm_90`` (optionally ``-device=H200``, and
``-schedule-for=RTXPRO6000`` to size the kernels for another card while compiling for this arch);
or TVM's JSON form ``{"kind": "cuda", "arch": "sm_90"}`` / ``{"kind": "llvm", "mcpu": "generic"}``.
TVM >= 0.24 no longer parses the CLI string form itself (FACTS.md), so this module does.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from specpilot.core import cpu_level
from specpilot.core.errors import SpecPilotError


KIB, MIB = 1024, 1024 * 1024
STATIC_SHARED = 48 * KIB     # static __shared__ per block, every arch (beyond it only dynamic, opted in)


@dataclass(frozen=True)
class Device:
    """One card: datasheet peaks for the cost model and the limits the schedules and the build's
    launch check size kernels by (CUDA C Programming Guide, "Technical Specifications per Compute
    Capability")."""
    name: str
    arch: str
    bandwidth: float        # peak DRAM bandwidth, bytes/s (datasheet)
    bf16_flops: float       # peak dense bf16 tensor FLOP/s (datasheet)
    sms: int
    shared_per_block: int   # dynamic shared memory a block may opt in to, bytes
    shared_per_sm: int      # shared memory per SM, bytes (each resident block also reserves 1 KiB)
    threads_per_sm: int
    l2_bytes: int
    tensor_cores: str       # the fastest tensor-core instructions: "mma.sync" | "wgmma" | "tcgen05"
    threads_per_block: int = 1024
    registers_per_sm: int = 65536
    measured_copy: float | None = None    # bytes/s read + written, measured on our machine
    measured_bf16: float | None = None    # FLOP/s of a large bf16 matmul, measured

    @property
    def kernel_forms(self) -> str:
        """The tensor-core instructions SpecPilot's GEMM kernels use on this card: wgmma where the
        card has it (sm_90a), mma.sync elsewhere -- Blackwell's tcgen05 has no kernel here yet."""
        return "wgmma" if self.tensor_cores == "wgmma" else "mma.sync"


# Datasheet numbers; the measured ones come from ../shared/design/FACTS.md (H200 machine).
DEVICES = {
    "A100": Device("A100", "sm_80", 2.039e12, 312e12, 108, 163 * KIB, 164 * KIB, 2048, 40 * MIB, "mma.sync"),
    "L40S": Device("L40S", "sm_89", 0.864e12, 362e12, 142, 99 * KIB, 100 * KIB, 1536, 96 * MIB, "mma.sync"),
    "RTX4090": Device("RTX4090", "sm_89", 1.008e12, 165e12, 128, 99 * KIB, 100 * KIB, 1536, 72 * MIB, "mma.sync"),
    "H100": Device("H100", "sm_90", 3.35e12, 989e12, 132, 227 * KIB, 228 * KIB, 2048, 50 * MIB, "wgmma"),
    "H200": Device("H200", "sm_90", 4.8e12, 989e12, 132, 227 * KIB, 228 * KIB, 2048, 50 * MIB, "wgmma",
                   measured_copy=4.13e12, measured_bf16=784e12),
    "B200": Device("B200", "sm_100", 8.0e12, 2250e12, 148, 227 * KIB, 228 * KIB, 2048, 126 * MIB, "tcgen05"),
    "RTXPRO6000": Device("RTXPRO6000", "sm_120", 1.792e12, 504e12, 188, 99 * KIB, 100 * KIB, 1536, 128 * MIB,
                         "mma.sync"),
}
TUNED = DEVICES["H200"]     # the card the kernel tables were measured on (the schedules' default)
DEFAULT_DEVICE = {"sm_80": "A100", "sm_89": "L40S", "sm_90": "H100", "sm_100": "B200", "sm_120": "RTXPRO6000"}
KNOWN_ARCHS = tuple(DEFAULT_DEVICE)


@dataclass(frozen=True)
class TargetSpec:
    kind: str                  # "llvm" | "cuda"
    arch: str | None = None
    device: str | None = None
    schedule_for: str | None = None   # size the schedules for this card, compile for ``arch`` (measuring
                                      # one card's kernel family on another: sm_120's on the H200)
    cpu: str | None = None            # llvm: the x86-64 level the code is built for (`core.cpu_level`)

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def text(self) -> str:
        if self.kind == "llvm":
            return f"llvm -mcpu={self.cpu}" if self.cpu else "llvm"
        return (f"cuda -arch={self.arch}" + (f" -device={self.device}" if self.device else "")
                + (f" -schedule-for={self.schedule_for}" if self.schedule_for else ""))

    def device_info(self) -> Device | None:
        """The card the code runs on (the arch's default card unless -device names one)."""
        if self.kind != "cuda":
            return None
        return DEVICES[self.device or DEFAULT_DEVICE[self.arch]]

    def schedule_device(self) -> Device | None:
        """The card the kernel schedules are sized for: -schedule-for's, else `device_info`."""
        return DEVICES[self.schedule_for] if self.schedule_for else self.device_info()

    def launch_devices(self) -> list[Device]:
        """Every card whose limits the build's kernels must respect."""
        if self.kind != "cuda":
            return []
        return list({d.name: d for d in (self.device_info(), self.schedule_device())}.values())


def compile_arch(arch: str) -> str:
    """The arch TVM compiles for: sm_90 as sm_90a, whose architecture-specific instructions
    (wgmma, used by `schedules.skinny_kernels`) every compute-capability-9.0 GPU (H100, H200) runs;
    code built for sm_90a runs on no other architecture, as sm_90 code runs on none either."""
    return "sm_90a" if arch == "sm_90" else arch


def _check_arch(arch: str | None, given: str) -> str:
    if arch not in KNOWN_ARCHS:
        raise SpecPilotError(f"--target {given!r}: unknown arch {arch!r}; known: {', '.join(KNOWN_ARCHS)}")
    return arch


def parse_target(text: str) -> TargetSpec:
    text = text.strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecPilotError(f"--target: not valid JSON ({e.msg})") from None
        kind, arch, device, schedule_for = d.get("kind"), d.get("arch"), d.get("device"), d.get("schedule-for")
        mcpu = d.get("mcpu")
    else:
        parts = shlex.split(text)
        if not parts:
            raise SpecPilotError("--target is empty; expected 'llvm' or 'cuda -arch=sm_XX'")
        kind, arch, device, schedule_for, mcpu = parts[0], None, None, None, None
        for flag in parts[1:]:
            key, _, value = flag.lstrip("-").partition("=")
            if key == "arch":
                arch = value
            elif key == "device":
                device = value
            elif key == "schedule-for":
                schedule_for = value
            elif key == "mcpu" and kind == "llvm":
                mcpu = value
            else:
                raise SpecPilotError(f"--target {text!r}: unknown flag {flag!r}; expected -arch=sm_XX [-device=NAME] "
                                     "[-schedule-for=NAME] (cuda) or -mcpu=LEVEL (llvm)")
    if kind == "llvm":
        if arch or device or schedule_for:
            raise SpecPilotError(f"--target {text!r}: llvm takes no -arch, -device or -schedule-for")
        if mcpu is not None and mcpu not in cpu_level.LEVELS:
            raise SpecPilotError(f"--target {text!r}: unknown -mcpu {mcpu!r}; known: {', '.join(cpu_level.LEVELS)}")
        if mcpu not in (None, cpu_level.GENERIC) and not cpu_level.on_x86():
            raise SpecPilotError(f"--target {text!r}: x86-64 levels are for x86-64 hosts; this one builds generic code")
        return TargetSpec("llvm", cpu=mcpu or cpu_level.host_level())
    if mcpu is not None:
        raise SpecPilotError(f"--target {text!r}: -mcpu is for llvm targets")
    if kind != "cuda":
        raise SpecPilotError(f"--target {text!r}: unknown kind {kind!r}; expected 'llvm' or 'cuda -arch=sm_XX'")
    arch = _check_arch(arch, text)
    if device is not None:
        device = _device_name(device, text)
        if DEVICES[device].arch != arch:
            raise SpecPilotError(f"--target {text!r}: {device} is {DEVICES[device].arch}, not {arch}")
    if schedule_for is not None:
        schedule_for = _device_name(schedule_for, text)
        if DEVICES[schedule_for].kernel_forms == "wgmma" and arch != "sm_90":
            raise SpecPilotError(f"--target {text!r}: {schedule_for}'s schedules use wgmma, which only sm_90 runs")
    return TargetSpec("cuda", arch, device, schedule_for)


def _device_name(given: str, text: str) -> str:
    match = {name.lower(): name for name in DEVICES}.get(str(given).lower())
    if match is None:
        raise SpecPilotError(f"--target {text!r}: unknown device {given!r}; known: {', '.join(DEVICES)}")
    return match
