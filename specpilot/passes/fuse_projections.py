"""fuse-projections: matmuls that read the same activation with different weights become one.

What it rewrites: in every function, the bindings ``y_i = matmul(x, permute_dims(W_i))`` that
share one ``x`` (attention's q/k/v projections, the MLP's gate and up, a Gated DeltaNet layer's
input projections) become ``y = matmul(x, permute_dims(W))`` over the weights stacked along
their output dimension, and each ``y_i`` a slice of ``y``.  The packed parameters change with
it: the stacked weight takes the first member's slot (named ``W_1+W_2+...``), the other members'
slots are dropped, and the weights are stacked ahead of time.  Every output element is the same
dot product over the same K values as before, so the results are the same products; a decode
step launches one GEMM instead of two or three and reads the weights in one wide pass (the
small k/v projections were the slowest GEMVs of the 8B-shape profile).

When it fires: on the weights that every function reads together, with one activation each (so one
stacked weight serves them all: a block drafter's block function reads q, k, v with its hidden states
and its context function k, v with the context's, so k and v stack and q stays apart), 2-D, of one
dtype and K, and read by nothing but these matmuls.

Where it sits: before w12-layout (which then converts the stacked weights) and before passes that
read single projections.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from specpilot.core.weights import FUSED, fuse_params
from specpilot.passes.base import Pass, PassContext
from specpilot.passes.packed_uses import packed_functions, packed_uses, rebuild_packed

_MATMUL, _PERMUTE = "relax.matmul", "relax.permute_dims"


def _is(call, name: str) -> bool:
    return isinstance(call, relax.Call) and call.op.same_as(tvm.ir.Op.get(name))


def _function_groups(func) -> tuple[list[list[int]], set[int]]:
    """(the slots matmul'd with one activation, per activation; slots read in any other way)."""
    info = packed_uses(func)
    fields = func.params[-1].ty.fields
    perm_of = {}
    for b in info.bindings:
        v = b.value
        if _is(v, _PERMUTE) and isinstance(v.args[0], relax.Var) and v.args[0] in info.slot_of \
                and len(fields[info.slot_of[v.args[0]]].shape) == 2 and (v.attrs.axes is None or
                                                                         [int(a) for a in v.attrs.axes] == [1, 0]):
            perm_of[b.var] = info.slot_of[v.args[0]]
    other, by_x = set(), {}
    for var, slot in info.slot_of.items():
        for user in info.consumers(var):
            if user is None or not _is(user[0], _PERMUTE) or user[1] != 0:
                other.add(slot)
    for var, slot in perm_of.items():
        users = info.consumers(var)
        if len(users) != 1 or users[0] is None or not _is(users[0][0], _MATMUL) or users[0][1] != 1 \
                or not isinstance(users[0][0].args[0], relax.Var):
            other.add(slot)
            continue
        call = users[0][0]
        key = (call.args[0], str(call.attrs.out_dtype), int(fields[slot].shape[1]), str(fields[slot].dtype))
        by_x.setdefault(key, []).append(slot)
    return list(by_x.values()), other


def plan_groups(mod) -> list[tuple[int, ...]]:
    """Slot groups (ascending), two or more slots each, whose members every function reads together:
    two slots share a group when each function that reads either with an activation reads both with
    the same one -- so where one function reads q, k, v with x and another k, v with y, k and v fuse
    (one GEMM in each) and q stays apart.  A slot read in any other way anywhere takes no part."""
    functions = [_function_groups(func) for _, func in packed_functions(mod)]
    excluded = set().union(*(other for _, other in functions))
    where: dict[int, set] = {}          # slot -> {(function, its group there)}
    for f, (groups, _) in enumerate(functions):
        for g, slots in enumerate(groups):
            for slot in set(slots) - excluded:
                where.setdefault(slot, set()).add((f, g))
    by_where: dict[frozenset, list[int]] = {}
    for slot, places in where.items():
        by_where.setdefault(frozenset(places), []).append(slot)
    return sorted(tuple(sorted(slots)) for slots in by_where.values() if len(slots) > 1)


@mutator
class _Fuse(PyExprMutator):
    def __init__(self, mod, func, new_packed: relax.Var, remap: dict[int, int], member: dict[int, tuple]):
        super().__init__(mod)
        self.old_packed, self.new_packed, self.remap, self.member = func.params[-1], new_packed, remap, member
        info = packed_uses(func)
        self.perm_slot = {b.var: info.slot_of[b.value.args[0]] for b in info.bindings
                          if _is(b.value, _PERMUTE) and isinstance(b.value.args[0], relax.Var)
                          and b.value.args[0] in info.slot_of}
        self.fused: dict = {}
        self.rewritten = 0

    def visit_var_(self, op):
        return self.new_packed if op.same_as(self.old_packed) else super().visit_var_(op)

    def visit_tuple_getitem_(self, op):
        tup = self.visit_expr(op.tuple_value)
        if tup.same_as(self.new_packed):
            return relax.TupleGetItem(tup, self.remap[op.index])
        return super().visit_tuple_getitem_(op)

    def visit_call_(self, call):
        if _is(call, _MATMUL) and isinstance(call.args[1], relax.Var) and call.args[1] in self.perm_slot \
                and self.perm_slot[call.args[1]] in self.member:
            slot = self.perm_slot[call.args[1]]
            fused_slot, begin, end = self.member[slot]
            x = self.visit_expr(call.args[0])
            key = (x, fused_slot)
            if key not in self.fused:
                w = self.builder_.emit(relax.TupleGetItem(self.new_packed, self.remap[fused_slot]))
                wt = self.builder_.emit(relax.op.permute_dims(w))
                self.fused[key] = self.builder_.emit(relax.op.matmul(x, wt, out_dtype=call.attrs.out_dtype))
            y = self.fused[key]
            self.rewritten += 1
            return relax.op.strided_slice(y, axes=[len(x.ty.shape) - 1], begin=[begin], end=[end],
                                          assume_inbound=True)
        return super().visit_call_(call)


class FuseProjections(Pass):
    name = "fuse-projections"
    doc = "matmuls reading one activation (q/k/v, gate/up) become one GEMM over stacked weights"
    statistics = ("groups", "matmuls_fused", "parameters_before", "parameters_after")
    manifest_key = "fused"

    def _plan(self, mod, context: PassContext) -> dict[str, list[str]]:
        """Fused name -> member names (decided once, from the module apply sees)."""
        if self.name not in context.scratch:
            names = list(context.params)
            context.scratch[self.name] = {FUSED.join(names[s] for s in g): [names[s] for s in g]
                                          for g in plan_groups(mod)}
        return context.scratch[self.name]

    def apply(self, mod, context: PassContext):
        names = list(context.params)
        index = {n: i for i, n in enumerate(names)}
        groups = [[index[m] for m in members] for members in self._plan(mod, context).values()]
        dropped = {s for g in groups for s in g[1:]}
        kept = [s for s in range(len(names)) if s not in dropped]
        remap = {s: i for i, s in enumerate(kept)}
        member = {}
        for g in groups:
            for s in g[1:]:
                remap[s] = remap[g[0]]        # dead after the rewrite (DCE), typed like the stacked weight
        out = tvm.ir.IRModule(dict(mod.functions), attrs=mod.attrs)
        fused_total = 0
        for gv, func in packed_functions(mod):
            fields = list(func.params[-1].ty.fields)
            new_fields = list(fields)
            for g in groups:
                rows = [int(fields[s].shape[0]) for s in g]
                k = fields[g[0]].shape[1]
                new_fields[g[0]] = relax.TensorType([sum(rows), k], fields[g[0]].dtype)
                offset = 0
                for s, r in zip(g, rows):
                    member[s] = (g[0], offset, offset + r)
                    offset += r
            new_packed = relax.Var("packed_params", relax.TupleType([new_fields[s] for s in kept]))
            fuse = _Fuse(out, func, new_packed, remap, member)
            out = rebuild_packed(fuse, gv, func, new_packed)
            fused_total += fuse.rewritten
        out = relax.transform.DeadCodeElimination()(out)
        context.statistics[self.name].update(groups=len(groups), matmuls_fused=fused_total,
                                             parameters_before=len(names), parameters_after=len(kept))
        return out

    def transform_params(self, params: dict, context: PassContext) -> dict:
        return fuse_params(params, context.scratch.get(self.name, {}))

    def manifest_entry(self, context: PassContext) -> dict:
        return dict(context.scratch.get(self.name, {}))
