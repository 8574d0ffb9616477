"""The batch-1 decode step's projections as one GEMV kernel each, with the RMSNorm before them
inside: y[1, N] = norm(x)[1, K] . W[N, K]^T.

In a decode step every projection reads a weight matrix once for one row of x; every norm (two a
layer and the final one) as a kernel of its own between them would be 17 of the 81 kernels of a
Qwen3-8B-shape step (8 layers), ~35 us of GPU time plus their launch gaps on the H200 (``--trace``,
docs/bench-log.md).  dlight's GEMV rule cannot take a reduction before its own.  Here the norm is
the kernel's prologue: each block reads the row of x (8 KB at hidden 4096, from L2), sums its
squares (float32, a fixed order: each thread's pieces, then a warp butterfly, then the warps in
order), and writes the normalized row -- the build's own RMSNorm expression (`kernels.norms.rms_scaled`, the
same roundings) -- to shared memory, while the block's first weight loads are already in flight.
The order of the float32 sum of squares is not the standalone norm kernel's, so a fused build may
differ from an unfused one in the last bit of a norm's scale; token forcing is the check
(bench/gpu_forcing.py).

The GEMV: a block of ``THREADS`` (8 warps); each warp takes ``rows_per_warp`` weight rows in
turn; a lane reads 16-byte pieces q = 32 p + lane of a row (a warp's load is 512 contiguous
bytes), ``U`` pieces in flight, the next U issued before the current ones are multiplied
(registers, no barrier); products and sums in float32 as the legalized matmul (the order of the
float32 sums differs, as any schedule's does); a warp butterfly, then lane 0 stores.  Rows per
warp are chosen so that the grid is about one wave of resident blocks (`rows_per_warp`): every
warp does the same work and no tail wave is left.  Elementwise epilogues (the cast to bf16, the
residual add, the logits' rounding) fuse into the store through `epilogue.fuse_epilogues`.

SwiGLU over a fused gate / up projection (silu(gate) * up of the output's two halves) joins the GEMV
too (`fuse_pairs`, after FuseTIR): in the paired form a warp takes rows c and c + N / 2 one after
the other and stores the activation of the two sums once.  H200, Qwen3-8B shapes, context 512
(docs/bench-log.md): step function 1.37 ms (81 kernels) -> 1.31 with the norm prologue -> 1.26 (56
kernels, 80.2 % of the copy bandwidth) with the pairs and decode attention's value rows loaded with
its keys; 1.24 with CUDA graphs.

`substitute` (before FuseOps) points each static one-row bf16 NT matmul at this kernel, and a
matmul whose x is an `lower.RMSNorm` output (its PrimFunc carries ``lower.NORM_ATTR``) at the
prologue form -- every such use of a norm, so a norm read by three unfused q / k / v
projections is computed in each of the three and its own kernel dropped.
"""

from __future__ import annotations

import json
from functools import lru_cache

from specpilot.core.target import DEVICES, TUNED, Device

THREADS = 256          # a block: 8 warps
PIECE = 8              # bf16 elements per 16-byte load
UNROLL = 4             # 16-byte pieces a lane has in flight per row chunk (and as many being multiplied)
REGISTERS = 64         # a thread's registers, about (ptxas, sm_90)
DECODE_ATTR = "specpilot.decode_gemv"   # on the kernels: JSON of `decode_gemv`'s arguments but ``paired``


def applicable(n_out: int, k_in: int) -> bool:
    """Rows of whole 16-byte pieces; the normalized row (bf16) must fit in static shared memory."""
    return k_in % PIECE == 0 and k_in * 2 <= 40 * 1024 and n_out >= 1


def resident_blocks(gpu: Device = TUNED) -> int:
    """Blocks ``gpu`` holds at once: per SM as many as its registers and threads allow (H200: 132 SMs x
    4 blocks of 256 threads at ~64 registers a thread)."""
    per_sm = min(gpu.registers_per_sm // (THREADS * REGISTERS), gpu.threads_per_sm // THREADS)
    return gpu.sms * max(per_sm, 1)


def rows_per_warp(n_out: int, gpu: Device = TUNED) -> int:
    """Weight rows per warp: the fewest that keep the grid within one wave of resident blocks."""
    warps = THREADS // 32
    return max(1, -(-n_out // (warps * resident_blocks(gpu))))


def _unroll(pieces: int) -> int:
    """Pieces in flight per chunk: the largest divisor of a lane's pieces per row up to UNROLL."""
    return next(u for u in range(min(UNROLL, pieces), 0, -1) if pieces % u == 0)


@lru_cache(maxsize=None)
def decode_gemv(n_out: int, k_in: int, norm: str | None = None, dtype: str = "bfloat16", paired: bool = False,
                gpu: Device = TUNED):
    """The kernel: (x[1, K], W[N, K]) -> float32 y[1, N], or with ``norm`` (`lower.NORM_ATTR`'s JSON)
    (x[1, K], g[K], W[N, K]) -> y = RMSNorm(x; g) . W^T with `lower`'s RMSNorm arithmetic.
    ``paired`` (N even, H = N / 2): a warp takes rows c and c + H one after the other and stores
    y[0, c], then y[0, c + H] -- the same y, in the form `epilogue.fuse_pair` turns into one store
    of a SwiGLU-like consumer of both.  The grid is sized for ``gpu``.  Carries ``DECODE_ATTR`` (how
    to make it again, paired)."""
    from specpilot.kernels.fast_frames import quick_stack
    if paired and n_out % 2:
        raise ValueError(f"decode GEMV: a paired form needs an even N, not {n_out}")
    with quick_stack():
        kernel = _decode_gemv(n_out, k_in, json.loads(norm) if norm else None, dtype, paired, gpu)
    return kernel.with_attr(DECODE_ATTR, json.dumps({"n_out": n_out, "k_in": k_in, "norm": norm, "dtype": dtype,
                                                     "gpu": gpu.name}))


def _decode_gemv(n_out: int, k_in: int, norm: dict | None, dtype: str, paired: bool, gpu: Device):
    from tvm.script import tirx as T

    from specpilot.kernels.norms import rms_scaled

    if not applicable(n_out, k_in):
        raise ValueError(f"decode GEMV: K={k_in} is not a multiple of {PIECE} or its row does not fit in shared memory")
    N, K = n_out, k_in
    warps = THREADS // 32
    H = N // 2 if paired else N              # units a warp takes: rows, or pairs of rows (c, c + H)
    per = 2 if paired else 1                 # weight rows a unit
    upw = rows_per_warp(H, gpu)              # units per warp
    rpw = per * upw                          # weight rows per warp
    units_block = warps * upw
    blocks = -(-H // units_block)
    row_pieces = K // PIECE                  # 16-byte pieces per row
    P = -(-row_pieces // 32)                 # per lane (the last may be past the row: guarded)
    ragged = row_pieces % 32 != 0
    U = _unroll(P)
    PC = P // U                              # chunks per row
    items = rpw * PC
    SR = -(-row_pieces // THREADS)           # staging: pieces per thread
    stage_ragged = row_pieces % THREADS != 0

    def f32(v):
        return T.Cast("float32", v)

    def unit(bx, warp, r):
        """The unit (row, or pair c) of the warp's weight row r."""
        return bx * units_block + (r // per) * warps + warp

    @T.macro
    def load(wa, w, bx, warp, lane, item):
        """The lane's U pieces of chunk ``item`` (weight row item // PC of the warp -- paired: row
        c, then c + H -- chunk item % PC), units past the last clamped (never stored), pieces past
        the row clamped (weighted 0)."""
        for u in T.unroll(U):
            for v in T.vectorized(PIECE):
                wa[u, v] = w[T.min(unit(bx, warp, item // PC), H - 1) + (item // PC) % per * H,
                             T.min(((item % PC) * U + u) * 32 + lane, row_pieces - 1) * PIECE + v]

    @T.macro
    def body(x, g, w, y, bx, tid):
        warp, lane = tid // 32, tid % 32
        xs = T.alloc_buffer((K,), dtype, scope="shared")
        xr = T.alloc_buffer((SR, PIECE), dtype, scope="local")
        wa = T.alloc_buffer((U, PIECE), dtype, scope="local")
        wb = T.alloc_buffer((U, PIECE), dtype, scope="local")
        xv = T.alloc_buffer((PIECE,), dtype, scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        first = T.alloc_buffer((1,), "float32", scope="local")
        red = T.alloc_buffer((warps,), "float32", scope="shared")
        ss = T.alloc_buffer((1,), "float32", scope="local")
        # the first chunk's weights in flight before the row of x is staged
        load(wa, w, bx, warp, lane, 0)
        for i in T.unroll(SR):
            if not stage_ragged or i * THREADS + tid < row_pieces:
                for v in T.vectorized(PIECE):
                    xr[i, v] = x[0, (i * THREADS + tid) * PIECE + v]
        if norm is None:
            for i in T.unroll(SR):
                if not stage_ragged or i * THREADS + tid < row_pieces:
                    for v in T.vectorized(PIECE):
                        xs[(i * THREADS + tid) * PIECE + v] = xr[i, v]
        else:
            # sum of squares: the thread's pieces, a warp butterfly, the warps in order
            ss[0] = T.float32(0)
            for i in T.unroll(SR):
                if not stage_ragged or i * THREADS + tid < row_pieces:
                    for v in T.unroll(PIECE):
                        ss[0] = ss[0] + f32(xr[i, v]) * f32(xr[i, v])
            for s in T.unroll(5):
                ss[0] = ss[0] + T.tvm_warp_shuffle_xor(T.tvm_warp_activemask(), ss[0], T.shift_right(16, s), 32, 32)
            if lane == 0:
                red[warp] = ss[0]
            T.tvm_storage_sync("shared")
            ss[0] = red[0]
            for j in T.unroll(warps - 1):
                ss[0] = ss[0] + red[j + 1]
            for i in T.unroll(SR):
                if not stage_ragged or i * THREADS + tid < row_pieces:
                    for v in T.unroll(PIECE):
                        xs[(i * THREADS + tid) * PIECE + v] = T.Cast(dtype, rms_scaled(
                            f32(xr[i, v]), ss[0], K, g[(i * THREADS + tid) * PIECE + v], float(norm["eps"]),
                            bool(norm["zero_centered"]), dtype, bool(norm["spelled"])))
        T.tvm_storage_sync("shared")
        for r in T.serial(rpw):
            acc[0] = T.float32(0)
            for c in T.serial(PC):
                for u in T.unroll(U):
                    for v in T.unroll(PIECE):
                        wb[u, v] = wa[u, v]
                if r * PC + c + 1 < items:     # the next chunk's loads before this one's products
                    load(wa, w, bx, warp, lane, r * PC + c + 1)
                for u in T.unroll(U):
                    if not ragged or (c * U + u) * 32 + lane < row_pieces:
                        for v in T.vectorized(PIECE):
                            xv[v] = xs[T.min((c * U + u) * 32 + lane, row_pieces - 1) * PIECE + v]
                        for v in T.unroll(PIECE):
                            acc[0] = acc[0] + f32(xv[v]) * f32(wb[u, v])
            for s in T.unroll(5):
                acc[0] = acc[0] + T.tvm_warp_shuffle_xor(T.tvm_warp_activemask(), acc[0], T.shift_right(16, s), 32, 32)
            if not paired:
                if lane == 0 and unit(bx, warp, r) < N:
                    y[0, unit(bx, warp, r)] = acc[0]
            elif r % 2 == 0:
                first[0] = acc[0]        # row c's sum (every lane has it after the butterfly)
            elif lane == 0 and unit(bx, warp, r) < H:
                y[0, unit(bx, warp, r)] = first[0]
                y[0, unit(bx, warp, r) + H] = acc[0]

    if norm is None:
        @T.prim_func(private=True, s_tir=True)
        def kernel(x: T.Buffer((1, K), dtype), w: T.Buffer((N, K), dtype), y: T.Buffer((1, N), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                for bx in T.thread_binding(blocks, thread="blockIdx.x"):
                    for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                        body(x, None, w, y, bx, tid)
    else:
        @T.prim_func(private=True, s_tir=True)
        def kernel(x: T.Buffer((1, K), dtype), g: T.Buffer((K,), dtype), w: T.Buffer((N, K), dtype),
                   y: T.Buffer((1, N), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            with T.sblock("root"):
                for bx in T.thread_binding(blocks, thread="blockIdx.x"):
                    for tid in T.thread_binding(THREADS, thread="threadIdx.x"):
                        body(x, g, w, y, bx, tid)
    return kernel


def decode_shape(func) -> tuple[int, int] | None:
    """(N, K) when ``func`` is exactly the legalized ``x[1, K] . W[N, K]^T`` (bf16 in, float32 out,
    one static row), else None."""
    from specpilot.schedules.skinny_mma import nt_matmul_parts
    parts = nt_matmul_parts(func)
    if parts is None:
        return None
    m, n, k = parts
    return (n, k) if m == 1 and applicable(n, k) else None


def substitute(mod, gpu: Device = TUNED):
    """Every call_tir of a one-row bf16 NT matmul (`decode_shape`) pointed at `decode_gemv` (sized for
    ``gpu``); where
    its x is the output of an RMSNorm call (`lower.NORM_ATTR`) whose every use is such a matmul, at the
    prologue form reading the norm's input and weight (the norm's call then dead).  Kernels are
    opaque to FuseOps and carry `epilogue.ATTR`.  Returns (module, number substituted)."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from specpilot.kernels.norms import NORM_ATTR
    from specpilot.schedules.epilogue import ATTR as EPILOGUE_OUTPUT, dataflow_blocks, rewrite_functions, tir_call
    shapes = {gv: decode_shape(f) for gv, f in mod.functions.items()}
    shapes = {gv: s for gv, s in shapes.items() if s is not None}
    if not shapes:
        return mod, 0
    norms = {gv: str(f.attrs[NORM_ATTR]) for gv, f in mod.functions.items()
             if isinstance(f, tirx.PrimFunc) and f.attrs and NORM_ATTR in f.attrs}
    call_tir = tvm.ir.Op.get("relax.call_tir")
    # norm outputs whose every use is a substitutable matmul (as its x): var -> (norm JSON, x, g)
    fusable = {}
    for values, users in dataflow_blocks(mod):
        for var, value in values.items():
            call = tir_call(value)
            if call is None or call[0] not in norms or len(call[1]) != 2 or not isinstance(var, relax.DataflowVar):
                continue
            uses = users.get(var, [])
            ok = bool(uses)
            for u in uses:
                c = tir_call(values.get(u))
                ok = ok and c is not None and c[0] in shapes and c[1][0].same_as(var) and \
                    not any(a.same_as(var) for a in c[1][1:])
            if ok:
                fusable[var] = (norms[call[0]], call[1][0], call[1][1])

    @mutator
    class _Swap(PyExprMutator):
        def __init__(self, m):
            super().__init__(m)
            self.kernels, self.swapped = {}, 0

        def kernel(self, shape, norm):
            if (shape, norm) not in self.kernels:
                k = decode_gemv(*shape, norm, gpu=gpu).with_attr("op_pattern", 8)        # kOpaque
                k = k.with_attr(EPILOGUE_OUTPUT, 3 if norm else 2)
                name = f"decode_gemv{'_norm' if norm else ''}_{shape[0]}_{shape[1]}"
                self.kernels[(shape, norm)] = self.builder_.add_func(k, name)
            return self.kernels[(shape, norm)]

        def visit_call_(self, call):
            if call.op.same_as(call_tir) and call.args[0] in shapes and isinstance(call.args[1], relax.Tuple):
                x, w = call.args[1].fields[:2]
                self.swapped += 1
                if x in fusable:
                    norm, xin, g = fusable[x]
                    args = [self.visit_expr(xin), self.visit_expr(g), self.visit_expr(w)]
                    return relax.call_tir(self.kernel(shapes[call.args[0]], norm), args, call.ty)
                return relax.call_tir(self.kernel(shapes[call.args[0]], None),
                                      [self.visit_expr(x), self.visit_expr(w)], call.ty)
            return super().visit_call_(call)

    swap = _Swap(mod)
    return rewrite_functions(mod, swap, lambda: swap.swapped)


def fuse_pairs(mod):
    """After FuseTIR: a `decode_gemv` call whose one user maps its columns c and c + N / 2 to the
    user's c (SwiGLU over a fused gate / up projection: `epilogue.paired_epilogue`) becomes one
    kernel -- the paired form, each warp's two rows' sums going straight into the user's
    expression, stored once: the activation's kernel and the float32 [1, N] between them gone.
    Returns (module, number fused)."""
    from specpilot.schedules.epilogue import fuse_paired_users
    return fuse_paired_users(mod, DECODE_ATTR, lambda spec: decode_gemv(
        spec["n_out"], spec["k_in"], spec["norm"], spec["dtype"], paired=True, gpu=DEVICES[spec["gpu"]]))
