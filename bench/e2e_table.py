"""The bench/README "End to end" table from `specpilot bench` result files (JSON written with -o).

    python bench/e2e_table.py bench/results/e2e-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[str]:
    r = json.loads(path.read_text())
    out = []
    for e in r["engines"]:
        s = e["decode_tokens_per_s_summary"]
        per = f"{e['tokens_per_verification']:.2f}" if e["tokens_per_verification"] else ""
        cycle = e["cycle"]["shares"] if e["cycle"] else None
        split = " / ".join(f"{100 * cycle[k]:.0f}" for k in ("draft", "verify", "commit", "host")) if cycle else ""
        check = e["check"]
        tokens = f"{check['identical']}/{r['requests']}" + (f" (+{len(check['excused'])} near-tie)" if check["excused"] else "")
        tokens = tokens if check["passed"] else "FAILED"
        out.append(f"| {r['system'].split('/')[-1]} {r['prompts']} | {e['engine']} | {s['median']:.1f} "
                   f"({s['min']:.0f}-{s['max']:.0f}) | {per} | **{e['speedup']:.2f}x** | {e['end_to_end_speedup']:.2f}x | "
                   f"{split} | {tokens} | `{path.name}` |")
    return out


def main() -> None:
    print("| build, prompts | engine | decode tok/s median (min-max) | tokens/verif | speedup | end-to-end | "
          "cycle % draft / verify / commit / host | identical to AR | file |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in sys.argv[1:]:
        print("\n".join(rows(Path(name))))


if __name__ == "__main__":
    main()
