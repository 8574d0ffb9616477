"""two-level-verify: the nested 8-bit view proposes, exact verification decides -- compiled
builds emit stock's tokens exactly (budgets 8 / 32 / 64, dense and hybrid examples), and the
pass is refused without the view or tree verification."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from specpilot.compiler.build import BuildRequest, build
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.legality import require_legal
from specpilot.passes.pipeline import parse
from specpilot.runtime.decoding import speculative_two_level
from specpilot.runtime.systems import from_build

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = {"tiny-llama.yaml": "w12-layout,nested-int8-view,tree-verify{budget=16},two-level-verify",
             # stacked projections under the whole stack (W12 converts them, the view and the trees read them)
             "tiny-hybrid.yaml": "fuse-projections,w12-layout,nested-int8-view,tree-verify{budget=16},"
                                 "gdn-path-recompute,two-level-verify"}


@pytest.mark.parametrize("example", sorted(PIPELINES))
@pytest.mark.slow
def test_two_level_decoding_is_exact(example, tmp_path):
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data["deployment"]["max_batch"] = 2
    data["passes"] = PIPELINES[example]
    spec_path = tmp_path / example
    spec_path.write_text(yaml.safe_dump(data))
    build(BuildRequest(load_spec(spec_path), parse_target("llvm"), tmp_path / "b"))
    system = from_build(tmp_path / "b")
    model, make = system.engines["compiled"].model, system.engines["compiled-two-level"].drafter
    prompt = system.tokenizer.encode("def fibonacci(n):")
    stock = system.generate("stock", prompt, 40)
    for budget in (8, 32, 64):
        gen = speculative_two_level(model, make(), prompt, 40, budget, system.capacity, force=stock.tokens)
        assert gen.choices == stock.tokens, budget
    assert system.generate("compiled-two-level", prompt, 40).tokens == stock.tokens
    # sampled: the same seed draws stock's tokens through the view, the trees and the W12 layout
    from specpilot.core.sampling import SamplingParams
    from specpilot.runtime.forcing import force
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=99)
    report, stock_runs, _ = force(system, "compiled-two-level", [(prompt, 40)], sampling=params)
    assert report.passed and not report.excused, report.reason
    assert system.generate("compiled-two-level", prompt, 40, sampling=params).tokens == stock_runs[0].tokens


@pytest.mark.parametrize("text,reason", [
    ("tree-verify,two-level-verify", "two-level-verify requires nested-int8-view"),
    ("w12-layout,nested-int8-view,two-level-verify", "two-level-verify requires tree-verify"),
])
def test_needs_the_view_and_trees(text, reason):
    with pytest.raises(SpecPilotError, match=reason):
        require_legal(parse(text), PassContext(weights_known=True))
