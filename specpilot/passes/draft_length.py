"""draft-length: a serving-schedule pass -- how many tokens the drafter proposes per verification.

What it changes: no kernel.  It records the draft-length policy in the manifest's
``serving`` section (and as module attributes, so pipelines that differ in it differ in IR
identity); the engine drafts accordingly.  A chain engine drafts that many tokens; a tree engine
in a batch gives each request at most that many nodes a pass (`runtime.draft_schedule`).  With
``dynamic=true`` each request picks its own length every step from the lengths length, length -
step, ... >= min (``length=16,min=8,step=4``: 16, 12 or 8) by its recent acceptance and the
drafter's confidence in its last draft: requests whose drafts keep failing stop paying for long
drafts.  With ``priced=true`` a batched chain engine also cuts each pass's chains to the length with
the most expected tokens a second of pass, from its own passes' measured cost (`runtime.pass_cost`), and
a batched tree engine verifies the prefix of its best-first nodes that buys the most (`pass_cost.tree_nodes`).
Any draft length is lossless -- verification still accepts only the target's own tokens.

Defaults reproduce stock: ``length=0`` means the spec's ``drafter.draft_len`` (with a tree: the tree
budget), fixed.
"""

from __future__ import annotations

from specpilot.passes.base import Option, Pass, PassContext


class DraftLength(Pass):
    name = "draft-length"
    doc = "draft-length policy per verification: fixed length or per-request dynamic (serving schedule)"
    options = (Option("length", int, 0, "tokens drafted per verification (0: the spec's draft_len); the maximum "
                      "when dynamic"),
               Option("dynamic", bool, False, "choose each request's length from its recent acceptance"),
               Option("min", int, 1, "shortest dynamic draft"),
               Option("step", int, 1, "the dynamic lengths are length, length - step, ... >= min"),
               Option("priced", bool, False, "batched passes: each pass's chain length or tree nodes by its "
                      "measured cost"))
    statistics = ("draft_len", "dynamic")
    manifest_key = "serving"

    def manifest_entry(self, context: PassContext) -> dict:
        """The policy; a length of 0 (the spec's draft_len) is filled in by the build."""
        return {"draft_len": self["length"], "draft_dynamic": self["dynamic"], "draft_min": self["min"],
                "draft_step": self["step"], "draft_priced": self["priced"]}

    def relations(self, others: dict[str, Pass]) -> list[tuple[str, str, bool]]:
        tree = others.get("tree-verify")
        if tree is None:
            return []
        return [("tree-verify", f"draft-length: length ({self['length']}) exceeds the tree budget ({tree['budget']}) of tree-verify",
                 self["length"] <= tree["budget"])]

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if not 0 <= self["length"] <= 64:
            return False, f"length must be in 0..64 (0: the spec's draft_len), got {self['length']}"
        if not 1 <= self["min"] <= 64:
            return False, f"min must be in 1..64, got {self['min']}"
        if self["length"] and self["min"] > self["length"]:
            return False, f"min ({self['min']}) exceeds length ({self['length']})"
        if not 1 <= self["step"] <= 64:
            return False, f"step must be in 1..64, got {self['step']}"
        if self["priced"] and context.max_batch < 2:
            return False, "priced: prices batched passes; needs deployment.max_batch >= 2"
        return True, ""

    def apply(self, mod, context: PassContext):
        context.statistics[self.name].update(draft_len=self["length"], dynamic=self["dynamic"])
        mod = (mod.with_attr("specpilot.draft_len", self["length"])
               .with_attr("specpilot.draft_dynamic", int(self["dynamic"]))
               .with_attr("specpilot.draft_min", self["min"]).with_attr("specpilot.draft_step", self["step"]))
        # only where set: pipelines without it keep their IR identity (and the memory's entries theirs)
        return mod.with_attr("specpilot.draft_priced", 1) if self["priced"] else mod
