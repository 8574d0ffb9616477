"""Workers that crash or hang are reported and their candidates rejected; the rest go on."""

from __future__ import annotations

from specpilot.agent.executor import LocalExecutor


def test_crashed_and_hung_workers_are_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_WORKER_TEST", "1")
    jobs = [{"pipeline": "a", "build_dir": str(tmp_path / "a"), "simulate": "crash"},
            {"pipeline": "b", "build_dir": str(tmp_path / "b"), "simulate": "hang"},
            {"pipeline": "c", "build_dir": str(tmp_path / "c"), "spec": {"target": {}}, "target": "llvm"}]
    results = LocalExecutor(workers=3, timeout=20).map(jobs)
    crash, hang, bad = results
    assert not crash.ok and "exited with status 3" in crash.error
    assert not hang.ok and "hung: killed after 20 s" in hang.error
    assert not bad.ok and "target" in bad.error           # a job the worker cannot build: its message comes back
    assert hang.seconds < 60
