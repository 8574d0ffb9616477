"""Embedding libspecpilot: bad build directories and requests are clear errors through the C API
(never a crash), the library runs clean under AddressSanitizer + UndefinedBehaviorSanitizer, and
the example HTTP server answers concurrent loopback requests with the Python engine's tokens."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import urllib.error
import urllib.request

import pytest

from specpilot.core.sampling import SamplingParams
from specpilot.runtime.threads import physical_cores
from specpilot.runtime.systems import from_build
from tests.conftest import TINY_CONFIGS, build_spec
from tests.cpp.helpers import cpp_programs, generate, run_generate

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    """A Qwen3-family build with an n-gram drafter, tree verification and four KV-cache rows."""
    tmp = tmp_path_factory.mktemp("cpp")
    return build_spec(tmp, {"target": {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"],
                                       "init": {"seed": 2}},
                            "drafter": {"kind": "ngram", "draft_len": 4},
                            "deployment": {"max_seq_len": 128, "max_batch": 4}, "passes": "tree-verify{budget=8}"})


@pytest.fixture(scope="module")
def programs():
    return cpp_programs()


@pytest.fixture(scope="module")
def system(small_build):
    return from_build(small_build)


def _copy(build: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(build, out)
    return out


def _rewrite_manifest(build: Path, change) -> None:
    """Edit manifest.json and re-seal its digest (what an older or foreign build looks like)."""
    path = build / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    (build / "manifest.sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest())


def _corrupt(path: Path, offset: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


BAD_BUILDS = {
    "no manifest": (lambda b: (b / "manifest.json").unlink(), (), "not a build directory"),
    "edited manifest": (lambda b: (b / "manifest.json").write_text((b / "manifest.json").read_text().replace(
        '"max_batch": 4', '"max_batch": 9')), (), "does not match manifest.sha256"),
    "corrupt model.so": (lambda b: _corrupt(b / "model.so"), (), "content hash differs"),
    "garbage model.so": (lambda b: (b / "model.so").write_bytes(b"\x7fELF" + b"\0" * 100), ("--no-verify",), "cannot load"),
    "truncated params": (lambda b: (b / "params" / "params.safetensors").write_bytes(
        (b / "params" / "params.safetensors").read_bytes()[:1000]), ("--no-verify",), "params.safetensors"),
    "garbage params header": (lambda b: (b / "params" / "params.safetensors").write_bytes(
        (64).to_bytes(8, "little") + b"{not json" + b" " * 200), ("--no-verify",), "header is not a JSON object"),
    "missing params": (lambda b: (b / "params" / "params.safetensors").unlink(), (), "missing from the build"),
    "other version": (lambda b: _rewrite_manifest(b, lambda d: d.update(version=3)), (), "build format version 3"),
    "seeded params": (lambda b: _rewrite_manifest(b, lambda d: d.update(params_source="seeded")), (), "--params file"),
    "no caches": (lambda b: _rewrite_manifest(b, lambda d: d.update(caches=None)), (), "compile it again"),
    "missing function": (lambda b: _rewrite_manifest(b, lambda d: d["functions"].append("target_nothing")), (),
                         "has no function target_nothing"),
    "cuda device for a CPU build": (lambda b: None, ("--device", "cuda:0"), "cannot run on a CUDA device"),
    "an unknown CPU level": (lambda b: _rewrite_manifest(b, lambda d: d.update(cpu="x86-64-v9")), (),
                             "unknown CPU level x86-64-v9"),
    "unknown device": (lambda b: None, ("--device", "tpu"), "expected cpu, cuda or cuda:N"),
}


@pytest.mark.parametrize("case", list(BAD_BUILDS))
def test_a_bad_build_is_a_clear_error(case, small_build, programs, tmp_path):
    damage, flags, message = BAD_BUILDS[case]
    build = _copy(small_build, tmp_path)
    damage(build)
    proc = run_generate(programs, build, [PROMPT], ["compiled"], 4, extra=flags)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)       # an error code, not a signal
    assert message in proc.stderr, proc.stderr


BAD_REQUESTS = {
    "token outside the vocabulary": ([[3, 301]], {}, "outside the vocabulary [0, 301)"),
    "negative token": ([[-1]], {}, "outside the vocabulary"),
    "too long": ([PROMPT], {"max-new-tokens": 200}, "exceeds deployment.max_seq_len=128"),
    "no new tokens": ([PROMPT], {"max-new-tokens": 0}, "max_new_tokens must be >= 1"),
    "unknown engine": ([PROMPT], {"engine": "compiled-two-level"}, "unknown engine 'compiled-two-level'"),
    "bad temperature": ([PROMPT], {"temperature": -1}, "temperature"),
    "bad top-p": ([PROMPT], {"temperature": 1, "top-p": 0}, "top_p"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_is_a_clear_error(case, small_build, programs):
    prompts, options, message = BAD_REQUESTS[case]
    extra = [x for k, v in options.items() for x in (f"--{k}", str(v))]
    proc = run_generate(programs, small_build, prompts, (), 4, extra=extra)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_clean_under_address_and_undefined_behaviour_sanitizers(small_build, system):
    """Every engine, greedy and sampled, and a few error paths, in the sanitized build: no report,
    the same tokens."""
    programs = cpp_programs("asan")
    env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=99", "UBSAN_OPTIONS": "print_stacktrace=1"}
    want = system.generate("compiled", PROMPT, 24).tokens
    for sampling in (None, {"temperature": 0.7, "top_k": 20, "seed": 3}):
        proc = subprocess.run([str(programs / "specpilot-generate"), str(small_build), "--prompt-ids",
                               ",".join(map(str, PROMPT)), "--max-new-tokens", "24", "--engine", "compiled",
                               "--engine", "compiled-spec", "--engine", "compiled-tree",
                               *[x for k, v in (sampling or {}).items() for x in (f"--{k.replace('_', '-')}", str(v))]],
                              capture_output=True, text=True, timeout=600, env={**__import__("os").environ, **env})
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "AddressSanitizer" not in proc.stderr and "runtime error:" not in proc.stderr, proc.stderr[-4000:]
        runs = [json.loads(line) for line in proc.stdout.splitlines()]
        assert len(runs) == 3
        if sampling is None:
            assert all(r["tokens"] == want for r in runs)
        else:
            assert len({tuple(r["tokens"]) for r in runs}) == 1
    for prompts, extra in (([[3, 999]], ()), ([PROMPT], ("--device", "cuda:0"))):
        proc = run_generate(programs, small_build, prompts, (), 4, extra=extra, env=env)
        assert proc.returncode == 1 and "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]


def _serve(programs: Path, build: Path, *flags, env: dict | None = None):
    proc = subprocess.Popen([str(programs / "specpilot-server"), str(build), "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if match is None:
        proc.kill()
        raise AssertionError(f"server did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, f"http://127.0.0.1:{match.group(1)}"


def _requests(n: int):
    """n requests of varied prompts, lengths and sampling (a bounded load)."""
    out = []
    for i in range(n):
        body = {"prompt": [(5 * i + 7 * j) % 301 for j in range(3 + i % 7)], "max_tokens": 12 + 3 * (i % 5)}
        if i % 3 == 2:
            body.update(temperature=0.9, top_p=0.95, seed=100 + i)
        out.append(body)
    return out


def _expected(system, body) -> list[int]:
    sampling = SamplingParams(temperature=body["temperature"], top_p=body["top_p"], seed=body["seed"]) \
        if "temperature" in body else None
    return system.generate("compiled", body["prompt"], body["max_tokens"], sampling=sampling).tokens


def _http(url: str, payload: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET, or a POST of ``payload``."""
    request = urllib.request.Request(url, data=payload, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    responses: list = [None] * len(bodies)

    def post(i):
        responses[i] = _http(f"{url}/v1/completions", json.dumps(bodies[i]).encode())

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return responses


def test_a_cpu_build_runs_its_kernels_on_every_core(small_build, programs):
    """Unless TVM_NUM_THREADS or OMP_NUM_THREADS says (the pool reads the first, else the second), the
    runtime gives a CPU build's kernels every physical core, the Python engines' rule
    (`runtime.threads.physical_cores`), where TVM's own default is half the logical CPUs on x86: the count
    the engine reports is the one TVM's pool runs on (runtime.NumThreads)."""
    base = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    for extra, want in (({}, physical_cores()), ({"OMP_NUM_THREADS": "1"}, 1),
                        ({"TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}, 1)):
        proc, url = _serve(programs, small_build, env={**base, **extra})
        try:
            info = _http(f"{url}/v1/models")[1]["data"][0]["specpilot"]
            assert info["cpu_threads"] == want, (extra, info)
            assert info["device"] == "cpu"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["compiled", "compiled-tree"])
def test_server_answers_concurrent_requests_with_the_python_tokens(engine, small_build, programs, system):
    """12 requests at once (the autoregressive engine batches them, up to four rows; the tree engine
    runs them in turn): each answer is the Python engine's tokens for that request alone."""
    proc, url = _serve(programs, small_build, "--engine", engine, "--max-queue", "32")
    try:
        assert _http(f"{url}/health") == (200, {"status": "ok"})
        models = _http(f"{url}/v1/models")[1]
        assert models["data"][0]["specpilot"]["max_batch"] == 4
        bodies = _requests(12)
        responses = _post_all(url, bodies)
        for body, (status, data) in zip(bodies, responses):
            assert status == 200, data
            choice = data["choices"][0]
            assert choice["token_ids"] == _expected(system, body), body
            assert data["usage"]["completion_tokens"] == len(choice["token_ids"])
            assert data["usage"]["prompt_tokens"] == len(body["prompt"])
        bad = {"not json": b"{", "no prompt": json.dumps({"max_tokens": 3}).encode(),
               "text prompt": json.dumps({"prompt": "hello"}).encode(),
               "stream": json.dumps({"prompt": [1, 2], "stream": True}).encode(),
               "out of vocabulary": json.dumps({"prompt": [1, 4000]}).encode(),
               "too long": json.dumps({"prompt": [1, 2], "max_tokens": 500}).encode()}
        for name, payload in bad.items():
            status, data = _http(f"{url}/v1/completions", payload)
            assert status == 400, (name, data)
            assert data["error"]["message"], name
        # still serving after the bad requests
        status, again = _http(f"{url}/v1/completions", json.dumps(bodies[0]).encode())
        assert again["choices"][0]["token_ids"] == _expected(system, bodies[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_readme_example_compiles_and_runs(small_build, programs, system, tmp_path):
    """README "Embedding in C++": its C program, compiled with the link line it gives, prints the
    build's best engine's tokens for its prompt (the Python engine's)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Embedding in C++"):]
    source = section[section.index("```c\n") + 5:section.index("```", section.index("```c\n") + 5)]
    (tmp_path / "demo.c").write_text(source)
    lib = programs.parent
    root = lib.parents[1]
    cc = subprocess.run(["cc", str(tmp_path / "demo.c"), f"-I{root / 'cpp' / 'include'}", f"-L{lib}", "-lspecpilot",
                         f"-Wl,-rpath,{lib}", "-o", str(tmp_path / "demo")], capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    run = subprocess.run([str(tmp_path / "demo"), str(small_build)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert [int(t) for t in run.stdout.split()] == system.generate("compiled-tree", [1, 2, 3, 4], 16).tokens
    missing = subprocess.run([str(tmp_path / "demo"), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 1 and "not a build directory" in missing.stderr


def test_a_seeded_build_runs_once_materialized(programs, tmp_path):
    """`--params seeded` builds make their weights in Python at load time: the C++ runtime refuses
    them, saying how to write them in; `specpilot materialize` does, and the copy gives the
    Python engine's tokens."""
    import yaml

    from tests.build_helpers import compile_cli
    spec = {"target": {"architecture": "LlamaForCausalLM", "config": TINY_CONFIGS["LlamaForCausalLM"], "init": {"seed": 4}},
            "drafter": {"kind": "ngram", "draft_len": 3}, "deployment": {"max_seq_len": 96},
            "passes": "tree-verify{budget=6}"}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(spec))
    compile_cli(tmp_path / "model.yaml", "llvm", tmp_path / "seeded", "--params", "seeded")
    refused = run_generate(programs, tmp_path / "seeded", [PROMPT], (), 8)
    assert refused.returncode == 1 and "specpilot materialize" in refused.stderr, refused.stderr
    exe = Path(sys.executable).with_name("specpilot")
    done = subprocess.run([str(exe), "materialize", str(tmp_path / "seeded"), "-o", str(tmp_path / "file")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    again = subprocess.run([str(exe), "materialize", str(tmp_path / "seeded"), "-o", str(tmp_path / "file")],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "exists" in again.stderr       # nothing overwritten
    want = from_build(tmp_path / "seeded")
    got = generate(programs, tmp_path / "file", [PROMPT, PROMPT[:3]], ["compiled", "compiled-tree"], 24)
    for i, prompt in enumerate([PROMPT, PROMPT[:3]]):
        tokens = want.generate("compiled", prompt, 24).tokens
        assert got[("compiled", i)]["tokens"] == tokens and got[("compiled-tree", i)]["tokens"] == tokens
