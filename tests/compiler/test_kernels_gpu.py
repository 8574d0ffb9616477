"""GPU forms of the lowering's TIR kernels, on a machine without a GPU: they are well formed,
bound to blocks and threads, and compile to sm_90 code.  Their numbers are checked on the H200
(bench/tree_verify.py: the GDN recurrence against the PyTorch recurrence; bench/gpu_forcing.py:
whole hybrid builds, chain and tree, against stock)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.compiler.kernels import gated_delta_rule

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dk,dv", [(16, 12), (128, 128), (6, 5)])
def test_gdn_gpu_form_splits_dk_over_threads(dk, dv):
    text = gated_delta_rule(3, dk, dv, keep_states=True, gpu=True, tree=True).script()
    assert '"threadIdx.y"' in text and '"threadIdx.x"' in text and '"blockIdx.x"' in text
    assert "T.alloc_shared(" in text and text.count('tvm_storage_sync("shared"') == 2
    parts = 4 if dk % 4 == 0 else 2 if dk % 2 == 0 else 1
    assert f"T.thread_binding({parts}, thread=\"threadIdx.y\")" in text
    # the CPU form is untouched: a thread per value column, no shared memory
    cpu = gated_delta_rule(3, dk, dv, keep_states=True, gpu=False, tree=True).script()
    assert "shared" not in cpu and "thread_binding" not in cpu


def test_gdn_gpu_forms_compile_to_sm90_code_without_a_gpu(tmp_path):
    from specpilot.compiler.build import cuda_stub_env
    out = tmp_path / "gdn.so"
    code = (
        "import sys, tvm\n"
        "from specpilot.compiler.build import load_cuda_runtime\n"
        "from specpilot.compiler.kernels import gated_delta_rule\n"
        "assert load_cuda_runtime()\n"
        "funcs = {'tree': gated_delta_rule(4, 16, 12, True, True, True), 'chain': gated_delta_rule(4, 16, 12, True, True),\n"
        "         'step': gated_delta_rule(4, 16, 12, False, True)}\n"
        "mod = tvm.IRModule({k: f.with_attr('global_symbol', k) for k, f in funcs.items()})\n"
        "t = tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90'}, host={'kind': 'llvm'})\n"
        "with t:\n"
        "    tvm.compile(mod, target=t).export_library(sys.argv[1])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=cuda_stub_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes().count(b"\x50\xed\x55\xba") >= 1      # a CUDA fatbin
