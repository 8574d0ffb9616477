"""CUDA builds of randomly drawn valid configurations of all five families, for every arch of the
device table, fp32 and bf16, tree verification included: each builds, passes the launch check for
its card and embeds that arch's code -- or is refused up front with a clear error.  Odd sizes on
purpose: odd head counts and GQA ratios, head dims not multiples of 32, partial rotary parts, GDN
head dims and vocabularies that are not multiples of 32 or 64.

CI builds ``CI_DRAWS`` fixed draws (about 40 s each); ``SPECPILOT_FUZZ=N`` (`make fuzz`) adds
N x 3 fresh ones, their seeds in the test ids."""

from __future__ import annotations

import json
import os
import random

import pytest
import yaml

from specpilot.core.target import DEFAULT_DEVICE, DEVICES, KNOWN_ARCHS
from tests.build_helpers import compile_cli

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3NextForCausalLM",
            "Qwen3_5ForCausalLM")
HYBRID = FAMILIES[3:]
SCALE = int(os.environ.get("SPECPILOT_FUZZ", "1"))
CI_DRAWS = (19, 12, 21)   # a Qwen3.5 hybrid bf16 for sm_90, a Qwen3 bf16 for sm_120, a Qwen2 fp32 for sm_80
SEEDS = CI_DRAWS + (tuple(random.SystemRandom().randrange(10**6) for _ in range(3 * SCALE)) if SCALE > 1 else ())


def draw(seed: int) -> tuple[dict, str]:
    """(spec data, target text) of draw ``seed``: the family and arch rotate with the seed, the sizes
    are random."""
    rng = random.Random(seed)
    family, arch = FAMILIES[seed % 5], KNOWN_ARCHS[(seed // 5 + seed) % 5]
    heads = rng.randint(1, 6)
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    head_dim = rng.choice((8, 12, 16, 24, 32, 40, 48, 64))
    cfg = dict(vocab_size=rng.randint(256, 700), intermediate_size=rng.randint(40, 260),
               num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=rng.randint(1, 2))
    if family in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        cfg["hidden_size"] = heads * head_dim
    else:
        cfg.update(hidden_size=rng.randrange(32, 161, 4), head_dim=head_dim)
    if family in HYBRID:
        k_heads = rng.choice((1, 2))
        cfg.update(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                   partial_rotary_factor=rng.choice((0.25, 0.5, 1.0)), linear_num_key_heads=k_heads,
                   linear_num_value_heads=k_heads * rng.choice((1, 2, 3)),
                   linear_key_head_dim=rng.randrange(8, 41, 2), linear_value_head_dim=rng.randrange(6, 41, 2),
                   linear_conv_kernel_dim=rng.choice((2, 3, 4)))
    if family == "Qwen3NextForCausalLM":
        cfg["num_experts"] = 0
    passes = "tree-verify{budget=8}" + (",gdn-path-recompute" if family in HYBRID else "")
    spec = {"target": {"architecture": family, "config": cfg, "init": {"seed": seed}},
            "drafter": {"kind": "ngram", "draft_len": 4},
            "deployment": {"dtype": rng.choice(("float32", "bfloat16")), "max_batch": 1, "max_seq_len": 128},
            "passes": passes}
    return spec, f"cuda -arch={arch}"


def test_draws_cover_every_family_arch_and_dtype():
    """The rotation: over 25 consecutive seeds every (family, arch) pair once; CI's draws differ in
    family, arch and dtype."""
    pairs = {(draw(s)[0]["target"]["architecture"], draw(s)[1]) for s in range(25)}
    assert len(pairs) == 25
    ci = [draw(s) for s in CI_DRAWS]
    assert len({d["target"]["architecture"] for d, _ in ci}) == len({t for _, t in ci}) == len(CI_DRAWS)
    assert {d["deployment"]["dtype"] for d, _ in ci} == {"float32", "bfloat16"}
    assert any(d["target"]["architecture"] in HYBRID for d, _ in ci)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_random_config_builds_for_its_arch(seed, tmp_path):
    spec, target = draw(seed)
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    compile_cli(tmp_path / "m.yaml", target, tmp_path / "b", "--params", "seeded")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    arch = target.split("=")[1]
    card = DEVICES[DEFAULT_DEVICE[arch]]
    assert manifest["launch"]["devices"] == [card.name], (seed, spec)
    assert manifest["launch"]["most_shared"]["bytes"] <= card.shared_per_block
    assert arch.encode() in (tmp_path / "b" / "model.so").read_bytes(), (seed, spec)
