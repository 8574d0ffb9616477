"""--target parsing into TVM 0.27 targets, and the device table."""

from __future__ import annotations

import typing

import pytest

from specpilot.cli import join_target_flags
from specpilot.compiler.build import tvm_target
from specpilot.core.target import DEVICES, TargetSpec, parse_target
from specpilot.core.errors import SpecPilotError


@pytest.mark.parametrize("text,kind,arch,device,compiled", [
    ("llvm", "llvm", None, None, None),
    # Hopper builds compile for sm_90a (wgmma): the same GPUs, their architecture-specific instructions
    ("cuda -arch=sm_90", "cuda", "sm_90", None, "sm_90a"),
    ("cuda -arch=sm_90 -device=h200", "cuda", "sm_90", "H200", "sm_90a"),
    ("cuda -arch=sm_120", "cuda", "sm_120", None, "sm_120"),
    ("cuda -arch=sm_90 -schedule-for=rtxpro6000", "cuda", "sm_90", None, "sm_90a"),
    ('{"kind": "cuda", "arch": "sm_80"}', "cuda", "sm_80", None, "sm_80"),
])
def test_parse(text, kind, arch, device, compiled):
    t = parse_target(text)
    assert (t.kind, t.arch, t.device) == (kind, arch, device)
    assert parse_target(t.text()) == t
    compiled_for = tvm_target(t)
    assert compiled_for.kind.name == kind
    if arch:
        assert str(compiled_for.attrs["arch"]) == compiled


@pytest.mark.parametrize("text,message", [
    ("cuda -arch=sm_75", "unknown arch 'sm_75'; known: sm_80, sm_89, sm_90, sm_100, sm_120"),
    ("cuda", "unknown arch None"),
    ("rocm -arch=gfx90a", "unknown kind 'rocm'"),
    ("cuda -arch=sm_90 -mcpu=x", "unknown flag '-mcpu=x'"),
    ('{"kind": "cuda", "arch": "sm_90", "mcpu": "x86-64-v3"}', "-mcpu is for llvm targets"),
    ("llvm -mcpu=znver4", "unknown -mcpu 'znver4'; known: generic, x86-64-v2, x86-64-v3, x86-64-v4"),
    ("cuda -arch=sm_90 -device=A100", "A100 is sm_80, not sm_90"),
    ("llvm -arch=sm_90", "llvm takes no -arch"),
    ("llvm -schedule-for=H200", "llvm takes no -arch, -device or -schedule-for"),
    ("cuda -arch=sm_120 -schedule-for=H200", "H200's schedules use wgmma, which only sm_90 runs"),
    ("cuda -arch=sm_90 -schedule-for=V100", "unknown device 'V100'"),
    ("{bad json", "not valid JSON"),
    ("", "--target is empty"),
])
def test_bad_targets(text, message):
    with pytest.raises(SpecPilotError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_target(text)


def test_device_table_and_defaults():
    assert parse_target("cuda -arch=sm_90 -device=H200").device_info().measured_copy == pytest.approx(4.13e12)
    assert parse_target("cuda -arch=sm_120").device_info().name == "RTXPRO6000"
    assert parse_target("llvm").device_info() is None
    assert all(d.bandwidth > 0 and d.bf16_flops > 0 and d.sms > 0 for d in DEVICES.values())


def test_device_limits_are_the_cards():
    """Every card's limits are those of its compute capability (CUDA C Programming Guide): the opt-in
    shared memory a block 1 KiB under the SM's, 99 KiB on sm_89 / sm_120, 227 KiB on sm_90 / sm_100;
    each arch's default card is of that arch; wgmma only on sm_90."""
    from specpilot.core.target import DEFAULT_DEVICE, KIB
    for d in DEVICES.values():
        assert d.shared_per_block == d.shared_per_sm - KIB and d.threads_per_block == 1024
        assert d.threads_per_sm in (1536, 2048) and d.l2_bytes >= 32 * KIB * KIB
        assert (d.kernel_forms == "wgmma") == (d.arch == "sm_90")
        assert d.shared_per_block == {"sm_80": 163, "sm_89": 99, "sm_90": 227, "sm_100": 227, "sm_120": 99}[d.arch] * KIB
    assert all(DEVICES[name].arch == arch for arch, name in DEFAULT_DEVICE.items())


def test_schedule_device_and_launch_devices():
    """-schedule-for sizes the kernels for another card; the build must launch on both."""
    t = parse_target("cuda -arch=sm_90 -device=H200 -schedule-for=RTXPRO6000")
    assert t.device_info().name == "H200" and t.schedule_device().name == "RTXPRO6000"
    assert [d.name for d in t.launch_devices()] == ["H200", "RTXPRO6000"]
    assert [d.name for d in parse_target("cuda -arch=sm_89").launch_devices()] == ["L40S"]
    assert parse_target("llvm").launch_devices() == [] and parse_target("llvm").schedule_device() is None
    # TVM's target carries the limits (its static shared memory bound answers dlight's warning)
    attrs = tvm_target(parse_target("cuda -arch=sm_120")).attrs
    assert int(attrs["max_shared_memory_per_block"]) == 48 * 1024
    assert int(attrs["l2_cache_size_bytes"]) == DEVICES["RTXPRO6000"].l2_bytes


def test_unquoted_arch_flag_is_joined():
    assert join_target_flags(["compile", "m.yaml", "--target", "cuda", "-arch=sm_120", "-o", "b"]) == \
        ["compile", "m.yaml", "--target", "cuda -arch=sm_120", "-o", "b"]


def test_cli_unknown_arch_is_one_line(run_cli, tmp_path):
    from pathlib import Path
    spec = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"
    code, _, err = run_cli("compile", spec, "--target", "cuda", "-arch=sm_42", "-o", tmp_path / "b")
    assert code == 2 and err.strip().startswith("error: --target 'cuda -arch=sm_42': unknown arch") and "\n" not in err.strip()


def test_cost_model_says_where_the_kernels_lack_the_cards_tensor_cores():
    """sm_100's tcgen05 has no kernel here (mma.sync runs), and a build sized for another card's
    forms: the peaks carry a note; where the kernels use the card's fastest form, none."""
    from specpilot.core.costs import device_peaks
    assert "tcgen05" in device_peaks("cuda -arch=sm_100")["note"] and "mma.sync" in device_peaks("cuda -arch=sm_100")["note"]
    assert "sized for RTXPRO6000" in device_peaks("cuda -arch=sm_90 -schedule-for=RTXPRO6000")["note"]
    assert all("note" not in device_peaks(f"cuda -arch={a}") for a in ("sm_80", "sm_89", "sm_90", "sm_120"))


def test_cli_device_option_and_devices_command(run_cli, tmp_path):
    import json
    from pathlib import Path
    spec = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"
    code, _, err = run_cli("compile", spec, "--target", "cuda -arch=sm_90 -device=H100", "--device", "H200",
                           "-o", tmp_path / "b")
    assert code == 2 and "--device H200 and --target's -device=H100 disagree" in err
    code, _, err = run_cli("compile", spec, "--target", "cuda -arch=sm_90", "--device", "A100", "-o", tmp_path / "b")
    assert code == 2 and "A100 is sm_80, not sm_90" in err
    code, _, err = run_cli("compile", spec, "--target", "llvm", "--device", "H200", "-o", tmp_path / "b")
    assert code == 2 and "llvm takes no" in err
    code, out, _ = run_cli("devices", "--json")
    table = json.loads(out)
    assert code == 0 and set(table) == set(DEVICES) and table["B200"]["kernel_forms"] == "mma.sync"
    assert table["RTXPRO6000"]["shared_per_block"] == 99 * 1024 and table["H100"]["default_for_arch"]
    code, out, _ = run_cli("devices")
    assert code == 0 and "RTXPRO6000  sm_120" in out


def test_cpu_levels():
    """`llvm` is this CPU's x86-64 level up to v3; -mcpu names a level; each level needs the one below's
    features and its own, read from /proc/cpuinfo's flags."""
    from specpilot.core import cpu_level

    assert parse_target("llvm").cpu == cpu_level.host_level()
    t = parse_target("llvm -mcpu=x86-64-v2")
    assert t.cpu == "x86-64-v2" and parse_target(t.text()) == t
    assert str(tvm_target(t).attrs["mcpu"]) == "x86-64-v2"
    assert "mcpu" not in tvm_target(parse_target("llvm -mcpu=generic")).attrs
    assert parse_target('{"kind": "llvm", "mcpu": "x86-64-v4"}').cpu == "x86-64-v4"
    v3 = frozenset(cpu_level.needs("x86-64-v3"))
    assert set(cpu_level.needs("x86-64-v2")) < v3 and {"avx2", "fma"} <= v3 and "avx512f" not in v3
    assert cpu_level.host_level(features=v3) == "x86-64-v3"
    assert cpu_level.host_level(features=v3 - {"fma"}) == "x86-64-v2"
    assert cpu_level.host_level(features=frozenset({"sse2"})) == "generic"
    assert cpu_level.host_level(cap="x86-64-v4", features=v3 | set(cpu_level.needs("x86-64-v4"))) == "x86-64-v4"
    assert cpu_level.missing("x86-64-v3", v3 - {"avx2", "bmi2"}) == ["avx2", "bmi2"]
    with pytest.raises(SpecPilotError, match="unknown CPU level 'x86-64-v5'"):
        cpu_level.needs("x86-64-v5")
    assert typing.get_args(cpu_level.Level) == cpu_level.LEVELS       # the manifest's field takes each level
    assert TargetSpec("llvm").text() == "llvm"


def test_x86_levels_are_refused_off_x86(monkeypatch):
    from specpilot.core import cpu_level

    monkeypatch.setattr(cpu_level.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_level, "host_features", cpu_level.host_features.__wrapped__)     # uncached
    assert parse_target("llvm -mcpu=generic").cpu == "generic" and parse_target("llvm").cpu == "generic"
    with pytest.raises(SpecPilotError, match="x86-64 levels are for x86-64 hosts"):
        parse_target("llvm -mcpu=x86-64-v3")
