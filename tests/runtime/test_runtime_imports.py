"""The runtime side (engine, systems, decoding, profiling) must import without TVM's compiler
parts: a GPU machine runs builds under a runtime-only TVM, where ``tvm.script`` (and with it
every TVMScript kernel and pass) does not load.  Simulated by blocking ``tvm.script``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_runtime_modules_import_without_tvm_script():
    code = ("import sys; sys.modules['tvm.script'] = None; sys.path.insert(0, '.')\n"
            "import specpilot.runtime.systems, specpilot.runtime.engine, specpilot.runtime.profile\n"
            "import specpilot.runtime.reference.view, bench.decode, bench.tree_verify, bench.gpu_forcing\n"
            "from specpilot.core.pipeline_text import tree_budget\n"
            "assert tree_budget('w12-layout,tree-verify{budget=16}') == 16\n"
            "assert 'specpilot.kernels' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
