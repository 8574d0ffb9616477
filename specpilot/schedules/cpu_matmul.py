"""The ``cpu-nt`` set's matmul schedule: ``x @ W^T`` with any number of rows, vectorised over K.

TVM's default CPU loops run a projection row by row, each row streaming the whole weight, and
leave the K reduction scalar: one-row decode projections ran at ~8x their bound on the demo's
CPU and multi-row ones (prefill, every verification) at ~66x (docs/bench-log.md).  Here, per
block of ``COLS`` weight rows (the parallel loop), every activation row is reduced against them
with K split into ``LANES`` partial sums computed as one vector (rfactor), summed right after
into the output: each weight row is read once per call whatever the row count.

Two loop orders, chosen by the row count (at run time when it is symbolic):
- one row (decode): each weight row's K loop in turn, so the weights stream from memory in order;
- more rows (verification, prefill): the block's weight rows interleaved inside the K loop, so
  ``COLS`` independent accumulators (registers) hide the FMA latency that one dependent chain a
  row pays.  One row in this order streams ``COLS`` rows at once, measured ~2x slower on the
  vocabulary head, hence the dispatch.
The partial sums change the order of the float additions, not what is added.  The interleaved
order's partial sums stay in the default scope, where TVM puts a small constant-size buffer on the
stack and LLVM keeps it in registers; a "local" buffer is a workspace allocation per parallel block,
which LLVM cannot prove apart from the inputs, so it stores every accumulator every step (verification
3-5 % slower on the demo's build).  The one-row order keeps "local": measured 7 % faster decode steps.
"""

from __future__ import annotations

import tvm

LANES = 8
COLS = (8, 4)       # weight rows a block: the first that divides the output's columns


def _matmul_block(sch):
    """The function's ``x @ W^T`` block: spatial loops then one reduction."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        name = sch.get(block).name_hint
        if not name.startswith("NT_matmul"):
            continue
        iters = sch.get(block).iter_vars
        kinds = [int(v.iter_type) for v in iters]
        if len(iters) >= 2 and kinds[-1] == 2 and all(k == 0 for k in kinds[:-1]):   # 0 spatial, 2 reduction
            return block
    return None


def _fit(func: tvm.tirx.PrimFunc) -> tuple[int, object] | None:
    """(columns a block, the row count) when the schedule takes ``func``'s matmul, else None."""
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    block = _matmul_block(sch)
    if block is None:
        return None
    extents = [sch.get(loop).extent for loop in sch.get_loops(block)]
    n_cols, depth = extents[-2], extents[-1]
    if not all(isinstance(e, tvm.tirx.IntImm) for e in (n_cols, depth)) or int(depth) % LANES:
        return None
    cols = next((c for c in COLS if int(n_cols) % c == 0), None)
    rows = 1
    for extent in extents[:-2]:
        rows = rows * extent
    return (cols, rows) if cols else None


def _ordered(func: tvm.tirx.PrimFunc, cols: int, interleave: bool) -> tvm.tirx.PrimFunc:
    """``func`` scheduled in one of the two loop orders (module docstring)."""
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    block = _matmul_block(sch)
    loops = sch.get_loops(block)
    _, ki = sch.split(loops[-1], [None, LANES])
    rf = sch.rfactor(ki, factor_axis=len(loops) - 1)
    *rows, j, ko, ki = sch.get_loops(rf)
    jo, ji = sch.split(j, [None, cols])
    sch.reorder(jo, *rows, *((ko, ji) if interleave else (ji, ko)), ki)
    if interleave:
        sch.unroll(ji)
    else:
        sch.set_scope(rf, 0, "local")
    sch.vectorize(ki)
    sch.parallel(jo)
    sch.reverse_compute_at(block, rows[-1])
    if interleave:
        sch.decompose_reduction(rf, ko)     # the accumulators start at zero before the K loop, not in it
    return sch.mod["main"]


def _rebound(stmt, copy: tvm.tirx.PrimFunc, func: tvm.tirx.PrimFunc):
    """``stmt`` of ``copy`` (a `renew_defs` of ``func``) with ``func``'s parameters and symbolic sizes."""
    from tvm.tirx.buffer import is_buffer_var
    from tvm.tirx.transform.common import BufferReplacer

    buffers = dict(zip(copy.body.block.alloc_buffers, func.body.block.alloc_buffers))   # an epilogue's intermediate
    sizes = {}
    for new, old in zip(copy.params, func.params):
        if not is_buffer_var(new):
            sizes[new] = old
            continue
        buffers[new] = old
        sizes.update({a: b for a, b in zip(new.ty.shape, old.ty.shape) if isinstance(a, tvm.tirx.Var)})
    # the buffers first, then the sizes in what is left: BufferReplacer rebuilds every buffer it is not
    # given (the function's own, given as themselves, stay the same objects)
    stmt = BufferReplacer(buffer_map=buffers)(stmt)
    return BufferReplacer(buffer_map={b: b for b in buffers.values()}, var_map=sizes)(stmt)


def _schedule(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    from tvm.s_tir import SBlock, SBlockRealize, renew_defs
    from tvm.sym.analyzer import Analyzer

    fit = _fit(func)
    if fit is None:
        return None
    cols, rows = fit
    rows = Analyzer().simplify(rows)
    if isinstance(rows, tvm.tirx.IntImm):
        return _ordered(func, cols, interleave=int(rows) != 1)
    # both orders in one function: the second from a copy with its own loop and block variables (TIR
    # defines each once), bound back to the function's parameters and sizes
    copy = renew_defs(func)
    one, many = _ordered(func, cols, False), _ordered(copy, cols, True)
    first, other = one.body.block, _rebound(many.body.block, copy, func)
    buffers = list(first.alloc_buffers)     # an epilogue's intermediate: the function's, for both orders
    buffers += [b for b in other.alloc_buffers if not any(b.same_as(a) for a in buffers)]
    root = SBlock([], [], [], "root", tvm.tirx.IfThenElse(rows == 1, first.body, other.body), alloc_buffers=buffers)
    return one.with_body(SBlockRealize([], True, root))


def cpu_matmuls() -> tvm.transform.Pass:
    """Schedule every function's ``x @ W^T`` (after FuseTransposeMatmul + legalization); a function
    the schedule does not fit keeps TVM's default loops."""
    from tvm.s_tir import ScheduleError

    @tvm.transform.module_pass(opt_level=0, name="specpilot.cpu_matmuls")
    def _apply(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        functions = dict(mod.functions.items())
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            try:
                scheduled = _schedule(func)
            except ScheduleError:   # a form this schedule does not take
                scheduled = None
            if scheduled is not None:
                functions[gv] = scheduled.with_attr("global_symbol", func.attrs["global_symbol"]) \
                    if func.attrs and "global_symbol" in func.attrs else scheduled
        return tvm.IRModule(functions, attrs=mod.attrs)
    return _apply
