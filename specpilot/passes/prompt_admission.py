"""prompt-admission: a batch-schedule pass -- waiting prompts ride along in verification passes.

What it changes: no kernel.  It records the chunk size in the manifest (``admission``) and as a
module attribute.  The batched engine splits each waiting prompt into chunks of at most ``chunk``
tokens and puts them in the rows of a verification pass that the running requests' drafted nodes
leave under the node budget, sharing the pass's weight loads instead of a prefill pass of their
own; running requests are never delayed for it (their nodes are chosen first), and a prompt whose
last chunk went through joins the batch with its first token from that pass.  With nothing
running (a pass of their own delays no one), prompts are prefilled whole, and so are they when
the backlog the free rows could take holds more than ``passes`` chunks (a burst): items of a batched
pass are padded to the longest, so chunks stay short, and a burst riding a chunk a pass would leave
rows idle for many passes, which costs more than one pass's delay.  Lossless: a prompt's cache is the
same however it is cut.

When it is legal: with `node-budget` (its room is what the budget leaves), in a batch deployment.
"""

from __future__ import annotations

from specpilot.passes.base import Option, Pass, PassContext


class PromptAdmission(Pass):
    name = "prompt-admission"
    doc = "waiting prompts in chunks ride along in verification passes, in the room the node budget leaves"
    options = (Option("chunk", int, 64, "prompt tokens one chunk carries at most (1..4096); a hybrid build's "
                      "verification kernel may take fewer, and the engine cuts to that"),
               Option("passes", int, 4, "a backlog of at most this many chunks rides along; a larger one "
                      "joins by a prefill pass of its own (1..1024)"))
    requires = ("node-budget",)
    statistics = ("chunk", "passes")
    manifest_key = "admission"

    def manifest_entry(self, context: PassContext) -> dict:
        return {"chunk": self["chunk"], "passes": self["passes"]}

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if not 1 <= self["chunk"] <= 4096:
            return False, f"chunk must be in 1..4096, got {self['chunk']}"
        if not 1 <= self["passes"] <= 1024:
            return False, f"passes must be in 1..1024, got {self['passes']}"
        if context.max_batch < 2:
            return False, "rides beside running requests: needs deployment.max_batch >= 2"
        return True, ""

    def apply(self, mod, context: PassContext):
        context.statistics[self.name].update(chunk=self["chunk"], passes=self["passes"])
        return (mod.with_attr("specpilot.admission_chunk", self["chunk"])
                .with_attr("specpilot.admission_passes", self["passes"]))
