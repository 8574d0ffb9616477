"""w12-layout: target weights in the lossless W12 layout, read by a decode-fused GEMM.

What it rewrites: every ``matmul(x, permute_dims(W))`` whose W is a packed parameter of the
target model with bf16-exact values becomes ``call_tir(w12_gemm, x, planes of W)``; the
packed-parameter tuple of every function changes accordingly (W's slot holds the hi plane,
the lo plane, bases and escapes are appended), and the weights are converted ahead of time.
The results are those of the same GEMM over the exact weights (the escapes are merged in
column order), so token forcing holds.

When it is legal: the weights must be known at build time (not ``--params seeded``), and for
now only for ``llvm`` targets: the CUDA schedule of the fused GEMM is the rest of issue 4.
A weight that is not bf16-representable, not 2-D, smaller than ``min_size`` or not the
target's is left as it is (the pass does not fire on it).

Where it sits: before any pass that reads the matmul patterns it replaces, and before
nested-int8-view, which reads the GEMMs it creates.
"""

from __future__ import annotations

import torch
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from specpilot.compiler import kernels, w12
from specpilot.passes.base import Option, Pass, PassContext

PLANES = ("w12_lo", "w12_base", "w12_esc_ptr", "w12_esc_col", "w12_esc_bits")


def _eligible(name: str, value: torch.Tensor, min_size: int) -> bool:
    if not name.startswith("target.") or value.dim() != 2 or value.numel() < min_size:
        return False
    if value.dtype == torch.bfloat16:
        return True
    return value.dtype == torch.float32 and torch.equal(value.to(torch.bfloat16).float(), value)


def _tensor_type(t: torch.Tensor) -> relax.TensorType:
    return relax.TensorType(list(t.shape), str(t.dtype).split(".")[-1])


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, old_param: relax.Var, new_param: relax.Var, slots: dict[int, list[int]],
                 layouts: dict[int, w12.W12Kernel]):
        super().__init__(mod)
        self.old_param, self.new_param, self.slots, self.layouts = old_param, new_param, slots, layouts
        self.rewritten = 0

    def visit_var_(self, op: relax.Var) -> relax.Expr:
        return self.new_param if op.same_as(self.old_param) else super().visit_var_(op)

    def _weight_slot(self, expr) -> int | None:
        """The packed index i when expr (already visited) is permute_dims(packed_params[i]) with
        slot i rewritten; bindings are looked up in their rewritten form."""
        if isinstance(expr, relax.Var):
            expr = self.lookup_binding(expr)
        if not (isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.permute_dims"))):
            return None
        arg = expr.args[0]
        bound = self.lookup_binding(arg) if isinstance(arg, relax.Var) else arg
        if isinstance(bound, relax.TupleGetItem) and bound.tuple_value.same_as(self.new_param) \
                and bound.index in self.slots:
            return bound.index
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if call.op.same_as(tvm.ir.Op.get("relax.matmul")) and len(call.args) == 2:
            slot = self._weight_slot(self.visit_expr(call.args[1]))
            x = self.visit_expr(call.args[0])
            if slot is not None and len(x.ty.shape) == 2:
                layout = self.layouts[slot]
                n, k = layout.hi.shape
                kernel = kernels.w12_gemm(n, k, int(layout.esc_ptr[-1]), x.ty.dtype)
                gv = self.builder_.add_func(kernel, "w12_gemm")
                planes = [relax.TupleGetItem(self.new_param, j) for j in [slot, *self.slots[slot]]]
                self.rewritten += 1
                out = relax.call_tir(gv, [x, *planes],
                                     relax.TensorType([x.ty.shape[0], n], "float32"))
                dtype = call.attrs.out_dtype if call.attrs.out_dtype else x.ty.dtype
                return out if str(dtype) == "float32" else relax.op.astype(out, dtype)
        return super().visit_call_(call)


def _matmul_only_slots(mod) -> set[int]:
    """Packed slots that every function reads only as ``matmul(x2d, permute_dims(W))``."""
    matmul, permute = tvm.ir.Op.get("relax.matmul"), tvm.ir.Op.get("relax.permute_dims")
    good: dict[int, bool] = {}
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not func.params or func.params[-1].name != "packed_params":
            continue
        packed = func.params[-1]
        bindings = [b for block in func.body.blocks for b in block.bindings]
        uses: dict = {}   # var -> consumers (the Call, or None for any other kind of use)

        def note(expr, consumer):
            if isinstance(expr, relax.Var):
                uses.setdefault(expr, []).append(consumer)
            elif isinstance(expr, relax.Tuple):
                for field in expr.fields:
                    note(field, None)

        for b in bindings:
            v = b.value
            if isinstance(v, relax.Call):
                for arg in v.args:
                    note(arg, v)
            elif isinstance(v, relax.TupleGetItem):
                if not v.tuple_value.same_as(packed):
                    note(v.tuple_value, None)
            else:
                note(v, None)
        note(func.body.body, None)
        slot_of = {b.var: b.value.index for b in bindings
                   if isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value.same_as(packed)}
        bound_to = {b.value: b.var for b in bindings if isinstance(b.value, relax.Call)}
        for var, slot in slot_of.items():
            ok = True
            for consumer in uses.get(var, []):
                if consumer is None or not consumer.op.same_as(permute):
                    ok = False
                    continue
                for user in uses.get(bound_to.get(consumer), [None]):
                    if user is None or not user.op.same_as(matmul) or not user.args[1].same_as(bound_to[consumer]) \
                            or len(user.args[0].ty.shape) != 2:
                        ok = False
            good[slot] = good.get(slot, True) and ok
    return {slot for slot, ok in good.items() if ok}


class W12Layout(Pass):
    name = "w12-layout"
    doc = "target matmul weights in the lossless 12-bit W12 layout, decoded inside the GEMM"
    options = (Option("min_size", int, 0, "leave matrices with fewer elements than this in bf16"),)
    targets = ("llvm",)
    statistics = ("rewritten", "weights", "bytes_before", "bytes_after", "escape_rate")

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if not context.weights_known:
            return False, "needs the weights at build time (not --params seeded)"
        return True, ""

    def _plan(self, context: PassContext, mod=None) -> dict[str, w12.W12Kernel]:
        """Which weights to convert (decided once, from the module apply sees) and their layouts."""
        plan = context.scratch.get(self.name)
        if plan is None:
            readable = _matmul_only_slots(mod)
            plan = {name: w12.kernel_layout(w12.encode_cached(value.to(torch.bfloat16)))
                    for i, (name, value) in enumerate(context.params.items())
                    if i in readable and _eligible(name, value, self["min_size"])}
            context.scratch[self.name] = plan
        return plan

    def apply(self, mod, context: PassContext):
        plan = self._plan(context, mod)
        names = list(context.params)
        index = {name: i for i, name in enumerate(names)}
        extra = len(names)
        slots, layouts = {}, {}
        for name, layout in plan.items():
            slots[index[name]] = list(range(extra, extra + len(PLANES)))
            layouts[index[name]] = layout
            extra += len(PLANES)
        out = tvm.ir.IRModule(dict(mod.functions), attrs=mod.attrs)
        rewritten = 0
        for gv, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not func.params or func.params[-1].name != "packed_params":
                continue
            old = func.params[-1]
            fields = list(old.ty.fields)
            for slot, layout in layouts.items():
                fields[slot] = _tensor_type(layout.hi)
            for slot in sorted(layouts):
                layout = layouts[slot]
                fields += [_tensor_type(t) for t in (layout.lo, layout.base, layout.esc_ptr, layout.esc_col,
                                                     layout.esc_bits)]
            new = relax.Var("packed_params", relax.TupleType(fields))
            rewriter = _Rewriter(out, old, new, slots, layouts)
            body = rewriter.visit_expr(func.body)
            new_func = relax.Function([*func.params[:-1], new], body, func.ret_ty, func.is_pure, func.attrs)
            rewriter.builder_.update_func(gv, new_func)
            out = rewriter.builder_.get()
            rewritten += rewriter.rewritten
        out = relax.transform.DeadCodeElimination()(out)
        before = sum(2 * layout.hi.numel() for layout in plan.values())
        after = sum(layout.nbytes for layout in plan.values())
        escapes = sum(int(layout.esc_ptr[-1]) for layout in plan.values())
        context.statistics[self.name].update(
            rewritten=rewritten, weights=len(plan), bytes_before=before, bytes_after=after,
            escape_rate=escapes / max(1, sum(layout.hi.numel() for layout in plan.values())))
        return out

    def transform_params(self, params: dict, context: PassContext) -> dict:
        plan = self._plan(context)
        out = {name: (plan[name].hi if name in plan else value) for name, value in params.items()}
        for name in params:
            if name in plan:
                layout = plan[name]
                for suffix, value in zip(PLANES, (layout.lo, layout.base, layout.esc_ptr, layout.esc_col,
                                                  layout.esc_bits)):
                    out[f"{name}.{suffix}"] = value
        return out
