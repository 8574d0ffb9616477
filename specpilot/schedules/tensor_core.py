"""bf16 tensor-core matmuls for the GPU schedule sets.

TVM 0.27's dlight ``Matmul`` rule tensorizes float16 and int8 only; bf16 matmuls (every
projection of a bf16 model with more than a few rows: prefill and verification) get its
CUDA-core tiling, which on the H200 runs verification 20-30x slower than the weights' bytes
allow (docs/bench-log.md).  CUDA's WMMA API has bf16 fragments (16x16x16, float32
accumulators, sm_80 and later), so this module registers bf16 forms of TVM's WMMA load and
multiply intrinsics (the fill and store intrinsics are float32's, already registered) and
applies dlight's own ``MatmulTensorization`` schedule with them.  The arithmetic is the
same as the CUDA-core schedule's: bf16 inputs, float32 products and sums.
"""

from __future__ import annotations

from contextlib import contextmanager

from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.gpu import matmul as dl_matmul
from tvm.s_tir import TensorIntrin

_REGISTERED = False
SHAPE = "16x16x16"


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from specpilot.kernels.fast_frames import quick_stack
    with quick_stack():   # the import parses ~500 TVMScript intrinsics
        from tvm.s_tir.tensor_intrin import cuda as intrin
    names = {
        f"wmma_load_{SHAPE}_bf16_a_shared_dyn": intrin.get_wmma_load_intrin(16, 16, 16, "bfloat16", "shared.dyn",
                                                                           False, False),
        f"wmma_load_{SHAPE}_bf16_b_trans_shared_dyn": intrin.get_wmma_load_intrin(16, 16, 16, "bfloat16", "shared.dyn",
                                                                                 True, True),
        f"wmma_sync_{SHAPE}_bf16bf16f32_trans": intrin.get_wmma_sync_intrin(16, 16, 16, "bfloat16", "float32", True),
    }
    for name, (desc, impl) in names.items():
        try:
            TensorIntrin.get(name, allow_missing=False)
        except Exception:   # not registered yet in this process
            TensorIntrin.register(name, desc, impl)
    _REGISTERED = True


def _bf16_group(load_scope, store_scope, in_dtype, out_dtype, trans_b) -> dict[str, str]:
    """`get_wmma_intrin_group`'s answer with the bf16 loads and multiply (float32 accumulators)."""
    if out_dtype != "float32":
        raise ValueError("bf16 WMMA accumulates in float32 only")
    return {"init": f"wmma_fill_{SHAPE}_f32", "load_a": f"wmma_load_{SHAPE}_bf16_a_shared_dyn",
            "load_b": f"wmma_load_{SHAPE}_bf16_b_trans_shared_dyn",
            "compute": f"wmma_sync_{SHAPE}_bf16bf16f32_trans", "store": f"wmma_store_{SHAPE}_f32_shared_dyn"}


@contextmanager
def _bf16_intrinsics():
    from tvm.s_tir.tensor_intrin import cuda as intrin
    saved = intrin.get_wmma_intrin_group
    intrin.get_wmma_intrin_group = _bf16_group
    try:
        yield
    finally:
        intrin.get_wmma_intrin_group = saved


class BF16Matmul(dl.ScheduleRule):
    """dlight's tensor-core matmul schedule for bf16 x bf16 -> float32 matmuls on sm_80+, where
    no fixed extent other than the batch is 64 or less (dlight's own threshold); None otherwise,
    so the next rule applies."""

    def apply(self, func, target, tunable):
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda" or \
                dl_matmul.check_sm_version(str(target.attrs.get("arch", ""))) < 80:
            return None
        from tvm import s_tir
        from tvm.s_tir.dlight.analysis import get_root_block
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        reductions = dl_matmul.get_reduction_blocks(sch, blocks)
        if not reductions or len(reductions) != 1:
            return None
        block = sch.get(reductions[0])
        if len(block.reads) < 2 or dl_matmul.get_in_out_dtypes(block) != ("bfloat16", "float32") or \
                str(block.reads[1].source.dtype) != "bfloat16" or dl_matmul.get_index_map(block) is None:
            return None
        if any(isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value <= 64 for iv in block.iter_vars):
            return None     # a skinny side: GEMV-like, tensor cores do not pay
        _register()
        with _bf16_intrinsics():
            try:
                return dl_matmul.MatmulTensorization().apply(func, target, tunable)
            except Exception:   # a shape the schedule cannot tile: leave it to the next rule
                return None


def nt_matmul(n_out: int, k_in: int, dtype: str = "bfloat16", rows: int = 0):
    """A plain x[m, k] . W[n, k]^T PrimFunc with float32 products and sums, as Relax legalizes
    the models' projections (m symbolic, or ``rows``): what the rule is tested and timed on."""
    from specpilot.kernels.fast_frames import quick_stack
    with quick_stack():
        return _nt_matmul(n_out, k_in, dtype, rows)


def _nt_matmul(n_out: int, k_in: int, dtype: str, rows: int):
    from tvm import tirx as tir
    from tvm.script import tirx as T
    n_out, k_in = T.int64(n_out), T.int64(k_in)

    @T.prim_func(private=True, s_tir=True)
    def mm(x_h: T.handle, w: T.Buffer((n_out, k_in), dtype), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, k_in), dtype)
        y = T.match_buffer(y_h, (m, n_out), "float32")
        for i, j, k in T.grid(m, n_out, k_in):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    y[vi, vj] = T.float32(0)
                y[vi, vj] = y[vi, vj] + T.Cast("float32", x[vi, vk]) * T.Cast("float32", w[vj, vk])
    if rows:
        return mm.specialize({mm.params[0]: tir.decl_buffer((T.int64(rows), k_in), dtype)})
    return mm
