"""Elementwise epilogues fused into the skinny GEMM kernels' stores.

`skinny_mma.substitute` keeps its kernels opaque to FuseOps, so the cast to bf16 after every
projection, the residual add after the output projections and the logits' bf16 rounding ran as
kernels of their own: a float32 [m, N] written, read back and rewritten in bf16, one launch each
(16-19 of a 27B-style hybrid's tree verification's ~150 kernels).  The decode GEMVs (dlight)
always fused them.  `fuse_epilogues` runs after FuseTIR: where a skinny kernel's float32 output
has one user, and that user is an elementwise PrimFunc over the same [m, N] -- every block a
spatial map ``buf[i, j] = f(...)`` whose reads of the GEMM output and of its own intermediates
are at exactly [i, j] (other inputs, e.g. the residual, at any index of i, j) -- the user's
expression is composed into one, and every store ``y[r, c] = acc`` of the kernel becomes
``out[r, c] = f(acc, r, c)``.  The arithmetic is the consumer's own expression tree, with the
same dtypes and casts; only where it runs changes (TVM's bf16 legalization then lowers it the
same way), so the fused build computes bit for bit what the unfused one does.  Consumers that
move elements (slices, transposes, repeats) stay separate kernels.

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


def _substitute(expr, vars_: dict, loads):
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


def _same_vars(indices, row, col) -> bool:
    return len(indices) == 2 and indices[0].same_as(row) and indices[1].same_as(col)


def elementwise_epilogue(consumer, source: int, n_out: int) -> Epilogue | None:
    """The consumer's computation as one expression of the GEMM's accumulator, when it is an
    elementwise map over [rows, ``n_out``] reading parameter ``source`` (the GEMM output) only at
    its own element; else None."""
    from tvm import tirx
    from tvm.ir.expr import TensorLoad

    params = list(consumer.params)
    if not 0 <= source < len(params) - 1:
        return None
    src, out = params[source], params[-1]
    if any(p.same_as(src) for i, p in enumerate(params) if i != source):
        return None
    row, col, acc = tirx.Var("row", "int64"), tirx.Var("col", "int64"), tirx.Var("acc", "float32")
    known: list[tuple] = []          # (intermediate buffer, its expression over row, col, acc)
    blocks = _sblocks(consumer)
    if not blocks:
        return None
    final = None
    for n, realize in enumerate(blocks):
        block = realize.block
        ivs = list(block.iter_vars)
        if len(ivs) != 2 or any(int(iv.iter_type) != 0 for iv in ivs) or block.init is not None \
                or block.match_buffers or not isinstance(realize.predicate, tirx.IntImm) \
                or int(realize.predicate.value) != 1:
            return None
        if any(not isinstance(iv.dom.min, tirx.IntImm) or int(iv.dom.min.value) != 0 for iv in ivs) or \
                not isinstance(ivs[1].dom.extent, tirx.IntImm) or int(ivs[1].dom.extent.value) != n_out:
            return None
        store = block.body
        if not isinstance(store, tirx.BufferStore) or not _same_vars(store.indices, ivs[0].var, ivs[1].var):
            return None
        bad = []

        def loads(load, mut, ivs=ivs, bad=bad):
            if load.source.same_as(src) or any(load.source.same_as(b) for b, _ in known):
                if not _same_vars(load.indices, row, col):
                    bad.append(load)
                    return None
                if load.source.same_as(src):
                    return acc
                return next(e for b, e in known if load.source.same_as(b))
            if any(load.source.same_as(b) for b in block.alloc_buffers):
                bad.append(load)
            return None
        # rename the block's iterators to (row, col) first, then inline loads
        value = _substitute(store.value, [(ivs[0].var, row), (ivs[1].var, col)], lambda load, mut: None)
        value = _substitute(value, [], loads)
        if bad:
            return None
        if store.buffer.same_as(out):
            if n != len(blocks) - 1:
                return None
            final = value
        elif any(store.buffer.same_as(p) for p in params):
            return None      # writes another parameter: not an elementwise map
        else:
            known.append((store.buffer, value))
    if final is None:
        return None
    # nothing of the GEMM output or of intermediates may survive in the expression
    import tvm_ffi
    left = []
    tvm_ffi.structural_walk(final, [(TensorLoad, lambda load: left.append(load) if load.source.same_as(src)
                                     or any(load.source.same_as(b) for b, _ in known) else None)])
    if left:
        return None
    return Epilogue([p for i, p in enumerate(params) if i != source], out, final, row, col, acc)


def fuse(producer, epilogue: Epilogue):
    """``producer`` (stores only to its parameter ``ATTR``) with each store ``y[r, c] = v`` made
    ``out[r, c] = epilogue(v, r, c)``; parameters: the producer's without y, then the epilogue's."""
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad

    index = int(producer.attrs[ATTR])
    y = producer.params[index]
    read = []
    tvm_ffi.structural_walk(producer.body, [(TensorLoad, lambda load: read.append(load) if load.source.same_as(y) else None)])
    if read:
        raise ValueError("the producer reads its output: it cannot take an epilogue")

    def on_store(store, mut):
        if not store.buffer.same_as(y):
            return mut.default_mutate(store)
        r, c = store.indices
        r, c = (tirx.Cast("int64", r) if str(r.ty) != "int64" else r), (tirx.Cast("int64", c) if str(c.ty) != "int64" else c)
        value = mut.mutate(store.value)
        expr = _substitute(epilogue.expr, [(epilogue.row, r), (epilogue.col, c), (epilogue.acc, value)],
                           lambda load, m: None)
        return tirx.BufferStore(epilogue.out, expr, list(store.indices))
    body = tvm_ffi.structural_mutate(producer.body, [(tirx.BufferStore, on_store)])
    params = [p for i, p in enumerate(producer.params) if i != index] + list(epilogue.params)
    attrs = {k: v for k, v in producer.attrs.items() if k != ATTR}
    return tirx.PrimFunc(params, body).with_attrs(attrs)


def fuse_epilogues(mod):
    """Every call of an epilogue producer whose output one elementwise call_tir consumes, fused
    into one kernel (see the module docstring).  Returns (module, number fused)."""
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

    plan = {}        # consumer binding var -> (producer binding var, producer gv, producer args, consumer gv)
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            if not isinstance(block, relax.DataflowBlock):
                continue
            users = relax.analysis.udchain(block)
            values = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
            for var, value in values.items():
                call = tir_call(value)
                if call is None or call[0] not in producers or not isinstance(var, relax.DataflowVar):
                    continue
                use = list(users.get(var, []))
                if len(use) != 1 or use[0] not in values or use[0] in plan:
                    continue
                consumer = tir_call(values[use[0]])
                if consumer is None or not isinstance(mod[consumer[0]], tirx.PrimFunc) or consumer[0] in producers:
                    continue
                if sum(1 for a in consumer[1] if a.same_as(var)) != 1:
                    continue
                plan[use[0]] = (var, call[0], call[1], consumer[0], consumer[1])
    if not plan:
        return mod, 0

    @mutator
    class _Fuse(PyExprMutator):
        def __init__(self, m):
            super().__init__(m)
            self.kernels, self.fused = {}, 0

        def visit_var_binding_(self, binding):
            entry = plan.get(binding.var)
            if entry is None:
                return super().visit_var_binding_(binding)
            var, prod_gv, prod_args, cons_gv, cons_args = entry
            source = next(i for i, a in enumerate(cons_args) if a.same_as(var))
            # one kernel per (producer, consumer up to structure): prefill and verify share theirs
            consumer = mod[cons_gv].without_attr("global_symbol")
            key = next((k for k in self.kernels if k[0].same_as(prod_gv) and k[2] == source
                        and tvm_ffi.structural_equal(k[1], consumer)), None) or (prod_gv, consumer, source)
            if key not in self.kernels:
                producer = mod[prod_gv]
                shape = producer.params[int(producer.attrs[ATTR])].ty.shape
                n_out = int(shape[1]) if len(shape) == 2 and isinstance(shape[1], tirx.IntImm) else None
                epi = elementwise_epilogue(consumer, source, n_out) if n_out is not None else None
                self.kernels[key] = None if epi is None else self.builder_.add_func(
                    fuse(producer, epi), f"{prod_gv.name_hint}_{cons_gv.name_hint}")
            fused = self.kernels[key]
            if fused is None:
                return super().visit_var_binding_(binding)
            args = [self.visit_expr(a) for a in prod_args] + \
                [self.visit_expr(a) for i, a in enumerate(cons_args) if i != source]
            self.fused += 1
            new = self.builder_.normalize(relax.call_tir(fused, args, binding.value.ty))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, new))

    fuser = _Fuse(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            fuser.builder_.update_func(gv, fuser.visit_expr(func))
    if not fuser.fused:
        return mod, 0
    out = relax.transform.DeadCodeElimination()(fuser.builder_.get())
    return out, fuser.fused
