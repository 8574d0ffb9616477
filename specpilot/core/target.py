"""Targets: what `--target` accepts, turned into TVM 0.27 targets, plus the device table the
cost model reads.

Accepted forms: ``llvm``; ``cuda -arch=sm_90`` (optionally ``-device=H200``); or TVM's JSON
form ``{"kind": "cuda", "arch": "sm_90"}``.  TVM >= 0.24 no longer parses the CLI string
form itself (FACTS.md), so this module does.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from specpilot.core.errors import SpecPilotError


@dataclass(frozen=True)
class Device:
    name: str
    arch: str
    bandwidth: float        # peak DRAM bandwidth, bytes/s (datasheet)
    bf16_flops: float       # peak dense bf16 tensor FLOP/s (datasheet)
    sms: int
    measured_copy: float | None = None    # bytes/s read + written, measured on our machine
    measured_bf16: float | None = None    # FLOP/s of a large bf16 matmul, measured


# Datasheet numbers; the measured ones come from ../shared/design/FACTS.md (H200 machine).
DEVICES = {
    "A100": Device("A100", "sm_80", 2.039e12, 312e12, 108),
    "L40S": Device("L40S", "sm_89", 0.864e12, 362e12, 142),
    "RTX4090": Device("RTX4090", "sm_89", 1.008e12, 165e12, 128),
    "H100": Device("H100", "sm_90", 3.35e12, 989e12, 132),
    "H200": Device("H200", "sm_90", 4.8e12, 989e12, 132, measured_copy=4.13e12, measured_bf16=784e12),
    "B200": Device("B200", "sm_100", 8.0e12, 2250e12, 148),
    "RTXPRO6000": Device("RTXPRO6000", "sm_120", 1.792e12, 504e12, 188),
}
DEFAULT_DEVICE = {"sm_80": "A100", "sm_89": "L40S", "sm_90": "H100", "sm_100": "B200", "sm_120": "RTXPRO6000"}
KNOWN_ARCHS = tuple(DEFAULT_DEVICE)


@dataclass(frozen=True)
class TargetSpec:
    kind: str                  # "llvm" | "cuda"
    arch: str | None = None
    device: str | None = None

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def text(self) -> str:
        if self.kind == "llvm":
            return "llvm"
        return f"cuda -arch={self.arch}" + (f" -device={self.device}" if self.device else "")

    def device_info(self) -> Device | None:
        if self.kind != "cuda":
            return None
        return DEVICES[self.device or DEFAULT_DEVICE[self.arch]]


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
        kind, arch, device = d.get("kind"), d.get("arch"), d.get("device")
    else:
        parts = shlex.split(text)
        if not parts:
            raise SpecPilotError("--target is empty; expected 'llvm' or 'cuda -arch=sm_XX'")
        kind, arch, device = parts[0], None, None
        for flag in parts[1:]:
            key, _, value = flag.lstrip("-").partition("=")
            if key == "arch":
                arch = value
            elif key == "device":
                device = value
            else:
                raise SpecPilotError(f"--target {text!r}: unknown flag {flag!r}; expected -arch=sm_XX [-device=NAME]")
    if kind == "llvm":
        if arch or device:
            raise SpecPilotError(f"--target {text!r}: llvm takes no -arch or -device")
        return TargetSpec("llvm")
    if kind != "cuda":
        raise SpecPilotError(f"--target {text!r}: unknown kind {kind!r}; expected 'llvm' or 'cuda -arch=sm_XX'")
    arch = _check_arch(arch, text)
    if device is not None:
        match = {name.lower(): name for name in DEVICES}.get(device.lower())
        if match is None:
            raise SpecPilotError(f"--target {text!r}: unknown device {device!r}; known: {', '.join(DEVICES)}")
        if DEVICES[match].arch != arch:
            raise SpecPilotError(f"--target {text!r}: {match} is {DEVICES[match].arch}, not {arch}")
        device = match
    return TargetSpec("cuda", arch, device)
