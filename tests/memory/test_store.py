"""The memory: reproduce-checked entries in SQLite (WAL), concurrent writers, export/import."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specpilot.compiler.build import system_hash
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target
from specpilot.core.errors import SpecPilotError
from specpilot.agent.reproduce import reproduce_hash
from specpilot.memory.store import Applicability, Entry, Memory

SPEC = Path(__file__).parents[2] / "examples" / "tiny-llama.yaml"
SCOPE = Applicability(family="LlamaForCausalLM", hybrid=False, target_kind="llvm", dtype="float32",
                      drafter_kind="model")


def _entry(pipeline: str, source_hash: str, **kw) -> Entry:
    spec = load_spec(SPEC)
    return Entry(pipeline=pipeline, source_hash=source_hash, applicability=SCOPE, target="llvm",
                 spec=spec.model_dump(mode="json"), spec_path=str(SPEC),
                 results={"speedup": 1.5, "lcb": 0.4}, **kw)


@pytest.fixture(scope="module")
def hashes():
    spec, target = load_spec(SPEC), parse_target("llvm")
    return {p: system_hash(spec, target, p) for p in ("draft-length{length=2}", "draft-length{dynamic=true,length=2}")}


def test_entry_stored_only_if_it_reproduces(tmp_path, hashes):
    mem = Memory(tmp_path / "m.sqlite")
    assert mem.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    good = mem.add(_entry("draft-length{length=2}", hashes["draft-length{length=2}"]), reproduce_hash)
    assert good.id == good.key() and good.options == {"draft-length": {"length": 2, "dynamic": False, "min": 1, "step": 1,
                                                                               "priced": False}}
    assert mem.verify(good.id, reproduce_hash) == []
    # a source hash from another system: not stored, and the message says what differed
    with pytest.raises(SpecPilotError, match=r"gives IRModule [0-9a-f]{16}, not the source system's 00000000"):
        mem.add(_entry("draft-length{length=3}", "0" * 16), reproduce_hash)
    # non-canonical text is canonicalized before the check (defaults dropped, options ordered)
    dyn = mem.add(_entry("draft-length{dynamic=true,length=2,min=1}", hashes["draft-length{dynamic=true,length=2}"],
                         dependencies=[good.id]), reproduce_hash)
    assert dyn.pipeline == "draft-length{length=2,dynamic=true}" and mem.verify(dyn.id, reproduce_hash) == []
    # a dependency whose passes the entry lacks, or one that is not stored
    bad = _entry("draft-length{length=2}", hashes["draft-length{length=2}"], dependencies=["feedbeef0000"])
    with pytest.raises(SpecPilotError, match="dependency feedbeef0000 is not in the memory"):
        mem.add(bad, reproduce_hash)
    assert [e.id for e in mem.entries()] == [good.id, dyn.id]
    # tampering with a stored entry: verify reports it
    body = json.loads(mem.db.execute("SELECT body FROM entries WHERE id = ?", (good.id,)).fetchone()[0])
    body["source_hash"] = "1" * 16
    mem.db.execute("UPDATE entries SET body = ? WHERE id = ?", (json.dumps(body), good.id))
    assert any("not the source system's 1111111111111111" in p for p in mem.verify(good.id, reproduce_hash))


def test_export_import_round_trip_and_garbage(tmp_path, hashes):
    src = Memory(tmp_path / "a.sqlite")
    first = src.add(_entry("draft-length{length=2}", hashes["draft-length{length=2}"]), reproduce_hash)
    src.add(_entry("draft-length{length=2,dynamic=true}", hashes["draft-length{dynamic=true,length=2}"],
                   dependencies=[first.id]), reproduce_hash)
    data = src.export()
    data["entries"].reverse()             # dependencies after dependents: import orders them
    dst = Memory(tmp_path / "b.sqlite")
    assert len(dst.import_(json.loads(json.dumps(data)), reproduce_hash)) == 2
    assert [e.pipeline for e in dst.entries()] == [e.pipeline for e in src.entries()]
    with pytest.raises(SpecPilotError, match="not a SpecPilot memory export"):
        dst.import_({"entries": []}, reproduce_hash)
    with pytest.raises(SpecPilotError, match="entry field entries|entry field applicability"):
        dst.import_({"format": "specpilot-memory", "version": 1, "entries": [{"pipeline": "x"}]}, reproduce_hash)
    forged = json.loads(json.dumps(data))
    forged["entries"][0]["pipeline"] = "w12-layout"   # id no longer matches the content
    with pytest.raises(SpecPilotError, match="does not match its pipeline and scope"):
        Memory(tmp_path / "c.sqlite").import_(forged, reproduce_hash)
    evil = json.loads(json.dumps(data))
    evil["entries"] = [evil["entries"][1]]
    evil["entries"][0].update(pipeline="__import__('os').system('true')", id="")
    with pytest.raises(SpecPilotError, match="pipeline does not parse"):
        Memory(tmp_path / "d.sqlite").import_(evil, reproduce_hash)
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(SpecPilotError, match="not a SpecPilot memory"):
        Memory(tmp_path / "junk.sqlite")


def test_concurrent_writers(tmp_path):
    """Four processes add 15 entries each at once (WAL + busy timeout): none is lost."""
    path = tmp_path / "shared.sqlite"
    script = textwrap.dedent(f"""
        import sys
        from specpilot.memory.store import Applicability, Entry, Memory
        scope = Applicability(family="F", hybrid=False, target_kind="llvm", dtype="float32", drafter_kind="ngram")
        mem = Memory({str(path)!r})
        for i in range(15):
            e = Entry(pipeline=f"draft-length{{{{length={{int(sys.argv[1]) * 15 + i + 1}}}}}}", source_hash="h",
                      applicability=scope, target="llvm", spec={{}})
            mem.add(e, reproduce=lambda entry: "h")
    """)
    Memory(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)]) for w in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 60
    lengths = sorted(int(e.pipeline.split("=")[1][:-1]) for e in Memory(path).entries())
    assert lengths == list(range(1, 61))


def test_cli_ls_show_verify(tmp_path, run_cli, hashes):
    path = tmp_path / "m.sqlite"
    e = Memory(path).add(_entry("draft-length{length=2}", hashes["draft-length{length=2}"]), reproduce_hash)
    code, out, _ = run_cli("memory", "ls", "--json", "--memory", path)
    rows = json.loads(out)
    assert code == 0 and rows[0]["id"] == e.id and rows[0]["pipeline"] == "draft-length{length=2}"
    assert rows[0]["applicability"]["family"] == "LlamaForCausalLM" and rows[0]["results"]["speedup"] == 1.5
    assert run_cli("memory", "verify", e.id[:6], "--memory", path)[0] == 0
    code, out, _ = run_cli("memory", "show", e.id, "--json", "--memory", path)
    assert json.loads(out)["source_hash"] == hashes["draft-length{length=2}"]
    code, _, err = run_cli("memory", "show", "zzzz", "--memory", path)
    assert code == 2 and "no entry 'zzzz'" in err
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run_cli("memory", "import", tmp_path / "bad.json", "--memory", path)
    assert code == 2 and "not valid JSON" in err


def test_an_entry_survives_a_killed_writer_in_the_database_file_alone(tmp_path):
    """A search stopped at a time limit (killed, no close) leaves the entry in the database file
    itself: copying the .sqlite without its -wal keeps it."""
    import shutil
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parents[2])!r})
        from tests.memory.test_store import _entry
        from specpilot.memory.store import Memory
        mem = Memory({str(tmp_path / "m.sqlite")!r})
        mem.add(_entry("draft-length{{length=2}}", "ab" * 8), reproduce=lambda e: e.source_hash)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    shutil.copy(tmp_path / "m.sqlite", tmp_path / "copy.sqlite")
    assert [e.pipeline for e in Memory(tmp_path / "copy.sqlite").entries()] == ["draft-length{length=2}"]


@pytest.mark.slow
def test_an_entry_from_a_seeded_gpu_build_reproduces_with_seeded_lowering(tmp_path):
    """A GPU search builds seeded random models without their weights, and a W12 module then
    differs from one lowered with them; the entry records the mode and is checked with it."""
    from specpilot.agent.cycle import Search
    spec_path = Path(__file__).parents[2] / "bench" / "specs" / "tiny-llama-w12-bf16.yaml"
    spec, target = load_spec(spec_path), parse_target("cuda -arch=sm_90")
    search = Search(spec_path, "cuda -arch=sm_90", tmp_path / "s", say=lambda *_: None)
    assert search.params == "seeded" and not search.context.weights_known
    assert Search(SPEC, "llvm", tmp_path / "c", say=lambda *_: None).params == "file"
    smollm2 = Path(__file__).parents[2] / "examples" / "smollm2.yaml"      # a checkpoint: nothing to redraw
    with pytest.raises(SpecPilotError, match="--params seeded needs seeded random models"):
        Search(smollm2, "cuda -arch=sm_90", tmp_path / "x", params="seeded", say=lambda *_: None)
    seeded = system_hash(spec, target, "w12-layout", params="seeded")
    scope = Applicability(family="LlamaForCausalLM", hybrid=False, target_kind="cuda", arch="sm_90", dtype="bfloat16",
                          drafter_kind=spec.drafter.kind)

    def entry(**constraints):
        return Entry(pipeline="w12-layout", source_hash=seeded, applicability=scope, target="cuda -arch=sm_90",
                     spec=spec.model_dump(mode="json"), spec_path=str(spec_path), constraints=constraints)
    mem = Memory(tmp_path / "m.sqlite")
    stored = mem.add(entry(params="seeded"), reproduce_hash)
    assert mem.verify(stored.id, reproduce_hash) == []
    with pytest.raises(SpecPilotError, match="not the source system's"):     # lowered with the weights: another module
        mem.add(entry(), reproduce_hash)


def test_another_database_is_refused_untouched_and_reads_make_no_file(tmp_path, run_cli):
    import hashlib
    import sqlite3
    other = tmp_path / "app.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE users (name TEXT)")
    db.execute("INSERT INTO users VALUES ('ada')")
    db.commit()
    db.close()
    before = hashlib.sha256(other.read_bytes()).hexdigest()
    for args in (("ls",), ("show", "abc"), ("export",)):
        code, _, err = run_cli("memory", *args, "--memory", other)
        assert code == 2 and "not a SpecPilot memory" in err and "left as it was" in err
    assert hashlib.sha256(other.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]        # no -wal / -shm either
    (tmp_path / "junk").write_bytes(b"\x00garbage" * 100)
    assert run_cli("memory", "ls", "--memory", tmp_path / "junk")[0] == 2
    missing = tmp_path / "none.sqlite"
    code, out, _ = run_cli("memory", "ls", "--json", "--memory", missing)
    assert code == 0 and json.loads(out) == [] and not missing.exists()
    code, _, err = run_cli("memory", "show", "abc", "--memory", missing)
    assert code == 2 and "no memory here" in err and not missing.exists()


def test_an_unreadable_row_is_skipped_and_reported(tmp_path, hashes, run_cli):
    path = tmp_path / "m.sqlite"
    mem = Memory(path)
    kept = mem.add(_entry("draft-length{length=2}", hashes["draft-length{length=2}"]), reproduce_hash)
    mem.db.execute("INSERT INTO entries VALUES ('bad1', 'x', 'f', 'llvm', '{\"from\": \"the future\"}', '9', '9')")
    mem.close()
    code, out, err = run_cli("memory", "ls", "--json", "--memory", path)
    assert code == 0 and [r["id"] for r in json.loads(out)] == [kept.id] and "bad1" in err
    code, _, err = run_cli("memory", "show", "bad1", "--memory", path)
    assert code == 2 and "unreadable" in err


def test_the_reproduce_check_tells_tree_budgets_apart():
    """Two tree budgets lower to the same IR; their systems (and memory entries) differ all the same."""
    spec, target = load_spec(SPEC), parse_target("llvm")
    eight, sixteen = (system_hash(spec, target, f"tree-verify{{budget={n}}}") for n in (8, 16))
    assert eight != sixteen == system_hash(spec, target, "tree-verify{budget=16}")
