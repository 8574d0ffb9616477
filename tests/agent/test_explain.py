"""`specpilot explain` on a tiny build: the factors, the kernel table, progress on stderr while it
runs, and the plot (kernels that only move bytes drawn against bandwidth, the slowest labelled)."""

from __future__ import annotations

import json

from tests.conftest import TINY_CONFIGS, build_spec


def test_explain_reports_factors_kernels_and_plots(tmp_path, run_cli):
    data = {"target": {"architecture": "LlamaForCausalLM", "config": TINY_CONFIGS["LlamaForCausalLM"],
                       "init": {"seed": 1}},
            "drafter": {"kind": "ngram", "draft_len": 3}, "deployment": {"dtype": "float32", "max_seq_len": 256}}
    build = build_spec(tmp_path, data)
    png = tmp_path / "roofline.png"
    code, out, err = run_cli("explain", build, "--max-new-tokens", 12, "--json", "--plot", png)
    assert code == 0, err
    report = json.loads(out)
    assert set(report["factors"]) == {"acceptance", "kernel", "overhead"}
    assert report["bottleneck"] == max(report["factors"], key=report["factors"].get)
    kernels = report["kernels"]
    assert kernels and all(k["calls"] > 0 and k["seconds"] > 0 for k in kernels)
    assert any(k["flops"] == 0 and k["bytes"] > 0 for k in kernels)       # copies: drawn on the bandwidth panel
    assert png.stat().st_size > 10_000
    code, out, _ = run_cli("explain", build, "--max-new-tokens", 12)
    assert code == 0 and "factors:" in out and "bottleneck" in out
