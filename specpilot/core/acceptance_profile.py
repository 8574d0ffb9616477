"""Acceptance profiles: how many tokens each verification of a real (target, drafter) pair
committed, per request -- what the replay drafter (``drafter: {kind: replay}``) reproduces so that a
projection's acceptance is a measured one while its drafting time is real.

    {"format": "specpilot-acceptance-profile", "version": 1, "source": "...",
     "accepted": [[3, 1, 4, ...], ...],      tokens per verification (accepted drafts + the target's own)
     "confidence": {"right": [...], "wrong": [...], "beyond": [...]}}     optional

``confidence`` (a chain engine's profile): the drafter's first-ranked probability at each drafted
position, pooled by what the target made of it -- accepted (``right``), the first rejected of its
chain (``wrong``), or drafted past that (``beyond``).  A replay drafter given these pools scores its
proposals as that drafter would have (`runtime.replay`), so schedules that rank by the drafter's
confidence see a real drafter's, not the replay's certainty.

`specpilot bench --record-profile FILE` writes one from an engine's runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_write_text

FORMAT = "specpilot-acceptance-profile"
VERSION = 1
POOLS = ("right", "wrong", "beyond")
DIGITS = 5          # a probability's significant digits in the file


def check_accepted(accepted, where: str) -> list[list[int]]:
    """``accepted`` as lists of positive ints, one list per request; a clear error otherwise."""
    if not isinstance(accepted, list) or not accepted:
        raise SpecPilotError(f"{where}: 'accepted' must be a non-empty list of lists, one per request")
    for i, request in enumerate(accepted):
        if not isinstance(request, list) or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1025
                                                    for n in request):
            raise SpecPilotError(f"{where}: request {i}: tokens per verification must be integers in 1..1025")
    return accepted


def check_confidence(confidence, where: str) -> dict[str, list[float]]:
    """``confidence`` as its three pools of probabilities in (0, 1] (``right`` and ``wrong`` not empty)."""
    if not isinstance(confidence, dict) or set(confidence) != set(POOLS):
        raise SpecPilotError(f"{where}: 'confidence' must map {', '.join(POOLS)} to lists of probabilities")
    for pool in POOLS:
        values = confidence[pool]
        if not isinstance(values, list) or not all(
                isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1 for p in values):
            raise SpecPilotError(f"{where}: confidence.{pool}: probabilities in (0, 1] expected")
        if not values and pool != "beyond":
            raise SpecPilotError(f"{where}: confidence.{pool} is empty: record a longer run")
    return {pool: [float(p) for p in confidence[pool]] for pool in POOLS}


def confidence_pools(accepted: list[list[int]], scores: list[list[list[float]]]) -> dict[str, list[float]]:
    """The pools of a chain engine's runs: per request, tokens per verification (``accepted``, the
    prefill's first) and the first-ranked log-probabilities of each verification's drafted chain
    (``scores``).  A request's last verification is left out (the run may have stopped inside it)."""
    pools = {pool: [] for pool in POOLS}
    for counts, chains in zip(accepted, scores):
        for committed, chain in list(zip(counts[1:], chains))[:-1]:
            probabilities = [round_probability(math.exp(s)) for s in chain]
            kept = committed - 1                  # drafts the target accepted
            pools["right"] += probabilities[:kept]
            pools["wrong"] += probabilities[kept:kept + 1]
            pools["beyond"] += probabilities[kept + 1:]
    return pools


def round_probability(p: float) -> float:
    return max(float(f"{p:.{DIGITS}g}"), 10.0 ** -DIGITS)


def read_document(path: Path | str) -> dict:
    """A profile file's checked contents: ``accepted``, and ``confidence`` (None where not recorded)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecPilotError(f"{path}: not a readable acceptance profile ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecPilotError(f"{path}: not an acceptance profile (format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise SpecPilotError(f"{path}: acceptance profile version {data.get('version')}, this SpecPilot reads {VERSION}")
    confidence = data.get("confidence")
    return {"accepted": check_accepted(data.get("accepted"), str(path)),
            "confidence": None if confidence is None else check_confidence(confidence, str(path))}


def read_profile(path: Path | str) -> list[list[int]]:
    return read_document(path)["accepted"]


def read_confidence(path: Path | str) -> dict[str, list[float]]:
    """A profile's confidence pools; a clear error where it has none."""
    confidence = read_document(path)["confidence"]
    if confidence is None:
        raise SpecPilotError(f"{path}: the profile has no drafter confidences (record one from a chain engine: "
                             "`specpilot bench --engines compiled,compiled-spec --record-profile FILE`)")
    return confidence


def write_profile(path: Path | str, accepted: list[list[int]], source: str,
                  confidence: dict[str, list[float]] | None = None) -> None:
    check_accepted(accepted, str(path))
    document = {"format": FORMAT, "version": VERSION, "source": source, "accepted": accepted}
    if confidence is not None:
        document["confidence"] = check_confidence(confidence, str(path))
    atomic_write_text(path, json.dumps(document))
