"""logit-bias-fault: a deliberately wrong pass, for testing the gates (never proposed).

What it changes: every target step function that takes ``positions`` adds ``bias`` to the
logit of token ``token`` at every position >= ``after``.  Below ``after`` the module is
exact, so a gate that forces only short outputs passes it; token forcing past ``after``
catches it at the first position where stock did not already choose ``token``.  This is
the paper's fault-injection experiment: development requests capped at 2048 tokens miss a
bias after token 2048, the sealed validation at 4096 must reject it.

When it is legal: always (it is a test instrument); the search adds it only when asked
(``specpilot search --inject-fault AFTER``), and the builtin proposer never lists it.
"""

from __future__ import annotations

import numpy as np

from specpilot.passes.base import Option, Pass, PassContext


class LogitBiasFault(Pass):
    name = "logit-bias-fault"
    doc = "TEST ONLY: bias one token's logit from absolute position AFTER on (a fault the gates must catch)"
    options = (Option("after", int, 2048, "first absolute position that is biased"),
               Option("bias", float, 1000.0, "added to the logit"),
               Option("token", int, 0, "the token whose logit is biased"))
    statistics = ("functions_faulted",)
    proposable = False

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if self["after"] < 0:
            return False, f"after must be >= 0, got {self['after']}"
        return True, ""

    def apply(self, mod, context: PassContext):
        from tvm import relax

        out = mod.clone()
        faulted = 0
        for gv in list(mod.get_global_vars()):
            func = mod[gv]
            if not (isinstance(func, relax.Function) and gv.name_hint.startswith("target_")
                    and any(p.name == "positions" for p in func.params)):
                continue
            out = self._wrap(out, gv, func)
            faulted += 1
        context.statistics[self.name].update(functions_faulted=faulted)
        return out

    def _wrap(self, mod, gv, func):
        """``gv``'s body gains one binding block: the logits it returns, biased."""
        from tvm import relax

        body = func.body
        bindings = []
        normalizer = relax.BlockBuilder()

        def bind(name, value, ty):
            var = relax.Var(name, ty)
            bindings.append(relax.VarBinding(var, normalizer.normalize(value)))
            return var

        out_ty = func.ret_ty
        tuple_out = isinstance(out_ty, relax.TupleType)
        logits_ty = out_ty.fields[0] if tuple_out else out_ty
        logits = bind("fault_logits", relax.TupleGetItem(body.body, 0), logits_ty) if tuple_out else body.body
        batch, n, vocab = logits_ty.shape
        dtype = str(logits_ty.dtype)
        positions = next(p for p in func.params if p.name == "positions")
        late = bind("fault_late", relax.op.greater_equal(positions, relax.const(self["after"], "int32")),
                    relax.TensorType([batch, n], "bool"))
        hit = bind("fault_hit", relax.op.expand_dims(late, axis=-1), relax.TensorType([batch, n, 1], "bool"))
        row = np.zeros(int(vocab), dtype="float32")
        row[self["token"] % int(vocab)] = self["bias"]
        bias = bind("fault_bias", relax.op.where(hit, relax.const(row.astype(dtype)),
                                                 relax.const(np.zeros(int(vocab), dtype=dtype))), logits_ty)
        result = bind("fault_out", relax.op.add(logits, bias), logits_ty)
        if tuple_out:
            rest = [bind(f"fault_field{i}", relax.TupleGetItem(body.body, i), out_ty.fields[i])
                    for i in range(1, len(out_ty.fields))]
            result = bind("fault_result", relax.Tuple([result] + rest), out_ty)
        new_body = normalizer.normalize(relax.SeqExpr(list(body.blocks) + [relax.BindingBlock(bindings)], result))
        new = relax.Function(func.params, new_body, out_ty, func.is_pure, func.attrs)
        out = mod.clone()
        out[gv] = new
        return out
