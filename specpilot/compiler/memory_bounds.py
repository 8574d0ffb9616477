"""Upper bounds of the step functions' dynamic dimensions, for TVM's static memory planning.

TVM's pooled allocator keeps a freed block for a later request of its exact size.  A batch's passes
change shape from one pass to the next (the packed rows, the longest draft, the batch, the cached
length), so each new shape allocates anew and the pool hoards the card until the runtime hands it back,
which waits for the device.  Given a function's bounds (its ``tir_var_upper_bound``),
``StaticPlanBlockMemory`` plans its intermediates once, at the bounds: each call then takes the same
few blocks whatever its shape.  Its outputs stay sized by the call (the recurrent states a sequence
outlive it, and planned at the bounds a batch of 16 would hold a batch of 32's).  The runtime keeps
every call inside its function's bounds (the manifest's ``memory_bounds``).

The outputs' storage is rounded instead (`round_rows`, `round_output_storage`): a function's batch is
allocated for the next power of two, at most the pool's rows. A batch losing one request a pass at the
end of a burst then asks for a few sizes of each output, not one a batch size -- a (B, ...) recurrent
state of a 27B-class hybrid is 151 MB a row. Other dimensions stay as the call has them: a row count
rounded up to a power of two would hold up to twice the logits.
"""

from __future__ import annotations


def verify_rows(budget: int | None, draft_len: int | None, chunk: int | None) -> int | None:
    """Tokens a sequence's row of a packed verification holds at most: its last token and a tree's
    budget or a chain's draft, or an admitted prompt chunk (None without a tree budget: no bound)."""
    if not budget:
        return None
    return 1 + max(budget, draft_len or 0, chunk or 0)


def step_bounds(max_batch: int, capacity: int, packed_tokens: int | None) -> dict[str, dict[str, int]]:
    """The bounds of the step functions whose every dimension has one: decode's batch is at most the
    pool's rows and its cached length at most the capacity; a packed verification's too, and its tokens a
    sequence at most ``packed_tokens`` (the runtime verifies longer rows padded), its real rows at most
    that many a sequence.  Prefill and padded verification take a prompt's chunk or a whole tree a
    sequence: their memory stays planned a call."""
    rows = {"batch": max_batch, "kv_len": capacity}
    bounds = {"target_decode": dict(rows), "target_decode_batch": dict(rows)}
    if packed_tokens:
        bounds["target_verify_packed"] = {**rows, "n": packed_tokens, "real": max_batch * packed_tokens}
    return bounds


def bound_functions(mod, bounds: dict[str, dict[str, int]]):
    """``mod`` with each Relax function named in ``bounds`` whose signature's dimensions all have one
    annotated with them."""
    from tvm import relax

    for gv, func in list(mod.functions.items()):
        wanted = bounds.get(gv.name_hint)
        if not isinstance(func, relax.Function) or not wanted:
            continue
        names = {v.name for param in func.params for v in relax.analysis.tir_vars_in_type(param.ty)}
        if names <= set(wanted):
            mod[gv] = func.with_attr("tir_var_upper_bound", {name: wanted[name] for name in names})
    return mod



ROUND_ROWS = "specpilot.round_rows"      # a Relax function's attribute: {dimension: its cap}


def round_rows(mod, max_batch: int):
    """``mod`` with each Relax function that takes a ``batch`` dimension marked to round it (`ROUND_ROWS`),
    at most ``max_batch``."""
    from tvm import relax

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and "batch" in {
                v.name for param in func.params for v in relax.analysis.tir_vars_in_type(param.ty)}:
            mod[gv] = func.with_attr(ROUND_ROWS, {"batch": max_batch})
    return mod


def power_of_two_at_most(dim, cap: int):
    """The TIR expression: ``dim`` rounded up to a power of two, at most ``cap`` (``dim`` itself past it)."""
    from tvm import tirx

    expr = tirx.Select(dim <= cap, tirx.IntImm("int64", cap), dim)
    power = 1
    while power * 2 < cap:
        power *= 2
    while power >= 1:
        expr = tirx.Select(dim <= power, tirx.IntImm("int64", power), expr)
        power //= 2
    return expr


def round_output_storage():
    """A Relax pass, after ``StaticPlanBlockMemory``: each allocation it left unplanned (a function's
    outputs) of a function with `ROUND_ROWS` gets storage of its own sized
    with those dimensions rounded (`power_of_two_at_most`); the tensor is that storage's first bytes."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax.expr_functor import PyExprMutator, mutator

    alloc = tvm.ir.Op.get("relax.builtin.alloc_tensor")

    @mutator
    class Rounded(PyExprMutator):
        def __init__(self, mod, caps: dict[str, int]):
            super().__init__(mod)
            self.caps = caps

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != alloc or not isinstance(call.args[0], relax.ShapeExpr):
                return call
            dims = list(call.args[0].values)
            rounded = [power_of_two_at_most(d, self.caps[d.name]) if isinstance(d, tirx.Var) and d.name in self.caps
                       else d for d in dims]
            if all(r is d for r, d in zip(rounded, dims)):
                return call
            size = tirx.IntImm("int64", tvm.DataType(call.args[1].value).bits // 8)
            for dim in rounded:
                size = size * dim
            storage = self.builder_.emit(relax.op.memory.alloc_storage(relax.ShapeExpr([size]), call.args[2],
                                                                       call.args[3], "uint8"), "storage")
            return relax.op.memory.alloc_tensor(storage, relax.prim_value(0), call.args[0], call.args[1], call.args[2])

    @tvm.transform.module_pass(opt_level=0, name="specpilot.round_output_storage")
    def _round(mod, _ctx):
        for gv, func in list(mod.functions.items()):
            caps = func.attrs.get(ROUND_ROWS) if isinstance(func, relax.Function) and func.attrs else None
            if caps:
                mod[gv] = Rounded(mod, {str(k): int(v) for k, v in caps.items()}).visit_expr(func)
        return mod
    return _round
