"""Elementwise epilogues fused into the skinny GEMM kernels' stores.

`skinny_mma.substitute` keeps its kernels opaque to FuseOps, so what follows a projection ran as
kernels of their own: the cast to bf16, the residual add, the logits' bf16 rounding -- a float32
[m, N] written, read back and rewritten, one launch each (16 of a 27B-style hybrid's tree
verification's ~147 kernels).  The decode GEMVs (dlight) always fused theirs.  `fuse_epilogues`
runs after FuseTIR: where the one user of a skinny kernel's float32 output is an elementwise map
of all of it -- every block a spatial ``buf[i, j] = f(...)`` reading the GEMM output at exactly
[i, j], earlier blocks' intermediates inlined where read, other inputs (the residual, biases) at
any index -- the user's blocks are composed into one expression and every store ``y[r, c] = acc``
of the kernel becomes ``out[r, c] = f(acc, r, c)``.  The arithmetic is the user's own expression
tree with the same dtypes and casts; only where it runs changes (TVM's bf16 legalization then
lowers it the same way), so a fused build computes bit for bit what the unfused one does (on the
H200: the 27B-style hybrid's prefill, AR step and tree-verify logits, conv states and records
bit-identical; bench/results/tree-verify-20261201-040129..).  Users that move elements (a
transpose, a repeat, SwiGLU's two columns of a fused gate/up output) keep the float32 output.

With ``slices`` an output with several users fuses too when each is a map or a column slice
(``out[r, c - offset]`` for the columns it holds; one kernel output per user: a Gated DeltaNet
layer's stacked input projection cut into q/k/v, z, b and a) -- correct, but measured no faster.

Producers are PrimFuncs carrying the ``specpilot.epilogue_output`` attribute: the index of the
parameter they only ever store to (the skinny kernels: 2).
"""

from __future__ import annotations

from dataclasses import dataclass

ATTR = "specpilot.epilogue_output"


@dataclass
class Epilogue:
    params: list        # the consumer's parameters without the GEMM output (its output last)
    out: object         # the consumer's output buffer (its last parameter)
    expr: object        # the composed value: over ROW, COL (the consumer's column), ACC
    row: object
    col: object
    acc: object
    offset: int = 0     # the consumer's column c is the GEMM's column c + offset (a slice) ...
    width: int = 0      # ... for c < width


def _sblocks(func) -> list:
    """The consumer's blocks (SBlockRealize) in program order, the root block left out."""
    import tvm_ffi
    from tvm.s_tir.stmt import SBlockRealize
    found = []
    tvm_ffi.structural_walk(func.body, [(SBlockRealize, found.append)], order="pre")
    return [r for r in found if r.block.name_hint != "root" or r.block.iter_vars]


def _substitute(expr, vars_: list, loads):
    """``expr`` with Vars replaced (by identity, ``vars_``: [(var, value)]) and every TensorLoad
    passed to ``loads(load, mutator)`` (returns its replacement, or None to keep it)."""
    import tvm_ffi
    from tvm.ir.expr import TensorLoad, Var

    def on_var(v, mut):
        return next((value for var, value in vars_ if v.same_as(var)), v)

    def on_load(load, mut):
        out = loads(load, mut)
        return out if out is not None else mut.default_mutate(load)
    return tvm_ffi.structural_mutate(expr, [(TensorLoad, on_load), (Var, on_var)])


def elementwise_epilogue(consumer, source: int, n_out: int) -> Epilogue | None:
    """The consumer's computation as one expression of the GEMM's accumulator, when it is an
    elementwise map over [rows, width] reading parameter ``source`` (the GEMM output, [rows,
    ``n_out``]) only at its own element -- or, a column slice, at [row, col + offset] for one
    constant offset (offset + width <= n_out); else None.  Blocks before the last may compute
    intermediates over any spatial domain (e.g. -exp(A) per head from a parameter): each is
    inlined where it is read."""
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad
    from tvm.sym.analyzer import Analyzer

    params = list(consumer.params)
    if not 0 <= source < len(params) - 1:
        return None
    src, out = params[source], params[-1]
    if any(p.same_as(src) for i, p in enumerate(params) if i != source):
        return None
    row, col, acc = tirx.Var("row", "int64"), tirx.Var("col", "int64"), tirx.Var("acc", "float32")
    known: list[tuple] = []          # (intermediate buffer, its iterators, its expression over them)
    blocks = _sblocks(consumer)
    if not blocks:
        return None
    final, width = None, None
    for n, realize in enumerate(blocks):
        block = realize.block
        ivs = list(block.iter_vars)
        if not ivs or any(int(iv.iter_type) != 0 for iv in ivs) or block.init is not None \
                or block.match_buffers or not isinstance(realize.predicate, tirx.IntImm) \
                or int(realize.predicate.value) != 1 or \
                any(not isinstance(iv.dom.min, tirx.IntImm) or int(iv.dom.min.value) != 0 for iv in ivs):
            return None
        store = block.body
        if not isinstance(store, tirx.BufferStore) or len(store.indices) != len(ivs) or \
                not all(i.same_as(iv.var) for i, iv in zip(store.indices, ivs)):
            return None
        bad = []

        def loads(load, mut, bad=bad, block=block):
            hit = next(((vs, e) for b, vs, e in known if load.source.same_as(b)), None)
            if hit is not None:           # an intermediate: its expression at these indices
                vs, e = hit
                if len(vs) != len(load.indices):
                    bad.append(load)
                    return None
                return _substitute(e, list(zip(vs, [mut.mutate(i) for i in load.indices])), lambda l, m: None)
            if any(load.source.same_as(b) for b in block.alloc_buffers):
                bad.append(load)
            return None                   # the GEMM output or a parameter: kept (indices mutated)
        value = _substitute(store.value, [], loads)
        if bad:
            return None
        if store.buffer.same_as(out):
            if n != len(blocks) - 1 or len(ivs) != 2 or not isinstance(ivs[1].dom.extent, tirx.IntImm):
                return None
            width = int(ivs[1].dom.extent.value)
            final = _substitute(value, [(ivs[0].var, row), (ivs[1].var, col)], lambda l, m: None)
        elif any(store.buffer.same_as(p) for p in params):
            return None      # writes another parameter: not an elementwise map
        else:
            known.append((store.buffer, [iv.var for iv in ivs], value))
    if final is None:
        return None
    # every read of the GEMM output at [row, col + offset], one constant offset
    analyzer, offsets, bad = Analyzer(), set(), []

    def src_loads(load, mut):
        if not load.source.same_as(src):
            return None
        shift = analyzer.simplify(load.indices[1] - col) if len(load.indices) == 2 else None
        if shift is None or not load.indices[0].same_as(row) or not isinstance(shift, tirx.IntImm):
            bad.append(load)
            return None
        offsets.add(int(shift.value))
        return acc
    final = _substitute(final, [], src_loads)
    if bad or len(offsets) != 1:
        return None
    offset = offsets.pop()
    if offset < 0 or offset + width > n_out:
        return None
    left = []
    tvm_ffi.structural_walk(final, [(TensorLoad, lambda load: left.append(load) if load.source.same_as(src)
                                     or any(load.source.same_as(b) for b, _, _ in known) else None)])
    if left:
        return None
    return Epilogue([p for i, p in enumerate(params) if i != source], out, final, row, col, acc, offset, width)


def fuse(producer, epilogues: list[Epilogue]):
    """``producer`` (stores only to its parameter ``ATTR``, [m, N]) with each store
    ``y[r, c] = v`` made, for every epilogue, ``out[r, c - offset] = epilogue(v, r, c - offset)``
    where its columns hold c (all of them when it reads y whole); parameters: the producer's
    without y, each epilogue's inputs, then each epilogue's output."""
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad

    index = int(producer.attrs[ATTR])
    y = producer.params[index]
    n_out = int(y.ty.shape[1])
    read = []
    tvm_ffi.structural_walk(producer.body, [(TensorLoad, lambda load: read.append(load) if load.source.same_as(y) else None)])
    if read:
        raise ValueError("the producer reads its output: it cannot take an epilogue")

    def int64(e):
        return tirx.Cast("int64", e) if str(e.ty) != "int64" else e

    def on_store(store, mut):
        if not store.buffer.same_as(y):
            return mut.default_mutate(store)
        r, c = (int64(i) for i in store.indices)
        value = mut.mutate(store.value)
        stores = []
        for epi in epilogues:
            col = c - tirx.const(epi.offset, "int64") if epi.offset else c
            expr = _substitute(epi.expr, [(epi.row, r), (epi.col, col), (epi.acc, value)], lambda load, m: None)
            put = tirx.BufferStore(epi.out, expr, [r, col])
            if epi.offset or epi.width != n_out:
                put = tirx.IfThenElse(tirx.all(tirx.const(epi.offset, "int64") <= c,
                                               c < tirx.const(epi.offset + epi.width, "int64")), put, None)
            stores.append(put)
        return stores[0] if len(stores) == 1 else tirx.SeqStmt(stores)
    body = tvm_ffi.structural_mutate(producer.body, [(tirx.BufferStore, on_store)])
    # destination-passing order: every input (the producer's, then each consumer's), then the outputs
    params = [p for i, p in enumerate(producer.params) if i != index] + \
        [p for e in epilogues for p in e.params[:-1]] + [e.out for e in epilogues]
    attrs = {k: v for k, v in producer.attrs.items() if k != ATTR}
    return tirx.PrimFunc(params, body).with_attrs(attrs)


def fuse_epilogues(mod, slices: bool = False):
    """Every call of an epilogue producer whose one user is an elementwise map of its whole
    output, fused with it into one kernel (see the module docstring).  ``slices``: also outputs
    with several users, each a map or a column slice (one kernel output per user; the fused call
    takes the first user's place, so every other input of the users must be defined before it).
    Off by default: on the H200 it computed bit-identical results but gained nothing in tree
    verification and cost prefill ~1.1 ms per 1024 tokens (bench/results/tree-verify-20261201-
    040205 / -040313 vs -040240, 27B-style hybrid).  Returns (module, number of users fused)."""
    import tvm
    import tvm_ffi
    from tvm import relax, tirx
    from tvm.relax.expr_functor import PyExprMutator, mutator

    call_tir = tvm.ir.Op.get("relax.call_tir")
    producers = {gv for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc) and f.attrs and ATTR in f.attrs}
    if not producers:
        return mod, 0

    def tir_call(value):
        if isinstance(value, relax.Call) and value.op.same_as(call_tir) and isinstance(value.args[1], relax.Tuple):
            return value.args[0], list(value.args[1].fields)
        return None

    # per producer call: [(consumer binding var, consumer gv, consumer args, source index)], by position
    plans: list[tuple] = []
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue
            users = relax.analysis.udchain(block)
            order = {b.var: i for i, b in enumerate(block.bindings)}
            values = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
            for var, value in values.items():
                call = tir_call(value)
                if call is None or call[0] not in producers or not isinstance(var, relax.DataflowVar):
                    continue
                use = sorted(set(users.get(var, [])), key=lambda u: order.get(u, -1))
                if not use or any(u not in values for u in use) or (len(use) > 1 and not slices):
                    continue
                consumers = []
                for u in use:
                    c = tir_call(values[u])
                    if c is None or not isinstance(mod[c[0]], tirx.PrimFunc) or c[0] in producers or \
                            sum(1 for a in c[1] if a.same_as(var)) != 1:
                        break
                    consumers.append((u, c[0], c[1], next(i for i, a in enumerate(c[1]) if a.same_as(var))))
                else:
                    first = order[consumers[0][0]]
                    ready = all(order.get(a, -1) < first for _, _, args, _ in consumers for a in args
                                if isinstance(a, relax.Var) and not a.same_as(var))
                    if ready:
                        plans.append((var, call[0], call[1], consumers))
    if not plans:
        return mod, 0
    at_first = {p[3][0][0]: p for p in plans}                   # first consumer var -> plan
    later = {u for p in plans for u, *_ in p[3][1:]}             # the other consumers: bound by the fused call

    @mutator
    class _Fuse(PyExprMutator):
        def __init__(self, m):
            super().__init__(m)
            self.kernels, self.fused, self.done = [], 0, set()

        def kernel(self, prod_gv, consumers):
            """The fused PrimFunc's global var (one per producer and consumers alike in structure:
            prefill and verify share theirs), or None where a consumer is not an epilogue."""
            funcs = [mod[c_gv].without_attr("global_symbol") for _, c_gv, _, _ in consumers]
            sources = [src for *_, src in consumers]
            for key, gv in self.kernels:
                if key[0].same_as(prod_gv) and key[2] == sources and len(key[1]) == len(funcs) and \
                        all(tvm_ffi.structural_equal(a, b) for a, b in zip(key[1], funcs)):
                    return gv
            producer = mod[prod_gv]
            shape = producer.params[int(producer.attrs[ATTR])].ty.shape
            epis = None
            if len(shape) == 2 and isinstance(shape[1], tirx.IntImm):
                epis = [elementwise_epilogue(f, src, int(shape[1])) for f, src in zip(funcs, sources)]
                whole = all(e is not None and e.offset == 0 and e.width == int(shape[1]) for e in epis)
                epis = None if any(e is None for e in epis) or not (slices or whole) else epis
            gv = None if epis is None else self.builder_.add_func(
                fuse(producer, epis), "_".join([prod_gv.name_hint] + [c_gv.name_hint for _, c_gv, _, _ in consumers]))
            self.kernels.append(((prod_gv, funcs, sources), gv))
            return gv

        def visit_var_binding_(self, binding):
            if binding.var in later and binding.var in self.done:
                return                                   # bound by the fused call already
            plan = at_first.get(binding.var)
            fused = self.kernel(plan[1], plan[3]) if plan is not None else None
            if fused is None:
                return super().visit_var_binding_(binding)
            _, _, prod_args, consumers = plan
            args = [self.visit_expr(a) for a in prod_args] + \
                [self.visit_expr(a) for _, _, c_args, src in consumers for i, a in enumerate(c_args) if i != src]
            self.fused += len(consumers)
            outs = [bound[u].ty for u, *_ in consumers]
            if len(consumers) == 1:
                new = self.builder_.normalize(relax.call_tir(fused, args, outs[0]))
                self.builder_.emit_normalized(relax.VarBinding(binding.var, new))
                return
            tup = self.builder_.emit(relax.call_tir(fused, args, outs))
            for i, (u, *_) in enumerate(consumers):
                self.builder_.emit_normalized(relax.VarBinding(u, self.builder_.normalize(relax.TupleGetItem(tup, i))))
                self.done.add(u)

    bound = {b.var: b.value for f in mod.functions.values() if isinstance(f, relax.Function)
             for block in f.body.blocks for b in block.bindings}   # each consumer's call: its output type
    fuser = _Fuse(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            fuser.builder_.update_func(gv, fuser.visit_expr(func))
    if not fuser.fused:
        return mod, 0
    out = relax.transform.DeadCodeElimination()(fuser.builder_.get())
    return out, fuser.fused
