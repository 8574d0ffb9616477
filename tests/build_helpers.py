"""Helpers for tests that build a spec and check the build against stock by token forcing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def assert_forces_exactly(build_dir: Path, tokens: int, engines=("compiled", "compiled-spec"), vocab: int = 384):
    """Two prompts of odd lengths, stock greedy vs each engine forced onto stock's tokens: every
    position must agree exactly (no excused near-ties: these are fp32 CPU builds)."""
    from specpilot.runtime.forcing import force_requests
    from specpilot.runtime.systems import from_build

    system = from_build(build_dir)
    prompts = [[(13 * i + r) % vocab for i in range(10 + 5 * r)] for r in range(2)]
    stock_runs = [system.generate("stock", p, tokens) for p in prompts]
    for engine in engines:
        runs = [system.generate(engine, p, tokens, force=s.tokens) for p, s in zip(prompts, stock_runs)]
        report = force_requests(stock_runs, runs)
        assert report.passed and not report.excused, (engine, report.first_divergence)


def compile_cli(spec, target: str, out, *extra) -> subprocess.CompletedProcess:
    """`specpilot compile` as a user runs it, in its own process (a CUDA build re-runs itself with the
    stub driver); fails the test with its stderr unless it succeeds."""
    exe = Path(sys.executable).with_name("specpilot")
    env = {k: v for k, v in os.environ.items() if k != "SPECPILOT_CUDA_STUB"}
    proc = subprocess.run([str(exe), "compile", str(spec), "--target", target, "-o", str(out), *extra],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
