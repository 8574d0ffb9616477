"""The memory's reproduce check: lower stock from an entry's spec, apply its pipeline, hash the
IRModule.  The agent hands it to `memory.store.Memory` (which imports no compiler)."""

from __future__ import annotations

from pathlib import Path

from specpilot.compiler.build import system_hash
from specpilot.core.errors import SpecPilotError
from specpilot.core.spec import parse_spec
from specpilot.core.target import parse_target
from specpilot.memory.store import Entry


def reproduce_hash(entry: Entry) -> str:
    """Lower stock from the entry's spec, apply its pipeline, hash the IRModule."""
    spec = parse_spec({**entry.spec, "passes": ""}, Path(entry.spec_path) if entry.spec_path else None)
    params = entry.constraints.get("params", "file")     # how the source system was built
    if params not in ("file", "seeded"):
        raise SpecPilotError(f"entry {entry.id}: unknown params mode {params!r}")
    return system_hash(spec, parse_target(entry.target), entry.pipeline, params)
