"""The counter-based draw (`core.counter_draw`) against plain-Python integer arithmetic on fresh
random inputs, its values independent of how it is chunked, and seeded models drawn with it
(``init: {draw: device}``) decoding exactly from a ``--params seeded`` build."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specpilot.compiler.build import BuildRequest, build
from specpilot.core import counter_draw
from specpilot.core.errors import SpecPilotError
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target
from specpilot.core.weights import parameter_shapes, random_weights
from specpilot.runtime.systems import from_build
from tests.conftest import TINY_CONFIGS, tiny_config


def _hash32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_equals_plain_integer_arithmetic_on_random_words():
    rng = random.Random()
    words = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF] + [rng.getrandbits(32) for _ in range(4093)]
    got = counter_draw.hash32(torch.tensor(words, dtype=torch.int64)).tolist()
    assert got == [_hash32_reference(w) for w in words]


def test_bits_across_a_high_word_boundary_equal_the_per_counter_hash():
    start = (1 << 32) - 7
    counters = torch.arange(start, start + 15, dtype=torch.int64)
    key = counter_draw.stream_key(3, "w")
    want = [_hash32_reference((c & 0xFFFFFFFF) ^ _hash32_reference((c >> 32) ^ key)) for c in counters.tolist()]
    assert counter_draw.bits(key, counters, start, start + 15).tolist() == want
    assert counter_draw.bits(key, counters[:5], start, start + 5).tolist() == want[:5]


@pytest.mark.parametrize("shape", [(1,), (7, 13), (257, 129)])
def test_normal_is_the_same_whatever_the_chunk_and_near_unit_normal(monkeypatch, shape):
    whole = counter_draw.normal(11, "layer.weight", shape, std=0.5)
    monkeypatch.setattr(counter_draw, "CHUNK", 97)
    assert torch.equal(counter_draw.normal(11, "layer.weight", shape, std=0.5), whole)
    assert torch.equal(whole.to(torch.bfloat16).float(), whole)                 # bf16 values
    assert whole.abs().max() <= 0.5 * math.sqrt(3) * 2
    if whole.numel() > 10000:
        assert abs(whole.mean().item()) < 0.01 and abs(whole.std().item() - 0.5) < 0.01
    other = counter_draw.normal(12, "layer.weight", shape, std=0.5)
    assert whole.numel() == 1 or not torch.equal(other, whole)


def test_device_draw_is_deterministic_and_the_same_in_every_dtype():
    cfg = tiny_config("Qwen3_5ForCausalLM")
    a = random_weights(cfg, 5, draw="device")
    b = random_weights(cfg, 5, draw="device", dtype=torch.bfloat16)
    assert set(a) == set(parameter_shapes(cfg))
    for name, t in a.items():
        assert t.dtype == torch.float32 and b[name].dtype == torch.bfloat16 and torch.equal(b[name].float(), t)
        assert tuple(t.shape) == parameter_shapes(cfg)[name] and bool(torch.isfinite(t).all())
    a_log = [t for n, t in a.items() if n.endswith("A_log")][0]
    assert float(a_log.min()) >= 0 and float(a_log.max()) <= math.log(16) + 0.02
    assert not torch.equal(a["model.embed_tokens.weight"],
                           random_weights(cfg, 6, draw="device")["model.embed_tokens.weight"])
    with pytest.raises(SpecPilotError, match="init.draw must be"):
        random_weights(cfg, 5, draw="gpu")


@pytest.mark.slow
def test_a_seeded_build_with_device_draws_decodes_exactly(tmp_path):
    import yaml

    arch = "Qwen3_5ForCausalLM"
    spec = {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 2, "draw": "device"}},
            "drafter": {"kind": "ngram", "draft_len": 3}, "deployment": {"dtype": "float32", "max_seq_len": 128}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    build(BuildRequest(load_spec(tmp_path / "m.yaml"), parse_target("llvm"), tmp_path / "b", params="seeded"))
    system = from_build(tmp_path / "b")
    stock_weights = random_weights(tiny_config(arch), 2, draw="device")
    assert torch.equal(system.engines["stock"].model.w["model.embed_tokens.weight"],
                       stock_weights["model.embed_tokens.weight"])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = system.generate("stock", prompt, 32).tokens
    assert system.generate("compiled", prompt, 32).tokens == want
    assert system.generate("compiled-spec", prompt, 32).tokens == want
