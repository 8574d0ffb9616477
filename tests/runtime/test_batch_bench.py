"""`specpilot bench --batch --arrivals`: a tiny CPU build with the three batch mechanisms run through a
short arrival trace at two batch sizes -- requests joining, leaving and admitted in chunks -- with
every row's tokens checked against each request's own autoregressive tokens and the JSON complete."""

from __future__ import annotations

import json

import pytest

from specpilot.runtime.batching import Arrival, write_trace
from tests.conftest import TINY_CONFIGS, build_spec

HYBRID = {"architecture": "Qwen3_5ForCausalLM", "config": TINY_CONFIGS["Qwen3_5ForCausalLM"], "init": {"seed": 4}}
COST = {"architecture": "LlamaForCausalLM", "init": {"seed": 9},
        "config": {**TINY_CONFIGS["LlamaForCausalLM"], "num_hidden_layers": 1}}
PASSES = ("fuse-projections,tree-verify{budget=8},gdn-path-recompute,draft-length{length=8,min=4,step=2,dynamic=true},"
          "node-budget{nodes=12},prompt-admission{chunk=4,passes=16}")


@pytest.fixture(scope="module")
def replay_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    data = {"target": HYBRID, "passes": PASSES,
            "drafter": {"kind": "replay", "alpha": 0.8, "cost": COST, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 128, "max_batch": 4}}
    return build_spec(tmp, data), tmp


def test_batched_bench_through_a_trace_checks_every_row(run_cli, replay_build):
    build, tmp = replay_build
    trace = tmp / "trace.jsonl"
    write_trace(trace, [Arrival(0.002 * i * i, tuple((7 * i + 3 * j) % 200 + 1 for j in range(5 + 3 * i)), 10 + i)
                        for i in range(6)])
    out = tmp / "batch.json"
    code, stdout, err = run_cli("bench", build, "--batch", "1,4", "--arrivals", trace, "--forced", "--json",
                                "-o", out, "--warmup", 0, "--schedules", "20/6")
    assert code == 0, err
    report = json.loads(stdout)
    assert report == json.loads(out.read_text()) and report["format"] == "specpilot-batch-bench"
    assert report["tokens_checked"] and report["environment"]["python"]
    rows = {(r["engine"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(e, b) for e in ("compiled", "compiled-spec", "compiled-tree", "compiled-tree-sched",
                                          "compiled-tree-sched[20/6]") for b in (1, 4)}
    for (engine, batch), r in rows.items():
        assert r["requests"] == 6 and r["refused"] == 0 and r["tokens"] == sum(10 + i for i in range(6))
        assert r["check"]["passed"] and r["check"]["identical"] == 6 and not r["check"]["excused"]
        assert r["throughput"] > 0 and r["latency"]["p50"] <= r["latency"]["p99"] <= r["latency"]["max"]
        assert 0 < r["tpot"]["p50"] <= r["tpot"]["p99"] and r["tpot"]["max"] * 9 <= r["latency"]["max"]
        assert r["per_pass"]["running"] <= batch
        assert (r["tokens_per_verification"] is None) == (engine == "compiled")
    sched = rows[("compiled-tree-sched", 4)]
    assert sched["policy"]["budget"] == 12 and (sched["policy"]["chunk"], sched["policy"]["passes"]) == (4, 16)
    assert sched["policy"]["lengths"] == [8, 6, 4]
    assert sched["per_pass"]["admitted"] > 0 and sched["per_pass"]["drafted"] <= 12
    other = rows[("compiled-tree-sched[20/6]", 4)]     # the runtime's choice: another budget and chunk
    assert other["policy"]["budget"] == 20 and other["policy"]["chunk"] == 6 and other["policy"]["lengths"] == [8, 6, 4]
    assert other["per_pass"]["drafted"] <= 20 and other["per_pass"]["admitted"] > 0
    assert rows[("compiled", 4)]["speedup"] == 1.0
    for (engine, batch), r in rows.items():     # the synchronised rerun's split of a pass
        split = r["split"]
        assert split["per_pass_ms"]["verify"] > 0 and min(split["seconds"].values()) >= 0
        assert sum(split["seconds"].values()) == pytest.approx(split["cycle_seconds"])
        assert engine == "compiled" or split["seconds"]["draft"] > 0
        ms = split["per_pass_ms"]          # the drafter's catch-up and level passes, within drafting
        assert ms["draft_sync"] + ms["draft_levels"] <= ms["draft"] + 1e-9
        assert (ms["draft_levels"] > 0) == (engine != "compiled"), (engine, batch, ms, r["per_pass"])
    assert rows[("compiled", 4)]["split"]["prefill_seconds"] > 0     # joins by their own prefill pass


def test_batched_bench_without_the_split(run_cli, replay_build):
    build, _ = replay_build
    code, stdout, err = run_cli("bench", build, "--batch", "2", "--engines", "compiled,compiled-tree", "--json",
                                "--warmup", 0, "--requests", 2, "--max-new-tokens", 4, "--breakdown-requests", 0)
    assert code == 0, err
    assert [r["split"] for r in json.loads(stdout)["rows"]] == [None, None]


def test_fill_reaches_every_row_s_policy(run_cli, replay_build):
    """`--fill`: every row's drafts grow into the rows its passes pad them to (off without it); tokens checked."""
    build, _ = replay_build
    for extra, want in (([], False), (["--fill"], True)):
        code, stdout, err = run_cli("bench", build, "--batch", "2", "--engines", "compiled,compiled-tree-sched", "--json",
                                    "--warmup", 0, "--requests", 2, "--max-new-tokens", 4, "--breakdown-requests", 0,
                                    "--forced", *extra)
        assert code == 0, err
        rows = json.loads(stdout)["rows"]
        assert [r["policy"]["fill"] for r in rows] == [want, want] and all(r["check"]["passed"] for r in rows)


def test_other_draft_lengths_are_rows_of_every_speculative_engine(run_cli, replay_build):
    """`--draft-lengths`: one row per set and speculative engine, drafting at most the set's longest a
    request and pass (fixed for one length, chosen by acceptance for several), tokens checked."""
    build, _ = replay_build
    code, stdout, err = run_cli("bench", build, "--batch", "3", "--engines", "compiled,compiled-spec,compiled-tree-sched",
                                "--json", "--warmup", 0, "--requests", 3, "--max-new-tokens", 12, "--forced",
                                "--breakdown-requests", 0, "--draft-lengths", "3,6:4")
    assert code == 0, err
    rows = {r["engine"]: r for r in json.loads(stdout)["rows"]}
    assert list(rows) == ["compiled", "compiled-spec", "compiled-tree-sched", "compiled-spec[draft 3]",
                          "compiled-tree-sched[draft 3]", "compiled-spec[draft 6:4]", "compiled-tree-sched[draft 6:4]"]
    assert all(r["check"]["passed"] and r["tokens"] == 36 for r in rows.values())
    for engine in ("compiled-spec", "compiled-tree-sched"):
        fixed, chosen = rows[f"{engine}[draft 3]"], rows[f"{engine}[draft 6:4]"]
        assert (fixed["policy"]["nodes"], fixed["policy"]["lengths"]) == (3, None)
        assert (chosen["policy"]["nodes"], chosen["policy"]["lengths"]) == (6, [6, 4])
        assert fixed["per_pass"]["drafted"] <= 3 * fixed["per_pass"]["running"] + 1e-9
        assert chosen["per_pass"]["drafted"] <= 6 * chosen["per_pass"]["running"] + 1e-9
    assert rows["compiled-spec[draft 3]"]["tokens_per_verification"] <= 4


def test_auto_lengths_are_a_row_of_each_drafting_engine(run_cli, replay_build):
    """`--draft-lengths auto`: one more row of each drafting engine, its chain lengths or tree nodes
    chosen by its passes' cost, tokens checked."""
    build, _ = replay_build
    code, stdout, err = run_cli("bench", build, "--batch", "3", "--engines",
                                "compiled,compiled-spec,compiled-tree-sched", "--json", "--warmup", 0, "--requests", 3,
                                "--max-new-tokens", 12, "--forced", "--breakdown-requests", 0, "--draft-lengths", "auto")
    assert code == 0, err
    rows = {r["engine"]: r for r in json.loads(stdout)["rows"]}
    assert list(rows) == ["compiled", "compiled-spec", "compiled-tree-sched", "compiled-spec[draft auto]",
                          "compiled-tree-sched[draft auto]"]
    assert all(r["check"]["passed"] and r["tokens"] == 36 for r in rows.values())
    assert all(r["releases"] == 0 for r in rows.values())      # a CPU's builds hand no memory back
    for engine in ("compiled-spec", "compiled-tree-sched"):
        assert rows[f"{engine}[draft auto]"]["policy"]["adaptive"] and not rows[engine]["policy"]["adaptive"]
        assert rows[engine]["prices"] is None      # the fitted prices are an adaptive row's
        prices = rows[f"{engine}[draft auto]"]["prices"]
        assert set(prices) == {"pass", "row", "level", "padded_row", "request"} and prices["pass"] > 0 and prices["row"] >= 0


@pytest.mark.parametrize("args,message", [(["--batch", "0"], "positive integers"),
                                          (["--batch", "two"], "comma-separated integers"),
                                          (["--batch", "2", "--arrivals", "poisson:-1"], "positive rate"),
                                          (["--batch", "2", "--arrivals", "sometimes"], "trace file, burst"),
                                          (["--batch", "8"], "holds 4 sequence(s) at once"),
                                          (["--batch", "2", "--schedules", "0/4"], "NODES/CHUNK pairs"),
                                          (["--batch", "2", "--schedules", "64"], "NODES/CHUNK pairs"),
                                          (["--batch", "2", "--draft-lengths", "4:0"], "sets of positive integers"),
                                          (["--batch", "2", "--draft-lengths", "x"], "sets of positive integers"),
                                          (["--batch", "2", "--draft-lengths", "9"], "drafts at most 8 tokens"),
                                          (["--batch", "2", "--draft-lengths", "8:6:3"], "8:6:3 is not evenly spaced"),
                                          (["--batch", "2", "--draft-lengths", "4,4"], "4 is given twice"),
                                          (["--batch", "2", "--draft-lengths", ","], "no set of lengths"),
                                          (["--batch", "2", "--draft-lengths", "auto", "--engines",
                                            "compiled"], "no engine here drafts"),
                                          (["--draft-lengths", "4"], "--draft-lengths needs --batch"),
                                          (["--schedules", "64/8"], "--schedules needs --batch"),
                                          (["--fill"], "--fill needs --batch")])
def test_bad_batch_options_are_refused(run_cli, replay_build, args, message):
    code, _, err = run_cli("bench", replay_build[0], *args)
    assert code == 2 and message in err


def test_a_real_drafter_s_confidence_reaches_the_batch_schedule(run_cli, replay_build):
    """`--replay-confidence`: the build's plan scored with recorded pools -- every row's tokens still
    checked, and the shared budget, ranking by those scores, drafts otherwise than under the replay's
    certainty of its plan."""
    from specpilot.core.acceptance_profile import write_profile
    build, tmp = replay_build
    write_profile(tmp / "pools.json", [[2, 1]], "test", {"right": [[0.9, 0.05], [0.6, 0.3], [0.3, 0.2]],
                                                         "wrong": [[0.5, 0.4], [0.2, 0.1]], "ranks": [1, None],
                                                         "beyond": [[0.4, 0.3]]})
    rows = {}
    for extra in ((), ("--replay-confidence", tmp / "pools.json")):
        code, stdout, err = run_cli("bench", build, "--batch", "3", "--engines", "compiled,compiled-tree-sched",
                                    "--json", "--warmup", 0, "--requests", 3, "--max-new-tokens", 16, "--forced",
                                    "--breakdown-requests", 0, *extra)
        assert code == 0, err
        report = json.loads(stdout)
        assert report["tokens_checked"] and all(r["check"]["identical"] == 3 for r in report["rows"])
        rows[bool(extra)] = report["rows"][1]
    assert report["replay_confidence"] == str(tmp / "pools.json")
    assert rows[True]["per_pass"] != rows[False]["per_pass"]
