"""Who reads what in a function that takes ``packed_params``: the analysis the weight-rewriting
passes (w12-layout, fuse-projections) decide on."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax


@dataclass
class PackedUses:
    bindings: list            # every binding of the function, in order
    slot_of: dict             # var bound to packed_params[i] -> i
    uses: dict                # var -> its consumers: (call, argument index), or None for any other use
    bound_to: dict            # call -> the var it is bound to

    def consumers(self, var) -> list:
        return self.uses.get(var, [])


def packed_functions(mod):
    """(global var, function) for every Relax function whose last parameter is ``packed_params``."""
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and func.params and func.params[-1].name == "packed_params":
            yield gv, func


def rebuild_packed(mutator, gv, func: relax.Function, packed: relax.Var):
    """The module of ``mutator`` (a PyExprMutator over it) with ``func`` taking ``packed`` as its
    packed_params and its body rewritten by ``mutator``."""
    body = mutator.visit_expr(func.body)
    mutator.builder_.update_func(gv, relax.Function([*func.params[:-1], packed], body, func.ret_ty, func.is_pure,
                                                    func.attrs))
    return mutator.builder_.get()


def packed_uses(func: relax.Function) -> PackedUses:
    """Reading packed_params[i] itself is not a use of packed_params (its slots are tracked instead)."""
    packed = func.params[-1]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    uses: dict = {}

    def note(expr, consumer):
        if isinstance(expr, relax.Var):
            uses.setdefault(expr, []).append(consumer)
        elif isinstance(expr, relax.Tuple):
            for field in expr.fields:
                note(field, None)

    for b in bindings:
        v = b.value
        if isinstance(v, relax.Call):
            for i, arg in enumerate(v.args):
                note(arg, (v, i))
        elif isinstance(v, relax.TupleGetItem):
            if not v.tuple_value.same_as(packed):
                note(v.tuple_value, None)
        else:
            note(v, None)
    note(func.body.body, None)
    slot_of = {b.var: b.value.index for b in bindings
               if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value.same_as(packed)}
    bound_to = {b.value: b.var for b in bindings if isinstance(b.value, relax.Call)}
    return PackedUses(bindings, slot_of, uses, bound_to)
