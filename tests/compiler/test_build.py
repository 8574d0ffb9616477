"""Compiled builds on the CPU (--target llvm, fp32): every architecture's compiled
autoregressive and compiled speculative decoding pass token forcing exactly against the
stock reference, and a build loads with the TVM runtime alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from specpilot.compiler.build import BuildRequest, build
from specpilot.core.manifest import Manifest, read_manifest
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target
from specpilot.core.errors import SpecPilotError
from specpilot.runtime.drafters import catch_up_chains, chain_levels, chain_network
from specpilot.runtime.forcing import force_requests
from specpilot.runtime.systems import from_build
from tests.build_helpers import compile_cli
from tests.conftest import TINY_CONFIGS, build_spec

ROOT = Path(__file__).resolve().parents[2]
DRAFTERS = {  # every drafter kind is covered by some architecture
    "LlamaForCausalLM": {"kind": "model", "architecture": "LlamaForCausalLM",
                         "config": {**TINY_CONFIGS["LlamaForCausalLM"], "num_hidden_layers": 1}, "init": {"seed": 5}},
    "Qwen2ForCausalLM": {"kind": "ngram"},
    "Qwen3ForCausalLM": {"kind": "early-exit", "layers": 2},
    "Qwen3NextForCausalLM": {"kind": "early-exit", "layers": 3},
    "Qwen3_5ForCausalLM": {"kind": "model", "architecture": "Qwen3_5ForCausalLM",
                           "config": {**TINY_CONFIGS["Qwen3_5ForCausalLM"], "num_hidden_layers": 2,
                                      "layer_types": ["linear_attention", "full_attention"]}, "init": {"seed": 5}},
}
PROMPTS = [[(11 * i + 3 * r) % 301 for i in range(9 + 4 * r)] for r in range(3)]


def _spec(tmp_path, arch):
    data = {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 1}},
            "drafter": {**DRAFTERS[arch], "draft_len": 4, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 400, "max_batch": 3}}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def built(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    spec = _spec(tmp, request.param)
    manifest = build(BuildRequest(spec, parse_target("llvm"), tmp / "build"))
    return tmp / "build", manifest


def test_manifest_and_functions(built):
    out, manifest = built
    assert (out / "model.so").is_file() and (out / "params" / "params.safetensors").is_file()
    on_disk = json.loads((out / "manifest.json").read_text())
    assert Manifest.model_validate(on_disk) == manifest
    hybrid = manifest.models["target"]["layer_types"].count("linear_attention") > 0
    for fn in ("prefill", "decode", "verify"):
        assert f"target_{fn}" in manifest.functions
    assert ("target_commit" in manifest.functions) == hybrid
    assert manifest.versions["apache-tvm"] == "0.27.0.post1"
    assert set(manifest.hashes) == {"model.so", "params/params.safetensors"}


@pytest.mark.parametrize("engine", ["compiled", "compiled-spec"])
def test_compiled_token_forcing_256_exact(built, engine):
    out, _ = built
    system = from_build(out)
    stock_runs, runs = [], []
    for prompt in PROMPTS:
        stock = system.generate("stock", prompt, 256)
        stock_runs.append(stock)
        runs.append(system.generate(engine, prompt, 256, force=stock.tokens))
    report = force_requests(stock_runs, runs, tie_tolerance=0.0)
    assert report.passed, report.first_divergence
    assert report.positions == 3 * 256 and not report.excused
    if engine == "compiled-spec":   # and unforced it generates stock's tokens
        assert system.generate(engine, PROMPTS[0], 96).tokens == stock_runs[0].tokens[:96]


def test_unforced_decoding_with_tokens_on_the_device_equals_the_host_loop(built):
    """The unforced loop feeds each step's argmax back where the build runs (no host round trip a
    step): the same tokens, choices, margins and runner-ups as the host loop (forced by a no-op
    hook onto it), and with a stop token it stops where the host loop does, inside a window."""
    from specpilot.runtime.decoding import autoregressive
    out, _ = built
    model = from_build(out).engines["compiled"].model
    for prompt in PROMPTS[:2]:
        host = autoregressive(model, prompt, 45, 400, logits_hook=lambda pos, row: row)
        device = autoregressive(model, prompt, 45, 400, window=8)
        assert device.tokens == host.tokens and device.choices == host.choices
        assert device.margins == host.margins and device.runner_up == host.runner_up
        assert device.accepted == host.accepted == [1] * 45
        stop = host.tokens[21]    # the first position it appears at, in the third window
        first = host.tokens.index(stop)
        stopped = autoregressive(model, prompt, 45, 400, stop_ids=[stop], window=8)
        assert stopped.tokens == host.tokens[:first + 1] == \
            autoregressive(model, prompt, 45, 400, stop_ids=[stop], logits_hook=lambda pos, row: row).tokens
        # streamed: every token heard once, in order, in bursts; a listener's False ends it at that token
        heard = []
        streamed = autoregressive(model, prompt, 45, 400, on_token=heard.append)
        assert heard == streamed.tokens == host.tokens
        heard.clear()
        cut = autoregressive(model, prompt, 45, 400, on_token=lambda t: heard.append(t) or len(heard) < 7)
        assert heard == cut.tokens == host.tokens[:7]
        heard.clear()
        assert autoregressive(model, prompt, 45, 400, stop_ids=[stop], on_token=heard.append).tokens == heard == \
            host.tokens[:first + 1]
    assert len(model.free_rows) == model.max_batch       # every finished sequence gave its row back


def test_continuous_batch_forcing_exact(built):
    """Five requests of different prompt lengths and lengths through a 3-row cache pool: requests
    join (prefilled in the same call as the others' decode steps) and leave; every request's
    tokens are stock's, exactly."""
    out, _ = built
    system = from_build(out)
    prompts = [[(5 * i + 17 * r) % 301 for i in range(3 + 7 * r)] for r in range(5)]
    limits = [41, 17, 64, 9, 30]
    stock_runs = [system.generate("stock", p, n) for p, n in zip(prompts, limits)]
    runs = system.generate_batch("compiled", prompts, limits, forces=[s.tokens for s in stock_runs])
    report = force_requests(stock_runs, runs, tie_tolerance=0.0)
    assert report.passed, report.first_divergence
    assert report.positions == sum(limits) and not report.excused
    unforced = system.generate_batch("compiled", [prompts[r] for r in (0, 2, 4)], [20, 20, 20])
    assert [g.tokens for g in unforced] == [stock_runs[r].tokens[:20] for r in (0, 2, 4)]


def test_compiled_drafter_levels_score_as_node_by_node(built):
    """The compiled drafter network's tree levels (a dense network keeps the scored nodes in its cache)
    answer as node-by-node expansion on the same build, three levels deep, with a path asked for
    again; the n-gram drafter has no network, and a hybrid one without gdn-path-recompute expands
    node by node."""
    out, manifest = built
    system = from_build(out)
    make = system.engines["compiled-spec"].drafter
    if getattr(make(), "network", None) is None:
        assert DRAFTERS[manifest.spec["target"]["architecture"]]["kind"] == "ngram"
        return
    context = PROMPTS[1]
    expand, alone = make().expander(context), make().expander(context)
    if getattr(expand, "batch", None) is None:      # a hybrid network built without gdn-path-recompute
        assert make().network.model.cfg.is_hybrid and manifest.gdn_verify is None
        return
    level = [[t] for t, _ in expand([])[:2]]
    for depth in range(3):
        paths = level + ([level[0]] if depth == 2 else [])
        for path, got in zip(paths, expand.batch(paths)):
            want = alone(path)
            assert [t for t, _ in got] == [t for t, _ in want], (depth, path)
            assert torch.allclose(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), atol=1e-4)
        level = [path + [t] for path in level for t, _ in alone(path)[:2]]


def test_compiled_drafter_chains_equal_its_own_proposals(built):
    """Chains run on the compiled drafter network with the chosen tokens kept where it runs (torch
    tensors as a step's tokens) equal each request's own `propose` on the same build."""
    out, manifest = built
    make = from_build(out).engines["compiled-spec"].drafter
    if chain_network(make()) is None:
        assert DRAFTERS[manifest.spec["target"]["architecture"]]["kind"] == "ngram"
        return
    drafters, contexts, lengths = [make() for _ in range(2)], [PROMPTS[1], PROMPTS[2][:9]], [5, 2]
    alone = make()              # the build holds three drafter rows
    for _ in range(2):          # the second round catches up in one batched pass
        chains, _ = chain_levels(catch_up_chains([chain_network(d) for d in drafters], contexts, lengths), 2)
        for context, n, chain in zip(contexts, lengths, chains):
            alone.reset()
            want = alone.propose(context, n)
            assert [t for t, _ in chain] == want.chain()
            np.testing.assert_allclose([v for _, v in chain], want.logprobs[:, 0].tolist(), rtol=1e-4, atol=1e-4)
        contexts = [c + [t for t, _ in chain[:2]] + [7] for c, chain in zip(contexts, chains)]


def test_batched_step_equals_single_steps(built):
    """One padded call over sequences at different lengths (one of them verifying a chunk with
    per-token states) gives each sequence the logits of its own call."""
    out, _ = built
    model = from_build(out).engines["compiled"].model
    a, b = model.new_state(400), model.new_state(400)
    model.forward(list(range(40, 53)), a)
    model.forward([7, 8], b)
    batched = model.forward_batch([([60, 61, 62, 63], a), ([9], b)], record=True)
    a.truncate(13)      # roll both back through the recorded per-token states
    b.truncate(2)
    again = [model.forward([60, 61, 62, 63], a, record=True), model.forward([9], b, record=True)]
    for x, y in zip(batched, again):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    c = model.new_state(400)
    with pytest.raises(SpecPilotError, match="all 3 KV-cache rows"):
        model.new_state(400)
    a.close()
    model.new_state(400)   # a closed sequence's row is free again
    c.close()


def test_recorded_pass_is_committed_only_where_kept(built):
    """A recorded verification's recurrent states are committed lazily: truncating into the pass
    runs one commit (the kept token's) when the states are next read, never the pass's last-token
    commit; a pass kept whole is committed when its states are next read.  Models without Gated
    DeltaNet layers have no commit."""
    out, _ = built
    model = from_build(out).engines["compiled"].model
    if not model.has_gdn:
        assert model._commit is None
        return
    calls, real = [], model._commit
    model._commit = lambda *args: calls.append(args) or real(*args)
    a, b = model.new_state(400), model.new_state(400)
    model.forward(list(range(40, 53)), a)
    model.forward([60, 61, 62, 63], a, record=True)
    assert calls == []
    a.truncate(15)
    assert calls == []
    model.forward(list(range(40, 53)) + [60, 61], b)        # as if the rejected tokens never came
    torch.testing.assert_close(model.forward([5], a), model.forward([5], b), rtol=1e-6, atol=1e-6)
    assert len(calls) == 1 and calls[0][-1].numpy().tolist() == [1]    # the kept token's: 15 - 13 - 1
    model.forward([70, 71], a, record=True)
    assert len(calls) == 1
    model.forward([72], a)                                    # reads the states: commits the pass
    assert len(calls) == 2
    a.close()
    b.close()


def test_runtime_only_load(built):
    """A fresh process with TVM forced onto its runtime library (no compiler) runs the build."""
    out, _ = built
    code = (
        "import sys, json; import tvm;"
        "from specpilot.runtime.engine import CompiledModule;"
        "from specpilot.runtime.decoding import autoregressive;"
        "m = CompiledModule(sys.argv[1]).model('target');"
        "print(json.dumps({'compiler': hasattr(tvm, 'relax') and hasattr(tvm.relax, 'build'),"
        " 'tokens': autoregressive(m, [1, 2, 3], 8, 400).tokens}))"
    )
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["compiler"] is False
    assert result["tokens"] == from_build(out).generate("stock", [1, 2, 3], 8).tokens


def test_a_build_compiled_again_into_its_folder_loads_as_the_new_build(tmp_path):
    """One process loads a build, the folder is compiled again with another pipeline, and the next
    load runs the new library: the loader would hand back the first library loaded from that path
    (its functions, not the new manifest's), so other bytes at a loaded path load from a copy."""
    spec = _spec(tmp_path, "LlamaForCausalLM")
    out = tmp_path / "build"
    build(BuildRequest(spec, parse_target("llvm"), out))
    first = from_build(out)
    assert "compiled-tree" not in first.engines
    data = yaml.safe_load((tmp_path / "model.yaml").read_text())
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({**data, "passes": "tree-verify{budget=4}"}))
    build(BuildRequest(load_spec(tmp_path / "model.yaml"), parse_target("llvm"), out))
    again = from_build(out)
    assert "target_compact_kv" in read_manifest(out).functions and "compiled-tree" in again.engines
    prompt = PROMPTS[1]
    stock = again.generate("stock", prompt, 12)
    assert again.generate("compiled-tree", prompt, 12, force=stock.tokens).tokens == stock.tokens
    assert first.generate("compiled", prompt, 12, force=stock.tokens).tokens == stock.tokens   # the old one runs on


def test_corrupt_build_is_refused(built, tmp_path):
    import shutil
    out, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    params = copy / "params" / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[-1] ^= 0xFF
    params.write_bytes(bytes(data))
    with pytest.raises(SpecPilotError, match="content hash differs"):
        from_build(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))   # an older build format
    with pytest.raises(SpecPilotError, match="build format version 2.*rebuild"):
        from_build(copy)
    (copy / "manifest.json").write_text("{}")
    with pytest.raises(SpecPilotError, match="not a SpecPilot build manifest"):
        from_build(copy)
    # the integrity checks cannot be switched off by editing the manifest
    import hashlib
    (copy / "manifest.json").write_text(json.dumps({**manifest, "hashes": {}}))
    with pytest.raises(SpecPilotError, match="does not match manifest.sha256"):
        from_build(copy)
    (copy / "manifest.sha256").write_text(hashlib.sha256((copy / "manifest.json").read_bytes()).hexdigest())
    with pytest.raises(SpecPilotError, match="no entry for model.so"):
        from_build(copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "manifest.sha256").write_text(hashlib.sha256((copy / "manifest.json").read_bytes()).hexdigest())
    shutil.copyfile(out / "params" / "params.safetensors", params)
    lib = copy / "model.so"
    lib.write_bytes(lib.read_bytes()[:4096])      # truncated: refused before it is loaded, never SIGBUS
    with pytest.raises(SpecPilotError, match="model.so: content hash differs"):
        from_build(copy)


def test_unknown_pass_is_refused_before_building(tmp_path):
    spec = _spec(tmp_path, "Qwen3ForCausalLM")
    with pytest.raises(SpecPilotError, match="unknown pass"):
        build(BuildRequest(spec, parse_target("llvm"), tmp_path / "b", passes="fuse-everything"))


def test_cli_compile_run_verify(run_cli, tmp_path):
    out = tmp_path / "b"
    code, stdout, stderr = run_cli("compile", ROOT / "examples" / "tiny-llama.yaml", "--target", "llvm", "-o", out,
                                   "--passes", "w12-layout", "--dump-ir", tmp_path / "ir",
                                   "--print-ir-after", "w12-layout", "--json")
    summary = json.loads(stdout)
    assert code == 0 and summary["target"] == parse_target("llvm").text() and summary["pipeline"] == "w12-layout"
    assert sorted(p.name for p in (tmp_path / "ir").iterdir()) == ["01-lower.py", "02-w12-layout.py",
                                                                   "03-relax-pipeline.py"]
    assert "def target_verify" in (tmp_path / "ir" / "01-lower.py").read_text()
    assert "# IR after w12-layout" in stderr and "w12_gemm" in stderr and "# IR after lower" not in stderr
    code, stdout, _ = run_cli("run", out, "--prompt", "hi", "--max-new-tokens", 12, "--json")
    assert code == 0 and len(json.loads(stdout)["tokens"]) == 12
    code, stdout, _ = run_cli("verify", out, "--max-new-tokens", 24, "--inject-fault-after", 5)
    assert code == 1 and "position 5" in stdout
    code, stdout, _ = run_cli("verify", out, "--max-new-tokens", 24, "--engine", "compiled", "--batch", "--json")
    assert code == 0 and json.loads(stdout)["passed"] is True
    code, stdout, _ = run_cli("verify", out, "--max-new-tokens", 24, "--engine", "compiled-spec", "--batch", "--json")
    assert code == 0 and json.loads(stdout)["passed"] is True        # chains batch too
    code, _, stderr = run_cli("verify", out, "--max-new-tokens", 24, "--engine", "compiled-tree-sched", "--batch")
    assert code == 2 and "unknown engine 'compiled-tree-sched'" in stderr     # the build chose no batch schedule


@pytest.mark.slow
def test_specpilot_compile_for_cuda_embeds_device_code(tmp_path):
    """Through the stub driver, as `specpilot compile` does: the library embeds a fatbin, no CUDA source."""
    spec = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml"
    # with CUDA graphs: the same build, plus the static decode's kernel runs lifted into capture functions
    compile_cli(spec, "cuda -arch=sm_90", tmp_path / "b", "--passes", "kernel-schedule{graph=true}", "--json")
    data = (tmp_path / "b" / "model.so").read_bytes()
    assert data.count(b"\x50\xed\x55\xba") >= 1 and b"__global__" not in data
    manifest = read_manifest(tmp_path / "b")
    assert manifest.cuda_graph is True and manifest.pipeline == "kernel-schedule{graph=true}"
    assert "target_decode_cuda_graph_capture" in manifest.functions


@pytest.mark.slow
def test_a_graph_build_replays_the_fixed_verification_and_the_block_pass(tmp_path):
    """Static shapes but for the KV length: target_verify_tree (tree-verify{fixed=true}) and a block
    drafter's pass (its head the target head's rows of a draft vocabulary) are lifted into CUDA-graph
    capture functions, as the decode step is."""
    data = {"target": {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"],
                       "init": {"seed": 2}},
            "drafter": {"kind": "block", "init": {"seed": 4}, "draft_len": 5, "top_k": 3, "block_size": 6,
                        "draft_vocab": 120},
            "deployment": {"dtype": "bfloat16", "max_seq_len": 256}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    compile_cli(tmp_path / "m.yaml", "cuda -arch=sm_90", tmp_path / "b", "--params", "seeded", "--passes",
                "tree-verify{budget=8,fixed=true},kernel-schedule{graph=true}", "--json")
    manifest = read_manifest(tmp_path / "b")
    assert manifest.tree.fixed_tokens == 9
    assert {"target_verify_tree_cuda_graph_capture", "drafter_block_cuda_graph_capture"} <= set(manifest.functions)
    assert not any(f.startswith("target_verify_cuda_graph") for f in manifest.functions)   # symbolic: launched
    assert "drafter.lm_head.weight" in manifest.params


def test_params_load_references_the_checkpoint_and_checks_it(tmp_path, monkeypatch):
    """--params load: no weights in the build; the engine reads the checkpoint it references (or the same
    one elsewhere, SPECPILOT_WEIGHTS), refuses another, and decodes exactly as a build with its weights."""
    import shutil

    from specpilot.core.weights import random_weights, save_checkpoint
    from tests.conftest import tiny_config
    cfg = tiny_config("Qwen3ForCausalLM", vocab_size=300)
    save_checkpoint(tmp_path / "ckpt", cfg, random_weights(cfg, 3))
    spec_path = tmp_path / "m.yaml"
    spec_path.write_text("target: {checkpoint: ckpt}\ndrafter: {kind: ngram, draft_len: 3}\n"
                         "deployment: {max_seq_len: 128}\npasses: tree-verify{budget=6}\n")
    spec = load_spec(spec_path)
    loaded = build(BuildRequest(spec, parse_target("llvm"), tmp_path / "load", params="load"))
    build(BuildRequest(spec, parse_target("llvm"), tmp_path / "file"))
    assert not (tmp_path / "load" / "params").exists() and loaded.weights["kind"] == "checkpoint"
    prompt = [5, 7, 11, 13, 17]
    want = from_build(tmp_path / "file").generate("compiled-tree", prompt, 24).tokens
    assert from_build(tmp_path / "load").generate("compiled-tree", prompt, 24).tokens == want
    shutil.move(tmp_path / "ckpt", tmp_path / "moved")
    with pytest.raises(SpecPilotError, match="SPECPILOT_WEIGHTS"):
        from_build(tmp_path / "load")
    monkeypatch.setenv("SPECPILOT_WEIGHTS", str(tmp_path / "moved"))
    assert from_build(tmp_path / "load").generate("compiled-tree", prompt, 24).tokens == want
    save_checkpoint(tmp_path / "other", cfg, random_weights(cfg, 4))
    monkeypatch.setenv("SPECPILOT_WEIGHTS", str(tmp_path / "other"))
    with pytest.raises(SpecPilotError, match="not the checkpoint this build was made from"):
        from_build(tmp_path / "load")
    seeded = load_spec(Path(__file__).resolve().parents[2] / "examples" / "tiny-llama.yaml")
    with pytest.raises(SpecPilotError, match="use --params seeded"):
        build(BuildRequest(seeded, parse_target("llvm"), tmp_path / "x", params="load"))


def test_sampled_engines_draw_stock_s_tokens(built):
    """Sampled decoding (`runtime.sampling`): the build's own noise kernel draws, with the same seed,
    the tokens stock draws -- autoregressive, speculative and as a continuous batch -- and unforced
    speculative sampling equals unforced autoregressive sampling; another seed draws others."""
    from specpilot.core.sampling import SamplingParams
    from specpilot.runtime.forcing import force
    out, _ = built
    system = from_build(out)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=2 ** 36 + 1)
    requests = [(p, 64) for p in PROMPTS]
    stock_runs = None
    for engine, batch in (("compiled", False), ("compiled-spec", False), ("compiled", True)):
        report, stock_runs, _ = force(system, engine, requests, tolerance="auto", batch=batch,
                                      stock_runs=stock_runs, sampling=params)
        assert report.passed and not report.excused, (engine, batch, report.reason)
    greedy = system.generate("stock", PROMPTS[0], 64).tokens
    assert stock_runs[0].tokens != greedy
    ar = system.generate("compiled", PROMPTS[1], 64, sampling=params).tokens
    assert system.generate("compiled-spec", PROMPTS[1], 64, sampling=params).tokens == ar
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=2)
    assert system.generate("compiled", PROMPTS[1], 64, sampling=other).tokens != ar


def test_compiled_sampling_kernel_equals_reference(built):
    """The build's sample_scores against the PyTorch reference on fresh random rows (odd count),
    every kind of key and cut; and its draws follow softmax(logits / T) (chi-square)."""
    import numpy as np
    import torch

    from specpilot.core.sampling import SamplingParams
    from specpilot.runtime.engine import CompiledModule
    from specpilot.runtime.sampling import controls, reference_scores
    from tests.runtime.test_sampling import chi_square_draws, chi_square_p
    out, manifest = built
    module = CompiledModule(out)
    vocab = manifest.models["target"]["vocab_size"]
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.standard_normal((7, vocab)).astype(np.float32)) * 3
    key = rng.integers(-2 ** 31, 2 ** 31, size=(7, 3)).astype(np.int32)
    ctl = controls(logits, SamplingParams(temperature=0.7, top_p=0.9))
    ctl[::2] = controls(logits[::2], SamplingParams(temperature=1.7))
    torch.testing.assert_close(module.sample_scores(logits, key, ctl), reference_scores(logits, key, ctl),
                               rtol=2e-6, atol=2e-6)
    params = SamplingParams(temperature=0.8, top_k=40)
    counts, expected, kept = chi_square_draws(module.sample_scores, logits[:1], params, 4000)
    assert counts[~kept].sum() == 0 and chi_square_p(counts, expected, kept) > 1e-3


def test_the_cuda_stub_is_never_taken_from_a_folder_others_can_write(tmp_path, monkeypatch):
    """A predictable stub folder someone else could have filled (group/world-writable, or a link) is
    not reused: the stub is built in a fresh private folder instead."""
    import os
    import stat

    from specpilot.compiler import build as build_module
    monkeypatch.setattr(build_module.tempfile, "tempdir", str(tmp_path))
    env = build_module.cuda_stub_env()
    mine = Path(env["LD_LIBRARY_PATH"].split(":")[0])
    assert mine.parent == tmp_path and stat.S_IMODE(os.lstat(mine).st_mode) == 0o700
    assert (mine / "libcuda.so.1").is_file()
    assert build_module.cuda_stub_env()["LD_LIBRARY_PATH"].split(":")[0] == str(mine)    # reused: still ours
    planted = mine / "libcuda.so.1"
    os.chmod(mine, 0o777)
    other = Path(build_module.cuda_stub_env()["LD_LIBRARY_PATH"].split(":")[0])
    assert other != mine and stat.S_IMODE(os.lstat(other).st_mode) == 0o700 and planted.exists()
    os.chmod(mine, 0o700)
    os.rename(mine, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", mine)
    linked = Path(build_module.cuda_stub_env()["LD_LIBRARY_PATH"].split(":")[0])
    assert linked not in (mine, tmp_path / "elsewhere")


def test_a_recompile_replaces_the_build_whole_and_refuses_other_folders(tmp_path, monkeypatch):
    """The build is written beside -o and swapped in at the end: a build that dies on the way leaves
    the previous one loadable and nothing behind; a folder that is not a build is never replaced."""
    from specpilot.compiler import build as build_module
    from specpilot.core.errors import SpecPilotError
    spec = _spec(tmp_path, "LlamaForCausalLM")
    out = tmp_path / "build"
    first = build(BuildRequest(spec, parse_target("llvm"), out))

    def dies(*args, **kwargs):
        raise KeyboardInterrupt          # as a kill during export would
    monkeypatch.setattr(build_module, "write_manifest", dies)
    with pytest.raises(KeyboardInterrupt):
        build(BuildRequest(spec, parse_target("llvm"), out, passes="tree-verify{budget=4}"))
    assert Manifest.model_validate(json.loads((out / "manifest.json").read_text())) == first
    from_build(out)                       # the previous build, whole: its hashes check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "model.yaml"]
    monkeypatch.undo()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SpecPilotError, match="not a SpecPilot build"):
        build(BuildRequest(spec, parse_target("llvm"), tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_compiled_batches_are_exact_under_every_batch_schedule(arch, tmp_path):
    """A build with the three batch mechanisms (node-budget, dynamic draft-length, prompt-admission):
    5 requests through 3 cache rows, joining and leaving, as autoregressive, chain, tree and
    shared-budget batches: every request's tokens are its own autoregressive tokens, exactly (a Gated
    DeltaNet target keeps each row's accepted path), and every row goes back."""
    passes = ("tree-verify{budget=8}" + (",gdn-path-recompute" if arch == "Qwen3_5ForCausalLM" else "")
              + ",draft-length{length=6,min=2,step=2,dynamic=true},node-budget{nodes=10},prompt-admission{chunk=5,passes=8}")
    data = {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 1}},
            "drafter": {"kind": "early-exit", "layers": TINY_CONFIGS[arch]["num_hidden_layers"] - 1, "top_k": 3},
            "passes": passes, "deployment": {"dtype": "float32", "max_seq_len": 200, "max_batch": 3}}
    system = from_build(build_spec(tmp_path, data))
    policy = system.batch_policy("compiled-tree-sched")
    assert (policy.nodes, policy.budget, policy.lengths, policy.chunk, policy.passes) == (6, 10, (6, 4, 2), 5, 8)
    prompts = [[(5 * i + 17 * r) % 301 for i in range(3 + 5 * r)] for r in range(5)]
    limits = [23, 9, 31, 4, 17]
    alone = [system.generate("compiled", p, n).tokens for p, n in zip(prompts, limits)]
    for engine in ("compiled", "compiled-spec", "compiled-tree", "compiled-tree-sched"):
        runs = system.generate_batch(engine, prompts, limits)
        assert [r.tokens for r in runs] == alone, engine
        if engine != "compiled":
            assert any(a > 1 for run in runs for a in run.accepted[1:]), engine
    model = system.engines["compiled"].model
    assert len(model.free_rows) == model.max_batch          # every finished request gave its row back


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_a_long_prompt_prefilled_in_chunks_is_the_same_prompt(arch, tmp_path):
    """GPU builds prefill long prompts in passes of `PREFILL_CHUNK` tokens; the same cut on a CPU build
    (4 tokens a pass, an 11-token prompt: passes of 4, 4, 3) gives the one-pass logits and the same
    greedy tokens (the KV cache and the Gated DeltaNet states carry from pass to pass)."""
    data = {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 2}},
            "deployment": {"dtype": "float32", "max_seq_len": 64}}
    system = from_build(build_spec(tmp_path, data))
    model = system.engines["compiled"].model
    prompt = [(7 * i + 3) % 301 for i in range(11)]
    assert model.prefill_chunk is None                      # a CPU build: one pass
    whole = model.forward(prompt, model.new_state(64))
    tokens = system.generate("compiled", prompt, 12).tokens
    model.prefill_chunk = 4
    cut = model.forward(prompt, model.new_state(64))
    assert cut.shape == whole.shape
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-5)
    assert system.generate("compiled", prompt, 12).tokens == tokens


def test_a_build_for_a_level_this_cpu_lacks_is_refused(built, tmp_path, monkeypatch):
    """A CPU build records its x86-64 level; where the CPU lacks one of the level's features it is refused
    before its library loads (its first AVX2 instruction would stop the process)."""
    import hashlib
    import shutil
    from specpilot.core import cpu_level

    out, manifest = built
    assert manifest.cpu == parse_target("llvm").cpu == cpu_level.host_level()
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**data, "cpu": "x86-64-v3"}))
    (copy / "manifest.sha256").write_text(hashlib.sha256((copy / "manifest.json").read_bytes()).hexdigest())
    v2 = frozenset(cpu_level.needs("x86-64-v2"))
    monkeypatch.setattr(cpu_level, "host_features", lambda: v2)
    with pytest.raises(SpecPilotError, match=r"built for x86-64-v3, and this CPU lacks avx, avx2, .*level: x86-64-v2"):
        from_build(copy)
    monkeypatch.setattr(cpu_level, "host_features", lambda: v2 | frozenset(cpu_level.needs("x86-64-v3")))
    from_build(copy)        # a CPU with the level's features: loads (the code itself is this machine's level)


def test_a_cpu_nt_build_passes_token_forcing(run_cli, tmp_path):
    """`kernel-schedule{set=cpu-nt}` (`schedules.cpu_matmul`: one-row decode, multi-row prefill and tree
    verification, projections it does not fit left to TVM's loops) on the hybrid example, at this CPU's
    level: the chain and tree engines force exactly against stock, and so does a batch of chains."""
    out = tmp_path / "b"
    code, _, err = run_cli("compile", ROOT / "examples" / "tiny-hybrid.yaml", "--target", "llvm", "-o", out,
                           "--passes", "tree-verify{budget=8},gdn-path-recompute,kernel-schedule{set=cpu-nt}")
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["schedule"] == "cpu-nt"
    for engine, extra in (("compiled-spec", ()), ("compiled-tree", ()), ("compiled-spec", ("--batch",))):
        code, stdout, err = run_cli("verify", out, "--max-new-tokens", 32, "--engine", engine, "--tie-tolerance", 0,
                                    "--json", *extra)
        assert code == 0 and json.loads(stdout)["passed"] is True, (engine, extra, err)
