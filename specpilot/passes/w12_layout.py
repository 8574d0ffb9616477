"""w12-layout: target weights in the lossless W12 layout, read by a decode-fused GEMM.

What it rewrites: every ``matmul(x, permute_dims(W))`` whose W is a packed parameter of the
target model with bf16-exact values becomes ``call_tir(w12_gemm, x, planes of W)``; the
packed-parameter tuple of every function changes accordingly (W's slot holds the hi plane,
the lo plane, bases and escapes are appended), and the weights are converted ahead of time.
On ``llvm`` the GEMM is `kernels.w12_gemm` (escapes merged in column order: the same sums as
a plain GEMM over the exact weights); on ``cuda`` it is `schedules.w12_mma` (tensor cores,
planes tiled for it, escapes added exactly in its epilogue; float32 sums in another order, as
any GPU schedule's).  Either way every weight enters with its exact bf16 value.

When it is legal: on ``llvm`` the weights must be known at build time (the CPU kernel is
specialised to each matrix's escape count).  On ``cuda``: sm_80 or later and a bfloat16
deployment (the kernel multiplies bf16 activations on tensor cores); the kernel does not depend
on the weights, so ``--params seeded`` builds may use it -- the engine converts the redrawn
weights when it loads them (manifest ``w12``).  A weight that is not bf16-representable, not
2-D, smaller than ``min_size``, not the target's, read by anything but such a matmul, or (on
cuda) of a shape the kernel does not tile (N % 16, K % 64) is left as it is.

Where it sits: before any pass that reads the matmul patterns it replaces, and before
nested-int8-view, which reads the GEMMs it creates.
"""

from __future__ import annotations

import torch
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from specpilot.core import w12
from specpilot import kernels
from specpilot.core.w12 import PLANES
from specpilot.passes.base import Option, Pass, PassContext
from specpilot.passes.packed_uses import packed_functions, packed_uses, rebuild_packed


def _eligible(name: str, shape, value: torch.Tensor | None, min_size: int, gpu: bool) -> bool:
    """``value`` None: a seeded bf16 build (weights drawn in bf16 at load: representable)."""
    if not name.startswith("target.") or len(shape) != 2 or shape[0] * shape[1] < min_size:
        return False
    if gpu:
        from specpilot.schedules.w12_mma import applicable
        if not applicable(int(shape[0]), int(shape[1])):
            return False
    if value is None or value.dtype == torch.bfloat16:
        return True
    return value.dtype == torch.float32 and torch.equal(value.to(torch.bfloat16).float(), value)


def _tensor_type(t: torch.Tensor) -> relax.TensorType:
    return relax.TensorType(list(t.shape), str(t.dtype).split(".")[-1])


def _plane_types(n: int, k: int, layout: w12.W12Kernel | None) -> list[relax.TensorType]:
    """Types of (hi, lo, base, ptr, col, bits): from the converted tensors, or (GPU layout, weights
    not known) from the shape, the escape count a fresh symbolic extent."""
    if layout is not None:
        return [_tensor_type(t) for t in (layout.hi, layout.lo, layout.base, layout.esc_ptr, layout.esc_col,
                                          layout.esc_bits)]
    e = tvm.tirx.Var("w12_escapes", "int64")
    return [relax.TensorType([n // 16, 4 * k], "int32"), relax.TensorType([n // 16, 2 * k], "int32"),
            relax.TensorType([n], "int32"), relax.TensorType([n + 1], "int32"), relax.TensorType([e], "int32"),
            relax.TensorType([e], "int32")]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, old_param: relax.Var, new_param: relax.Var, slots: dict[int, list[int]],
                 kernels_: dict[int, object]):
        super().__init__(mod)
        self.old_param, self.new_param, self.slots, self.kernels = old_param, new_param, slots, kernels_
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
                kernel = self.kernels[slot](x.ty.dtype)
                n = int(kernel.attrs["w12.n"])
                gv = self.builder_.add_func(kernel, "w12_gemm")
                planes = [relax.TupleGetItem(self.new_param, j) for j in [slot, *self.slots[slot]]]
                self.rewritten += 1
                out = relax.call_tir(gv, [x, *planes],
                                     relax.TensorType([x.ty.shape[0], n], "float32"))
                dtype = call.attrs.out_dtype if call.attrs.out_dtype else x.ty.dtype
                return out if str(dtype) == "float32" else relax.op.astype(out, dtype)
        return super().visit_call_(call)


def _matmul_only_slots(mod, x_dtype: str | None = None) -> set[int]:
    """Packed slots that every function reads only as ``matmul(x2d, permute_dims(W))`` (with x of
    dtype ``x_dtype`` when given)."""
    matmul, permute = tvm.ir.Op.get("relax.matmul"), tvm.ir.Op.get("relax.permute_dims")
    good: dict[int, bool] = {}
    for _, func in packed_functions(mod):
        info = packed_uses(func)
        for var, slot in info.slot_of.items():
            ok = True
            for consumer in info.consumers(var):
                if consumer is None or not consumer[0].op.same_as(permute):
                    ok = False
                    continue
                transposed = info.bound_to.get(consumer[0])
                for user in info.uses.get(transposed, [None]):
                    if user is None or not user[0].op.same_as(matmul) or user[1] != 1 \
                            or len(user[0].args[0].ty.shape) != 2 \
                            or (x_dtype is not None and str(user[0].args[0].ty.dtype) != x_dtype):
                        ok = False
            good[slot] = good.get(slot, True) and ok
    return {slot for slot, ok in good.items() if ok}


class W12Layout(Pass):
    name = "w12-layout"
    doc = "target matmul weights in the lossless 12-bit W12 layout, decoded inside the GEMM"
    options = (Option("min_size", int, 0, "leave matrices with fewer elements than this in bf16"),)
    targets = ("llvm", "cuda")
    after = ("fuse-projections",)      # it converts the stacked weights
    manifest_key = "w12"
    statistics = ("rewritten", "weights", "bytes_before", "bytes_after", "escape_rate")

    def legal(self, context: PassContext) -> tuple[bool, str]:
        if context.target_kind == "cuda":
            from specpilot.core.schedule_sets import sm_version
            if sm_version(context.arch) < 80:
                return False, f"the GPU W12 GEMM runs on bf16 tensor cores: needs sm_80 or later, not {context.arch}"
            if context.dtype != "bfloat16":
                return False, f"the GPU W12 GEMM multiplies bf16 activations: needs dtype bfloat16, not {context.dtype}"
            return True, ""
        if not context.weights_known:
            return False, "on the CPU it needs the weights at build time (not --params seeded)"
        return True, ""

    @staticmethod
    def layout_kind(context: PassContext) -> str:
        return "gpu" if context.target_kind == "cuda" else "cpu"

    def _plan(self, context: PassContext, mod=None) -> dict[str, tuple[int, int, w12.W12Kernel | None]]:
        """Which weights to convert (decided once, from the module apply sees): name -> (N, K,
        layout, or None when the weights are not known)."""
        plan = context.scratch.get(self.name)
        if plan is None:
            gpu = context.target_kind == "cuda"
            readable = _matmul_only_slots(mod, "bfloat16" if gpu else None)
            shapes = _packed_shapes(mod)
            plan = {}
            for i, (name, value) in enumerate(context.params.items()):
                if i in readable and _eligible(name, shapes[i], value, self["min_size"], gpu):
                    n, k = (int(d) for d in shapes[i])
                    plan[name] = (n, k, None if value is None else w12.convert(value, self.layout_kind(context)))
            context.scratch[self.name] = plan
        return plan

    def apply(self, mod, context: PassContext):
        plan = self._plan(context, mod)
        if not plan:   # nothing to convert: the module as it was (a clone, as every pass returns)
            context.statistics[self.name].update(rewritten=0, weights=0, bytes_before=0, bytes_after=0, escape_rate=0.0)
            return tvm.ir.IRModule(dict(mod.functions), attrs=mod.attrs)
        gpu = context.target_kind == "cuda"
        names = list(context.params)
        index = {name: i for i, name in enumerate(names)}
        extra = len(names)
        slots, kernels_ = {}, {}
        for name, (n, k, layout) in plan.items():
            slots[index[name]] = list(range(extra, extra + len(PLANES)))
            if gpu:
                from specpilot.schedules.w12_mma import w12_mma
                kernels_[index[name]] = lambda dtype, n=n, k=k: w12_mma(n, k)
            else:
                escapes = int(layout.esc_ptr[-1])
                kernels_[index[name]] = lambda dtype, n=n, k=k, e=escapes: kernels.w12_gemm(n, k, e, dtype)
            extra += len(PLANES)
        out = tvm.ir.IRModule(dict(mod.functions), attrs=mod.attrs)
        rewritten = 0
        for gv, func in packed_functions(mod):
            old = func.params[-1]
            fields = list(old.ty.fields)
            appended = []
            for slot in sorted(slots):
                n, k, layout = plan[names[slot]]
                hi, *rest = _plane_types(n, k, layout)   # fresh symbolic extents per function
                fields[slot] = hi
                appended += rest
            new = relax.Var("packed_params", relax.TupleType(fields + appended))
            rewriter = _Rewriter(out, old, new, slots, kernels_)
            out = rebuild_packed(rewriter, gv, func, new)
            rewritten += rewriter.rewritten
        out = relax.transform.DeadCodeElimination()(out)
        known = [layout for _, _, layout in plan.values() if layout is not None]
        stats = dict(rewritten=rewritten, weights=len(plan), bytes_before=sum(2 * n * k for n, k, _ in plan.values()))
        if len(known) == len(plan):   # with the weights: bytes as stored and escapes
            stats.update(bytes_after=sum(layout.nbytes for layout in known),
                         escape_rate=sum(int(layout.esc_ptr[-1]) for layout in known)
                         / max(1, sum(n * k for n, k, _ in plan.values())))
        context.statistics[self.name].update(stats)
        return out

    def transform_params(self, params: dict, context: PassContext) -> dict:
        plan = self._plan(context)
        return w12.convert_params(params, plan, self.layout_kind(context),
                                  done={name: layout for name, (_, _, layout) in plan.items()})

    def manifest_entry(self, context: PassContext) -> dict:
        """What the engine needs to convert redrawn (seeded) weights itself."""
        return {"layout": self.layout_kind(context), "weights": list(self._plan(context))}


def _packed_shapes(mod) -> dict[int, tuple]:
    """Shapes of the packed parameters by slot (from any function that takes them)."""
    for _, func in packed_functions(mod):
        return {i: tuple(f.shape) if hasattr(f, "shape") and f.shape is not None else ()
                for i, f in enumerate(func.params[-1].ty.fields)}
    return {}
