"""Every registered pass is checked for well-formedness around each application in these tests:
its input and its output must be well-formed Relax (TVM's relax tests do the same with a pass
instrument)."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

from specpilot.passes.registry import REGISTRY


def _check(mod, pass_name: str, where: str) -> None:
    if isinstance(mod, tvm.IRModule):
        assert relax.analysis.check_well_formed(mod), f"{pass_name}: {where} is not well-formed Relax"


@pytest.fixture(autouse=True)
def well_formed_around_every_pass(monkeypatch):
    for cls in set(REGISTRY.values()):
        def checked(self, mod, context, _apply=cls.apply):
            _check(mod, self.name, "its input")
            out = _apply(self, mod, context)
            _check(out, self.name, "its output")
            return out
        monkeypatch.setattr(cls, "apply", checked)
