"""The search's run log resumes past a record cut short by a crash (kill -9 mid-write)."""

from __future__ import annotations

import json

from specpilot.agent.run_log import RunLog


def test_a_truncated_last_record_is_dropped_and_the_log_goes_on(tmp_path):
    path = tmp_path / "run.jsonl"
    log = RunLog(path)
    log.add("built", pipeline="a")
    log.add("measured", base="", candidate="a")
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"event": "built", "pipel')          # the crash
    resumed = RunLog(path)
    assert [e["event"] for e in resumed.events] == ["built", "measured"] and path.read_bytes() == whole
    resumed.add("sealed", pipeline="a")
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["built", "measured", "sealed"]


def test_a_complete_record_without_its_newline_is_dropped_too(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"event": "built"}\n{"event": "measured"}')
    assert [e["event"] for e in RunLog(path).events] == ["built"]
    assert path.read_bytes() == b'{"event": "built"}\n'
