"""Shared fixtures: tiny configs of every supported family, odd sizes on purpose."""

from __future__ import annotations

import os
import sys
import tempfile

# CI has no GPU: Triton kernels run under Triton's interpreter (must be set before triton is imported)
os.environ.setdefault("TRITON_INTERPRET", "1")
# converted W12 packs go to a throw-away cache, not the user's
os.environ.setdefault("SPECPILOT_CACHE_DIR", tempfile.mkdtemp(prefix="specpilot-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402

from specpilot.core.config import config_from_hf  # noqa: E402
from specpilot.core.weights import random_weights  # noqa: E402
from specpilot.runtime.reference.model import ReferenceModel  # noqa: E402

TINY_CONFIGS = {
    "LlamaForCausalLM": dict(vocab_size=301, hidden_size=48, intermediate_size=91, num_hidden_layers=3,
                             num_attention_heads=6, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "Qwen2ForCausalLM": dict(vocab_size=301, hidden_size=48, intermediate_size=91, num_hidden_layers=3,
                             num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True),
    "Qwen3ForCausalLM": dict(vocab_size=301, hidden_size=48, intermediate_size=91, num_hidden_layers=3,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=10),
    "Qwen3NextForCausalLM": dict(vocab_size=301, hidden_size=48, intermediate_size=91, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=0,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=6, linear_conv_kernel_dim=3),
    "Qwen3_5ForCausalLM": dict(vocab_size=301, hidden_size=48, intermediate_size=91, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=6),
}

DENSE = "Qwen3ForCausalLM"
HYBRID = "Qwen3_5ForCausalLM"


def build_spec(tmp_path, data: dict, out: str = "b"):
    """``data`` written as tmp_path/model.yaml and built for llvm into tmp_path/out (returned)."""
    import yaml

    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(data))
    build(BuildRequest(load_spec(tmp_path / "model.yaml"), parse_target("llvm"), tmp_path / out))
    return tmp_path / out


def assert_block_chains_are_the_level_walk_s(system, prompts, lengths, drafter_class, monkeypatch):
    """A batch's chains from its block drafters' one pass (no level of expansions) against the level walk
    (taken once ``drafter_class`` has no block drafter): the same acceptance and tokens."""
    from specpilot.runtime import batching
    levels = []
    expand = batching.expand_across
    monkeypatch.setattr(batching, "expand_across", lambda *a: levels.append(1) or expand(*a))
    got = system.generate_batch("compiled-spec", prompts, lengths, max_batch=len(prompts))
    assert not levels
    monkeypatch.setattr(drafter_class, "block_drafter", property(lambda self: None))
    walked = system.generate_batch("compiled-spec", prompts, lengths, max_batch=len(prompts))
    assert levels and [g.accepted for g in got] == [w.accepted for w in walked]
    assert [g.tokens for g in got] == [w.tokens for w in walked]


def tiny_config(arch: str, **overrides):
    return config_from_hf({**TINY_CONFIGS[arch], **overrides}, architecture=arch)


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32, **overrides) -> ReferenceModel:
    cfg = tiny_config(arch, **overrides)
    return ReferenceModel(cfg, random_weights(cfg, seed), dtype)


def noisy_copy(model: ReferenceModel, scale: float, seed: int = 1) -> ReferenceModel:
    """The same model with Gaussian noise on its weights: a drafter that agrees often, not always."""
    gen = torch.Generator().manual_seed(seed)
    weights = {k: v + scale * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=gen)
               for k, v in model.w.items() if not (model.cfg.tie_word_embeddings and k == "lm_head.weight")}
    return ReferenceModel(model.cfg, weights, model.dtype)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run the `specpilot` entry point in-process; returns (exit code, stdout, stderr)."""
    from specpilot.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["specpilot", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
