"""`specpilot bench` and the replay drafter: a tiny CPU build benchmarked with its tokens checked
against AR and its JSON complete; replayed acceptance equal to the recorded profile, exactly."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import yaml

from specpilot.core.acceptance_profile import read_profile, write_profile
from specpilot.core.errors import SpecError, SpecPilotError
from specpilot.core.spec import load_spec
from specpilot.runtime.bench import check_choices, check_tokens
from specpilot.runtime.systems import from_build, from_spec
from tests.conftest import TINY_CONFIGS, assert_block_chains_are_the_level_walk_s, build_spec

DENSE_TARGET = {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"], "init": {"seed": 4}}
COST = {"architecture": "LlamaForCausalLM", "init": {"seed": 9},
        "config": {**TINY_CONFIGS["LlamaForCausalLM"], "num_hidden_layers": 1}}
PROFILE = [[3, 1, 4, 1, 5, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8]]


def _replay_spec(tmp_path, drafter_extra: dict, passes: str = "") -> dict:
    return {"target": DENSE_TARGET, "passes": passes,
            "drafter": {"kind": "replay", "cost": COST, "draft_len": 7, "top_k": 3, **drafter_extra},
            "deployment": {"dtype": "float32", "max_seq_len": 256}}


def test_bench_on_a_tiny_build_checks_tokens_and_writes_its_json(run_cli, tmp_path):
    data = {"target": DENSE_TARGET, "drafter": {"kind": "ngram", "draft_len": 3}, "passes": "tree-verify{budget=8}",
            "deployment": {"dtype": "float32", "max_seq_len": 256}}
    build = build_spec(tmp_path, data)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code, stdout, err = run_cli("bench", build, "--requests", 2, "--max-new-tokens", 24, "--json", "-o", out,
                                "--plot", png, "--record-profile", tmp_path / "profile.json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report == json.loads(out.read_text()) and png.stat().st_size > 1000
    assert report["format"] == "specpilot-bench" and report["tokens_checked"] and report["ar_engine"] == "compiled"
    assert {"date", "torch", "apache-tvm"} <= set(report["environment"])
    names = [e["engine"] for e in report["engines"]]
    assert names[:3] == ["compiled", "compiled-spec", "compiled-tree"]
    assert {"stock", "stock-spec", "stock-tree", "hf-generate", "hf-compiled", "hf-assisted"} <= set(names)
    for e in report["engines"]:
        assert e["check"]["passed"] and e["check"]["identical"] == 2 and len(e["decode_tokens_per_s"]) == 2
        assert all(r > 0 for r in e["decode_tokens_per_s"]) and e["speedup"] > 0 and len(e["ttft_seconds"]) == 2
        if e["engine"] in ("compiled-spec", "compiled-tree"):
            shares = e["cycle"]["shares"]
            assert set(shares) == {"draft", "verify", "commit", "host"} and abs(sum(shares.values()) - 1) < 1e-6
            assert e["tokens_per_verification"] >= 1
            assert e["efficiency"] == pytest.approx(e["speedup"] / e["tokens_per_verification"])
    assert report["engines"][0]["speedup"] == 1.0
    recorded = read_profile(tmp_path / "profile.json")
    tree = next(e for e in report["engines"] if e["engine"] == "compiled-tree")
    assert recorded == tree["accepted"] and sum(recorded[0]) == 23     # every token after the first
    # sampled: every engine draws sampled AR's tokens; the greedy-only transformers rows stay out
    code, stdout, err = run_cli("bench", build, "--requests", 2, "--max-new-tokens", 24, "--json", "--temperature",
                                "0.9", "--seed", 5, "--breakdown-requests", 0)
    assert code == 0, err
    sampled = json.loads(stdout)
    assert sampled["sampling"]["temperature"] == 0.9 and sampled["tokens_checked"]
    assert {e["engine"] for e in sampled["engines"]} == {"compiled", "compiled-spec", "compiled-tree", "stock",
                                                         "stock-spec", "stock-tree"}
    assert all(e["check"]["identical"] == 2 for e in sampled["engines"])


@pytest.mark.parametrize("passes,engine", [("", "stock-spec"), ("tree-verify{budget=12}", "stock-tree")])
def test_replay_acceptance_equals_the_profile_exactly(tmp_path, passes, engine):
    write_profile(tmp_path / "p.json", PROFILE, "test")
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(_replay_spec(tmp_path, {"profile": "p.json"}, passes)))
    system = from_spec(load_spec(tmp_path / "m.yaml"))
    prompts = [[5, 9, 2, 7], [11, 3, 8]]
    for prompt, counts in zip(prompts, PROFILE):
        want = system.generate("stock", prompt, sum(counts) + 1)
        system.oracle.register(prompt, want.tokens)
        got = system.generate(engine, prompt, sum(counts) + 1)
        assert got.tokens == want.tokens and got.accepted[1:] == counts


def test_replay_from_a_compiled_build_runs_its_cost_network_and_stays_exact(tmp_path):
    build = build_spec(tmp_path, _replay_spec(tmp_path, {"alpha": 0.7, "seed": 5}, "tree-verify{budget=10}"))
    system = from_build(build)
    assert "drafter_decode" in system.engines["compiled"].model.module.manifest.functions   # the cost network
    prompt = [4, 8, 15, 16, 23, 42]
    ar = system.generate("compiled", prompt, 48)
    runs = [system.generate(e, prompt, 48) for e in ("compiled-spec", "compiled-tree", "compiled-tree")]
    assert all(r.tokens == ar.tokens for r in runs)
    assert runs[1].accepted == runs[2].accepted          # seeded: the same plan every time
    assert 1.5 < runs[1].mean_accepted < 4.5              # alpha 0.7: about 1 / (1 - 0.7) tokens a verification


def test_a_replay_spending_a_block_drafter_s_time_drafts_a_batch_in_one_call(tmp_path, monkeypatch):
    """A replay drafter whose cost is a seeded block drafter (`cost: {kind: block}`): the build's
    target keeps features, its block cycles of a continuous batch run in one call, tokens stay AR's."""
    from specpilot.runtime.compiled_draft_nets import CompiledBlockNet
    calls = []
    batch = CompiledBlockNet.cycle_batch
    monkeypatch.setattr(CompiledBlockNet, "cycle_batch", lambda self, entries, k: calls.append(len(entries))
                        or batch(self, entries, k))
    data = _replay_spec(tmp_path, {"alpha": 0.7, "seed": 5}, "tree-verify{budget=10}")
    data["drafter"]["cost"] = {"kind": "block", "layers": 1, "block_size": 6, "init": {"seed": 9}}
    data["deployment"]["max_batch"] = 2
    system = from_build(build_spec(tmp_path, data))
    module = system.engines["compiled"].model.module
    assert "drafter_cycle_batch" in module.manifest.functions and "drafter_decode" not in module.manifest.functions
    prompts, lengths = [[4, 8, 15, 16, 23, 42], [5, 9, 2, 7], [11, 3, 8, 1, 1]], [40, 24, 32]
    ar = [system.generate("compiled", p, n).tokens for p, n in zip(prompts, lengths)]
    for engine in ("compiled-spec", "compiled-tree"):
        calls.clear()
        got = system.generate_batch(engine, prompts, lengths, max_batch=2)
        assert [g.tokens for g in got] == ar, engine
        assert calls and max(calls) == 2, (engine, calls)
        assert sum(g.mean_accepted for g in got) / 3 > 1.5, engine      # alpha 0.7 replayed


def test_a_batch_s_block_drafted_trees_walk_no_levels_and_are_the_prefetched_trees(tmp_path, monkeypatch):
    """A block drafter's tree expansions are lookups in its drafted block: the batched tree engine
    fetches no levels ahead for them (no `expand_across` call), and its trees -- so its acceptance and
    tokens -- are those it builds with the levels fetched ahead (expanders given a ``batch``)."""
    from specpilot.runtime import batching
    from specpilot.runtime.replay import ReplayDrafter
    data = _replay_spec(tmp_path, {"alpha": 0.7, "seed": 5}, "tree-verify{budget=10}")
    data["drafter"]["cost"] = {"kind": "block", "layers": 1, "block_size": 6, "init": {"seed": 9}}
    data["deployment"]["max_batch"] = 3
    system = from_build(build_spec(tmp_path, data))
    prompts, lengths = [[4, 8, 15, 16, 23, 42], [5, 9, 2, 7], [11, 3, 8, 1, 1]], [40, 24, 32]
    levels = []
    expand_across = batching.expand_across
    monkeypatch.setattr(batching, "expand_across", lambda *a: levels.append(1) or expand_across(*a))
    got = system.generate_batch("compiled-tree", prompts, lengths, max_batch=3)
    assert not levels
    expander = ReplayDrafter.expander

    def batched(self, context):
        expand = expander(self, context)
        expand.batch = lambda paths: [expand(p) for p in paths]
        return expand
    monkeypatch.setattr(ReplayDrafter, "expander", batched)
    fetched = system.generate_batch("compiled-tree", prompts, lengths, max_batch=3)
    assert levels and [g.accepted for g in got] == [f.accepted for f in fetched]
    assert [g.tokens for g in got] == [f.tokens for f in fetched] == \
        [system.generate("compiled", p, n).tokens for p, n in zip(prompts, lengths)]


def test_a_batch_s_replayed_block_chains_are_the_level_walk_s(tmp_path, monkeypatch):
    """Chains of a batch whose drafters' time is a block drafter's come from the one block pass, no
    level of expansions: the same chains (so the same acceptance) as walking each request's expander
    by its first-ranked children, the path taken where no block drafter stands behind the drafter."""
    from specpilot.runtime.replay import ReplayDrafter
    data = _replay_spec(tmp_path, {"alpha": 0.7, "seed": 5}, "tree-verify{budget=10}")
    data["drafter"]["cost"] = {"kind": "block", "layers": 1, "block_size": 6, "init": {"seed": 9}}
    data["deployment"]["max_batch"] = 3
    system = from_build(build_spec(tmp_path, data))
    assert_block_chains_are_the_level_walk_s(system, [[4, 8, 15, 16, 23, 42], [5, 9, 2, 7], [11, 3, 8, 1, 1]],
                                             [40, 24, 32], ReplayDrafter, monkeypatch)


def test_replay_rows_run_once_per_acceptance_plan(run_cli, tmp_path):
    build = build_spec(tmp_path, _replay_spec(tmp_path, {"alpha": 0.7, "seed": 5}, "tree-verify{budget=10}"))
    write_profile(tmp_path / "p.json", PROFILE, "test")
    code, stdout, err = run_cli("bench", build, "--requests", 2, "--max-new-tokens", 48, "--json",
                                "--engines", "compiled,stock,compiled-spec,compiled-tree", "--breakdown-requests", 0,
                                "--replay-alpha", "0.3,0.9", "--replay-profile", tmp_path / "p.json",
                                "--record-profile", tmp_path / "recorded.json")
    assert code == 0, err
    report = json.loads(stdout)
    rows = {(e["engine"], e["replay"]): e for e in report["engines"]}
    plans = ("alpha=0.3", "alpha=0.9", "profile=p.json")
    assert set(rows) == {("compiled", None), ("stock", None)} | {(e, p) for e in ("compiled-spec", "compiled-tree")
                                                                 for p in plans}
    assert read_profile(tmp_path / "recorded.json") == rows["compiled-tree", "profile=p.json"]["accepted"]  # the last row
    assert report["tokens_checked"] and all(e["check"]["identical"] == 2 for e in report["engines"])
    for engine in ("compiled-spec", "compiled-tree"):
        assert rows[engine, "alpha=0.9"]["tokens_per_verification"] > rows[engine, "alpha=0.3"]["tokens_per_verification"]
        assert "REPLAY alpha=0.9" in rows[engine, "alpha=0.9"]["label"]
    tree = rows["compiled-tree", "profile=p.json"]["accepted"]
    assert [got[:len(want)] for got, want in zip(tree, PROFILE)] == PROFILE      # the profile, exactly
    # forced onto AR's tokens: the same acceptance, every position's own choice checked
    code, stdout, err = run_cli("bench", build, "--requests", 2, "--max-new-tokens", 48, "--json", "--forced",
                                "--engines", "compiled,compiled-tree", "--breakdown-requests", 0,
                                "--replay-profile", tmp_path / "p.json")
    assert code == 0, err
    forced = json.loads(stdout)
    assert forced["forced"] and forced["tokens_checked"] and all(e["check"]["identical"] == 2 for e in forced["engines"])
    assert forced["engines"][1]["accepted"] == tree


@pytest.mark.parametrize("args,message", [
    (("--replay-alpha", "0.5,x"), "'x' is not a number"),
    (("--replay-alpha", "1.5"), "not a rate in"),
])
def test_bad_replay_plans_are_refused(run_cli, tmp_path, args, message):
    build = build_spec(tmp_path, _replay_spec(tmp_path, {"alpha": 0.7}))
    code, _, err = run_cli("bench", build, "--requests", 1, "--max-new-tokens", 8, *args)
    assert code != 0 and message in err


def test_replay_plans_need_a_replay_drafter(run_cli, tmp_path):
    data = {"target": DENSE_TARGET, "drafter": {"kind": "ngram"}, "deployment": {"max_seq_len": 128}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    code, _, err = run_cli("bench", tmp_path / "m.yaml", "--requests", 1, "--max-new-tokens", 8, "--replay-alpha", "0.5")
    assert code != 0 and "need a replay drafter" in err


@pytest.mark.parametrize("passes,engine", [("", "stock-spec"), ("tree-verify{budget=12}", "stock-tree")])
def test_a_run_that_leaves_the_recorded_continuation_stays_exact_with_every_later_draft_wrong(tmp_path, passes,
                                                                                             engine):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(_replay_spec(tmp_path, {"alpha": 1.0}, passes)))
    system = from_spec(load_spec(tmp_path / "m.yaml"))
    prompt = [5, 9, 2, 7]
    want = system.generate("stock", prompt, 30).tokens
    recorded = list(want)
    recorded[10] = (recorded[10] + 1) % system.vocab_size       # the engine will leave this run at 10
    system.oracle.register(prompt, recorded)
    got = system.generate(engine, prompt, 30)
    assert got.tokens == want
    committed = list(itertools.accumulate(got.accepted))
    cut = next(i for i, n in enumerate(committed) if n > 10)   # the verification that reached position 10
    assert all(n == 1 for n in got.accepted[cut + 1:]) and len(got.accepted) > cut + 1


@pytest.mark.parametrize("drafter,message", [
    ({"kind": "replay", "cost": COST}, "one of 'profile'"),
    ({"kind": "replay", "alpha": 0.5}, "drafter.cost: missing"),
    ({"kind": "replay", "alpha": 1.5, "cost": COST}, "less than or equal to 1"),
    ({"kind": "replay", "profile": "nope.json", "cost": COST}, "does not exist"),
    ({"kind": "replay", "alpha": 0.5, "cost": COST, "init": {"seed": 1}}, "goes under 'cost'"),
    ({"kind": "replay", "alpha": 0.5, "cost": {"kind": "block", "layers": 1}}, "drafter.cost.init: .*seeded drafter"),
    ({"kind": "replay", "alpha": 0.5, "cost": {"kind": "block", "init": {"seed": 1}, "architecture": "LlamaForCausalLM"}},
     "drafter.cost.architecture"),
    ({"kind": "replay", "alpha": 0.5, "cost": {**COST, "layers": 2}}, "are a block cost's"),
    ({"kind": "replay", "alpha": 0.5, "cost": {"kind": "block", "init": {"seed": 1, "draw": "device"}}},
     "drafter.cost.init: a block cost is drawn from its seed alone"),
    ({"kind": "replay", "alpha": 0.5, "block_size": 4, "cost": {"kind": "block", "init": {"seed": 1}}},
     "drafter.block_size: a replay drafter's network options go under 'cost'"),
])
def test_bad_replay_drafters_are_refused_with_the_key(tmp_path, drafter, message):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"target": DENSE_TARGET, "drafter": drafter}))
    with pytest.raises(SpecError, match=message):
        load_spec(tmp_path / "m.yaml")


def test_a_corrupt_profile_is_a_clear_error(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"format": "specpilot-acceptance-profile", "version": 1,
                                                 "accepted": [[2, 0]]}))
    with pytest.raises(SpecPilotError, match="integers in 1..1025"):
        read_profile(tmp_path / "p.json")


def test_forced_runs_are_checked_at_every_position_by_their_own_choices():
    ar = [SimpleNamespace(tokens=[5, 6, 7, 8], margins=[3.0, 0.1, 2.0, 4.0])] * 3
    runs = [SimpleNamespace(tokens=[5, 6, 7, 8], choices=c) for c in ([5, 6, 7, 8], [5, 9, 7, 8], [5, 9, 7, 1])]
    check = check_choices(ar, runs, 0.25)
    assert check.identical == 1
    assert check.excused == [{"request": 1, "position": 1, "ar_margin": 0.1}, {"request": 2, "position": 1, "ar_margin": 0.1}]
    assert check.failed == [{"request": 2, "position": 3, "ar_token": 8, "token": 1, "ar_margin": 4.0}]


def test_token_check_fails_fp32_differences_and_excuses_only_near_ties():
    ar = [SimpleNamespace(tokens=[1, 2, 3, 4], margins=[5.0, 0.01, 3.0, 2.0])]
    assert check_tokens(ar, [[1, 2, 3, 4]], 0.0).passed
    wrong = check_tokens(ar, [[1, 9, 3, 4]], 0.0)
    assert not wrong.passed and wrong.failed[0]["position"] == 1 and wrong.failed[0]["ar_token"] == 2
    tie = check_tokens(ar, [[1, 9, 3, 4]], 0.05)
    assert tie.passed and tie.excused == [{"request": 0, "position": 1, "ar_margin": 0.01}]
    assert not check_tokens(ar, [[1, 2, 7, 4]], 0.05).passed          # a margin of 3 is no tie
    assert not check_tokens(ar, [[1, 2, 3]], 0.05).passed             # a short run is a difference


def test_built_in_prompt_sets_are_real_text_for_a_real_tokenizer():
    """A checkpoint's tokenizer (no vocab_size attribute) gets the code and chat texts themselves; only a
    random model too small for bytes gets synthetic ids."""
    from specpilot.cli import bench_prompts
    from specpilot.runtime.prompt_sets import CODE, chat, CHAT
    from specpilot.runtime.tokenizer import ByteTokenizer
    real = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text: [ord(c) for c in text]), vocab_size=49152)
    assert bench_prompts("code", real, 2) == [[ord(c) for c in CODE[0]], [ord(c) for c in CODE[1]]]
    assert bench_prompts("chat", real, 1) == [[ord(c) for c in chat(CHAT[0])]]
    tiny = SimpleNamespace(tokenizer=ByteTokenizer(100), vocab_size=100)
    ids = bench_prompts("code", tiny, None)
    assert len(ids) == 16 and all(0 <= t < 100 for p in ids for t in p)


def test_pass_cost_kernel_lists_merge_per_layer_copies():
    """CUDA kernel names carry the layer's number before `_kernel`, the CPU's at the end: either way a
    family of three or more copies launched once each is one row; kernels launched many times, and two
    that merely share a stem, keep their own rows."""
    from bench._common import merge_copies
    totals = {"gated_delta_rule_kernel": [10.0, 1], "gated_delta_rule7_kernel": [11.0, 1],
              "gated_delta_rule82_kernel": [12.0, 1], "attention_decode": [1.0, 1], "attention_decode1": [2.0, 1],
              "attention_decode2": [3.0, 1], "skinny_mma_17408_5120_kernel_5": [70.0, 64], "rms_norm1": [4.0, 1],
              "rms_norm2": [5.0, 1]}
    merge_copies(totals)
    assert totals == {"gated_delta_rule*": [33.0, 3], "attention_decode*": [6.0, 3],
                      "skinny_mma_17408_5120_kernel_5": [70.0, 64], "rms_norm1": [4.0, 1], "rms_norm2": [5.0, 1]}


@pytest.mark.parametrize("passes", ["", "tree-verify{budget=8}"])
def test_pass_cost_bench_profiles_a_cpu_build_per_kernel(tmp_path, passes):
    """bench/batch_pass_cost.py on a tiny CPU build: per node count, the timed passes, a per-kernel
    profile through the VM's instrument hook (a kernel's per-layer copies under one name), and the
    commit (a tree build keeps every other node, moving keys and values; a chain build its prefix)."""
    import subprocess
    import sys
    from pathlib import Path
    data = {"target": DENSE_TARGET, "drafter": {"kind": "ngram", "draft_len": 3}, "passes": passes,
            "deployment": {"dtype": "float32", "max_seq_len": 256}}
    build = build_spec(tmp_path, data)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "bench" / "batch_pass_cost.py"), str(build), "--batches", "1",
                           "--nodes", "0,4", "--context", "12", "--reps", "2", "--accepted", "2", "--top", "40",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "out").glob("batch-pass-cost-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["nodes"] for r in rows] == [0, 4]
    layers = TINY_CONFIGS["Qwen3ForCausalLM"]["num_hidden_layers"]
    for row in rows:
        for name in ("ar_step", "verify"):
            ranked = row[name]["kernels"]
            assert ranked[-1]["kernel"] == "(all)" and ranked[-1]["us"] > 0
            assert sum(k["us"] for k in ranked[:-1]) == pytest.approx(ranked[-1]["us"])    # --top covers them all
            attention = [k for k in ranked if k["kernel"].startswith("attention_")]
            assert any(k["kernel"].endswith("*") and k["calls"] == layers for k in attention), ranked
        assert row["commit"]["accepted"] == min(2, row["nodes"] // 2 if passes else row["nodes"])
        assert row["context"] == 12         # every node count at the prefilled context
        assert row["verify"]["median_ms"] > 0 and row["commit"]["accept_path_ms"] >= 0


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3_5ForCausalLM"])
def test_block_agreement_drafts_what_the_engine_s_block_drafter_drafts(arch):
    """bench/block_agreement.py's teacher-forced blocks are the engine's: at every position its top-1 drafts
    equal `BlockDrafter.block_ranked`'s first ranks for the same context."""
    import torch

    from bench.block_agreement import forced_blocks
    from specpilot.core import feature_drafter as fd
    from specpilot.core.weights import random_weights
    from specpilot.runtime.decoding import autoregressive
    from specpilot.runtime.feature_drafters import BlockDrafter
    from specpilot.runtime.reference.feature_nets import build_net
    from specpilot.runtime.reference.model import ReferenceModel
    from tests.conftest import tiny_config

    cfg = tiny_config(arch)
    model = ReferenceModel(cfg, random_weights(cfg, 3), feature_layers=(0, 2))
    dcfg = fd.seeded_config("block", cfg, block_size=5, target_layers=(0, 2))
    net = build_net(dcfg, fd.random_init(dcfg, 6), model.w, torch.float32, "cpu")
    prompt = [(7 * i + 3) % 301 for i in range(11)]
    seq = prompt + autoregressive(model, prompt, 9, 64).tokens
    blocks = forced_blocks(net, model, seq, len(prompt), 64)
    assert len(blocks) == len(seq) - 1 - len(prompt)
    for n, drafts in enumerate(blocks, start=len(prompt)):
        state = model.new_state(64)
        model.forward(seq[:n], state)
        drafter = BlockDrafter(net, top_k=1, capacity=64)
        drafter.bind(state)
        assert drafts == drafter.block_ranked(seq[:n + 1])[0][:, 0].tolist()


def test_block_hits_counts_agreement_by_position_and_the_matching_prefix():
    from bench.block_agreement import block_hits
    seq = [1, 2, 3, 4, 5, 6]
    # positions 2 and 3 (the target consumed seq[:n]); drafts for the tokens after seq[n]
    hits, accepted = block_hits([[4, 9, 6], [5, 6]], seq, 2)
    assert hits == {1: [1, 1], 2: [0, 1], 3: [1]} and accepted == [1, 2]
