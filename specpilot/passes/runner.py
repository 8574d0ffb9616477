"""Running a pipeline over an IRModule, with instruments: IR after a pass (print or dump),
per-pass timing and statistics, and a well-formedness check after every pass."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.legality import require_legal
from specpilot.passes.pipeline import Pipeline


@dataclass
class PassRecord:
    name: str
    text: str
    seconds: float
    statistics: dict = field(default_factory=dict)


def run_pipeline(pipeline: Pipeline, mod, context: PassContext,
                 after: Callable[[str, object], None] | None = None) -> tuple[object, list[PassRecord]]:
    """Check legality, then apply each pass in order; ``after(pass_name, mod)`` sees every result."""
    from tvm import relax

    require_legal(pipeline, context)
    records = []
    for p in pipeline:
        start = time.perf_counter()
        context.statistics[p.name] = {}
        out = p.apply(mod, context)
        seconds = time.perf_counter() - start
        if out is mod:
            raise SpecPilotError(f"pass {p.name} returned its input module; passes rewrite a clone")
        if not relax.analysis.check_well_formed(out):
            raise SpecPilotError(f"pass {p.name} produced ill-formed IR")
        mod = out
        # the parameters follow the IR after every pass: a later pass indexes the packed slots
        # this one left (fuse-projections drops slots, w12-layout appends planes)
        context.params = p.transform_params(context.params, context)
        records.append(PassRecord(p.name, str(p), seconds, dict(context.statistics[p.name])))
        if after is not None:
            after(p.name, mod)
    return mod, records
