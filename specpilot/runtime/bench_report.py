"""A bench run for people: the table printed after a run, and its plot (tokens/s per engine and the
verification cycle's breakdown)."""

from __future__ import annotations

from pathlib import Path


def row_name(engine: dict) -> str:
    """An engine row's name; a replay row's acceptance plan beside it."""
    return f"{engine['engine']} {engine['replay']}" if engine.get("replay") else engine["engine"]


def table(report: dict):
    """A rich Table of the run: one row per engine, the autoregressive engine first."""
    from rich.table import Table

    sampling = report.get("sampling")
    how = f", sampled at T={sampling['temperature']:g} seed {sampling['seed']}" if sampling else ", greedy"
    how += ", speculative engines forced onto AR's tokens" if report.get("forced") else ""
    t = Table(title=f"{report['requests']} requests x {report['max_new_tokens']} new tokens "
                    f"({report['prompts']}{how}), AR = {report['ar_engine']}")
    for column in ("engine", "decode tok/s (median, min-max)", "TTFT ms", "tokens/verif (speedup / it)", "speedup",
                   "end-to-end", "tokens", "cycle: draft/verify/commit/host"):
        t.add_column(column, justify="left" if column in ("engine", "tokens") else "right")
    for e in report["engines"]:
        s = e["decode_tokens_per_s_summary"]
        ttft = sorted(e["ttft_seconds"])[len(e["ttft_seconds"]) // 2] * 1000
        check = e["check"]
        tokens = (f"identical {check['identical']}/{report['requests']}" if check["passed"]
                  else f"FAILED ({len(check['failed'])})") + (f", {len(check['excused'])} near-ties" if check["excused"] else "")
        shares = e["cycle"]["shares"] if e["cycle"] else None
        cycle = "/".join(f"{100 * shares[k]:.0f}" for k in ("draft", "verify", "commit", "host")) + " %" if shares else ""
        per = f"{e['tokens_per_verification']:.2f} (eff. {e['efficiency']:.2f})" if e["tokens_per_verification"] else ""
        t.add_row(f"{row_name(e)}\n[dim]{e['label']}[/dim]", f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})",
                  f"{ttft:.1f}", per, f"{e['speedup']:.2f}x", f"{e['end_to_end_speedup']:.2f}x", tokens, cycle)
    return t


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = report["engines"]
    names = [row_name(e) for e in engines]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    medians = [e["decode_tokens_per_s_summary"]["median"] for e in engines]
    low = [m - e["decode_tokens_per_s_summary"]["min"] for m, e in zip(medians, engines)]
    high = [e["decode_tokens_per_s_summary"]["max"] - m for m, e in zip(medians, engines)]
    left.barh(names, medians, xerr=[low, high], color="tab:blue")
    for y, (m, e) in enumerate(zip(medians, engines)):
        left.text(m, y, f" {m:.1f} ({e['speedup']:.2f}x)", va="center")
    left.invert_yaxis()
    left.set_xlabel("decode tokens/s (median over requests, min-max)")
    left.set_title(f"speedup over {report['ar_engine']}, same run")
    spec = [e for e in engines if e["cycle"]]
    bottom = [0.0] * len(spec)
    for part, color in (("draft", "tab:orange"), ("verify", "tab:blue"), ("commit", "tab:green"), ("host", "tab:gray")):
        values = [100 * e["cycle"]["shares"][part] for e in spec]
        right.barh([row_name(e) for e in spec], values, left=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.invert_yaxis()
    right.set_xlabel("share of a verification cycle (%)")
    right.set_title("where a cycle goes")
    right.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
