"""Acceptance profiles: how many tokens each verification of a real (target, drafter) pair
committed, per request -- what the replay drafter (``drafter: {kind: replay}``) reproduces so that a
projection's acceptance is a measured one while its drafting time is real.

    {"format": "specpilot-acceptance-profile", "version": 1, "source": "...",
     "accepted": [[3, 1, 4, ...], ...],      tokens per verification (accepted drafts + the target's own)
     "confidence": {"right": [[p0, p1, ...], ...], "wrong": [...], "ranks": [2, null, ...],
                    "beyond": [...]}}      optional

``confidence`` (a chain engine's profile): the drafter's ranked probabilities (its top-k, best
first) at each drafted position, pooled by what the target made of it -- accepted (``right``), the
first rejected of its chain (``wrong``, with the rank at which the drafter offered the target's token
there, or None), or drafted past that (``beyond``).  A replay drafter given these pools scores its
proposals as that drafter would have and offers the target's token where it did (`runtime.replay`),
so what ranks by the drafter's confidence, and a tree's other ranks, see a real drafter's.

`specpilot bench --record-profile FILE` writes one from an engine's runs.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_write_text

FORMAT = "specpilot-acceptance-profile"
VERSION = 1
POOLS = ("right", "wrong", "beyond")
DIGITS = 4          # a probability's significant digits in the file
CAP = 1024          # rows kept a pool


def check_accepted(accepted, where: str) -> list[list[int]]:
    """``accepted`` as lists of positive ints, one list per request; a clear error otherwise."""
    if not isinstance(accepted, list) or not accepted:
        raise SpecPilotError(f"{where}: 'accepted' must be a non-empty list of lists, one per request")
    for i, request in enumerate(accepted):
        if not isinstance(request, list) or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1025
                                                    for n in request):
            raise SpecPilotError(f"{where}: request {i}: tokens per verification must be integers in 1..1025")
    return accepted


def check_confidence(confidence, where: str) -> dict:
    """``confidence`` as its pools of ranked probability rows (``right`` and ``wrong`` not empty) and
    the target's rank in each ``wrong`` row (``ranks``: 1..K-1, or None where it was not drafted)."""
    if not isinstance(confidence, dict) or set(confidence) != {*POOLS, "ranks"}:
        raise SpecPilotError(f"{where}: 'confidence' must map {', '.join(POOLS)} to rows of probabilities and "
                             "ranks to the target's rank in each wrong row")
    checked = {pool: _rows(confidence[pool], f"{where}: confidence.{pool}") for pool in POOLS}
    for pool in ("right", "wrong"):
        if not checked[pool]:
            raise SpecPilotError(f"{where}: confidence.{pool} is empty: record a longer run")
    ranks = confidence["ranks"]
    if not isinstance(ranks, list) or len(ranks) != len(checked["wrong"]) or not all(
            r is None or (isinstance(r, int) and not isinstance(r, bool) and 1 <= r < len(row))
            for r, row in zip(ranks, checked["wrong"])):
        raise SpecPilotError(f"{where}: confidence.ranks: one per wrong row, each None or a rank 1..K-1 of it")
    return {**checked, "ranks": list(ranks)}


def _rows(rows, where: str) -> list[list[float]]:
    if not isinstance(rows, list) or not all(
            isinstance(row, list) and row and all(isinstance(p, (int, float)) and not isinstance(p, bool)
                                                  and 0 < p <= 1 for p in row) for row in rows):
        raise SpecPilotError(f"{where}: rows of probabilities in (0, 1] expected")
    return [[float(p) for p in row] for row in rows]


def confidence_pools(accepted: list[list[int]], drafts: list[list[tuple]], cap: int = CAP, seed: int = 0) -> dict:
    """The pools of a chain engine's runs: per request, tokens per verification (``accepted``, the
    prefill's first) and each verification's draft as (log-probability rows, token rows, the target's
    token after its last accepted draft).  A request's last verification is left out (the run may have
    stopped inside it); a pool over ``cap`` rows keeps a seeded sample of them."""
    pools = {pool: [] for pool in POOLS}
    ranks = []
    for counts, verifications in zip(accepted, drafts):
        for committed, (logprobs, tokens, target) in list(zip(counts[1:], verifications))[:-1]:
            rows = [[round_probability(math.exp(v)) for v in row] for row in logprobs]
            kept = committed - 1                  # drafts the target accepted
            pools["right"] += rows[:kept]
            pools["beyond"] += rows[kept + 1:]
            if kept < len(rows):
                pools["wrong"].append(rows[kept])
                ranks.append(tokens[kept].index(target) if target in tokens[kept] else None)
    rng = random.Random(seed)
    for pool in POOLS:
        if len(pools[pool]) > cap:
            keep = sorted(rng.sample(range(len(pools[pool])), cap))
            pools[pool] = [pools[pool][i] for i in keep]
            if pool == "wrong":
                ranks = [ranks[i] for i in keep]
    return {**pools, "ranks": ranks}


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


def read_confidence(path: Path | str) -> dict:
    """A profile's confidence pools; a clear error where it has none."""
    confidence = read_document(path)["confidence"]
    if confidence is None:
        raise SpecPilotError(f"{path}: the profile has no drafter confidences (record one from a chain engine: "
                             "`specpilot bench --engines compiled,compiled-spec --record-profile FILE`)")
    return confidence


def write_profile(path: Path | str, accepted: list[list[int]], source: str,
                  confidence: dict | None = None) -> None:
    check_accepted(accepted, str(path))
    document = {"format": FORMAT, "version": VERSION, "source": source, "accepted": accepted}
    if confidence is not None:
        document["confidence"] = check_confidence(confidence, str(path))
    atomic_write_text(path, json.dumps(document))
