"""tree-verify: verify a best-first tree of draft tokens in one target pass.

What it changes: the step functions already take rotary positions, cache slots and an
attention mask per token, so ``target_verify`` verifies a tree as it is given one: nodes at
positions ``start + depth``, each attending the cache and its own ancestors.  The pass adds
``target_compact_kv(kv, rows, src, dst)``: after acceptance, the accepted root path's keys
and values move (in place, inside the KV pool) from the slots the tree gave them to the
consecutive slots after the prefix.  The budget is the number of tree nodes the engine
drafts per verification; a build records it in its pipeline text.  ``fixed=true`` has the
lowering add ``target_verify_tree`` (`fixed_tokens`, `compiler.lower`): ``target_verify`` for one
sequence of exactly budget + 1 tokens, which every pass rewrites as it does ``target_verify``.
Its shapes are static but for the KV length, so a ``kernel-schedule{graph=true}`` build replays
its weight and activation kernels as CUDA graphs (verification otherwise launches every kernel);
the engine pads a smaller tree or chain to it (padding tokens are written nowhere, their rows
dropped).  ``packed=true`` has the lowering add ``target_verify_packed``: ``target_verify`` with
the batch's real tokens' flat indices (``pack``) and each padded position's row among them
(``unpack``), whose embedding, linear layers and head run over those rows only -- a batched pass
pads every request's draft to the longest, and a shared node budget gives uneven ones; the
attention and Gated DeltaNet kernels read the padded layout as before (the GPU recurrence stops at each
sequence's last real token: `kernels.gdn.gated_delta_rule`).

When it is legal: any target; on a hybrid target (Gated DeltaNet layers) only together with
``gdn-path-recompute``, since each node's recurrent state depends on its root path.

Where it sits: after the weight-layout passes (it reads nothing they write).
"""

from __future__ import annotations

from tvm import relax, tirx

from specpilot import kernels
from specpilot.core.errors import SpecPilotError
from specpilot.core.pipeline_text import TREE_BUDGET_DEFAULT
from specpilot.passes.base import Option, Pass, PassContext


class TreeVerify(Pass):
    name = "tree-verify"
    doc = "verify a best-first draft tree of up to `budget` nodes per target pass; adds target_compact_kv"
    options = (Option("budget", int, TREE_BUDGET_DEFAULT, "tree nodes drafted per verification (1..1024)"),
               Option("fixed", bool, False, "also add target_verify_tree: one sequence's verification of exactly "
                      "budget + 1 tokens (static shapes: CUDA graphs with kernel-schedule{graph=true})"),
               Option("packed", bool, False, "also add target_verify_packed: a batch's verification whose linear "
                      "layers and head skip the rows that pad its shorter drafts"))
    after = ("w12-layout", "nested-int8-view")
    needs_when = (("hybrid", "gdn-path-recompute"),)   # each node's Gated DeltaNet state follows its root path
    statistics = ("functions_added", "budget")
    manifest_key = "tree"

    def manifest_entry(self, context: PassContext) -> dict:
        return {"budget": self["budget"], **({"fixed_tokens": self["budget"] + 1} if self["fixed"] else {}),
                **({"packed": True} if self["packed"] else {})}

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if not 1 <= self["budget"] <= 1024:
            return False, f"budget must be in 1..1024, got {self['budget']}"
        return True, ""

    def apply(self, mod, context: PassContext):
        names = [gv.name_hint for gv in mod.get_global_vars()]
        if "target_verify" not in names:
            raise SpecPilotError("tree-verify: the module has no target_verify function")
        if self["packed"] and "target_verify_packed" not in names:
            raise SpecPilotError("tree-verify{packed=true}: the module has no target_verify_packed (lowering adds it "
                                 "for a pipeline with this pass: `compiler.build.lower_and_apply`)")
        if self["fixed"] and "target_verify_tree" not in names:
            raise SpecPilotError("tree-verify{fixed=true}: the module has no target_verify_tree (lowering adds it "
                                 "for a pipeline with this pass: `compiler.build.lower_and_apply`)")
        verify = mod["target_verify"]
        kv_info = next(p.ty for p in verify.params if p.name == "kv")
        n_layers, _, n_rows, n_kv, capacity, head_dim = (int(d) for d in kv_info.shape)
        gpu = context.target_kind == "cuda"
        bb = relax.BlockBuilder(mod)
        batch, n = tirx.Var("batch", "int64"), tirx.Var("n", "int64")
        kv = relax.Var("kv", kv_info)
        rows = relax.Var("rows", relax.TensorType([batch], "int32"))
        src = relax.Var("src", relax.TensorType([batch, n], "int32"))
        dst = relax.Var("dst", relax.TensorType([batch, n], "int32"))
        kernel = kernels.compact_kv(n_layers, n_rows, n_kv, capacity, head_dim, kv_info.dtype, gpu)
        with bb.function("target_compact_kv", [kv, rows, src, dst]):
            gv = bb.add_func(kernel, "compact_kv")
            out = bb.emit(relax.call_tir_inplace(gv, [kv, rows, src, dst], inplace_indices=[0], out_ty=kv_info))
            bb.emit_func_output(out)
        context.statistics[self.name].update(functions_added=1, budget=self["budget"])
        return bb.get()


def packed_verify(pipeline) -> bool:
    """Whether a pipeline asks the lowering for the packed batched verification."""
    tree = next((p for p in pipeline if p.name == TreeVerify.name), None)
    return tree is not None and tree["packed"]


def fixed_tokens(pipeline) -> int | None:
    """Tokens of the fixed-size verification a pipeline asks the lowering for (None: none)."""
    tree = next((p for p in pipeline if p.name == TreeVerify.name), None)
    return tree["budget"] + 1 if tree is not None and tree["fixed"] else None
