"""Workers that crash or hang are reported and their candidates rejected; the rest go on."""

from __future__ import annotations

import pytest

from specpilot.agent.executor import LocalExecutor


def test_crashed_and_hung_workers_are_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_WORKER_TEST", "1")
    jobs = [{"pipeline": "a", "build_dir": str(tmp_path / "a"), "simulate": "crash"},
            {"pipeline": "b", "build_dir": str(tmp_path / "b"), "simulate": "hang"},
            {"pipeline": "c", "build_dir": str(tmp_path / "c"), "spec": {"target": {}}, "target": "llvm"}]
    import time
    start = time.perf_counter()
    results = LocalExecutor(workers=3, timeout=20).map(jobs)
    crash = next(results)                   # comes back while the hung worker is still running
    assert time.perf_counter() - start < 20
    hang, bad = results
    assert not crash.ok and "exited with status 3" in crash.error
    assert not hang.ok and "hung: killed after 20 s" in hang.error
    assert not bad.ok and "target" in bad.error           # a job the worker cannot build: its message comes back
    assert hang.seconds < 60


@pytest.mark.slow
def test_bf16_candidates_are_forced_with_the_derived_tolerance(tmp_path):
    """A bf16 worker forces against the PyTorch reference with the tolerance stock's own
    arithmetic justifies (not 0, not a constant); a candidate that biases logits still fails.
    A job can ask for a seeded build (what a GPU search of seeded random models does)."""
    from specpilot.agent.executor import run_job
    from tests.conftest import TINY_CONFIGS

    spec = {"target": {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"],
                       "init": {"seed": 3}},
            "drafter": {"kind": "ngram", "draft_len": 4}, "deployment": {"dtype": "bfloat16", "max_seq_len": 160}}
    job = {"spec": spec, "target": "llvm", "engine": "compiled-spec", "prompts": [[4, 8, 15, 16], [23, 42, 7]],
           "max_new": 40}
    good = run_job({**job, "pipeline": "", "build_dir": str(tmp_path / "stock"), "params": "seeded"})
    assert good["ok"], good["error"]
    assert not (tmp_path / "stock" / "params").exists()          # seeded: the engine redrew the weights
    assert 0 < good["forcing"]["tie_tolerance"] < 0.5
    bad = run_job({**job, "pipeline": "logit-bias-fault{after=9}", "build_dir": str(tmp_path / "fault")})
    assert not bad["ok"] and "token forcing failed at request 0" in bad["error"]


def test_a_worker_dies_with_the_search_that_started_it(tmp_path):
    """kill -9 of the process running the executor takes its worker with it (no orphan goes on
    building into a folder a resumed search rebuilds)."""
    import signal
    import subprocess
    import sys
    import time
    code = ("import json, os, sys; from pathlib import Path; from specpilot.agent.executor import LocalExecutor\n"
            "os.environ['SPECPILOT_WORKER_TEST'] = '1'\n"
            f"job = {{'pipeline': 'x', 'build_dir': {str(tmp_path / 'b')!r}, 'simulate': 'hang'}}\n"
            "LocalExecutor(1, timeout=600)._one(job)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], env={**__import__("os").environ})
    deadline = time.time() + 60
    worker = None
    while worker is None and time.time() < deadline:
        out = subprocess.run(["pgrep", "-f", f"specpilot.agent.executor {tmp_path}/b.job/job.json"],
                             capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        worker = pids[0] if pids else None
        time.sleep(0.2)
    assert worker is not None, "the worker did not start"
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            state = open(f"/proc/{worker}/stat").read().split(")")[-1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):      # dead, waiting to be reaped
            return
        time.sleep(0.1)
    pytest.fail("the worker outlived the search that started it")
