"""kernel-schedule: which schedule set turns the graph into kernels (a tuning knob).

What it changes: no function.  It records the set in its manifest entry, which the build's
Relax-to-TIR pipeline compiles with (`schedules.relax_pipeline`), and on the module
(``specpilot.schedule``) for the IR's identity.  Every set computes exactly what the graph says, so the choice is lossless; only speed differs, which is why the
search's kernel-tuning phase turns it.

``graph=true`` (cuda) also has the build capture the step functions' runs of static-shape
kernels (weights and activations, between the kernels that read the dynamic KV length) as
CUDA graphs, replayed instead of launched kernel by kernel: the same kernels, fewer launches.

Defaults reproduce stock: ``set=default`` is the target's default set (`core.schedule_sets.default_schedule`:
skinny-mma on sm_80+ GPUs, nt-gemv on older ones, tvm-default on CPUs), no graphs.
"""

from __future__ import annotations

from specpilot.core.schedule_sets import FOR_TARGET, SCHEDULES, default_schedule, runs_on
from specpilot.passes.base import Option, Pass, PassContext

class KernelSchedule(Pass):
    name = "kernel-schedule"
    doc = ("choose the schedule set the build lowers kernels with (tvm-default; nt-gemv, skinny-mma on GPUs; "
           "cpu-nt on CPUs)")
    options = (Option("set", str, "default", "schedule set", choices=("default", *SCHEDULES)),
               Option("graph", bool, False, "replay the step functions' static-shape kernel runs as CUDA graphs "
                      "(TVM's RewriteCUDAGraph; cuda only)"))
    statistics = ("schedule", "cuda_graph")
    manifest_key = "kernel_schedule"

    def manifest_entry(self, context: PassContext) -> dict:
        chosen = default_schedule(context.target_kind, context.arch) if self["set"] == "default" else self["set"]
        return {"schedule": chosen, "cuda_graph": self["graph"] and context.target_kind == "cuda"}

    def legal(self, context: PassContext) -> tuple[bool, str]:
        allowed = sorted(FOR_TARGET[context.target_kind], key=SCHEDULES.index)
        if self["set"] != "default" and self["set"] not in allowed:
            return False, f"set={self['set']} is not a {context.target_kind} schedule set ({', '.join(allowed)})"
        if self["set"] != "default" and not runs_on(self["set"], context.target_kind, context.arch):
            return False, f"set={self['set']} needs bf16 mma.sync (sm_80 or later), not {context.arch}"
        if self["graph"] and context.target_kind != "cuda":
            return False, f"graph=true needs a cuda target (CUDA graphs), not {context.target_kind}"
        return True, ""

    def apply(self, mod, context: PassContext):
        chosen = default_schedule(context.target_kind, context.arch) if self["set"] == "default" else self["set"]
        context.statistics[self.name].update(schedule=chosen, cuda_graph=int(self["graph"]))
        mod = mod.with_attr("specpilot.schedule", chosen)
        return mod.with_attr("specpilot.cuda_graph", True) if self["graph"] else mod
