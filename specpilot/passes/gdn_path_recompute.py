"""gdn-path-recompute: Gated DeltaNet layers of a verification follow each token's root path.

What it rewrites: in a tree, a node's recurrent and conv state is the state after its own
root path, not after the token before it in the batch.  The lowering gives every verify a
``parents`` input; its Gated DeltaNet kernels (``gdn.kernel`` = recurrence with per-token
records, and conv) are the chain forms, which do not read it.  This pass swaps each for its
tree form (same signature): every node starts from its parent's state (parent -1: the state
before the pass) and its conv window is its ancestors' inputs, continued into the conv state
when the path is shorter.  The recurrence's tree form is ``form``: ``chunked`` (default) computes
every node in closed form at once (`compiler.gdn_tree`: path sums of the gates, the delta
system over ancestor pairs, solved a tree level at a time for up to 72 tokens, by substitution in
token order for up to 104; a larger budget falls back), and
``sequential`` walks the nodes in order (parents come first), reading a branch's parent state
back from scratch.  ``commit`` then rebuilds the accepted node's
recurrent state along its root path from the pass's records (`kernels.gdn_commit`).
Every verify's kernels are swapped, the drafter's too: a hybrid drafter then scores a whole
level of a draft tree in one pass (`runtime.drafters.ModelDrafter` batched expansion).

When it is legal: targets with Gated DeltaNet layers, with tree-verify in the pipeline.
Where it sits: after tree-verify.
"""

from __future__ import annotations

from tvm import tirx

from specpilot import kernels
from specpilot.kernels import gdn_tree
from specpilot.core.pipeline_text import TREE_BUDGET_DEFAULT
from specpilot.core.target import DEVICES
from specpilot.passes.base import Option, Pass, PassContext


def _tree_form(func: tirx.PrimFunc, chunked: dict | None):
    attrs = func.attrs
    gpu = bool(attrs["tirx.is_scheduled"])
    shape = [int(x) for x in attrs["gdn.shape"]]
    stack = tuple(int(x) for x in attrs["gdn.stack"]) if "gdn.stack" in attrs else None
    if "gdn.keep_states" in attrs and not bool(attrs["gdn.keep_states"]):
        return None            # prefill / decode: one sequence of tokens, nothing to follow
    if str(attrs["gdn.kernel"]) == "recurrence":
        if chunked:
            # as many tokens as the form holds, not just the budget's nodes + root: an engine may verify
            # larger trees or longer chains with the same build (more: the engine refuses, with the
            # limit from manifest_entry)
            return gdn_tree.gated_delta_rule_tree(*shape, gpu=gpu, stack=stack, **chunked)
        return kernels.gated_delta_rule(*shape, keep_states=True, gpu=gpu, tree=True, stack=stack)
    return kernels.gdn_conv_verify(*shape, str(attrs["gdn.dtype"]), gpu=gpu, tree=True, stack=stack)


class GdnPathRecompute(Pass):
    name = "gdn-path-recompute"
    doc = "Gated DeltaNet state of every tree node recomputed along its root path (verify kernels follow parents)"
    options = (Option("form", str, "chunked", "recurrence over the tree: chunked (every node in closed form at once, "
                      "up to 104 tokens: compiler/gdn_tree.py) or sequential (node after node)",
                      ("chunked", "sequential")),)
    requires = ("tree-verify",)
    manifest_key = "gdn_verify"   # the form, and the engine's limit on tokens a recording pass (verify) may take
    statistics = ("kernels_rewritten",)

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if not context.hybrid:
            return False, "only for targets with Gated DeltaNet layers"
        return True, ""

    def chunked(self, context: PassContext) -> dict | None:
        """The chunked form's arguments (`gdn_tree.form_for` the budget's nodes + root, and the card's
        shared memory a block), or None."""
        budget = int(context.statistics.get("tree-verify", {}).get("budget", TREE_BUDGET_DEFAULT))
        form = gdn_tree.form_for(budget + 1) if self["form"] == "chunked" else None
        if form and context.device:
            form["shared"] = DEVICES[context.device].shared_per_block
        return form

    def manifest_entry(self, context: PassContext):
        form = self.chunked(context)
        return {"form": "chunked", "max_tokens": form["nmax"]} if form else {"form": "sequential"}

    def apply(self, mod, context: PassContext):
        out = mod.clone() if hasattr(mod, "clone") else mod
        rewritten = 0
        chunked = self.chunked(context)
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, tirx.PrimFunc) or func.attrs is None or "gdn.kernel" not in func.attrs \
                    or bool(func.attrs["gdn.tree"]):
                continue
            tree = _tree_form(func, chunked)
            if tree is None:
                continue
            out[gv] = tree
            rewritten += 1
        context.statistics[self.name].update(kernels_rewritten=rewritten)
        return out
