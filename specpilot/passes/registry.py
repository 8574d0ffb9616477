"""The passes SpecPilot knows, by pipeline name: a plain dict filled from an import list.

A new pass is one file in this folder defining one `Pass` subclass, plus one line in
``PASS_CLASSES`` below.  The pass toolkit landed first; the optimizations (w12-layout,
nested-int8-view, tree-verify, gdn-path-recompute, two-level-verify) arrive one file each.
"""

from __future__ import annotations

from specpilot.passes.base import Pass

PASS_CLASSES: tuple[type[Pass], ...] = ()

REGISTRY: dict[str, type[Pass]] = {cls.name: cls for cls in PASS_CLASSES}
