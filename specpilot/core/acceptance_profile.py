"""Acceptance profiles: how many tokens each verification of a real (target, drafter) pair
committed, per request -- what the replay drafter (``drafter: {kind: replay}``) reproduces so that a
projection's acceptance is a measured one while its drafting time is real.

    {"format": "specpilot-acceptance-profile", "version": 1, "source": "...",
     "accepted": [[3, 1, 4, ...], ...]}      tokens per verification (accepted drafts + the target's own)

`specpilot bench --record-profile FILE` writes one from an engine's runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_write_text

FORMAT = "specpilot-acceptance-profile"
VERSION = 1


def check_accepted(accepted, where: str) -> list[list[int]]:
    """``accepted`` as lists of positive ints, one list per request; a clear error otherwise."""
    if not isinstance(accepted, list) or not accepted:
        raise SpecPilotError(f"{where}: 'accepted' must be a non-empty list of lists, one per request")
    for i, request in enumerate(accepted):
        if not isinstance(request, list) or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1025
                                                    for n in request):
            raise SpecPilotError(f"{where}: request {i}: tokens per verification must be integers in 1..1025")
    return accepted


def read_profile(path: Path | str) -> list[list[int]]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecPilotError(f"{path}: not a readable acceptance profile ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecPilotError(f"{path}: not an acceptance profile (format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise SpecPilotError(f"{path}: acceptance profile version {data.get('version')}, this SpecPilot reads {VERSION}")
    return check_accepted(data.get("accepted"), str(path))


def write_profile(path: Path | str, accepted: list[list[int]], source: str) -> None:
    check_accepted(accepted, str(path))
    atomic_write_text(path, json.dumps({"format": FORMAT, "version": VERSION, "source": source,
                                        "accepted": accepted}))
