"""The Relax-to-TIR pipeline a build runs after the passes: legalization plus kernel schedules.

Schedule sets (a knob the tuner can turn; each computes exactly what the graph says):

- ``tvm-default``: TVM's own default pipeline for the target (dlight's default GPU rules).
- ``nt-gemv`` (GPU): first fuse ``matmul(x, permute_dims(W))`` into one transposed-weight
  matmul, so decode GEMVs read W row-major and dlight's GEMV / low-batch GEMV rules apply,
  instead of the fallback schedule they get through a separate transpose.  The step
  functions take a symbolic batch, so a decode projection is x[batch, K] . W^T: dlight's
  tiled Matmul rule would claim it (and run batch 1 ~10x slower than a GEMV); kernels whose
  only symbolic extent is ``batch`` (decode steps) go to the low-batch GEMV rule first.
  bf16 matmuls with many rows (prefill, verification) run on tensor cores
  (`schedules.tensor_core`: dlight's WMMA schedule with bf16 intrinsics; dlight's own
  Matmul rule tensorizes float16 only).
- ``skinny-mma`` (GPU, sm_80+): ``nt-gemv`` with every plain bf16 projection whose shape it
  tiles (N a multiple of 16, K of 32) on `schedules.skinny_kernels`' tensor-core kernel, made for
  few rows (decode batches, chain and tree verification) and taking prefill's symbolic rows
  too: weights streamed once per launch through a shared-memory ring (``wgmma`` on sm_90a,
  ``mma.sync`` elsewhere; on sm_90a blocks of 128-256 rows beyond 72, sized per range of rows),
  one kernel choice by row count at run time.  Elementwise epilogues (casts, residual adds, the logits' bf16
  rounding) are fused into the kernel's stores (`schedules.epilogue`); slices, transposes and
  repeats of its output stay kernels of their own.  The one-sequence decode step's projections
  (one static row) run `schedules.decode_gemv`'s GEMV instead, with the RMSNorm before them as
  its prologue and SwiGLU over a fused gate / up projection in its stores.
- ``cpu-nt`` (CPU): the same transposed-weight fusion before TVM's default CPU pipeline, so
  no step transposes a weight matrix at run time, and every projection vectorised over K for any
  number of rows (`schedules.cpu_matmul`: each weight row read once per call).

Builds take the set from ``--schedule``, else from the ``kernel-schedule`` pass, else the
target's default.  Grids, tiles and shared-memory rings are sized from the device table's card
(`core.target.Device`: SMs, shared memory per block and per SM, threads per SM); the kernel
forms follow its tensor cores (wgmma only where the card has it and the code is for sm_90a).
"""

from __future__ import annotations

import tvm
from tvm import relax

from specpilot.core.schedule_sets import SCHEDULES
from specpilot.core.target import TUNED, Device

def _decode_only(rule):
    """``rule``, for kernels whose only symbolic extent is the decode batch."""
    from tvm import s_tir, tirx
    from tvm.s_tir import dlight as dl
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    def decode_extent(dom) -> bool:
        return isinstance(dom, (int, tirx.IntImm)) or (isinstance(dom, tirx.Var) and dom.name == "batch")

    class DecodeOnly(dl.ScheduleRule):
        def apply(self, func, target, tunable):
            if not isinstance(func, tirx.PrimFunc):
                return None
            infos = normalize_prim_func(s_tir.Schedule(func))
            if infos is None or not all(decode_extent(it.dom) for info in infos for it in info.iters):
                return None
            return rule.apply(func, target, tunable)

    return DecodeOnly()


_DecodeOnly = _decode_only


def _declining(rule):
    """``rule``, declining (None, the next rule's turn) where its analysis asserts or a schedule
    primitive refuses instead: dlight's GEMV and Reduction rules assert on a reduction reading one
    buffer through a Select of regions (`lower.attention_heads_te`, q / k / v slices of one
    projection), and its GEMV rule's compute-at fails on that block when the q + k + v heads are
    odd in number (Qwen3, 3 query heads over 1 KV head); GeneralReduction schedules it as one
    kernel.  A rule schedules a copy of the function, so a refusal leaves nothing behind."""
    from tvm import tirx
    from tvm.s_tir import dlight as dl
    from tvm.s_tir.schedule import ScheduleError

    class Declining(dl.ScheduleRule):
        def apply(self, func, target, tunable):
            if not isinstance(func, tirx.PrimFunc):
                return None
            try:
                return rule.apply(func, target, tunable)
            except (AssertionError, ScheduleError):
                return None

    return Declining()


def _not_heads(rule):
    """``rule``, declining the attention heads kernel (`kernels.norms.attention_heads_te`, found by its
    block): dlight's GEMV-family rules take it (its choices between loads are if_then_else) and pad
    its bf16 inputs to a multiple of the batch, which TVM's bf16 legalization then rejects (a
    Qwen3.5-style config of head_dim 12); the Reduction rules schedule it as one kernel."""
    from tvm import s_tir, tirx
    from tvm.s_tir import dlight as dl

    from specpilot.kernels.norms import HEADS_BLOCK

    class NotHeads(dl.ScheduleRule):
        def apply(self, func, target, tunable):
            if isinstance(func, tirx.PrimFunc):
                try:
                    s_tir.Schedule(func).get_sblock(HEADS_BLOCK)
                    return None
                except Exception:   # no such block: not the heads kernel
                    pass
            return rule.apply(func, target, tunable)

    return NotHeads()


def _skinny_mma(target: tvm.target.Target, gpu: Device) -> tvm.transform.Pass:
    # Hopper's warpgroup MMA where the code is for sm_90a and the schedules for a card that has it
    wgmma = str(target.attrs.get("arch", "")) == "sm_90a" and gpu.kernel_forms == "wgmma"

    @tvm.transform.module_pass(opt_level=0, name="specpilot.skinny_mma")
    def _substitute(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        from specpilot.schedules.skinny_mma import substitute
        return substitute(mod, wgmma=wgmma, gpu=gpu)[0]
    return _substitute


def _decode_gemv(gpu: Device) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="specpilot.decode_gemv")
    def _substitute(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        from specpilot.schedules.decode_gemv import substitute
        return substitute(mod, gpu)[0]
    return _substitute


def _fuse_epilogues() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="specpilot.fuse_epilogues")
    def _fuse(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        from specpilot.schedules import decode_gemv, skinny_mma
        from specpilot.schedules.epilogue import fuse_epilogues
        return fuse_epilogues(skinny_mma.fuse_pairs(decode_gemv.fuse_pairs(mod)[0])[0])[0]
    return _fuse


def gpu_schedules() -> tvm.transform.Pass:
    """The GPU builds' kernel schedules (dlight rules, first match wins)."""
    from tvm.s_tir import dlight as dl

    from specpilot.schedules.tensor_core import BF16Matmul
    rules = [_not_heads(_DecodeOnly(dl.gpu.LowBatchGEMV())), BF16Matmul(), dl.gpu.Matmul(), _not_heads(dl.gpu.GEMV()),
             _not_heads(dl.gpu.LowBatchGEMV()), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
    return dl.ApplyDefaultSchedule(*(_declining(r) for r in rules), dl.gpu.Fallback())


def _cpu_nt(target: tvm.target.Target, after_planning: list) -> tvm.transform.Pass:
    """x @ W^T as one kernel reading W in its stored layout (no per-call weight transpose), vectorised
    over K for any number of rows (`schedules.cpu_matmul`), then TVM's CPU lowering."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from specpilot.schedules.cpu_matmul import cpu_matmuls

    @tvm.transform.module_pass(opt_level=0, name="specpilot.cpu_nt_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        with target:
            seq = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul(), *cpu.library_dispatch_passes(target),
                                            *cpu.legalize_passes(target), cpu_matmuls(),
                                            *cpu.dataflow_lower_passes(target),
                                            *_finalize(cpu.finalize_passes(target), after_planning)])
            return seq(mod)
    return _pipeline


def _finalize(passes: list, after_planning: list) -> list:
    """A backend's finalization passes with ``after_planning`` right after ``StaticPlanBlockMemory``."""
    at = next(i for i, p in enumerate(passes) if p.info.name == "StaticPlanBlockMemory") + 1
    return [*passes[:at], *after_planning, *passes[at:]]


def _default(target: tvm.target.Target, after_planning: list) -> tvm.transform.Pass:
    """TVM's default pipeline for ``target`` (CUDA or CPU), ``after_planning`` run after its memory planning."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.backend.cuda import pipeline as cuda
    backend = cuda if target.kind.name == "cuda" else cpu

    @tvm.transform.module_pass(opt_level=0, name="specpilot.default_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        with target:
            seq = tvm.transform.Sequential(backend.library_dispatch_passes(target) + backend.legalize_passes(target)
                                           + backend.dataflow_lower_passes(target)
                                           + _finalize(backend.finalize_passes(target), after_planning))
            return seq(mod)
    return _pipeline


def pipeline(target: tvm.target.Target, schedule: str, gpu: Device = TUNED,
             after_planning: list | None = None) -> tvm.transform.Pass:
    """The pipeline of ``schedule`` for ``target``, its kernels sized for the card ``gpu``;
    ``after_planning``: Relax passes to run right after its static memory planning."""
    after_planning = list(after_planning or [])
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule set {schedule!r}; known: {', '.join(SCHEDULES)}")
    if schedule == "cpu-nt" and target.kind.name != "cuda":
        return _cpu_nt(target, after_planning)
    if schedule not in ("nt-gemv", "skinny-mma") or target.kind.name != "cuda":
        if target.kind.name not in ("cuda", "llvm"):
            if after_planning:
                raise ValueError(f"passes after memory planning take a cuda or llvm target, not {target.kind.name}")
            return relax.get_default_pipeline(target)
        return _default(target, after_planning)
    from tvm.relax.backend.cuda import pipeline as cuda

    legalize = [
        relax.transform.FuseTransposeMatmul(),
        relax.transform.LegalizeOps(),
        *([_decode_gemv(gpu), _skinny_mma(target, gpu)] if schedule == "skinny-mma" else []),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        *([_fuse_epilogues()] if schedule == "skinny-mma" else []),
        gpu_schedules(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="specpilot.nt_gemv_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        with target:
            seq = tvm.transform.Sequential(cuda.library_dispatch_passes(target) + legalize
                                           + cuda.dataflow_lower_passes(target)
                                           + _finalize(cuda.finalize_passes(target), after_planning))
            return seq(mod)

    return _pipeline
