"""Executor: candidates are built and checked in separate worker processes.

A job is JSON: the spec, the target, the pipeline, the output directory and the development
requests.  The worker (``python -m specpilot.agent.executor JOB``) builds the candidate and
runs token forcing against stock on the development requests; it writes ``result.json``
and never measures speed (the controller does, `agent.adjudicate`).  Jobs run ``workers`` at a
time (one per GPU, or per CPU slot); a worker that crashes or outlives its timeout is killed,
reported, and its candidate rejected -- the search goes on.  With ``ray`` installed,
`RayExecutor` runs the same job function as Ray tasks, so a search can spread over a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from specpilot.core.files import atomic_write_text


@dataclass
class JobResult:
    pipeline: str
    ok: bool
    build_dir: str
    seconds: float
    forcing: dict | None = None
    ir_hash: str | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return dict(vars(self))


def run_job(job: dict) -> dict:
    """Build one candidate and force it against stock on the development requests."""
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import parse_spec
    from specpilot.core.target import parse_target
    from specpilot.runtime.forcing import force
    from specpilot.runtime.systems import from_build

    if os.environ.get("SPECPILOT_WORKER_TEST") == "1":   # the executor's own tests: a worker that dies or hangs
        if job.get("simulate") == "crash":
            os._exit(3)
        if job.get("simulate") == "hang":
            time.sleep(3600)
    start = time.perf_counter()
    spec = parse_spec({**job["spec"], "passes": ""}, Path(job["spec_path"]) if job.get("spec_path") else None)
    out = Path(job["build_dir"])
    manifest = build(BuildRequest(spec, parse_target(job["target"]), out, passes=job["pipeline"],
                                  params=job.get("params", "file")))
    system = from_build(out)
    engine = job["engine"]
    requests = [(prompt, job["max_new"]) for prompt in job["prompts"]]
    report, _, _ = force(system, engine, requests, job.get("tie_tolerance", "auto"))
    return {"pipeline": job["pipeline"], "ok": report.passed, "build_dir": str(out),
            "seconds": time.perf_counter() - start, "forcing": report.to_dict(), "ir_hash": manifest.ir_hash,
            "error": None if report.passed else f"token forcing failed at request {report.first_divergence.request}, "
                                                f"position {report.first_divergence.position}"}


class LocalExecutor:
    def __init__(self, workers: int = 1, timeout: float = 900.0, workdir: Path | None = None):
        self.workers, self.timeout = max(1, workers), timeout
        self.workdir = Path(workdir) if workdir else None

    def _one(self, job: dict) -> JobResult:
        out = Path(job["build_dir"])
        work = out.parent / f"{out.name}.job"      # beside the build: the build directory is the build's alone
        work.mkdir(parents=True, exist_ok=True)
        job_file, result_file = work / "job.json", work / "result.json"
        job_file.write_text(json.dumps(job))
        result_file.unlink(missing_ok=True)
        start = time.perf_counter()
        log = open(work / "worker.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "specpilot.agent.executor", str(job_file), str(os.getpid())],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return JobResult(job["pipeline"], False, str(out), time.perf_counter() - start,
                             error=f"worker hung: killed after {self.timeout:.0f} s")
        finally:
            log.close()
        seconds = time.perf_counter() - start
        if rc != 0 or not result_file.is_file():
            tail = (work / "worker.log").read_text(errors="replace").strip().splitlines()[-3:]
            return JobResult(job["pipeline"], False, str(out), seconds,
                             error=f"worker exited with status {rc}: {' | '.join(tail) or 'no output'}")
        try:
            data = json.loads(result_file.read_text())
            return JobResult(**{k: data.get(k) for k in ("pipeline", "ok", "build_dir", "forcing", "ir_hash", "error")},
                             seconds=seconds)
        except (json.JSONDecodeError, TypeError) as e:
            return JobResult(job["pipeline"], False, str(out), seconds, error=f"unreadable worker result ({e})")

    def map(self, jobs: list[dict]):
        """Results in job order, each as soon as it and those before it are done (the search
        logs each one then: an interrupted batch keeps its finished builds)."""
        with ThreadPoolExecutor(self.workers) as pool:
            yield from pool.map(self._one, jobs)


class RayExecutor:
    """The same jobs as Ray tasks (``ray`` must be installed; ``address`` joins a cluster).
    Build directories must be on storage every node sees."""

    def __init__(self, address: str | None = None, timeout: float = 900.0):
        import ray   # optional dependency
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        self.task = ray.remote(max_retries=0)(run_job_safely)
        self.timeout = timeout

    def map(self, jobs: list[dict]):
        refs = [self.task.remote(job) for job in jobs]
        for job, ref in zip(jobs, refs):
            start = time.perf_counter()
            try:
                data = self.ray.get(ref, timeout=self.timeout)
                yield JobResult(**{k: data.get(k) for k in ("pipeline", "ok", "build_dir", "forcing", "ir_hash",
                                                            "error")}, seconds=data.get("seconds", 0.0))
            except Exception as e:   # noqa: BLE001 -- a lost node, a crashed task, a timeout: reject, go on
                self.ray.cancel(ref, force=True)
                yield JobResult(job["pipeline"], False, job["build_dir"], time.perf_counter() - start,
                                error=f"ray task failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def make_executor(workers: int, timeout: float = 900.0, backend: str = "local"):
    if backend == "ray":
        return RayExecutor(timeout=timeout)
    return LocalExecutor(workers, timeout)


def run_job_safely(job: dict) -> dict:
    """`run_job`, with any failure returned as a rejected candidate carrying its message (plain
    data: a Ray driver cannot always rebuild a task's exception, and would lose the message)."""
    try:
        return run_job(job)
    except Exception as e:   # noqa: BLE001 -- any failure becomes a rejected candidate, with its message
        return {"pipeline": job["pipeline"], "ok": False, "build_dir": job["build_dir"], "forcing": None,
                "ir_hash": None, "error": f"{type(e).__name__}: {e}"}


def die_with_parent(parent: int) -> None:
    """Linux: this worker gets SIGKILL when the search that started it dies, even by kill -9 -- an
    orphan would go on writing into a folder the resumed search is rebuilding."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_DEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:        # the parent died before the signal was armed
        os._exit(1)


def main() -> None:
    job_file = Path(sys.argv[1])
    if len(sys.argv) > 2:
        die_with_parent(int(sys.argv[2]))
    job = json.loads(job_file.read_text())
    result = run_job_safely(job)
    atomic_write_text(job_file.parent / "result.json", json.dumps(result))


if __name__ == "__main__":
    main()
