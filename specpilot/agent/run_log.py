"""The search's run log (``run.jsonl``: what was proposed, built, measured, adopted) and its
development / held-out requests."""

from __future__ import annotations

import json
import random
from datetime import datetime, timezone
from pathlib import Path


class RunLog:
    """Events of a run, one JSON object a line, appended as they happen; a rerun reads them back to
    resume.  A last line cut short by a crash is dropped (and the file truncated before it)."""

    def __init__(self, path: Path):
        self.path = path
        self.events: list[dict] = []
        if path.is_file():
            good = 0
            with open(path, "rb") as f:
                for raw in f:
                    try:
                        self.events.append(json.loads(raw))
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        break
                    if not raw.endswith(b"\n"):       # a complete record without its newline
                        self.events.pop()
                        break
                    good += len(raw)
            with open(path, "r+b") as f:
                f.truncate(good)

    def add(self, event: str, **data) -> dict:
        rec = {"event": event, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **data}
        self.events.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def find(self, event: str, **match) -> dict | None:
        for e in reversed(self.events):
            if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                return e
        return None


def requests_for(vocab: int, n: int, seed: int, length: tuple[int, int] = (6, 14)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(n)]
