"""bf16 tensor-core matmuls (`schedules.tensor_core`): the rule takes bf16 x bf16 -> float32
matmuls with many rows on sm_80+, uses the bf16 WMMA intrinsics it registers, leaves
everything else to the next rule, and the result compiles to sm_90 code without a GPU.
(Its numbers are checked on the H200 against the float32 product: bench/tree_verify.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import tvm

from specpilot.schedules.tensor_core import BF16Matmul, nt_matmul


def _target(arch: str = "sm_90"):
    return tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})


def test_bf16_matmul_with_many_rows_goes_to_tensor_cores():
    t = _target()
    with t:
        sch = BF16Matmul().apply(nt_matmul(128, 128), t, False)
    assert sch is not None
    text = sch.mod.script()
    assert "wmma.matrix_a" in text and "wmma.matrix_b" in text and "wmma.accumulator" in text
    assert "tvm_mma_sync" in text and "bfloat16" in text


@pytest.mark.parametrize("case", ["fp16", "one row", "old gpu", "small k"])
def test_other_matmuls_are_left_to_the_next_rule(case):
    func = {"fp16": nt_matmul(384, 256, "float16"), "one row": nt_matmul(384, 256, rows=1),
            "old gpu": nt_matmul(384, 256), "small k": nt_matmul(384, 48)}[case]
    t = _target("sm_75" if case == "old gpu" else "sm_90")
    with t:
        assert BF16Matmul().apply(func, t, False) is None


def test_compiles_to_sm90_code_without_a_gpu(tmp_path):
    from specpilot.compiler.build import cuda_stub_env
    out = tmp_path / "mm.so"
    code = (
        "import sys, tvm\n"
        "sys.path.insert(0, 'tests/schedules')\n"
        "from specpilot.compiler.build import load_cuda_runtime\n"
        "from specpilot.schedules.tensor_core import BF16Matmul, nt_matmul\n"
        "from test_tensor_core import _target\n"
        "assert load_cuda_runtime()\n"
        "t = _target()\n"
        "with t:\n"
        "    f = BF16Matmul().apply(nt_matmul(128, 128), t, False).mod['main'].with_attr('global_symbol', 'mm')\n"
        "    tvm.compile(tvm.IRModule({'mm': f}), target=t).export_library(sys.argv[1])\n"
    )
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=cuda_stub_env(), capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes().count(b"\x50\xed\x55\xba") >= 1      # a CUDA fatbin
