"""The search cycle end to end on the CPU, kept small: real builds in worker processes, real
token forcing, real paired timing, a real SQLite memory.  A fixed proposer (the proposer
interface is pluggable, like the LLM one) offers one change that wins on this toy --
``draft-length{length=1}``: its drafter agrees ~1.3 tokens per verification, so drafting
five costs more than it earns.  Checked: the win is adopted, remembered and sealed; a rerun
on the same directory resumes from its run log without building or measuring again; and the
paper's fault experiment scaled down -- a logit bias from new token 40 on passes development
forcing over 16 tokens, is adopted on speed, and sealed validation over 96 tokens rejects it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpilot.agent.cycle import Search
from specpilot.agent.proposers import Candidate

SPEC = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"
WIN = "draft-length{length=1}"


class FixedProposer:
    name = "fixed"

    def __init__(self, pipelines: list[str]):
        self.pipelines = pipelines

    def propose(self, report, current, context, draft_len, references, tried):
        return [Candidate(p, "overhead", p, 0.5, "fixed for the test") for p in self.pipelines
                if p not in tried and p != str(current)]


def _search(out: Path, memory: Path, **kw) -> Search:
    return Search(SPEC, "llvm", out, rounds=1, workers=1, proposer=FixedProposer([WIN]), memory_path=memory,
                  dev_requests=3, dev_tokens=16, time_tokens=16, sealed_requests=2, sealed_tokens=96, repeats=5,
                  say=lambda *_: None, **kw)


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_search_adopts_seals_remembers_and_resumes(tmp_path):
    out, memory = tmp_path / "s", tmp_path / "memory.sqlite"
    report = _search(out, memory).run()
    assert report["result"] == WIN and report["sealed"]["passed"], report
    assert report["sealed"]["forcing"]["passed"] and report["speedup_vs_stock"]["lcb"] > 0
    assert report["candidate_builds"] == 1 and report["builds_to_result"] == 1
    assert json.loads((out / "final" / "manifest.json").read_text())["pipeline"] == WIN
    assert "PASSED" in (out / "report.md").read_text()
    events = [json.loads(line)["event"] for line in (out / "run.jsonl").read_text().splitlines()]
    assert events.count("built") == 2 and "remembered" in events     # stock + the candidate
    measured = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()
                if json.loads(line)["event"] == "measured"]
    assert all(isinstance(m["base_drift"], float) for m in measured)   # stock's median vs its own A/A run
    from specpilot.memory.store import Memory
    assert [e.pipeline for e in Memory(memory).entries()] == [WIN]

    again = _search(out, memory).run()                                   # resume: everything is in the log
    later = [json.loads(line)["event"] for line in (out / "run.jsonl").read_text().splitlines()]
    assert again["result"] == WIN and later.count("built") == 2 and later.count("measured") == events.count("measured")

    # interrupted after the candidate was built, before it was measured: the resumed run takes the
    # round's proposals from the log (this proposer would propose nothing now, and the memory
    # entry this run left must not come back as reuse), measures the build, adopts, seals
    lines = (out / "run.jsonl").read_text().splitlines()
    cut = max(i for i, line in enumerate(lines[:len(events)]) if json.loads(line)["event"] == "built")
    (out / "run.jsonl").write_text("\n".join(lines[:cut + 1]) + "\n")
    resumed = Search(SPEC, "llvm", out, rounds=1, workers=1, proposer=FixedProposer([]), memory_path=memory,
                     dev_requests=3, dev_tokens=16, time_tokens=16, sealed_requests=2, sealed_tokens=96, repeats=5,
                     say=lambda *_: None).run()
    after = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]
    assert resumed["result"] == WIN and resumed["sealed"]["passed"] and resumed["reused_entries"] == []
    assert [e["event"] for e in after].count("built") == 2
    assert [e["candidate"] for e in after[cut + 1:] if e["event"] == "measured"] == [WIN]

    # interrupted during sealed validation, after its first held-out request: the resume forces
    # only the second one and reaches the same verdict
    lines = (out / "run.jsonl").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "sealed_request")
    (out / "run.jsonl").write_text("\n".join(lines[:first + 1]) + "\n")
    sealed = _search(out, memory).run()
    events = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]
    assert sealed["result"] == WIN and sealed["sealed"]["forcing"]["positions"] == 2 * 96
    assert [e["request"] for e in events if e["event"] == "sealed_request"] == [0, 1]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_a_fault_past_development_forcing_is_caught_by_sealed_validation(tmp_path):
    report = _search(tmp_path / "f", tmp_path / "memory.sqlite", inject_fault=40).run()
    assert report["best_before_sealed"] == WIN          # dev forcing (16 tokens) could not see it; it was faster
    assert report["result"] == "(stock)" and not report["sealed"]["passed"]
    assert "token forcing failed on held-out request" in report["sealed"]["reason"]
    from specpilot.memory.store import Memory
    assert Memory(tmp_path / "memory.sqlite").entries() == []          # a faulty system is never remembered
