"""Building libspecpilot and running its example programs from the tests."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILDS = {"release": (ROOT / "build" / "cpp", ["-DCMAKE_BUILD_TYPE=Release"]),
          "asan": (ROOT / "build" / "cpp-asan", ["-DCMAKE_BUILD_TYPE=Debug", "-DSPECPILOT_SANITIZE=ON"])}


def cpp_programs(kind: str = "release") -> Path:
    """The directory of the example programs of build ``kind`` (`make cpp` / `make cpp-asan` make them;
    here they are brought up to date, one test process at a time).  A missing toolchain fails the
    test with CMake's message: nothing is skipped."""
    out, flags = BUILDS[kind]
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for cmd in (["cmake", "-S", str(ROOT / "cpp"), "-B", str(out), f"-DPython3_EXECUTABLE={sys.executable}", *flags],
                    ["cmake", "--build", str(out), "-j2"]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out / "examples"


def run_generate(programs: Path, build: Path, prompts, engines=(), max_new: int = 32, sampling: dict | None = None,
                 extra=(), env=None, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [str(programs / "specpilot-generate"), str(build), "--max-new-tokens", str(max_new), *extra]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    for e in engines:
        cmd += ["--engine", e]
    for key, value in (sampling or {}).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def generate(programs: Path, build: Path, prompts, engines, max_new: int, sampling: dict | None = None) -> dict:
    """{(engine, prompt index): {"tokens", "accepted"}} from the C++ generate program."""
    proc = run_generate(programs, build, prompts, engines, max_new, sampling)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    return {(r["engine"], r["prompt"]): r for r in runs}
