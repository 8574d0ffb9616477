"""Record `specpilot search` runs in bench/results: each run directory's report.json, the
memory entries it left, and the environment (machine, versions, date).

    python bench/search_runs.py NAME RUN_DIR [RUN_DIR ...] [--memory PATH] [--note TEXT] [--machine TEXT]

The searches themselves are CLI runs (see bench/README.md); this only collects what they wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--memory", type=Path, action="append", default=[])
    ap.add_argument("--note", default="")
    ap.add_argument("--machine", default="", help="where the searches ran, when not here (the environment "
                                                  "recorded is the collecting machine's)")
    args = ap.parse_args()
    runs = {}
    for d in args.runs:
        log = [json.loads(line) for line in (d / "run.jsonl").read_text().splitlines() if line.strip()]
        # a run stopped before its report (a device call's time limit) is recorded from its log
        report = json.loads((d / "report.json").read_text()) if (d / "report.json").is_file() else {"finished": False}
        report["cost_models"] = [{k: e.get(k) for k in ("round", "pipeline", "factors", "bottleneck", "tree_acceptance",
                                                        "accepted_per_verification", "kernels")}
                                 for e in log if e["event"] == "cost_model"]
        report["proposed"] = [{k: e[k] for k in ("round", "phase", "candidates")} for e in log if e["event"] == "proposed"]
        report["builds"] = [{k: e.get(k) for k in ("pipeline", "ok", "seconds", "error")}
                            | {"tie_tolerance": (e.get("forcing") or {}).get("tie_tolerance"),
                               "excused": len((e.get("forcing") or {}).get("excused", []))}
                            for e in log if e["event"] == "built"]
        report["measurements"] = [{k: e[k] for k in ("base", "candidate", "verdict", "base_median", "candidate_median")}
                                  for e in log if e["event"] in ("measured", "sealed_speed") and e.get("verdict")]
        report["aa"] = [{k: e[k] for k in ("interval", "base_median", "candidate_median")} for e in log if e["event"] == "aa"]
        report["rejected_builds"] = [{"pipeline": e["pipeline"], "error": e.get("error")}
                                     for e in log if e["event"] == "built" and not e.get("ok")]
        runs[str(d)] = report
    memories = {}
    for m in args.memory:
        from specpilot.memory.store import Memory
        with Memory(m) as mem:
            memories[str(m)] = [{"id": e.id, "pipeline": e.pipeline, "family": e.applicability.family,
                                 "results": e.results, "dependencies": e.dependencies} for e in mem.entries()]
    print(write(args.name, {"note": args.note, "search_machine": args.machine or "this machine", "runs": runs,
                            "memories": memories}))


if __name__ == "__main__":
    main()
