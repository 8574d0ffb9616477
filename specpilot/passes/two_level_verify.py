"""two-level-verify: a cheap verification proposes, one exact verification decides.

What it changes: nothing in the graph -- it composes functions other passes made.  Each
step, the drafter's best-first tree is first verified with ``target_verify_view`` (the
nested 8-bit view of the W12 weights): the path that view agrees with, plus its own next
token, becomes a proposed chain.  Nothing is accepted and no state moves.  The drafter then
continues from the chain's end, and one exact ``target_verify`` checks the chain with the new
drafts hanging below it as one tree; only that exact pass accepts tokens.  The build records
the pass in its pipeline; the engine (`runtime.decoding.speculative_two_level`) reads it.

When it is legal: with nested-int8-view (the view function) and tree-verify (tree
verification and KV compaction) earlier in the pipeline.
"""

from __future__ import annotations

from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import Pass, PassContext


class TwoLevelVerify(Pass):
    name = "two-level-verify"
    doc = "propose a chain with target_verify_view over the draft tree, then verify chain + new drafts exactly"
    requires = ("nested-int8-view", "tree-verify")
    statistics = ("view_function",)
    manifest_key = "two_level"

    def manifest_entry(self, context: PassContext) -> bool:
        return True

    def legal(self, context: PassContext) -> tuple[bool, str]:
        return True, ""

    def apply(self, mod, context: PassContext):
        if "target_verify_view" not in [gv.name_hint for gv in mod.get_global_vars()]:
            raise SpecPilotError("two-level-verify: the module has no target_verify_view (nested-int8-view makes it)")
        context.statistics[self.name].update(view_function="target_verify_view")
        return mod.clone()   # the graph is unchanged; the manifest's two_level tells the engine
