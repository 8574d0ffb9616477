"""The cost model's static part: FLOPs and bytes of each compiled kernel, from its TIR.

A build keeps its final kernels (after fusion and scheduling) in ``kernels.json`` (TVM's own
IR serialization).  Given one call -- the kernel's name and its arguments' shapes, as the
runtime profiler saw them -- the kernel's symbolic extents take those shapes' values and:

    flops  TVM's ``estimate_tir_flops`` over the kernel, which counts a symbolic extent as one
           iteration, times each symbolic extent's value in this call (exact for the step
           kernels' nests, whose symbolic loops -- batch, tokens, context -- each run once)
    bytes  every argument buffer read or written once (a lower bound on traffic: fused
           intermediates stay on chip), except the KV-cache pool, which a kernel touches only
           for the live rows and positions: it counts (rows used / pool rows) x (context /
           capacity) of the pool

and a kernel's lower bound is max(flops / (0.6 x peak FLOP/s), bytes / (0.9 x peak bytes/s)).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specpilot.core.costs import BANDWIDTH_EFFICIENCY, FLOP_EFFICIENCY
from specpilot.core.errors import SpecPilotError
from specpilot.core.manifest import read_manifest


@dataclass
class KernelCost:
    flops: float
    bytes: float

    def bound(self, peak_flops: float, peak_bandwidth: float) -> float:
        return max(self.flops / (FLOP_EFFICIENCY * peak_flops), self.bytes / (BANDWIDTH_EFFICIENCY * peak_bandwidth))


class KernelTable:
    """The kernels of one build; ``cost(name, shapes, context)`` per call."""

    def __init__(self, build_dir: Path):
        import tvm

        path = Path(build_dir) / "kernels.json"
        if not path.is_file():
            raise SpecPilotError(f"{build_dir}: no kernels.json (built before the cost model existed); rebuild it")
        self.mod = tvm.ir.load_json(path.read_text())
        self.kernels = {gv.name_hint: f for gv, f in self.mod.functions.items()}
        manifest = read_manifest(build_dir)
        self.capacity, self.rows = manifest.capacity, manifest.max_batch
        self._cache: dict = {}

    def __contains__(self, name: str) -> bool:
        return name in self.kernels

    def cost(self, name: str, shapes: tuple[tuple[int, ...], ...], context: int, batch: int = 1) -> KernelCost:
        key = (name, shapes, context, batch)
        if key not in self._cache:
            self._cache[key] = self._cost(name, shapes, context, batch)
        return self._cache[key]

    def _cost(self, name, shapes, context, batch) -> KernelCost:
        import tvm
        from tvm import tirx
        from tvm.s_tir.analysis import estimate_tir_flops

        func = self.kernels[name]
        buffers = [p for p in func.params if hasattr(p, "shape")]   # TVM 0.27: buffer parameters
        values = {}
        for buf, shape in zip(buffers, shapes):
            for dim, n in zip(buf.shape, shape):
                if isinstance(dim, tirx.Var):
                    values[dim.name] = int(n)
        try:   # TVM counts a symbolic extent as 1; every symbolic extent scales the loop nest once
            flops = float(estimate_tir_flops(tvm.IRModule({"main": func})))
        except Exception:  # TVM cannot count some loop nests (data-dependent extents): count none
            flops = 0.0
        for n in values.values():
            flops *= n
        total = 0.0
        for buf, shape in zip(buffers, shapes):
            n = 1
            for d in shape:
                n *= int(d)
            size = n * tvm.runtime.DataType(str(buf.dtype)).bits / 8
            if len(shape) >= 4 and tuple(shape[-2:-1]) == (self.capacity,) and self.rows in shape[-4:-3]:
                size *= min(1.0, context / self.capacity) * min(1.0, batch / self.rows)   # the KV-cache pool
            total += size
        return KernelCost(flops, total)
