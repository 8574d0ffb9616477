"""Opt-in (SPECPILOT_RAY=1, `make ray-test`, needs `pip install ray`): the Ray backend runs the
same jobs as Ray tasks on a local Ray instance -- a task whose worker dies, one that hangs past the
timeout and one that cannot build are rejected with their reasons, and a real candidate builds,
passes token forcing and comes back like a local worker's; and on a real local cluster (`ray start`:
a head and two worker nodes on loopback) a candidate whose node is killed comes back rejected."""

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


def test_a_local_cluster_losing_a_worker_node_mid_search(tmp_path, monkeypatch):
    """A head and two worker nodes on loopback (`ray start`); the node running a candidate is killed
    (SIGKILL of its raylet) while it builds: that candidate comes back rejected with the reason, the
    other comes back with its own result, and the executor returns -- the search goes on."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import importlib.util
    import json
    from types import SimpleNamespace
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed (make ray-test installs it)")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    import secrets
    cluster = {"SPECPILOT_WORKER_TEST": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN": secrets.token_hex(32)}       # this cluster's own token, nothing written to ~/.ray
    for key, value in cluster.items():
        monkeypatch.setenv(key, value)
    env = dict(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def raylets() -> set[int]:
        out = subprocess.run(["pgrep", "-f", "raylet/raylet"], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}

    start = ["--disable-usage-stats", "--include-dashboard=false"]
    subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=0", "--node-ip-address=127.0.0.1",
                    *start], env=env, check=True, capture_output=True, timeout=180)
    try:
        head = raylets()
        for _ in range(2):
            subprocess.run([ray_cli, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1",
                            "--node-ip-address=127.0.0.1", "--disable-usage-stats"], env=env, check=True,
                           capture_output=True, timeout=180)
        workers = raylets() - head
        assert len(workers) == 2
        jobs = [{"pipeline": "lost", "build_dir": str(tmp_path / "lost"), "simulate": "hang"},
                {"pipeline": "bad", "build_dir": str(tmp_path / "bad"), "spec": {"target": {}}, "target": "llvm"}]
        # the driver in its own process: Ray reads its auth settings once, at import
        driver = subprocess.Popen([sys.executable, "-c", (
            "import json, sys; from specpilot.agent.executor import RayExecutor\n"
            f"jobs = json.loads({json.dumps(json.dumps(jobs))})\n"
            f"out = [r.__dict__ for r in RayExecutor(address='127.0.0.1:{port}', timeout=300).map(jobs)]\n"
            f"open({str(tmp_path / 'results.json')!r}, 'w').write(json.dumps(out))")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 180
        while not subprocess.run(["pgrep", "-f", "run_job_safely"], capture_output=True).stdout:
            assert time.time() < deadline and driver.poll() is None, "the candidate never started"
            time.sleep(0.5)
        time.sleep(2)
        for pid in workers:                      # the node running the hanging candidate goes down
            os.kill(pid, signal.SIGKILL)
        _, err = driver.communicate(timeout=240)  # well before the 300 s task timeout
        assert driver.returncode == 0, err[-2000:]
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
    results = [SimpleNamespace(**r) for r in json.loads((tmp_path / "results.json").read_text())]
    lost, bad = results
    assert not lost.ok and "ray task failed" in lost.error and "Timeout" not in lost.error, lost.error
    assert not bad.ok and bad.error
