"""The ``cpu-nt`` set's matmul schedule: ``x @ W^T`` with any number of rows, vectorised over K.

TVM's default CPU loops run a projection row by row, each row streaming the whole weight, and
leave the K reduction scalar: one-row decode projections ran at ~8x their bound on the demo's
CPU and multi-row ones (prefill, every verification) at ~66x (docs/bench-log.md).  Here, per
block of ``COLS`` weight rows (the parallel loop), every activation row is reduced against them
with K split into ``LANES`` partial sums computed as one vector (rfactor), summed right after:
each weight row is read once per call whatever the row count.  The partial sums change the
order of the float additions, not what is added.
"""

from __future__ import annotations

import tvm

LANES = 8
COLS = 4


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


def _schedule(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    block = _matmul_block(sch)
    if block is None:
        return None
    loops = sch.get_loops(block)
    extents = [sch.get(loop).extent for loop in loops]
    n_cols, depth = extents[-2], extents[-1]
    if not all(isinstance(e, tvm.tirx.IntImm) for e in (n_cols, depth)) \
            or int(depth) % LANES or int(n_cols) % COLS:
        return None
    _, ki = sch.split(loops[-1], [None, LANES])
    rf = sch.rfactor(ki, factor_axis=len(loops) - 1)
    *rows, j, ko, ki = sch.get_loops(rf)
    jo, ji = sch.split(j, [None, COLS])
    sch.reorder(jo, *rows, ji, ko, ki)
    sch.vectorize(ki)
    sch.parallel(jo)
    sch.reverse_compute_at(block, jo)
    return sch.mod["main"]


def cpu_matmuls() -> tvm.transform.Pass:
    """Schedule every function's ``x @ W^T`` (after FuseTransposeMatmul + legalization); a function
    the schedule does not fit keeps TVM's default loops."""
    @tvm.transform.module_pass(opt_level=0, name="specpilot.cpu_matmuls")
    def _apply(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        functions = dict(mod.functions.items())
        for gv, func in mod.functions.items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            try:
                scheduled = _schedule(func)
            except (tvm.error.TVMError, ValueError):   # a form this schedule does not take
                scheduled = None
            if scheduled is not None:
                functions[gv] = scheduled.with_attr("global_symbol", func.attrs["global_symbol"]) \
                    if func.attrs and "global_symbol" in func.attrs else scheduled
        return tvm.IRModule(functions, attrs=mod.attrs)
    return _apply
