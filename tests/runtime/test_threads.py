"""A CPU build's cores: physical cores counted from /proc/cpuinfo's (physical id, core id) pairs among
the CPUs the process may use, capped by the cgroup's quota; TVM's pool gets them unless
TVM_NUM_THREADS says otherwise; torch runs a compiled engine's host work on one thread and is
restored after, while stock engines keep its setting."""

from __future__ import annotations

import os

import pytest
import torch

from specpilot.runtime import threads
from specpilot.runtime.systems import from_build
from tests.conftest import TINY_CONFIGS, build_spec


def _cpuinfo(pairs: list[tuple[int, int]]) -> str:
    """/proc/cpuinfo's text for logical CPUs 0.. with these (physical id, core id)."""
    return "\n\n".join(f"processor\t: {i}\nvendor_id\t: x\nphysical id\t: {p}\ncore id\t\t: {c}\nflags\t\t: fpu"
                       for i, (p, c) in enumerate(pairs)) + "\n"


@pytest.mark.parametrize("pairs,cpus,want", [
    ([(0, 0), (0, 1)], {0, 1}, 2),                                  # no SMT: a core each
    ([(0, 0), (0, 1), (0, 0), (0, 1)], {0, 1, 2, 3}, 2),            # two hardware threads a core
    ([(0, 0), (1, 0), (0, 0), (1, 0)], {0, 1, 2, 3}, 2),            # two packages, core 0 each
    ([(0, 0), (0, 1), (0, 2), (0, 0)], {0, 3}, 1),                  # pinned to two threads of one core
    ([(0, 0), (0, 1), (0, 2)], {1, 2}, 2),
])
def test_cpuinfo_counts_distinct_cores_among_the_allowed_cpus(pairs, cpus, want):
    assert threads.cores_in_cpuinfo(cpus, _cpuinfo(pairs)) == want


def test_cpuinfo_without_core_ids_counts_nothing():
    assert threads.cores_in_cpuinfo({0, 1}, "processor\t: 0\nflags\t: fpu\n\nprocessor\t: 1\n") is None


@pytest.mark.parametrize("text,want", [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000", 2),
                                       ("50000 100000", 1), ("", None)])
def test_cgroup_quota_rounds_up(text, want):
    assert threads.quota_cpus(text) == want


def test_physical_cores_reads_the_files_and_takes_the_smaller(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    info, quota = tmp_path / "cpuinfo", tmp_path / "cpu.max"
    info.write_text(_cpuinfo([(0, c % 4) for c in range(8)]))         # 8 threads on 4 cores
    assert threads.physical_cores(info, tmp_path / "none") == 4
    quota.write_text("300000 100000\n")
    assert threads.physical_cores(info, quota) == 3
    assert threads.physical_cores(tmp_path / "none", tmp_path / "none") == 8     # no cpuinfo: the CPUs


def test_tvm_gets_the_cores_unless_told(monkeypatch):
    for name in (threads.TVM_THREADS, threads.OMP_THREADS):     # set first, so teardown restores what was
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    monkeypatch.setattr(threads, "physical_cores", lambda: 6)
    threads.claim_cores_for_tvm()
    assert os.environ[threads.TVM_THREADS] == "6"
    monkeypatch.setenv(threads.TVM_THREADS, "1")
    threads.claim_cores_for_tvm()
    assert os.environ[threads.TVM_THREADS] == "1"
    monkeypatch.delenv(threads.TVM_THREADS)
    monkeypatch.setenv(threads.OMP_THREADS, "3")              # TVM's pool reads it: left to say
    threads.claim_cores_for_tvm()
    assert threads.TVM_THREADS not in os.environ


def test_torch_threads_are_set_inside_and_restored_after_an_error():
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with threads.torch_threads(None):
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            with threads.torch_threads(1):
                assert torch.get_num_threads() == 1
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original)


def test_compiled_engines_of_a_cpu_build_run_torch_on_one_thread(tmp_path):
    spec = {"target": {"architecture": "LlamaForCausalLM", "config": TINY_CONFIGS["LlamaForCausalLM"],
                       "init": {"seed": 2}},
            "drafter": {"kind": "ngram", "draft_len": 3}, "deployment": {"dtype": "float32", "max_seq_len": 128}}
    system = from_build(build_spec(tmp_path, spec))
    seen: dict[str, set[int]] = {}

    def noting(name):
        def hook(pos, logits):
            seen.setdefault(name, set()).add(torch.get_num_threads())
            return logits
        return hook

    original = torch.get_num_threads()
    before = max(2, original)
    torch.set_num_threads(before)
    try:
        for engine in ("compiled", "compiled-spec", "stock"):
            system.generate(engine, [3, 1, 4, 1, 5], 6, logits_hook=noting(engine))
            assert torch.get_num_threads() == before
        run = system.generate_batch("compiled", [[3, 1, 4], [2, 7]], [4, 4], logits_hook=noting("batch"))
        assert len(run) == 2 and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(original)
    assert seen == {"compiled": {1}, "compiled-spec": {1}, "stock": {before}, "batch": {1}}
    assert {n: e.host_threads for n, e in system.engines.items()} == {
        "stock": None, "stock-spec": None, "compiled": 1, "compiled-spec": 1}
