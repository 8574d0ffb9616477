"""The grammar of pipeline text, with no knowledge of which passes exist: what the spec, the
memory and the runtime need to read a pipeline without the compiler.

    pipeline := item ("," item)*            e.g.  w12-layout,tree-verify{budget=64}
    item     := NAME ["{" key "=" value ("," key "=" value)* "}"]
    NAME     := [a-z0-9][a-z0-9-]*          value: int | float | true | false | [A-Za-z0-9_.-]+

`specpilot.passes.pipeline.parse` turns the items into typed passes (and canonical text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specpilot.core.errors import SpecPilotError

_NAME = re.compile(r"[a-z0-9][a-z0-9-]*\Z")
_ITEM = re.compile(r"\s*([^,{}=\s]+)")
_OPTION = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([A-Za-z0-9_.+-]+)\s*")


@dataclass(frozen=True)
class PipelineItem:
    name: str
    options: dict = field(default_factory=dict)    # raw values: int, float, bool or str
    column: int = 0                                # where the name starts in the text (0-based)


def option_value(text: str):
    """An option's text as the value it spells: true/false, an int, a float, else the text."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_items(text: str) -> list[PipelineItem]:
    """Split pipeline text into items; errors say where (column) and what was expected."""
    text = text.strip()
    items: list[PipelineItem] = []
    i = 0

    def fail(message: str, at: int):
        raise SpecPilotError(f"pipeline {text!r}, column {at + 1}: {message}")

    while text:
        m = _ITEM.match(text, i)
        if not m:
            fail("expected a pass name", i)
        name, start = m.group(1), m.start(1)
        if not _NAME.match(name):
            fail(f"{name!r} is not a pass name (lowercase letters, digits and '-')", start)
        i, values = m.end(), {}
        if text[i:i + 1] == "{":
            i += 1
            while True:
                kv = _OPTION.match(text, i)
                if not kv:
                    fail("expected key=value", i)
                if kv.group(1) in values:
                    fail(f"option {kv.group(1)!r} given twice", kv.start(1))
                values[kv.group(1)] = option_value(kv.group(2))
                i = kv.end()
                if text[i:i + 1] == ",":
                    i += 1
                    continue
                if text[i:i + 1] == "}":
                    i += 1
                    break
                fail("expected ',' or '}'", i)
        items.append(PipelineItem(name, values, start))
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            break
        if text[i] != ",":
            fail("expected ',' between passes", i)
        i += 1
    return items


def pass_names(text: str) -> list[str]:
    return [item.name for item in parse_items(text)]


TREE_BUDGET_DEFAULT = 64    # tree-verify's `budget` default (the pass declares its option with it)


def tree_budget(text: str) -> int:
    """The tree-verify budget a pipeline text asks for (0 without tree-verify): what the stock reference
    of a spec (no build, no manifest) verifies trees with."""
    for item in parse_items(text):
        if item.name == "tree-verify":
            return int(item.options.get("budget", TREE_BUDGET_DEFAULT))
    return 0
