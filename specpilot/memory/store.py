"""The memory of verified pass sequences: one SQLite file (WAL; several worker processes may
write at once).

An entry is one accepted optimization for one kind of deployment:

    pipeline       canonical pipeline text -- the key (with the applicability scope)
    options        every pass's option values, defaults included
    dependencies   ids of the entries it was stacked on (their passes are part of its pipeline)
    constraints    what must hold to use it (token forcing exact / tie tolerance, required passes)
    results        speedup over its baseline with 95 % bounds, noise, token-forcing outcome
    applicability  architecture family, hybrid or not, target kind and arch, dtype, batch
                   range, drafter kind
    untested       scopes nobody has measured (other dtypes, batch sizes, ...)
    source_hash    structural hash of the source system's IRModule (after its pipeline)
    spec, target   the source deployment, so the entry can be re-checked anywhere

It is stored only if applying its pipeline to stock (lowered again from the entry's own spec)
reproduces ``source_hash``, and its dependencies are stored and contained in it.  Nothing
in an entry is ever executed: pipelines are parsed by the pipeline grammar, everything else is
JSON data validated by pydantic.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specpilot.core.errors import SpecPilotError

FORMAT = "specpilot-memory"
VERSION = 1


class Applicability(BaseModel):
    model_config = ConfigDict(extra="forbid")
    family: str                     # the target architecture, e.g. Qwen3_5ForCausalLM
    hybrid: bool
    target_kind: str                # llvm | cuda
    arch: str | None = None         # sm_90, ...
    dtype: str
    batch: tuple[int, int] = (1, 1)
    drafter_kind: str

    def matches(self, other: "Applicability") -> bool:
        """Could an entry scoped ``self`` be tried on a deployment described by ``other``?  Same
        target kind and dtype; other families and drafters are untested scopes the search
        re-measures (and the pipeline must still be legal there)."""
        return self.target_kind == other.target_kind and self.dtype == other.dtype


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = ""
    pipeline: str
    options: dict[str, dict] = Field(default_factory=dict)
    dependencies: list[str] = Field(default_factory=list)
    constraints: dict = Field(default_factory=dict)
    results: dict = Field(default_factory=dict)
    applicability: Applicability
    untested: list[str] = Field(default_factory=list)
    source_hash: str
    spec: dict
    spec_path: str | None = None
    target: str
    created: str = ""
    updated: str = ""

    def key(self) -> str:
        a = self.applicability
        scope = "|".join(str(x) for x in (a.family, a.target_kind, a.arch, a.dtype, a.drafter_kind))
        return hashlib.sha256(f"{self.pipeline}|{scope}".encode()).hexdigest()[:12]


def default_path() -> Path:
    """$SPECPILOT_MEMORY, else the user's data dir ($XDG_DATA_HOME/specpilot/memory.sqlite)."""
    if os.environ.get("SPECPILOT_MEMORY"):
        return Path(os.environ["SPECPILOT_MEMORY"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "specpilot" / "memory.sqlite"


def canonical(pipeline_text: str) -> str:
    from specpilot.passes.pipeline import parse
    return str(parse(pipeline_text))


def pass_options(pipeline_text: str) -> dict[str, dict]:
    from specpilot.passes.pipeline import parse
    return {p.name: dict(p.values) for p in parse(pipeline_text)}


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id TEXT PRIMARY KEY,
    pipeline TEXT NOT NULL,
    family TEXT NOT NULL,
    target_kind TEXT NOT NULL,
    body TEXT NOT NULL,          -- the entry as validated JSON
    created TEXT NOT NULL,
    updated TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_pipeline ON entries (pipeline);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _recognise(path: Path) -> None:
    """Refuse, without writing to it, a file that is not a SpecPilot memory."""
    if not path.is_file():
        raise SpecPilotError(f"{path}: not a file")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        raise SpecPilotError(f"{path}: not a SpecPilot memory ({e}); left as it was") from None
    if meta.get("format") != FORMAT:
        raise SpecPilotError(f"{path}: not a SpecPilot memory (an SQLite database of something else); left as it was")


class Memory:
    """The memory at ``path``.  An existing file is first read read-only and used only if it is a
    SpecPilot memory (another application's database is never altered); a missing one is created
    only with ``create`` (read commands never make files)."""

    def __init__(self, path: Path | str | None = None, create: bool = True):
        self.path = Path(path) if path else default_path()
        if self.path.exists():
            _recognise(self.path)
        elif not create:
            raise SpecPilotError(f"{self.path}: no memory here (nothing has been added to it yet)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(self.path), timeout=60, isolation_level=None)
            self.db.execute("PRAGMA busy_timeout = 60000")
            mode = self.db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise SpecPilotError(f"{self.path}: SQLite would not switch to WAL mode (got {mode})")
            self.db.executescript(_SCHEMA)
            self._write("INSERT OR IGNORE INTO meta VALUES ('format', ?), ('version', ?)", (FORMAT, str(VERSION)))
            meta = dict(self.db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as e:
            raise SpecPilotError(f"{self.path}: not a usable SpecPilot memory ({e})") from None
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise SpecPilotError(f"{self.path}: not a SpecPilot memory of version {VERSION} ({meta})")

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _write(self, sql: str, args=()) -> None:
        for attempt in range(20):    # busy_timeout covers most contention; BEGIN IMMEDIATE races rarely
            try:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.execute(sql, args)
                self.db.execute("COMMIT")
                # fold the write-ahead log into the database file now (best effort: readers may
                # hold it): a search killed at a time limit leaves a file complete on its own
                self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                return
            except sqlite3.OperationalError as e:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise SpecPilotError(f"{self.path}: database stayed locked")

    # ---- reading
    def entries(self) -> list[Entry]:
        """Every readable entry; a row that does not parse (written by a newer SpecPilot, or damaged)
        is reported in ``self.unreadable`` and skipped, never fatal for the others."""
        rows = self.db.execute("SELECT id, body FROM entries ORDER BY created, rowid").fetchall()
        self.unreadable: list[str] = []
        out = []
        for entry_id, body in rows:
            try:
                out.append(Entry.model_validate_json(body))
            except ValidationError as e:
                self.unreadable.append(f"{entry_id}: {e.errors()[0]['msg']}")
        return out

    def get(self, entry_id: str) -> Entry:
        rows = self.db.execute("SELECT id, body FROM entries WHERE id LIKE ?", (entry_id + "%",)).fetchall()
        if not rows:
            raise SpecPilotError(f"{self.path}: no entry {entry_id!r}")
        if len(rows) > 1:
            raise SpecPilotError(f"{self.path}: {entry_id!r} matches {len(rows)} entries; give more of the id")
        try:
            return Entry.model_validate_json(rows[0][1])
        except ValidationError as e:
            raise SpecPilotError(f"{self.path}: entry {rows[0][0]} is unreadable ({e.errors()[0]['msg']})") from None

    def find(self, pipeline: str, scope: Applicability) -> Entry | None:
        for e in self.entries():
            if e.pipeline == canonical(pipeline) and e.applicability == scope:
                return e
        return None

    def applicable(self, scope: Applicability) -> list[Entry]:
        """Entries that may apply to a deployment of this scope, best measured gain first."""
        found = [e for e in self.entries() if e.applicability.matches(scope)]
        return sorted(found, key=lambda e: (-(e.results.get("lcb") or 0.0), e.id))

    # ---- writing
    def check(self, entry: Entry, reproduce: Callable[[Entry], str]) -> list[str]:
        """Why ``entry`` may not be stored (empty: it may)."""
        from specpilot.passes.pipeline import parse

        problems = []
        try:
            names = set(parse(entry.pipeline).names())
        except SpecPilotError as e:
            return [f"pipeline does not parse: {e}"]
        if entry.pipeline != canonical(entry.pipeline):
            problems.append(f"pipeline {entry.pipeline!r} is not canonical ({canonical(entry.pipeline)!r})")
        for dep in entry.dependencies:
            try:
                d = self.get(dep)
            except SpecPilotError:
                problems.append(f"dependency {dep} is not in the memory")
                continue
            missing = set(parse(d.pipeline).names()) - names
            if missing:
                problems.append(f"dependency {dep} ({d.pipeline}) has passes the entry lacks: {', '.join(sorted(missing))}")
        try:
            got = reproduce(entry)
        except SpecPilotError as e:
            return problems + [f"applying the pipeline to stock failed: {e}"]
        if got != entry.source_hash:
            problems.append(f"applying {entry.pipeline!r} to stock gives IRModule {got}, "
                            f"not the source system's {entry.source_hash}")
        return problems

    def add(self, entry: Entry, reproduce: Callable[[Entry], str]) -> Entry:
        """Store (or refresh the results of) a verified entry; raises if it does not reproduce."""
        try:
            entry = entry.model_copy(update={"pipeline": canonical(entry.pipeline)})
        except SpecPilotError as e:
            raise SpecPilotError(f"memory entry not stored: pipeline does not parse: {e}") from None
        entry.options = entry.options or pass_options(entry.pipeline)
        problems = self.check(entry, reproduce)
        if problems:
            raise SpecPilotError(f"memory entry for {entry.pipeline!r} not stored: " + "; ".join(problems))
        now = datetime.now(timezone.utc).isoformat(timespec="microseconds")   # entries() keeps insertion order
        entry.id = entry.id or entry.key()
        old = self.db.execute("SELECT created FROM entries WHERE id = ?", (entry.id,)).fetchone()
        entry.created = old[0] if old else (entry.created or now)
        entry.updated = now
        self._write("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (entry.id, entry.pipeline, entry.applicability.family, entry.applicability.target_kind,
                     entry.model_dump_json(), entry.created, entry.updated))
        return entry

    def verify(self, entry_id: str, reproduce: Callable[[Entry], str]) -> list[str]:
        entry = self.get(entry_id)
        problems = [f"dependency {d} is not in the memory" for d in entry.dependencies
                    if not self.db.execute("SELECT 1 FROM entries WHERE id = ?", (d,)).fetchone()]
        return problems + [p for p in self.check(entry, reproduce) if p not in problems]

    # ---- files
    def export(self) -> dict:
        return {"format": FORMAT, "version": VERSION,
                "entries": [json.loads(e.model_dump_json()) for e in self.entries()]}

    def import_(self, data, reproduce: Callable[[Entry], str]) -> list[Entry]:
        """Validate a whole export file, then store its entries (dependencies first)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise SpecPilotError(f"not a SpecPilot memory export (expected format {FORMAT!r})")
        if data.get("version") != VERSION:
            raise SpecPilotError(f"memory export version {data.get('version')!r}; this SpecPilot reads {VERSION}")
        if not isinstance(data.get("entries"), list):
            raise SpecPilotError("memory export: 'entries' must be a list")
        try:
            entries = [Entry.model_validate(e) for e in data["entries"]]
        except ValidationError as e:
            err = e.errors()[0]
            raise SpecPilotError(f"memory export: entry field {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        for e in entries:
            if e.id and e.id != e.key():
                raise SpecPilotError(f"memory export: entry {e.id} does not match its pipeline and scope "
                                     f"(expected id {e.key()})")
        stored, pending = [], list(entries)
        while pending:
            ready = [e for e in pending if all(self._has(d) for d in e.dependencies)]
            if not ready:
                raise SpecPilotError(f"memory export: entry {pending[0].id} depends on entries that are neither "
                                     "stored nor in the file")
            for e in ready:
                stored.append(self.add(e, reproduce))
                pending.remove(e)
        return stored

    def _has(self, entry_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM entries WHERE id = ?", (entry_id,)).fetchone() is not None
