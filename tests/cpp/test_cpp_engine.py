"""libspecpilot against the Python engine: for the tiny CPU builds of all five families, every
engine the build has (autoregressive, chain, tree, two-level), four prompts of 128 new tokens,
greedy and seeded sampling -- the C++ tokens equal the Python engine's, and for greedy decoding
the accepted tokens per verification are the Python engine's too (the same drafts).  Both are
driven through the C API (examples/cpp/generate.c)."""

from __future__ import annotations

import pytest

from specpilot.runtime.systems import from_build
from tests.conftest import TINY_CONFIGS, build_spec
from tests.cpp.helpers import cpp_programs, generate

TOKENS = 128
PROMPTS = [[(7 * i) % 301 for i in range(11)] * 2,             # repeats: the n-gram drafter finds matches
           [5, 9, 13, 17, 5, 9, 13, 17, 5, 9, 13],
           [(31 * i + 3) % 301 for i in range(23)],
           [42]]
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 12345}
W12_TWO_LEVEL = "w12-layout,nested-int8-view,tree-verify{budget=8},two-level-verify"
# family -> (drafter, passes): every drafter kind the C++ runtime runs, GDN drafters included
CASES = {
    "LlamaForCausalLM": ({"kind": "early-exit", "layers": 1, "draft_len": 4}, W12_TWO_LEVEL),
    "Qwen2ForCausalLM": ({"kind": "ngram", "draft_len": 5}, "tree-verify{budget=8}"),
    "Qwen3ForCausalLM": ({"kind": "early-exit", "layers": 2, "draft_len": 3}, "tree-verify{budget=12}"),
    "Qwen3NextForCausalLM": ({"kind": "ngram", "draft_len": 4}, "tree-verify{budget=8},gdn-path-recompute"),
    "Qwen3_5ForCausalLM": ({"kind": "early-exit", "layers": 2, "draft_len": 4},
                           "w12-layout,nested-int8-view,tree-verify{budget=8},gdn-path-recompute,two-level-verify"),
}


@pytest.fixture(scope="module")
def programs():
    return cpp_programs()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_cpp_tokens_equal_the_python_engines(family, programs, tmp_path):
    drafter, passes = CASES[family]
    build = build_spec(tmp_path, {"target": {"architecture": family, "config": TINY_CONFIGS[family], "init": {"seed": 5}},
                                  "drafter": drafter, "deployment": {"max_seq_len": 256}, "passes": passes})
    system = from_build(build)
    engines = [e for e in system.engines if e.startswith("compiled")]
    assert {"compiled", "compiled-spec", "compiled-tree"} <= set(engines), engines
    assert ("compiled-two-level" in engines) == ("two-level-verify" in passes)

    cpp = generate(programs, build, PROMPTS, engines, TOKENS)
    for engine in engines:
        for i, prompt in enumerate(PROMPTS):
            want = system.generate(engine, prompt, TOKENS)
            got = cpp[(engine, i)]
            assert got["tokens"] == want.tokens, (engine, i)
            assert got["accepted"] == want.accepted, (engine, i)

    from specpilot.core.sampling import SamplingParams
    params = SamplingParams(**SAMPLING)
    cpp = generate(programs, build, PROMPTS, engines, TOKENS, SAMPLING)
    for i, prompt in enumerate(PROMPTS):
        want = system.generate("compiled", prompt, TOKENS, sampling=params).tokens
        assert len(set(want)) > 8          # sampling, not a constant stream
        for engine in engines:
            assert cpp[(engine, i)]["tokens"] == want, (engine, i)
