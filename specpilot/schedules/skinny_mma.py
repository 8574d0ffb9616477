"""The skinny GEMMs in a build: find the legalized ``x[m, K] . W[N, K]^T`` matmuls with a symbolic row
count and substitute `skinny_kernels.skinny_nt_matmul` for them (with the elementwise user of the
output fused into its stores), and SwiGLU over fused gate / up projections in the paired form's
stores (`fuse_pairs`)."""

from __future__ import annotations

import json

from specpilot.core.target import DEVICES, TUNED, Device
from specpilot.schedules.skinny_config import applicable
from specpilot.schedules.skinny_kernels import SKINNY_ATTR, pairable, skinny_nt_matmul


def nt_matmul_shape(func) -> tuple[int, int] | None:
    """(N, K) when ``func`` is exactly the legalized ``x[m, K] . W[N, K]^T`` with a symbolic row
    count m, or a static one above 1 (a fixed-size verification: the kernel takes its rows at the
    call), bf16 inputs, float32 products and sums, one block, nothing fused; else None."""
    parts = nt_matmul_parts(func)
    if parts is None or (isinstance(parts[0], int) and parts[0] < 2):
        return None     # one static row (the single-sequence decode step): `decode_gemv`'s
    return parts[1], parts[2]


def nt_matmul_parts(func) -> tuple | None:
    """(m, N, K) when ``func`` is exactly the legalized ``x[m, K] . W[N, K]^T`` (bf16 inputs, float32
    products and sums, one block, nothing fused; m an int where static, else its Var), else None."""
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import get_root_block

    if not isinstance(func, tirx.PrimFunc) or "tirx.is_scheduled" in (func.attrs or {}):
        return None
    try:
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
    except Exception:   # not a schedulable function: not ours to replace
        return None
    if len(blocks) != 1:
        return None
    block = sch.get(blocks[0])
    if len(block.reads) != 2 or len(block.writes) != 1 or len(block.iter_vars) != 3:
        return None
    (x, w), y = (r.source for r in block.reads), block.writes[0].source
    if (str(x.dtype), str(w.dtype), str(y.dtype)) != ("bfloat16", "bfloat16", "float32") or \
            len(x.shape) != 2 or len(w.shape) != 2 or len(y.shape) != 2 or \
            not all(isinstance(d, tirx.IntImm) for d in (*w.shape, x.shape[1], y.shape[1])):
        return None
    i, j, k = (iv.var for iv in block.iter_vars)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    def at(region, *vs):
        return len(region) == len(vs) and all(r.min.same_as(v) and int(r.extent) == 1 for r, v in zip(region, vs))
    if kinds != [0, 0, 2] or not (at(block.reads[0].region, i, k) and at(block.reads[1].region, j, k)
                                  and at(block.writes[0].region, i, j)):
        return None
    n, kk = int(w.shape[0]), int(w.shape[1])
    if int(x.shape[1]) != kk or int(y.shape[1]) != n:
        return None
    m = int(x.shape[0]) if isinstance(x.shape[0], tirx.IntImm) else x.shape[0]
    return (m, n, kk) if _is_plain_product(block, x, w, y) else None


def _is_plain_product(block, x, w, y) -> bool:
    """The block computes y[i, j] += f32(x[i, k]) * f32(w[j, k]) from a zero init."""
    from tvm import tirx
    from tvm.ir.expr import TensorLoad
    body, init = block.body, block.init
    if not (isinstance(init, tirx.BufferStore) and init.buffer.same_as(y) and isinstance(init.value, tirx.FloatImm)
            and init.value.value == 0):
        return False
    if not (isinstance(body, tirx.BufferStore) and isinstance(body.value, tirx.Add)):
        return False
    acc, prod = body.value.a, body.value.b
    if not (body.buffer.same_as(y) and isinstance(acc, TensorLoad) and acc.source.same_as(y)
            and isinstance(prod, tirx.Mul)):
        return False
    loads = []
    for side in (prod.a, prod.b):
        if not (isinstance(side, tirx.Cast) and str(side.ty) == "float32" and isinstance(side.value, TensorLoad)):
            return False
        loads.append(side.value.source)
    return loads[0].same_as(x) and loads[1].same_as(w)


def substitute(mod, wgmma: bool = False, gpu: Device = TUNED):
    """Point every call_tir of a plain bf16 NT matmul whose shape a configuration for ``gpu`` tiles at the
    tensor-core kernel (one PrimFunc per (N, K), marked scheduled so dlight leaves it alone, and
    opaque so FuseOps fuses nothing into it; `epilogue.fuse_epilogues` fuses elementwise consumers after FuseTIR)."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    from specpilot.schedules.epilogue import ATTR as EPILOGUE_OUTPUT, rewrite_functions
    shapes = {gv: nt_matmul_shape(f) for gv, f in mod.functions.items()}
    shapes = {gv: s for gv, s in shapes.items() if s is not None and applicable(*s, wgmma, gpu)}
    if not shapes:
        return mod, 0
    call_tir = tvm.ir.Op.get("relax.call_tir")

    @mutator
    class _Swap(PyExprMutator):
        def __init__(self, m):
            super().__init__(m)
            self.kernels, self.swapped = {}, 0

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(call_tir) and call.args[0] in shapes:
                shape = shapes[call.args[0]]
                if shape not in self.kernels:
                    kernel = skinny_nt_matmul(*shape, wgmma=wgmma, gpu=gpu).with_attr("op_pattern", 8)   # kOpaque
                    kernel = kernel.with_attr(EPILOGUE_OUTPUT, 2)    # y: `epilogue.fuse_epilogues` may fuse its consumer
                    kernel = kernel.with_attr(SKINNY_ATTR, json.dumps({"n_out": shape[0], "k_in": shape[1],
                                                                       "wgmma": wgmma, "gpu": gpu.name}))
                    self.kernels[shape] = self.builder_.add_func(kernel, f"skinny_mma_{shape[0]}_{shape[1]}")
                args = call.args[1].fields[:2] if isinstance(call.args[1], relax.Tuple) else call.args[1:3]
                self.swapped += 1
                return relax.call_tir(self.kernels[shape], list(args), call.ty)
            return call

    swap = _Swap(mod)
    return rewrite_functions(mod, swap, lambda: swap.swapped)


def fuse_pairs(mod):
    """After FuseTIR: a skinny kernel call whose one user maps its columns c and c + N / 2 to the
    user's c (SwiGLU over a fused gate / up projection at verification's row counts:
    `epilogue.paired_epilogue`) becomes one kernel -- the paired form (`skinny_nt_matmul` with
    ``paired``), each thread's two accumulators going straight into the user's expression, stored
    once: the activation's kernel and the float32 [m, N] between them gone (as
    `decode_gemv.fuse_pairs` does for the one-row step).  Returns (module, number fused)."""
    from specpilot.schedules.epilogue import fuse_paired_users

    def paired(spec):
        gpu = DEVICES[spec["gpu"]]
        if not pairable(spec["n_out"], spec["k_in"], spec["wgmma"], gpu):
            return None
        return skinny_nt_matmul(spec["n_out"], spec["k_in"], wgmma=spec["wgmma"], paired=True, gpu=gpu)
    return fuse_paired_users(mod, SKINNY_ATTR, paired)
