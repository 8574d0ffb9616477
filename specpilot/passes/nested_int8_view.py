"""nested-int8-view: a low-precision verification function on the W12 hi plane alone.

What it rewrites: it adds ``<function>_view`` (default ``target_verify_view``), a copy of
``<function>`` (default ``target_verify``) in which every
decode-fused W12 GEMM decodes from the hi plane only (the nested 8-bit view: sign, exponent
offset and the top three mantissa bits, the rest at their midpoint; escapes exact).  The lo
plane is passed but never read, so the view moves about 2/3 of W12's weight bytes.  Nothing
else changes: ``target_verify`` stays exact, and the view accepts no tokens by itself
(two-level verification uses its chain as a proposal; only exact verification accepts).

When it is legal: after w12-layout (it reads that pass's GEMMs: the CPU kernel's or the GPU
tensor-core kernel's twin without lo-plane loads), on the targets w12-layout supports.

Where it sits: right after w12-layout.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.utils import copy_with_new_vars

from specpilot import kernels
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import Option, Pass, PassContext


@mutator
class _HiOnly(PyExprMutator):
    """Points every call_tir of a w12_gemm kernel at its hi-plane-only twin."""

    def __init__(self, mod):
        super().__init__(mod)
        self.mod, self.swapped, self._twins = mod, 0, {}

    def visit_generic_const_(self, op) -> relax.Expr:
        # a node of its own: the copy may not share constants with the function it copies
        # (pattern fusion, e.g. FuseTransposeMatmul on cuda, rejects a node in two partitions)
        return relax.const(op.value)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op.same_as(tvm.ir.Op.get("relax.call_tir")) and call.args[0].name_hint.startswith("w12_gemm"):
            gv = call.args[0]
            if gv not in self._twins:
                attrs = self.mod[gv].attrs
                if "w12.gpu" in attrs:
                    from specpilot.schedules.w12_mma import w12_mma
                    kernel = w12_mma(int(attrs["w12.n"]), int(attrs["w12.k"]), hi_only=True)
                else:
                    kernel = kernels.w12_gemm(int(attrs["w12.n"]), int(attrs["w12.k"]), int(attrs["w12.escapes"]),
                                              str(attrs["w12.x_dtype"]), hi_only=True)
                self._twins[gv] = self.builder_.add_func(kernel, "w12_gemm_view")
            self.swapped += 1
            return relax.call_tir(self._twins[gv], call.args[1], call.ty)
        return call


class NestedInt8View(Pass):
    name = "nested-int8-view"
    doc = "adds target_verify_view: verification through the W12 hi plane alone (the nested 8-bit view)"
    options = (Option("function", str, "target_verify", "the verification function to view"),)
    requires = ("w12-layout",)
    after = ("w12-layout",)
    targets = ("llvm", "cuda")
    statistics = ("functions_added", "gemms_viewed")

    def legal(self, context: PassContext) -> tuple[bool, str]:
        return True, ""

    def apply(self, mod, context: PassContext):
        name = self["function"]
        if name not in [gv.name_hint for gv in mod.get_global_vars()]:
            raise SpecPilotError(f"nested-int8-view: the module has no function {name!r}")
        source = mod.get_global_var(name)
        mutator_ = _HiOnly(tvm.ir.IRModule(dict(mod.functions), attrs=mod.attrs))
        fresh = copy_with_new_vars(mod[source])   # a function may not share variables with another
        view = mutator_.visit_expr(fresh).with_attr("global_symbol", f"{name}_view")
        mutator_.builder_.add_func(view, f"{name}_view")
        out = mutator_.builder_.get()
        context.statistics[self.name].update(functions_added=1, gemms_viewed=mutator_.swapped)
        return out
