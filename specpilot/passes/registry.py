"""The passes SpecPilot knows, by pipeline name: a plain dict filled from an import list.

A new pass is one file in this folder defining one `Pass` subclass, plus one line in
``PASS_CLASSES`` below.
"""

from __future__ import annotations

from specpilot.passes.base import Pass
from specpilot.passes.draft_length import DraftLength
from specpilot.passes.fuse_projections import FuseProjections
from specpilot.passes.gdn_path_recompute import GdnPathRecompute
from specpilot.passes.kernel_schedule import KernelSchedule
from specpilot.passes.logit_bias_fault import LogitBiasFault
from specpilot.passes.nested_int8_view import NestedInt8View
from specpilot.passes.node_budget import NodeBudget
from specpilot.passes.prompt_admission import PromptAdmission
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.two_level_verify import TwoLevelVerify
from specpilot.passes.w12_layout import W12Layout

PASS_CLASSES: tuple[type[Pass], ...] = (FuseProjections, W12Layout, NestedInt8View, TreeVerify, GdnPathRecompute,
                                         TwoLevelVerify, DraftLength, NodeBudget, PromptAdmission, KernelSchedule,
                                         LogitBiasFault)

REGISTRY: dict[str, type[Pass]] = {cls.name: cls for cls in PASS_CLASSES}
