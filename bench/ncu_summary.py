"""A short table from an Nsight Compute raw CSV (``ncu --csv --page raw ... > FILE``): per kernel
launch its time, the throughputs against peak (DRAM, L2, L1/shared, tensor pipe), achieved
occupancy, registers, and the warp stall reasons that cost most cycles per issued instruction.

    python bench/ncu_summary.py FILE [--top 5]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

COLUMNS = (("us", "gpu__time_duration.sum", 1e-3),
           ("dram%", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("L2%", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("L1%", "l1tex__throughput.avg.pct_of_peak_sustained_active", 1),
           ("tc%", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", 1),
           ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
           ("regs", "launch__registers_per_thread", 1))
STALL = "smsp__average_warps_issue_stalled_"
STALL_TAIL = "_per_issue_active.ratio"


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(path: Path, top: int) -> list[str]:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith('"')]
    if len(lines) < 3:
        raise SystemExit(f"{path}: no ncu raw CSV rows (was it run with --csv --page raw?)")
    rows = list(csv.reader(lines))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    ns_unit = units[col["gpu__time_duration.sum"]] if "gpu__time_duration.sum" in col else "nsecond"
    scale_time = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(ns_unit, 1e-3)
    out = ["%-48s %s  top stalls (cycles per issued instruction)" % (
        "kernel", " ".join(f"{name:>7s}" for name, _, _ in COLUMNS))]
    for row in data:
        cells = []
        for name, metric, scale in COLUMNS:
            v = number(row[col[metric]]) if metric in col else None
            if v is not None and metric == "gpu__time_duration.sum":
                v *= scale_time
            cells.append(f"{v:7.1f}" if v is not None else f"{'-':>7s}")
        stalls = sorted(((number(row[i]) or 0.0, h[len(STALL):-len(STALL_TAIL)]) for h, i in col.items()
                         if h.startswith(STALL) and h.endswith(STALL_TAIL) and "not_issued" not in h),
                        reverse=True)[:top]
        kernel = row[col.get("Kernel Name", 0)][:48]
        out.append("%-48s %s  %s" % (kernel, " ".join(cells), ", ".join(f"{n} {v:.1f}" for v, n in stalls)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    print("\n".join(summarize(args.file, args.top)))


if __name__ == "__main__":
    sys.exit(main())
