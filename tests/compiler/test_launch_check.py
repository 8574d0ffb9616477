"""The build's launch-limit check (`compiler.launch_check`) and the device table reaching the
schedules: kernels sized for one card are refused for a card with smaller limits, naming the
kernel; the schedules sized for each card fit it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specpilot.compiler.launch_check import KernelUsage, check_usages, usage_summary, violations
from specpilot.core.errors import SpecPilotError
from specpilot.core.target import DEVICES, KIB
from specpilot.schedules.skinny_config import Config, pick
from tests.build_helpers import compile_cli
from tests.kernel_helpers import ROOT

H200, PRO = DEVICES["H200"], DEVICES["RTXPRO6000"]


def test_violations_name_each_limit():
    ok = KernelUsage("k", 256, 4 * KIB, 90 * KIB)
    assert violations(ok, PRO) == [] and violations(ok, H200) == []
    big = KernelUsage("ring", 128, 1024, 140 * KIB)
    assert violations(big, H200) == []
    assert violations(big, PRO) == [f"{140 * KIB + 1024} bytes of shared memory a block (static 1024, dynamic "
                                    f"{140 * KIB}) > RTXPRO6000's {99 * KIB}"]
    assert violations(KernelUsage("t", 2048, 0, 0), H200) == ["2048 threads a block > 1024"]
    assert violations(KernelUsage("s", 64, 49 * KIB, 0), H200) == [f"{49 * KIB} bytes of static shared memory > 49152"]
    assert "not a constant" in violations(KernelUsage("v", None, 0, 0), H200)[0]


def test_check_names_every_kernel_and_card():
    usages = [KernelUsage("gemm_a", 128, 0, 140 * KIB), KernelUsage("fine", 256, 0, 0),
              KernelUsage("gemm_b", 1024, 0, 120 * KIB)]
    with pytest.raises(SpecPilotError, match=r"2 kernel launch limit\(s\) exceeded.*gemm_a on RTXPRO6000.*"
                                             r"gemm_b on RTXPRO6000") as e:
        check_usages(usages, [H200, PRO])
    assert "fine" not in str(e.value)
    check_usages(usages, [H200])
    summary = usage_summary(usages, [H200])
    assert summary["most_shared"] == {"kernel": "gemm_a", "bytes": 140 * KIB} and summary["kernels"] == 3
    assert summary["most_threads"] == {"kernel": "gemm_b", "threads": 1024} and summary["shared_limit"] == 227 * KIB


# Compiles under the launch check in a subprocess with the stub CUDA driver (codegen embeds sm_XX code):
# prints {"summary": ...} or {"error": ...}.
_CHECK = """
import json, sys, tvm
from specpilot.compiler.build import load_cuda_runtime
from specpilot.compiler.launch_check import launch_check
from specpilot.core.errors import SpecPilotError
from specpilot.core.target import DEVICES
from specpilot.schedules.skinny_config import Config
from specpilot.schedules.skinny_kernels import skinny_nt_matmul
assert load_cuda_runtime()
n, k, configs, arch, cards = json.loads(sys.argv[1])
configs = tuple((limit, Config(**c)) for limit, c in configs) if configs else None
gpu = DEVICES["H200" if configs else cards[-1]]     # given configurations: the H200's sizing
func = skinny_nt_matmul(n, k, configs, gpu=gpu).with_attr("global_symbol", "gemm")
check = launch_check([DEVICES[c] for c in cards])
t = tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})
try:
    with t, tvm.transform.PassContext(instruments=[check]):
        tvm.compile(tvm.IRModule({"gemm": func}), target=t)
    print(json.dumps({"summary": check.summary()}))
except Exception as e:
    print(json.dumps({"error": str(check.failure or e)}))
"""


def _compile_checked(n: int, k: int, configs, arch: str, cards: list[str]) -> dict:
    from specpilot.compiler.build import cuda_stub_env
    arg = json.dumps([n, k, [(limit, vars(c)) for limit, c in configs] if configs else None, arch, cards])
    proc = subprocess.run([sys.executable, "-c", _CHECK, arg], env=cuda_stub_env(), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_h200_sized_gemm_is_refused_for_sm120_and_its_own_sizing_builds():
    """The H200 table's mma.sync kernel beyond 32 rows (72 rows x 64 channels, 3 stages: a 102 KiB ring;
    `Config.shared_bytes` also counts the split-K sums, which TVM lays over the ring) launches on the
    H200 but not on an sm_120 card (99 KiB): its build fails before code generation, naming the
    kernel; the same GEMM sized for the sm_120 card builds and fits."""
    h200_65 = ((None, Config(9, 2, 2, 2, 2, stages=3)),)
    ring = 3 * (64 + 72) * 128 * 2
    on_h200 = _compile_checked(128, 512, h200_65, "sm_90a", ["H200"])
    assert on_h200["summary"]["most_shared"]["bytes"] == ring > PRO.shared_per_block, on_h200
    on_pro = _compile_checked(128, 512, h200_65, "sm_120", ["RTXPRO6000"])
    assert "gemm_kernel on RTXPRO6000" in on_pro["error"] and f"{ring} bytes of shared memory" in on_pro["error"], on_pro
    sized = _compile_checked(128, 512, None, "sm_120", ["RTXPRO6000"])
    assert 0 < sized["summary"]["most_shared"]["bytes"] <= PRO.shared_per_block, sized


# the 27B-class hybrid's projections (bench/specs/qwen35-27b-shape-4l*.yaml): (N, K)
SHAPES_27B = [(17408, 5120), (5120, 17408), (34816, 5120), (248320, 5120), (12288, 5120), (1024, 5120),
              (10240, 5120), (6144, 5120), (5120, 6144), (16480, 5120), (48, 5120)]


@pytest.mark.parametrize("card", sorted(DEVICES))
def test_every_card_gets_gemms_within_its_limits(card):
    """For every card, every row range of every 27B-class GEMM takes a configuration whose shared
    memory and threads fit the card (wgmma only where the card has it)."""
    gpu = DEVICES[card]
    for n, k in SHAPES_27B:
        chosen = pick(n, k, wgmma=gpu.kernel_forms == "wgmma", gpu=gpu)
        assert chosen, (n, k)
        for _, cfg in chosen:
            assert cfg.shared_bytes(k) <= gpu.shared_per_block and cfg.threads() <= 1024, (card, n, k, cfg)
            assert not cfg.wgmma or gpu.kernel_forms == "wgmma"


def test_65_row_verification_gemm_for_sm120_within_99_kib():
    """What the H200 table gave every card without wgmma at 33-72 rows (the 27B down projection
    5120 <- 17408: 138 KiB, no launch on sm_120) and what an sm_120 card gets: 32-channel blocks, 96 KiB."""
    h200_65 = dict(pick(5120, 17408, wgmma=False, gpu=H200))[None]
    assert h200_65.shared_bytes(17408) > PRO.shared_per_block
    pro_65 = dict(pick(5120, 17408, wgmma=False, gpu=PRO))[None]
    assert pro_65.block_m() == 72 and pro_65.shared_bytes(17408) == 96 * KIB


def test_gdn_tree_columns_follow_the_card():
    """The 27B-class level-form GDN tree kernel (72 tokens, dk = dv = 128) takes 32 value columns a
    block within the H200's 227 KiB and 16 within sm_120's 99 KiB; with no budget, 32."""
    from specpilot.kernels.gdn_tree import LEVELS_COLUMNS, columns_within, level_sizes
    sizes = lambda lc: level_sizes(72, 128, lc)   # noqa: E731
    assert columns_within(128, LEVELS_COLUMNS, sizes, H200.shared_per_block) == 32
    assert 4 * sum(sizes(32)) > PRO.shared_per_block >= 4 * sum(sizes(16))
    assert columns_within(128, LEVELS_COLUMNS, sizes, PRO.shared_per_block) == 16
    assert columns_within(128, LEVELS_COLUMNS, sizes, None) == 32


@pytest.mark.slow
def test_27b_class_tree_build_for_sm120_passes_the_launch_check(tmp_path):
    """The user's command on the 27B-class hybrid for an sm_120 card: it builds, every kernel within
    99 KiB of shared memory (the manifest records the check), sm_120 code embedded."""
    out = tmp_path / "b"
    compile_cli(ROOT / "bench/specs/qwen35-27b-shape-4l-tree.yaml", "cuda -arch=sm_120", out, "--params", "seeded")
    launch = json.loads((out / "manifest.json").read_text())["launch"]
    assert launch["devices"] == ["RTXPRO6000"] and launch["kernels"] > 100
    assert 0 < launch["most_shared"]["bytes"] <= PRO.shared_per_block
    assert b"sm_120" in (out / "model.so").read_bytes()
