"""Pipelines: an ordered list of passes that round-trips as canonical text.

    pipeline := item ("," item)*            e.g.  w12-layout,tree-verify{budget=64}
    item     := NAME ["{" key "=" value ("," key "=" value)* "}"]
    NAME     := [a-z0-9][a-z0-9-]*          value: int | float | true | false | [A-Za-z0-9_.-]+

``str(parse(text))`` is canonical: options in each pass's declared order, defaults omitted,
so ``parse(str(p)) == p`` and equal pipelines have equal text (the memory keys on it).
"""

from __future__ import annotations

import re

from specpilot.errors import SpecPilotError
from specpilot.passes.base import Pass
from specpilot.passes.registry import REGISTRY

_NAME = re.compile(r"[a-z0-9][a-z0-9-]*\Z")


class Pipeline:
    def __init__(self, passes: list[Pass] | tuple[Pass, ...] = ()):
        self.passes = tuple(passes)

    def __iter__(self):
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.passes)

    def __repr__(self) -> str:
        return f"Pipeline({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self.passes == other.passes

    def __hash__(self) -> int:
        return hash(str(self))


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(text: str, registry: dict[str, type[Pass]] | None = None) -> Pipeline:
    """Parse pipeline text; errors say where (column) and what was expected."""
    registry = REGISTRY if registry is None else registry
    text = text.strip()
    if not text:
        return Pipeline()
    passes, i = [], 0

    def fail(message: str, at: int):
        raise SpecPilotError(f"pipeline {text!r}, column {at + 1}: {message}")

    while True:
        m = re.compile(r"\s*([^,{}=\s]+)").match(text, i)
        if not m:
            fail("expected a pass name", i)
        name, start = m.group(1), m.start(1)
        if not _NAME.match(name):
            fail(f"{name!r} is not a pass name (lowercase letters, digits and '-')", start)
        if name not in registry:
            known = ", ".join(sorted(registry)) or "none are registered"
            fail(f"unknown pass {name!r}; known: {known}", start)
        i = m.end()
        values = {}
        if text[i:i + 1] == "{":
            i += 1
            while True:
                kv = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([A-Za-z0-9_.+-]+)\s*").match(text, i)
                if not kv:
                    fail("expected key=value", i)
                if kv.group(1) in values:
                    fail(f"option {kv.group(1)!r} given twice", kv.start(1))
                values[kv.group(1)] = _value(kv.group(2))
                i = kv.end()
                if text[i:i + 1] == ",":
                    i += 1
                    continue
                if text[i:i + 1] == "}":
                    i += 1
                    break
                fail("expected ',' or '}'", i)
        passes.append(registry[name](**values))
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            break
        if text[i] != ",":
            fail("expected ',' between passes", i)
        i += 1
    return Pipeline(passes)
