"""Elementwise epilogues fused into the skinny GEMM kernels' stores.

`skinny_mma.substitute` keeps its kernels opaque to FuseOps, so what follows a projection ran as
kernels of their own: the cast to bf16, the residual add, the logits' bf16 rounding -- a float32
[m, N] written, read back and rewritten, one launch each (9 of a 27B-style hybrid's tree
verification's ~147 kernels).  The decode GEMVs (dlight) always fused theirs.  `fuse_epilogues`
runs after FuseTIR: where the one user of a skinny kernel's float32 output is an elementwise map
of all of it -- every block a spatial ``buf[i, j] = f(...)``, the last over the output's own
[m, N], reading the GEMM output at exactly [i, j], earlier blocks' intermediates inlined where
read, other inputs (the residual, biases) at any index -- the user's blocks are composed into one
expression and every store ``y[r, c] = acc`` of the kernel becomes ``out[r, c] = f(acc, r, c)``.
The arithmetic is the user's own expression tree with the same dtypes and casts; only where it
runs changes (TVM's bf16 legalization then lowers it the same way), so a fused build computes bit
for bit what the unfused one does (on the H200, the 27B-style hybrid's prefill, AR-step and
tree-verify logits, conv states and records: bench/README "Build comparison").
Users that move or drop elements (a slice, a transpose, a repeat) keep the float32 output; SwiGLU's
two columns of a fused gate/up output (`paired_epilogue`) go into the paired forms of the decode
GEMV (`decode_gemv.fuse_pairs`) and of the skinny warpgroup kernels (`skinny_mma.fuse_pairs`).
(Column slices fused with one kernel output per user measure bit-identical, no faster and with
prefill slower, so they are not fused; docs/bench-log.md.)

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
    expr: object        # the composed value: over ROW, COL, ACC
    row: object
    col: object
    acc: object


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
    elementwise map over the whole [rows, ``n_out``] of parameter ``source`` (the GEMM output)
    reading it only at its own element; else None.  Blocks before the last may compute
    intermediates over any spatial domain (e.g. -exp(A) per head from a parameter): each is
    inlined where it is read."""
    composed = _compose(consumer, source, n_out)
    if composed is None:
        return None
    final, row, col, src, params = composed
    from tvm import tirx
    acc = tirx.Var("acc", "float32")
    final = _accumulators(final, src, row, [(col, acc)])
    return None if final is None else Epilogue(params, consumer.params[-1], final, row, col, acc)


@dataclass
class PairEpilogue:
    """A consumer of a [rows, 2 H] GEMM output that reads, for its element [r, c] of [rows, H],
    exactly the GEMM's [r, c] and [r, c + H] (SwiGLU over a fused gate / up projection)."""
    params: list
    out: object
    expr: object        # over ROW, COL, ACC_A (the GEMM's [r, c]), ACC_B ([r, c + H])
    row: object
    col: object
    acc_a: object
    acc_b: object


def paired_epilogue(consumer, source: int, n_out: int) -> PairEpilogue | None:
    """The consumer as one expression of two accumulators when it maps the GEMM output's [r, c]
    and [r, c + n_out / 2] to its own [r, c] over [rows, n_out / 2] (`PairEpilogue`); else None."""
    from tvm import tirx
    if n_out % 2:
        return None
    composed = _compose(consumer, source, n_out // 2)
    if composed is None:
        return None
    final, row, col, src, params = composed
    a, b = tirx.Var("acc_a", "float32"), tirx.Var("acc_b", "float32")
    final = _accumulators(final, src, row, [(col, a), (col + tirx.const(n_out // 2, "int64"), b)])
    return None if final is None else PairEpilogue(params, consumer.params[-1], final, row, col, a, b)


def _accumulators(final, src, row, columns):
    """``final`` with every read of the GEMM output ``src`` at [row, column] replaced by that
    column's accumulator (``columns``: [(column expression, Var)]); None where it reads ``src``
    anywhere else."""
    from tvm.sym.analyzer import Analyzer
    analyzer, bad = Analyzer(), []

    def src_loads(load, mut):
        if not load.source.same_as(src):
            return None
        if len(load.indices) == 2 and load.indices[0].same_as(row):
            hit = next((v for c, v in columns if analyzer.can_prove_equal(load.indices[1], c)), None)
            if hit is not None:
                return hit
        bad.append(load)
        return None
    final = _substitute(final, [], src_loads)
    return None if bad else final


def _compose(consumer, source: int, out_cols: int):
    """The consumer's blocks composed into one expression of its last block's element [ROW, COL]
    -- (expression, ROW, COL, the GEMM output parameter, the parameters but it) -- when every block
    is a plain spatial map, the last one over [rows of the GEMM output, ``out_cols``], earlier ones'
    intermediates inlined where read; else None.  Reads of the GEMM output are left in."""
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
    row, col = tirx.Var("row", "int64"), tirx.Var("col", "int64")
    known: list[tuple] = []          # (intermediate buffer, its iterators, its expression over them)
    blocks = _sblocks(consumer)
    if not blocks:
        return None
    analyzer, final = Analyzer(), None
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
            # the last block covers the output's every element: the GEMM's rows and ``out_cols`` columns
            if n != len(blocks) - 1 or len(ivs) != 2 or len(src.ty.shape) != 2 or \
                    not analyzer.can_prove_equal(ivs[0].dom.extent, src.ty.shape[0]) or \
                    not analyzer.can_prove_equal(ivs[1].dom.extent, tirx.const(out_cols, "int64")):
                return None
            final = _substitute(value, [(ivs[0].var, row), (ivs[1].var, col)], lambda l, m: None)
        elif any(store.buffer.same_as(p) for p in params):
            return None      # writes another parameter: not an elementwise map
        else:
            known.append((store.buffer, [iv.var for iv in ivs], value))
    if final is None:
        return None
    left = []
    tvm_ffi.structural_walk(final, [(TensorLoad, lambda load: left.append(load)
                                     if any(load.source.same_as(b) for b, _, _ in known) else None)])
    if left:
        return None
    return final, row, col, src, [p for i, p in enumerate(params) if i != source]


def fuse(producer, epilogue: Epilogue):
    """``producer`` (stores only to its parameter ``ATTR``) with each store ``y[r, c] = v`` made
    ``out[r, c] = epilogue(v, r, c)``; parameters: the producer's without y, the epilogue's
    inputs, then its output (destination-passing order)."""
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad

    index = int(producer.attrs[ATTR])
    y = producer.params[index]
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
        expr = _substitute(epilogue.expr, [(epilogue.row, r), (epilogue.col, c), (epilogue.acc, mut.mutate(store.value))],
                           lambda load, m: None)
        return tirx.BufferStore(epilogue.out, expr, [r, c])
    body = tvm_ffi.structural_mutate(producer.body, [(tirx.BufferStore, on_store)])
    params = [p for i, p in enumerate(producer.params) if i != index] + list(epilogue.params)
    attrs = {k: v for k, v in producer.attrs.items() if k != ATTR}
    return tirx.PrimFunc(params, body).with_attrs(attrs)


def fuse_pair(producer, epilogue: PairEpilogue):
    """``producer`` (its stores to its parameter ``ATTR`` come in pairs, ``y[r, c] = a`` then
    ``y[r, c + H] = b``, as `decode_gemv`'s paired form writes them) with each pair made one
    ``out[r, c] = epilogue(a, b, r, c)``; parameters as `fuse`."""
    import tvm_ffi
    from tvm import tirx

    index = int(producer.attrs[ATTR])
    y = producer.params[index]
    found = []

    def is_y(stmt):
        return isinstance(stmt, tirx.BufferStore) and stmt.buffer.same_as(y)

    def on_seq(seq, mut):
        stmts, out, i = list(seq.seq), [], 0
        while i < len(stmts):
            if is_y(stmts[i]) and i + 1 < len(stmts) and is_y(stmts[i + 1]):
                first, second = stmts[i], stmts[i + 1]
                r, c = (tirx.Cast("int64", e) if str(e.ty) != "int64" else e for e in first.indices)
                expr = _substitute(epilogue.expr, [(epilogue.row, r), (epilogue.col, c), (epilogue.acc_a, first.value),
                                                   (epilogue.acc_b, second.value)], lambda load, m: None)
                out.append(tirx.BufferStore(epilogue.out, expr, [r, c]))
                found.append(first)
                i += 2
            else:
                out.append(mut.mutate(stmts[i]))
                i += 1
        return tirx.SeqStmt(out) if len(out) > 1 else out[0]
    body = tvm_ffi.structural_mutate(producer.body, [(tirx.SeqStmt, on_seq)])
    left = []
    tvm_ffi.structural_walk(body, [(tirx.BufferStore, lambda st: left.append(st) if st.buffer.same_as(y) else None)])
    if not found or left:
        raise ValueError("the producer does not store its output in (a, b) pairs: it cannot take a pair epilogue")
    params = [p for i, p in enumerate(producer.params) if i != index] + list(epilogue.params)
    attrs = {k: v for k, v in producer.attrs.items() if k != ATTR}
    return tirx.PrimFunc(params, body).with_attrs(attrs)


def fuse_paired_users(mod, spec_attr: str, paired_kernel):
    """Every call of a producer carrying ``spec_attr`` (JSON of how to make it again, "n_out" among
    it) whose one user is a `paired_epilogue` of its output, fused with that user into
    ``paired_kernel(spec)`` -- the producer's paired form (stores of columns c and c + N / 2 one
    after the other), or None where it has none -- by `fuse_pair`.  Returns (module, number fused)."""
    import json

    def make(producer, consumer, source):
        spec = json.loads(str(producer.attrs[spec_attr]))
        epi = paired_epilogue(consumer, source, spec["n_out"])
        kernel = paired_kernel(spec) if epi is not None else None
        if kernel is None:
            return None
        return fuse_pair(kernel.with_attr("op_pattern", 8).with_attr(ATTR, int(producer.attrs[ATTR])), epi)
    return fuse_users(mod, lambda f: spec_attr in f.attrs and ATTR in f.attrs, make)


def fuse_epilogues(mod):
    """Every call of an epilogue producer whose one user is an elementwise map of its whole
    output, fused with it into one kernel (see the module docstring).  Returns (module, number
    fused)."""
    from tvm import tirx

    def make(producer, consumer, source):
        shape = producer.params[int(producer.attrs[ATTR])].ty.shape
        epi = elementwise_epilogue(consumer, source, int(shape[1])) \
            if len(shape) == 2 and isinstance(shape[1], tirx.IntImm) else None
        return None if epi is None else fuse(producer, epi)
    return fuse_users(mod, lambda f: ATTR in f.attrs, make)


def tir_call(value):
    """(PrimFunc global var, argument list) of a ``call_tir`` with a tuple of arguments, else None."""
    import tvm
    from tvm import relax
    if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")) and \
            isinstance(value.args[1], relax.Tuple):
        return value.args[0], list(value.args[1].fields)
    return None


def dataflow_blocks(mod):
    """Each dataflow block of the module's Relax functions as (its bindings' values by variable, its
    variables' users)."""
    from tvm import relax
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                yield ({b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)},
                       relax.analysis.udchain(block))


def rewrite_functions(mod, mutator, changed):
    """Every Relax function of ``mod`` through ``mutator`` (a PyExprMutator over it); with
    ``changed()`` > 0 after, the new module without dead code, else ``mod``: (module, changed())."""
    from tvm import relax
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    if not changed():
        return mod, 0
    return relax.transform.DeadCodeElimination()(mutator.builder_.get()), changed()


def fuse_users(mod, is_producer, make):
    """Every call of a PrimFunc with ``is_producer(func)`` whose output's one user is a call of a
    PrimFunc (``consumer``, reading it as one argument, ``source``): where ``make(producer,
    consumer, source)`` gives a kernel (else None: left as is), the two calls become one of it,
    with the producer's arguments, then the consumer's others.  Kernels are made once per producer
    and consumer alike in structure (prefill and verify share theirs).  Returns (module, number
    fused)."""
    import tvm_ffi
    from tvm import relax, tirx
    from tvm.relax.expr_functor import PyExprMutator, mutator

    producers = {gv for gv, f in mod.functions.items()
                 if isinstance(f, tirx.PrimFunc) and f.attrs and is_producer(f)}
    if not producers:
        return mod, 0
    plan = {}        # consumer binding var -> (producer gv, producer args, consumer gv, consumer args, source index)
    for values, users in dataflow_blocks(mod):
        for var, value in values.items():
            call = tir_call(value)
            if call is None or call[0] not in producers or not isinstance(var, relax.DataflowVar):
                continue
            use = set(users.get(var, []))
            if len(use) != 1:
                continue
            (user,) = use
            consumer = tir_call(values.get(user))
            if consumer is None or not isinstance(mod[consumer[0]], tirx.PrimFunc) or consumer[0] in producers:
                continue
            sources = [i for i, a in enumerate(consumer[1]) if a.same_as(var)]
            if len(sources) == 1:
                plan[user] = (call[0], call[1], consumer[0], consumer[1], sources[0])
    if not plan:
        return mod, 0

    @mutator
    class _Fuse(PyExprMutator):
        def __init__(self, m):
            super().__init__(m)
            self.kernels, self.fused = [], 0

        def kernel(self, prod_gv, cons_gv, source):
            """The fused PrimFunc's global var, or None where ``make`` declines."""
            consumer = mod[cons_gv].without_attr("global_symbol")
            for (p_gv, c_func, src), gv in self.kernels:
                if p_gv.same_as(prod_gv) and src == source and tvm_ffi.structural_equal(c_func, consumer):
                    return gv
            fused = make(mod[prod_gv], consumer, source)
            gv = None if fused is None else self.builder_.add_func(fused, f"{prod_gv.name_hint}_{cons_gv.name_hint}")
            self.kernels.append(((prod_gv, consumer, source), gv))
            return gv

        def visit_var_binding_(self, binding):
            entry = plan.get(binding.var)
            fused = self.kernel(entry[0], entry[2], entry[4]) if entry is not None else None
            if fused is None:
                return super().visit_var_binding_(binding)
            _, prod_args, _, cons_args, source = entry
            args = [self.visit_expr(a) for a in prod_args] + \
                [self.visit_expr(a) for i, a in enumerate(cons_args) if i != source]
            self.fused += 1
            new = self.builder_.normalize(relax.call_tir(fused, args, binding.value.ty))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, new))

    fuser = _Fuse(mod)
    return rewrite_functions(mod, fuser, lambda: fuser.fused)
