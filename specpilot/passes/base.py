"""What a pass is: a named IRModule -> IRModule rewrite with typed options, declared
relations to other passes, a legality check, statistics, and optional ahead-of-time
parameter transforms.

A pass subclass declares, as class attributes:

    name         the pipeline-text name, e.g. "tree-verify"
    options      typed `Option`s with defaults, in canonical order
    requires     passes that must also be in the pipeline, earlier
    needs_when   (context flag, pass): that pass must also be present (anywhere) when the flag holds
    conflicts    passes that must not be in the pipeline
    after        passes that, when present, must come earlier (ordering only)
    targets      target kinds it may run for ("llvm", "cuda")
    statistics   names of the numbers ``apply`` reports

and implements ``legal(context) -> (ok, reason)``, optionally ``relations(others)`` (rules on its
options against another present pass's, e.g. a length within a budget), and ``apply(mod, context) -> mod`` (on a
clone: never mutate the input).  Passes keep no global mutable state, so candidates build in
parallel processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specpilot.core.errors import SpecPilotError


@dataclass(frozen=True)
class Option:
    name: str
    type: type           # int, float, bool or str
    default: Any
    doc: str = ""
    choices: tuple = ()

    def coerce(self, value: Any, pass_name: str) -> Any:
        where = f"{pass_name}{{{self.name}=...}}"
        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value in ("true", "false"):
                return value == "true"
            raise SpecPilotError(f"{where}: expected true or false, got {value!r}")
        try:
            if isinstance(value, bool) or (self.type is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError     # true is not a number of nodes
            coerced = self.type(value)
        except (TypeError, ValueError, OverflowError):
            raise SpecPilotError(f"{where}: expected {self.type.__name__}, got {value!r}") from None
        if self.type is int and not -2 ** 31 <= coerced < 2 ** 31:
            raise SpecPilotError(f"{where}: {coerced} is outside the 32-bit range kernels take")
        if self.type is float and not math.isfinite(coerced):
            raise SpecPilotError(f"{where}: expected a finite number, got {value!r}")
        if self.choices and coerced not in self.choices:
            raise SpecPilotError(f"{where}: expected one of {list(self.choices)}, got {coerced!r}")
        return coerced


@dataclass
class PassContext:
    """What legality and rewrites may look at: the deployment and the target, never timings."""
    target_kind: str = "llvm"                 # "llvm" | "cuda"
    arch: str | None = None
    device: str | None = None                 # the card GPU kernels are sized for (`core.target.DEVICES`)
    architecture: str | None = None           # the target model's family
    hybrid: bool = False                      # has Gated DeltaNet layers
    dtype: str = "float32"
    max_batch: int = 1                        # the deployment's sequences at once
    weights_known: bool = True                # False for --params seeded builds
    params: dict = field(default_factory=dict)       # packed parameter name -> value (None: seeded), in packed
                                                     # order; the runner applies each pass's transform_params
    statistics: dict = field(default_factory=dict)   # pass name -> {statistic: value}
    scratch: dict = field(default_factory=dict)      # pass name -> what apply leaves for transform_params


class Pass:
    name: ClassVar[str] = ""
    doc: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()
    needs_when: ClassVar[tuple[tuple[str, str], ...]] = ()   # (context flag, pass): present too when the flag holds
    conflicts: ClassVar[tuple[str, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    targets: ClassVar[tuple[str, ...]] = ("llvm", "cuda")
    statistics: ClassVar[tuple[str, ...]] = ()
    manifest_key: ClassVar[str | None] = None   # a build records `manifest_entry` under this key: the pass's
                                                # effect as the runtime must know it (`core.manifest`)
    proposable: ClassVar[bool] = True     # False: a test instrument the search never proposes

    def __init__(self, **values: Any):
        known = {o.name: o for o in self.options}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise SpecPilotError(f"{self.name}: unknown option {unknown[0]!r}; "
                                 f"options: {', '.join(known) or 'none'}")
        self.values = {o.name: o.coerce(values[o.name], self.name) if o.name in values else o.default
                       for o in self.options}

    def __getitem__(self, option: str) -> Any:
        return self.values[option]

    def legal(self, context: PassContext) -> tuple[bool, str]:
        return True, ""

    def relations(self, others: dict[str, "Pass"]) -> list[tuple[str, str, bool]]:
        """Rules between this pass's options and those of other passes of the pipeline (``others``:
        by name): (the other pass, words, holds) each; they bind when both are present (default: none)."""
        return []

    def apply(self, mod, context: PassContext):
        raise NotImplementedError(f"{self.name} does not implement apply")

    def transform_params(self, params: dict, context: PassContext) -> dict:
        """Ahead-of-time parameter rewrite matching ``apply`` (default: none)."""
        return params

    def manifest_entry(self, context: PassContext):
        """The pass's effect as the runtime must know it, recorded under ``manifest_key`` (None: nothing)."""
        return None

    def __str__(self) -> str:
        changed = [f"{o.name}={_format(self.values[o.name])}" for o in self.options
                   if self.values[o.name] != o.default]
        return self.name + ("{" + ",".join(changed) + "}" if changed else "")

    def __repr__(self) -> str:
        return f"<pass {self}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pass) and self.name == other.name and self.values == other.values

    def __hash__(self) -> int:
        return hash(str(self))


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)
