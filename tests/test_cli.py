"""The `specpilot` command line: generate and verify on the shipped examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HYBRID = EXAMPLES / "tiny-hybrid.yaml"
LLAMA = EXAMPLES / "tiny-llama.yaml"


@pytest.mark.parametrize("spec", [HYBRID, LLAMA], ids=["hybrid", "llama"])
def test_generate_json_spec_equals_stock(run_cli, spec):
    runs = {}
    for engine in ("stock", "stock-spec"):
        code, out, _ = run_cli("generate", spec, "--prompt", "def fibonacci(n):", "--max-new-tokens", 40,
                               "--engine", engine, "--json")
        assert code == 0
        runs[engine] = json.loads(out)
    assert runs["stock"]["tokens"] == runs["stock-spec"]["tokens"]
    assert len(runs["stock"]["tokens"]) == 40
    assert runs["stock"]["mean_accepted"] == 1.0
    assert runs["stock-spec"]["mean_accepted"] >= 1.0
    assert runs["stock-spec"]["tokens_per_s"] > 0


def test_generate_prompt_ids_and_lattice_replay(run_cli, tmp_path):
    lattices = tmp_path / "lat.jsonl"
    args = ("generate", HYBRID, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", 30, "--json")
    code, out, _ = run_cli(*args, "--record-lattices", lattices)
    assert code == 0
    code, replayed, _ = run_cli(*args, "--replay-lattices", lattices)
    assert code == 0
    live, again = json.loads(out), json.loads(replayed)
    assert live["tokens"] == again["tokens"] and live["verifications"] == again["verifications"]


@pytest.mark.slow
def test_verify_passes_and_fault_names_position_32(run_cli):
    code, out, _ = run_cli("verify", HYBRID, "--max-new-tokens", 48)
    assert code == 0 and out.startswith("PASS") and "excused near-ties: 0" in out
    code, out, _ = run_cli("verify", HYBRID, "--max-new-tokens", 48, "--inject-fault-after", 32)
    assert code == 1 and out.startswith("FAIL")
    assert "first divergence: request 0, position 32:" in out and "margin" in out and "context" in out
    code, out, _ = run_cli("verify", HYBRID, "--max-new-tokens", 48, "--inject-fault-after", 32, "--json")
    report = json.loads(out)
    assert code == 1 and not report["passed"] and report["first_divergence"]["position"] == 32


def test_verify_requests_file(run_cli, tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text('{"prompt": "hello"}\n{"prompt_ids": [7, 8, 9], "max_new_tokens": 12}\n')
    code, out, _ = run_cli("verify", LLAMA, "--requests", reqs, "--max-new-tokens", 20, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and report["requests"] == 2 and report["positions"] == 32


@pytest.mark.parametrize("lines,message", [
    ("{oops\n", "reqs.jsonl:1: not valid JSON"),
    ('{"prompt": 3}\n', "'prompt' must be a string"),
    ('{"prompt_ids": [1, "a"]}\n', "'prompt_ids' must be a list of integers"),
    ('{"prompt": "a", "prompt_ids": [1]}\n', "expected an object with 'prompt'"),
    ('{"prompt_ids": [1], "max_new_tokens": 0}\n', "'max_new_tokens' must be a positive integer"),
    ('{"prompt_ids": [100000]}\n', "prompt token 100000 is outside the vocabulary"),
    ("\n", "no requests"),
])
def test_bad_requests_file(run_cli, tmp_path, lines, message):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(lines)
    code, _, err = run_cli("verify", LLAMA, "--requests", reqs)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (("--prompt-ids", "1,x"), "expected comma-separated integers"),
    (("--prompt", "a", "--prompt-ids", "1"), "exactly one of --prompt or --prompt-ids"),
    ((), "exactly one of --prompt or --prompt-ids"),
    (("--prompt-ids", "1", "--max-new-tokens", 5000), "exceeds deployment.max_seq_len=1024"),
])
def test_bad_generate_arguments(run_cli, args, message):
    code, _, err = run_cli("generate", LLAMA, *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_directory_without_a_build_is_refused_clearly(run_cli, tmp_path):
    code, _, err = run_cli("generate", tmp_path, "--prompt-ids", "1")
    assert code == 2 and "not a build directory (no manifest.json)" in err


def test_console_script_runs_as_a_process():
    exe = Path(sys.executable).with_name("specpilot")
    proc = subprocess.run([str(exe), "verify", str(LLAMA), "--max-new-tokens", "16", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["passed"] is True


def test_an_unexpected_fault_is_one_line_and_exit_2(run_cli, monkeypatch):
    import specpilot.cli as cli_module

    def broken(_):
        raise ValueError("boom\n" + "x" * 5000)
    monkeypatch.setattr(cli_module, "_load_system", broken)
    code, out, err = run_cli("generate", "examples/tiny-llama.yaml", "--prompt-ids", "1,2")
    assert code == 2 and err.startswith("error: ValueError: boom") and "Traceback" not in err
    assert len(err.splitlines()) == 1 and len(err) < 500
    monkeypatch.setenv("SPECPILOT_DEBUG", "1")
    with pytest.raises(ValueError):
        run_cli("generate", "examples/tiny-llama.yaml", "--prompt-ids", "1,2")


def test_verbose_and_quiet_are_global(run_cli, monkeypatch):
    import specpilot.cli as cli_module

    def broken(_):
        raise ValueError("boom")
    monkeypatch.setattr(cli_module, "_load_system", broken)
    monkeypatch.delenv("SPECPILOT_DEBUG", raising=False)
    with pytest.raises(ValueError):
        run_cli("--verbose", "generate", "examples/tiny-llama.yaml", "--prompt-ids", "1,2")
    monkeypatch.delenv("SPECPILOT_DEBUG", raising=False)
    code, _, err = run_cli("-q", "generate", "examples/tiny-llama.yaml", "--prompt-ids", "1,2")
    assert code == 2 and err.startswith("error: ValueError: boom") and cli_module.OUTPUT["quiet"]
    run_cli("--help")
