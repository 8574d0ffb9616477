"""--target parsing into TVM 0.27 targets, and the device table."""

from __future__ import annotations

import pytest

from specpilot.cli import _join_target_flags
from specpilot.compiler.build import tvm_target
from specpilot.core.target import DEVICES, parse_target
from specpilot.core.errors import SpecPilotError


@pytest.mark.parametrize("text,kind,arch,device,compiled", [
    ("llvm", "llvm", None, None, None),
    # Hopper builds compile for sm_90a (wgmma): the same GPUs, their architecture-specific instructions
    ("cuda -arch=sm_90", "cuda", "sm_90", None, "sm_90a"),
    ("cuda -arch=sm_90 -device=h200", "cuda", "sm_90", "H200", "sm_90a"),
    ("cuda -arch=sm_120", "cuda", "sm_120", None, "sm_120"),
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
    ("cuda -arch=sm_90 -device=A100", "A100 is sm_80, not sm_90"),
    ("llvm -arch=sm_90", "llvm takes no -arch"),
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


def test_unquoted_arch_flag_is_joined():
    assert _join_target_flags(["compile", "m.yaml", "--target", "cuda", "-arch=sm_120", "-o", "b"]) == \
        ["compile", "m.yaml", "--target", "cuda -arch=sm_120", "-o", "b"]


def test_cli_unknown_arch_is_one_line(run_cli, tmp_path):
    from pathlib import Path
    spec = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"
    code, _, err = run_cli("compile", spec, "--target", "cuda", "-arch=sm_42", "-o", tmp_path / "b")
    assert code == 2 and err.strip().startswith("error: --target 'cuda -arch=sm_42': unknown arch") and "\n" not in err.strip()
