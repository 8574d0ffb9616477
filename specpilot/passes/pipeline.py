"""Pipelines: an ordered list of typed passes that round-trips as canonical text (the grammar is
`specpilot.core.pipeline_text`).

``str(parse(text))`` is canonical: options in each pass's declared order, defaults omitted,
so ``parse(str(p)) == p`` and equal pipelines have equal text (the memory keys on it).
"""

from __future__ import annotations

from specpilot.core.errors import SpecPilotError
from specpilot.core.pipeline_text import parse_items
from specpilot.passes.base import Pass
from specpilot.passes.registry import REGISTRY


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


def parse(text: str, registry: dict[str, type[Pass]] | None = None) -> Pipeline:
    """Parse pipeline text into typed passes; errors say where (column) and what was expected."""
    registry = REGISTRY if registry is None else registry
    passes = []
    for item in parse_items(text):
        if item.name not in registry:
            known = ", ".join(sorted(registry)) or "none are registered"
            raise SpecPilotError(f"pipeline {text.strip()!r}, column {item.column + 1}: unknown pass {item.name!r}; "
                                 f"known: {known}")
        passes.append(registry[item.name](**item.options))
    return Pipeline(passes)
