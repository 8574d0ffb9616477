"""Opt-in (SPECPILOT_RAY=1, `make ray-test`, needs `pip install ray`): the Ray backend runs the
same jobs as Ray tasks on a local Ray instance -- a task whose worker dies, one that hangs past the
timeout and one that cannot build are rejected with their reasons, and a real candidate builds,
passes token forcing and comes back like a local worker's."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.skipif(os.environ.get("SPECPILOT_RAY") != "1",
                                                  reason="opt-in: set SPECPILOT_RAY=1 (and pip install ray)")]


def test_ray_tasks_crash_hang_fail_and_pass(tmp_path, monkeypatch):
    import yaml

    ray = pytest.importorskip("ray")
    from specpilot.agent.executor import RayExecutor, make_executor
    monkeypatch.setenv("SPECPILOT_WORKER_TEST", "1")     # inherited by the local Ray instance's workers
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec_path = os.path.join(root, "examples", "tiny-llama.yaml")
    spec = yaml.safe_load(open(spec_path))
    good = {"pipeline": "", "build_dir": str(tmp_path / "good"), "spec": spec, "spec_path": spec_path,
            "target": "llvm", "engine": "compiled-spec", "prompts": [[5, 17, 42, 9]], "max_new": 16}
    jobs = [{"pipeline": "a", "build_dir": str(tmp_path / "a"), "simulate": "crash"},
            {"pipeline": "b", "build_dir": str(tmp_path / "b"), "simulate": "hang"},
            {"pipeline": "c", "build_dir": str(tmp_path / "c"), "spec": {"target": {}}, "target": "llvm"},
            good]
    try:
        executor = make_executor(1, timeout=150, backend="ray")
        assert isinstance(executor, RayExecutor)
        crash, hang, bad, ok = executor.map(jobs)
    finally:
        ray.shutdown()
    assert not crash.ok and "ray task failed" in crash.error
    assert not hang.ok and "ray task failed" in hang.error and "Timeout" in hang.error
    assert not bad.ok and "target" in bad.error        # the build's own message, not a lost exception
    assert ok.ok and ok.forcing["passed"] and ok.ir_hash and ok.error is None, ok.error
