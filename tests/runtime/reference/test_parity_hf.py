"""The stock reference against Hugging Face transformers on the same checkpoint (fp32):
logits within 1e-4 relative, and identical greedy tokens for 128 new tokens."""

from __future__ import annotations

import pytest
import torch

from specpilot.core.weights import load_checkpoint, random_weights, save_checkpoint
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.reference.model import ReferenceModel
from tests.conftest import TINY_CONFIGS, tiny_config

transformers = pytest.importorskip("transformers")


def _pair(arch, tmp_path, seed=0):
    cfg = tiny_config(arch)
    save_checkpoint(tmp_path, cfg, random_weights(cfg, seed))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    cfg, weights = load_checkpoint(tmp_path)
    return hf, ReferenceModel(cfg, weights)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_prefill_and_decode_logits_match_transformers(arch, tmp_path):
    hf, ref = _pair(arch, tmp_path)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ref.vocab_size, (1, 37), generator=gen)   # odd length, > one conv window
    with torch.no_grad():
        want = hf(ids).logits[0]
    state = ref.new_state(128)
    assert _rel(ref.forward(ids[0, :30], state), want[:30]) < 1e-4
    # the rest one token at a time (recurrent path), then a block of three (chunked path)
    for t in range(30, 34):
        assert _rel(ref.forward(ids[0, t:t + 1], state), want[t:t + 1]) < 1e-4
    assert _rel(ref.forward(ids[0, 34:37], state), want[34:37]) < 1e-4


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_greedy_128_tokens_match_transformers(arch, tmp_path):
    hf, ref = _pair(arch, tmp_path, seed=2)
    prompt = [(17 * i + 5) % ref.vocab_size for i in range(11)]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=128, min_new_tokens=128, do_sample=False)
    want = out[0, len(prompt):].tolist()
    got = autoregressive(ref, prompt, 128, capacity=256).tokens
    assert got == want
    assert len(set(got)) > 3, "a degenerate sequence would not test much"
