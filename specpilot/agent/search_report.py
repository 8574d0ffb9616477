"""The search's report: ``report.json`` + ``report.md`` and the final build beside them."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from specpilot.core.files import atomic_write_text, copy_tree_atomic


def write_report(search, current: str, final: str, sealed: dict, history: list, reused: list, seconds: float) -> dict:
    final_dir = search.out / "final"
    copy_tree_atomic(search.lab.build_dir(final), final_dir)
    builds = [e["pipeline"] for e in search.log.events if e["event"] == "built" and e["pipeline"]]
    to_result = builds.index(final) + 1 if final in builds else 0
    vs_stock = search.log.find("sealed_speed", base="", candidate=final) if final else None
    report = {
        "spec": str(search.spec_path), "target": search.target.text(), "rounds": search.rounds,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 1),
        "noise": search.lab.noise, "result": final or "(stock)", "best_before_sealed": current or "(stock)",
        "sealed": {k: v for k, v in sealed.items() if k not in ("event", "time")},
        "speedup_vs_stock": vs_stock["verdict"] if vs_stock else None,
        "candidate_builds": len(builds), "builds_to_result": to_result,
        "reused_entries": reused, "history": history,
        "memory": [e.id for e in search.memory.entries() if e.spec_path == str(search.spec_path)],
        "events": len(search.log.events), "final_build": str(final_dir),
    }
    atomic_write_text(search.out / "report.json", json.dumps(report, indent=2))
    atomic_write_text(search.out / "report.md", render_markdown(report))
    return report


def render_markdown(r: dict) -> str:
    lines = [f"# SpecPilot search: {r['spec']} on {r['target']}", "",
             f"- date: {r['date']}, {r['rounds']} round(s), {r['seconds']} s",
             f"- result: `{r['result']}` (best before sealed validation: `{r['best_before_sealed']}`)",
             f"- sealed validation: {'PASSED' if r['sealed'].get('passed') else 'FAILED'} -- {r['sealed'].get('reason')}",
             f"- stock timing noise (A/A): {r['noise']:.2%}",
             f"- candidate builds: {r['candidate_builds']} (the result was build #{r['builds_to_result']})",
             f"- reused memory entries: {', '.join(r['reused_entries']) or 'none'}"]
    if r["speedup_vs_stock"]:
        v = r["speedup_vs_stock"]
        lines.append(f"- vs stock on held-out requests: gain {v['gain']:+.1%} (95% lower bound {v['lcb']:+.1%}, "
                     f"threshold {v['threshold']:.1%})")
    lines += ["", "| round | phase | adopted |", "| --- | --- | --- |"]
    lines += [f"| {h['round']} | {h['phase']} | `{h['pipeline']}` |" for h in r["history"]]
    return "\n".join(lines) + "\n"
