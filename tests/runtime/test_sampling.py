"""Sampling as a function of (seed, position, logits): the PyTorch scores equal the definition,
sampled speculative decoding (chain, tree, two-level) is token-identical to sampled
autoregressive decoding with the same seed on every architecture, and the draws follow
softmax(logits / T) after top-k / top-p."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specpilot.core.sampling import MASKED, SamplingParams, noise_hash, uniform
from specpilot.runtime.decoding import autoregressive, speculative, speculative_tree, speculative_two_level
from specpilot.runtime.drafters import ModelDrafter, NGramDrafter
from specpilot.runtime.reference.view import ViewedModel
from specpilot.runtime.sampling import Sampled, controls, keys, reference_scores
from tests.conftest import TINY_CONFIGS, noisy_copy, tiny_model

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 17, 29, 41]


def definition_scores(logits: np.ndarray, seed: int, position: int, inv_t: float, low: float) -> np.ndarray:
    """core.sampling's definition, element by element (float64 noise, rounded to float32 at the end)."""
    g = np.array([-math.log(-math.log(np.float32(uniform(noise_hash(seed, position, v)))))
                  for v in range(logits.shape[0])])
    out = np.where(logits >= low, logits.astype(np.float64) * np.float32(inv_t) + g, MASKED)
    return out.astype(np.float32)


@pytest.mark.parametrize("vocab", [1, 37, 1003])
def test_reference_scores_follow_the_definition(vocab):
    rng = np.random.default_rng(vocab)
    seeds = [0, 1, 2 ** 33 + 5, 2 ** 64 - 1, int(rng.integers(0, 2 ** 63))]
    positions = [0, 9, 2 ** 31 - 1, 2 ** 32 - 1, int(rng.integers(0, 2 ** 20))]
    logits = torch.from_numpy(rng.standard_normal((len(seeds), vocab)).astype(np.float32))
    ctl = torch.tensor([[1 / 0.7, float("-inf")], [1.0, 0.3], [2.5, -0.5], [1.0, float("-inf")], [0.5, 0.0]])
    key = np.array([SamplingParams(seed=s).key_words(p) for s, p in zip(seeds, positions)], np.int32)
    got = reference_scores(logits, key, ctl).numpy()
    for r, (s, p) in enumerate(zip(seeds, positions)):
        want = definition_scores(logits[r].numpy(), s, p, float(ctl[r, 0]), float(ctl[r, 1]))
        np.testing.assert_allclose(got[r], want, rtol=2e-6, atol=2e-6)


def test_noise_depends_on_seed_and_position_only():
    logits = torch.zeros(4, 50)
    ctl = controls(logits, SamplingParams(temperature=1.0))
    a = reference_scores(logits, keys(SamplingParams(temperature=1.0, seed=7), [3, 3, 4, 3]), ctl)
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[3]) and not torch.equal(a[0], a[2])
    b = reference_scores(logits, keys(SamplingParams(temperature=1.0, seed=8), [3]), ctl[:1])
    assert not torch.equal(a[0], b[0])


def test_controls_top_k_and_top_p():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0]])
    assert controls(logits, SamplingParams(temperature=1.0, top_k=2))[0, 1] == 2.0     # 3, 2, 2 kept (tie kept)
    assert controls(logits, SamplingParams(temperature=1.0))[0, 1] == float("-inf")
    p = torch.softmax(logits[0], 0)
    mass = float(p[0])
    assert controls(logits, SamplingParams(temperature=1.0, top_p=mass * 0.99))[0, 1] == 3.0
    assert controls(logits, SamplingParams(temperature=1.0, top_p=mass * 1.01))[0, 1] == 2.0
    # top-p after top-k renormalises over the top-k tokens
    assert controls(logits, SamplingParams(temperature=1.0, top_k=1, top_p=0.5))[0, 1] == 3.0


def test_params_refuse_bad_values():
    from pydantic import ValidationError
    for bad in ({"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_p": 1.5},
                {"top_k": -1}, {"seed": -1}, {"seed": 2 ** 64}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)


def sampled(model, params):
    return Sampled(model, params, reference_scores)


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_sampled_speculative_equals_sampled_autoregressive(arch):
    target = tiny_model(arch, seed=3)
    draft = noisy_copy(target, 0.2)
    for params in (SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.3, top_k=40, top_p=0.9,
                                                                            seed=2 ** 40 + 3)):
        model = sampled(target, params)
        want = autoregressive(model, PROMPT, 64, 512).tokens
        assert want != autoregressive(target, PROMPT, 64, 512).tokens        # not greedy
        drafter = ModelDrafter(sampled(draft, params), top_k=3, capacity=512)
        chain = speculative(model, drafter, PROMPT, 64, 5, 512)
        assert chain.tokens == want
        assert chain.mean_accepted > 1.0
        assert speculative(model, NGramDrafter(3, 1, 4), PROMPT, 64, 4, 512).tokens == want
        tree = speculative_tree(model, ModelDrafter(sampled(draft, params), 3, 512), PROMPT, 64, 12, 512)
        assert tree.tokens == want
        two = speculative_two_level(sampled(ViewedModel(target), params), ModelDrafter(sampled(draft, params), 3, 512),
                                    PROMPT, 64, 12, 512)
        assert two.tokens == want


def test_seeds_differ_and_repeat():
    target = sampled(tiny_model("Qwen3ForCausalLM", seed=1), SamplingParams(temperature=1.0, seed=5))
    again = sampled(tiny_model("Qwen3ForCausalLM", seed=1), SamplingParams(temperature=1.0, seed=5))
    other = sampled(tiny_model("Qwen3ForCausalLM", seed=1), SamplingParams(temperature=1.0, seed=6))
    a = autoregressive(target, PROMPT, 40, 256).tokens
    assert a == autoregressive(again, PROMPT, 40, 256).tokens
    assert a != autoregressive(other, PROMPT, 40, 256).tokens


def chi_square_draws(score, logits: torch.Tensor, params: SamplingParams, draws: int):
    """Counts of argmax(scores) over ``draws`` seeds at one position, and the expected counts of
    softmax(logits / T) over the kept tokens."""
    rows = logits.expand(draws, -1).contiguous()
    key = np.array([SamplingParams(temperature=params.temperature, seed=s).key_words(17) for s in range(draws)],
                   np.int32)
    ctl = controls(rows, params)
    chosen = score(rows, key, ctl).argmax(-1)
    counts = torch.bincount(chosen, minlength=logits.shape[-1]).double()
    kept = logits[0] >= ctl[0, 1]
    p = torch.softmax(torch.where(kept, logits[0].double() / params.temperature,
                                  torch.tensor(float("-inf"), dtype=torch.float64)), 0)
    return counts, p * draws, kept


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor, kept: torch.Tensor) -> float:
    """Goodness of fit over the kept tokens (expected scaled to the draws that landed there)."""
    from scipy.stats import chisquare
    seen, want = counts[kept], expected[kept]
    return float(chisquare(seen.numpy(), (want * seen.sum() / want.sum()).numpy()).pvalue)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=12),
                                    SamplingParams(temperature=1.4, top_p=0.8)])
def test_reference_draws_follow_softmax(params):
    logits = torch.from_numpy(np.random.default_rng(3).standard_normal((1, 23)).astype(np.float32)) * 1.5
    counts, expected, kept = chi_square_draws(reference_scores, logits, params, 20000)
    assert counts[~kept].sum() == 0           # nothing outside top-k / top-p is ever drawn
    assert chi_square_p(counts, expected, kept) > 1e-3
    # the test can fail: draws from another temperature are rejected
    wrong = SamplingParams(temperature=params.temperature * 1.6, top_k=params.top_k, top_p=params.top_p)
    counts, _, _ = chi_square_draws(reference_scores, logits, wrong, 20000)
    assert chi_square_p(counts, expected, kept) < 1e-6


def test_sampled_bf16_tolerance_stays_on_the_logits_scale(tmp_path):
    """bf16 stock against its float32 twin under top-p: where one precision cuts a token the other
    keeps, the cut is an open decision, never a 3e38 'margin error' that would excuse everything."""
    import yaml

    from specpilot.core.spec import load_spec
    from specpilot.runtime.forcing import force
    from specpilot.runtime.systems import from_spec
    data = {"target": {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"],
                       "init": {"seed": 2}},
            "drafter": {"kind": "ngram", "draft_len": 4}, "deployment": {"dtype": "bfloat16", "max_seq_len": 256}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    system = from_spec(load_spec(tmp_path / "m.yaml"))
    params = SamplingParams(temperature=1.0, top_p=0.3, seed=4)
    requests = [([(5 * i + r) % 301 for i in range(7 + r)], 48) for r in range(4)]
    report, stock_runs, _ = force(system, "stock-spec", requests, sampling=params)
    assert report.passed, report.reason
    assert 0 <= report.tie_tolerance < 1.0
    tolerance, budget = system.derived_near_ties([p for p, _ in requests], stock_runs, params)
    assert tolerance == report.tie_tolerance and budget >= 8


def test_open_cut_rule_excuses_only_a_cut_the_precision_leaves_open(tmp_path):
    """Sampled bf16 forcing: a system that kept the token just under stock's top-p cut is excused only
    when scores off by the tolerance could move that cut; a token far below it never is."""
    import yaml

    from specpilot.core.spec import load_spec
    from specpilot.runtime.forcing import open_cut_rule
    from specpilot.runtime.systems import from_spec
    data = {"target": {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"],
                       "init": {"seed": 2}},
            "drafter": {"kind": "ngram"}, "deployment": {"dtype": "float32", "max_seq_len": 256}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    system = from_spec(load_spec(tmp_path / "m.yaml"))
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    prompt = [5, 9, 14, 77, 120]
    run = system.generate("stock", prompt, 12, sampling=params)
    rows = []
    autoregressive(system.engines["stock"].model, prompt, 12, 256, force=run.tokens,
                   logits_hook=lambda pos, row: rows.append(row.clone()) or row)
    pos, row = 5, rows[5]
    order = torch.argsort(row, descending=True, stable=True)
    cut = controls(row[None], params)[0, 1]
    first_cut = int(order[int((row >= cut).sum())])
    far = int(order[-1])
    want = run.tokens[pos]
    generous, strict = open_cut_rule(system, prompt, run.tokens, params, 50.0), \
        open_cut_rule(system, prompt, run.tokens, params, 1e-4)
    assert generous(pos, want, first_cut) and not strict(pos, want, first_cut)
    assert not open_cut_rule(system, prompt, run.tokens, params, 0.3)(pos, want, far)
