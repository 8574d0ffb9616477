"""Upper bounds of the step functions' dynamic dimensions, for TVM's static memory planning.

TVM's pooled allocator keeps a freed block for a later request of its exact size.  A batch's passes
change shape from one pass to the next (the packed rows, the longest draft, the batch, the cached
length), so each new shape allocates anew and the pool hoards the card until the runtime hands it back,
which waits for the device.  Given a function's bounds (its ``tir_var_upper_bound``),
``StaticPlanBlockMemory`` plans its intermediates once, at the bounds: each call then takes the same
few blocks whatever its shape.  Its outputs stay sized by the call (the recurrent states a sequence
outlive it, and planned at the bounds a batch of 16 would hold a batch of 32's).  The runtime keeps
every call inside its function's bounds (the manifest's ``memory_bounds``).
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

