"""node-budget: a batch-schedule pass -- one verification pass of B requests verifies at most N
drafted nodes in all, not B trees of the tree budget each.

What it changes: no kernel.  It records the budget in the manifest (``node_budget``) and as a
module attribute (pipelines that differ in it differ in IR identity); the batched engine then
draws each step's trees from one budget over the union of the running requests' candidates, best
first by cumulative path probability (`runtime.tree.best_first_shared`), so a request whose drafts
are unlikely may get no node at all in a step; the same build's batched chains split it as evenly
as their draft lengths allow (`runtime.batching.split_budget`: a chain pass pads every chain to the
longest, so an even split also leaves no padding behind one long draft).  ``min_prob`` leaves out
candidates whose path probability is below it: rows a pass would spend on nodes that are almost never
accepted (the room `prompt-admission` fills).  Lossless: verification accepts only the target's own tokens.

When it is legal: with tree verification (its trees are what it shares), in a deployment of more than
one sequence at once (one request has no one to share with).
"""

from __future__ import annotations

from specpilot.passes.base import Option, Pass, PassContext


class NodeBudget(Pass):
    name = "node-budget"
    doc = "one verification pass's drafted nodes shared by its requests, best first over their union (batch schedule)"
    options = (Option("nodes", int, 64, "drafted nodes one batched verification pass takes in all (1..4096)"),
               Option("min_prob", float, 0.0, "candidates below this path probability are not drafted (0..1)"))
    requires = ("tree-verify",)
    statistics = ("nodes",)
    manifest_key = "node_budget"

    def manifest_entry(self, context: PassContext) -> dict:
        return {"nodes": self["nodes"], "min_prob": self["min_prob"]}

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if not 1 <= self["nodes"] <= 4096:
            return False, f"nodes must be in 1..4096, got {self['nodes']}"
        if not 0.0 <= self["min_prob"] < 1.0:
            return False, f"min_prob must be in [0, 1), got {self['min_prob']}"
        if context.max_batch < 2:
            return False, "shares a pass among requests: needs deployment.max_batch >= 2"
        return True, ""

    def apply(self, mod, context: PassContext):
        context.statistics[self.name].update(nodes=self["nodes"])
        return (mod.with_attr("specpilot.node_budget", self["nodes"])
                .with_attr("specpilot.node_min_prob", str(self["min_prob"])))
