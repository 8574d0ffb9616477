"""Token forcing: exact in fp32, excused near-ties only below the tolerance, faults caught
at the position they start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.decoding import autoregressive, speculative
from specpilot.runtime.drafters import ModelDrafter, NGramDrafter
from specpilot.runtime.forcing import compare, force_requests, runner_up_fault
from tests.conftest import DENSE, HYBRID, noisy_copy, tiny_model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def test_compare_finds_first_unexcused_divergence():
    stock = [1, 2, 3, 4, 5]
    margins = [1.0, 0.01, 1.0, 0.5, 1.0]
    first, excused = compare(stock, margins, [1, 7, 3, 8, 5], tie_tolerance=0.1)
    assert [e.position for e in excused] == [1]
    assert (first.position, first.stock_token, first.system_token, first.stock_margin) == (3, 4, 8, 0.5)
    assert first.context == [1, 2, 3]
    first, excused = compare(stock, margins, [1, 7, 3, 8, 5], tie_tolerance=0.0)
    assert first.position == 1 and not excused


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_stock_spec_passes_exactly(arch, drafter):
    target = tiny_model(arch, seed=9)
    stock = autoregressive(target, PROMPT, 128, 512)
    d = ModelDrafter(noisy_copy(target, 0.3), 3, 512) if drafter == "model" else NGramDrafter()
    system = speculative(target, d, PROMPT, 128, 5, 512, force=stock.tokens)
    assert system.tokens == stock.tokens
    report = force_requests([stock], [system])
    assert report.passed and report.positions == 128 and not report.excused


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_injected_fault_is_caught_at_its_position(arch):
    target = tiny_model(arch, seed=9)
    stock = autoregressive(target, PROMPT, 64, 512)
    system = speculative(target, ModelDrafter(noisy_copy(target, 0.3), 3, 512), PROMPT, 64, 5, 512,
                         force=stock.tokens, logits_hook=runner_up_fault(32, 100.0))
    report = force_requests([stock], [system])
    assert not report.passed
    assert report.first_divergence.position == 32
    # forcing keeps the run on stock's path: every faulty position shows up, not just the first
    assert all(c != t for c, t in zip(system.choices[32:], stock.tokens[32:]))
    assert system.choices[:32] == stock.tokens[:32]


def test_fault_smaller_than_the_margin_changes_nothing():
    target = tiny_model(DENSE, seed=9)
    stock = autoregressive(target, PROMPT, 48, 512)
    tiny_bias = min(stock.margins[10:]) / 2
    system = autoregressive(target, PROMPT, 48, 512, force=stock.tokens, logits_hook=runner_up_fault(10, tiny_bias))
    assert force_requests([stock], [system]).passed


def test_bfloat16_excuses_only_near_ties_and_reports_them():
    """A bf16 system against fp32 stock: mismatches happen only where stock's margin is small."""
    target32 = tiny_model(HYBRID, seed=9)
    target16 = tiny_model(HYBRID, seed=9, dtype=torch.bfloat16)
    stock = autoregressive(target32, PROMPT, 96, 512)
    system = speculative(target16, NGramDrafter(), PROMPT, 96, 5, 512, force=stock.tokens)
    strict = force_requests([stock], [system], tie_tolerance=0.0)
    tolerance = max([m for m, c, t in zip(stock.margins, system.choices, stock.tokens) if c != t], default=0.0)
    loose = force_requests([stock], [system], tie_tolerance=tolerance + 1e-6)
    assert loose.passed
    assert len(loose.excused) == sum(c != t for c, t in zip(system.choices, stock.tokens))
    if loose.excused:
        assert not strict.passed
        assert all(e.stock_margin <= tolerance for e in loose.excused)


def test_bf16_tie_tolerance_is_derived_from_stocks_own_noise(run_cli, tmp_path):
    """In bf16 the default tolerance is measured: stock's top-2 margin error against the same
    weights in float32.  It is positive, small, reported, and a real fault still fails."""
    import json

    import yaml

    from tests.conftest import TINY_CONFIGS
    spec = tmp_path / "bf16.yaml"
    spec.write_text(yaml.safe_dump({
        "target": {"architecture": "Qwen3ForCausalLM", "config": TINY_CONFIGS["Qwen3ForCausalLM"], "init": {"seed": 1}},
        "drafter": {"kind": "ngram", "draft_len": 4}, "deployment": {"dtype": "bfloat16", "max_seq_len": 300}}))
    code, out, _ = run_cli("verify", spec, "--max-new-tokens", 48, "--json")
    report = json.loads(out)
    assert code == 0 and 0 < report["tie_tolerance"] < 0.5
    code, out, _ = run_cli("verify", spec, "--max-new-tokens", 48, "--json", "--inject-fault-after", 7)
    faulty = json.loads(out)
    # caught at the first position from 7 on where stock's margin is at least the tolerance; any
    # position before it from 7 on (the fault flips every one) is a near-tie, excused and listed
    first = faulty["first_divergence"]
    assert code == 1 and first["request"] == 0 and first["position"] >= 7
    assert first["stock_margin"] >= faulty["tie_tolerance"]
    excused = [e["position"] for e in faulty["excused"] if e["request"] == 0]
    assert all(p < 7 or p in excused for p in range(first["position"]))
    assert all(e["stock_margin"] <= faulty["tie_tolerance"] for e in faulty["excused"])
    code, _, err = run_cli("verify", spec, "--max-new-tokens", 8, "--tie-tolerance", "-1")
    assert code == 2 and ">= 0" in err
    fp32 = tmp_path / "fp32.yaml"
    fp32.write_text(spec.read_text().replace("bfloat16", "float32"))
    code, out, _ = run_cli("verify", fp32, "--max-new-tokens", 8, "--json")
    assert code == 0 and json.loads(out)["tie_tolerance"] == 0.0


def _bf16_spec(arch="Qwen3ForCausalLM", seed=1):
    from specpilot.core.spec import parse_spec
    from tests.conftest import TINY_CONFIGS
    return parse_spec({"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": seed}},
                       "drafter": {"kind": "ngram", "draft_len": 4},
                       "deployment": {"dtype": "bfloat16", "max_seq_len": 200}})


def test_derived_tolerance_reads_stocks_own_run_and_equals_rerunning_it():
    """The tolerance takes stock's margins and top-2 tokens from its unforced runs and runs only
    float32 again (teacher-forced, a few passes a run): the same number, to float32 rounding, as
    re-running both forced onto stock's tokens one token at a time.  The float32
    reference is built on first use only; a forced (not stock's own) run is refused."""
    from specpilot.core.errors import SpecPilotError
    from specpilot.runtime.decoding import top2
    from specpilot.runtime.systems import from_spec

    system = from_spec(_bf16_spec())
    assert "stock-fp32" not in system.engines            # lazy: twice the weights' memory, built on demand
    prompts = [[5, 9, 2, 6], [7, 1, 8, 2, 8, 1, 8]]
    runs = [system.generate("stock", p, 37) for p in prompts]
    assert all(len(r.runner_up) == len(r.tokens) and r.choices == r.tokens for r in runs)
    tolerance = system.derived_tie_tolerance(prompts, runs)
    assert "stock-fp32" in system.engines
    worst = 0.0
    for prompt, run in zip(prompts, runs):
        rows = {}
        for which in ("stock", "stock-fp32"):
            seen = rows.setdefault(which, [])
            autoregressive(system.engines[which].model, prompt, len(run.tokens), 200, force=run.tokens,
                           logits_hook=lambda pos, logits, seen=seen: seen.append(logits.float()) or logits)
        for low, high in zip(rows["stock"], rows["stock-fp32"]):
            a, b = top2(low)[1::2]
            worst = max(worst, abs(float(low[a] - low[b]) - float(high[a] - high[b])))
    assert 0 < tolerance == pytest.approx(worst, rel=1e-4, abs=1e-4)
    forced = system.generate("stock", prompts[0], 37, force=[(t + 1) % system.vocab_size for t in runs[0].tokens])
    with pytest.raises(SpecPilotError, match="unforced"):
        system.derived_tie_tolerance(prompts[:1], [forced])


def test_near_tie_budget_fails_a_build_that_mismatches_everywhere_under_a_loose_tolerance():
    """A tolerance derived as a maximum can be loose (2 logits on the tiny bf16 hybrid); then a
    wrong build's mismatches are all "near-ties".  The budget fails it and says why; a build
    within the budget passes with its near-ties listed."""
    from types import SimpleNamespace

    from specpilot.runtime.systems import near_tie_budget
    stock = SimpleNamespace(tokens=list(range(100)), margins=[0.5] * 100)
    wrong = SimpleNamespace(choices=[t + 1 for t in range(100)])
    near = SimpleNamespace(choices=[t + (1 if t % 25 == 0 else 0) for t in range(100)])     # 4 near-ties
    assert force_requests([stock], [wrong], tie_tolerance=2.0).passed              # tolerance alone
    report = force_requests([stock], [wrong], tie_tolerance=2.0, max_excused=near_tie_budget(100, 3))
    assert not report.passed and report.first_divergence is None and report.max_excused == 20
    assert "100 excused near-ties" in report.reason and "at most 20" in report.reason
    ok = force_requests([stock], [near], tie_tolerance=2.0, max_excused=near_tie_budget(100, 0))
    assert ok.passed and len(ok.excused) == 4 and ok.reason is None
    assert near_tie_budget(100, 0) == 8 and near_tie_budget(5000, 0) == 100 and near_tie_budget(100, 10) == 48


def test_derived_near_ties_budget_counts_what_stocks_precision_leaves_open():
    """The budget comes from the same float32 rerun as the tolerance: positions where stock's
    margin is below its own error there; a correct bf16 engine stays within it (CLI verify)."""
    from specpilot.runtime.systems import from_spec, near_tie_budget

    system = from_spec(_bf16_spec())
    prompts = [[5, 9, 2, 6], [7, 1, 8, 2, 8, 1, 8]]
    runs = [system.generate("stock", p, 37) for p in prompts]
    tolerance, budget = system.derived_near_ties(prompts, runs)
    assert tolerance == system.derived_tie_tolerance(prompts, runs)
    assert budget >= near_tie_budget(74, 0) and (budget - 8) % 4 == 0
    runs_spec = [system.generate("stock-spec", p, 37, force=r.tokens) for p, r in zip(prompts, runs)]
    assert force_requests(runs, runs_spec, tolerance, budget).passed


def test_an_engine_excusing_far_more_than_its_builds_ar_engine_fails():
    """The GPU forcing bench holds a build's speculative / tree engines to its own AR engine:
    same arithmetic per token, so many times its near-ties is a different computation (a tree-64
    build with a wrong verify: 483 excused vs 64, docs/bench-log.md)."""
    from types import SimpleNamespace

    from specpilot.runtime.forcing import against_baseline
    stock = SimpleNamespace(tokens=list(range(200)), margins=[0.5] * 200)
    ar = force_requests([stock], [SimpleNamespace(choices=[t + (t % 10 == 0) for t in range(200)])], 2.0)
    tree = force_requests([stock], [SimpleNamespace(choices=[t + (t % 2 == 0) for t in range(200)])], 2.0)
    close = force_requests([stock], [SimpleNamespace(choices=[t + (t % 8 == 0) for t in range(200)])], 2.0)
    assert len(ar.excused) == 20 and len(tree.excused) == 100 and len(close.excused) == 25
    assert not against_baseline(tree, ar).passed and "100 excused near-ties" in tree.reason    # > 2 x 20 + 16
    assert against_baseline(close, ar).passed and close.reason is None


def test_top2_breaks_ties_to_the_lowest_index_and_ranks_the_rest():
    """`decoding.top2` on fresh random rows with planted exact ties (bf16 values, odd lengths): the
    choice is argmax's (the lowest index of the maximum), the runner-up the best of the others
    (another index of the same value where the maximum is tied), values as read."""
    from specpilot.runtime.decoding import top2
    gen = torch.Generator().manual_seed(3)
    for n in (2, 7, 301, 4099):
        for _ in range(20):
            row = torch.randn(n, generator=gen).to(torch.bfloat16).float()
            picks = torch.randint(0, n, (3,), generator=gen)
            row[picks] = row.max() + float(torch.randint(0, 2, (1,), generator=gen))   # a tie at the top (or not)
            best, at, second, runner = top2(row)
            assert int(at) == int(row.argmax()) and float(best) == float(row.max())
            rest = row.clone()
            rest[int(at)] = float("-inf")
            assert int(runner) == int(rest.argmax()) and float(second) == float(rest.max()) and int(runner) != int(at)


def test_top2_rows_takes_every_rows_choice_at_once_as_top2_does():
    """`decoding.top2_rows` (a batched pass's choices, one host copy) on fresh random blocks of rows
    with planted exact ties, bf16 and float32, odd row counts and vocabularies: each row's Choice is
    `top2`'s values on that row; an Emitter records the same from either."""
    from specpilot.runtime.decoding import Choice, Emitter, top2, top2_rows
    gen = torch.Generator().manual_seed(5)
    for vocab in (3, 301, 4099):
        for dtype in (torch.bfloat16, torch.float32):
            blocks = []
            for rows in (1, 5, 17):
                block = torch.randn(rows, vocab, generator=gen).to(torch.bfloat16).to(dtype)
                for r in range(rows):                    # ties at the top in some rows
                    picks = torch.randint(0, vocab, (2,), generator=gen)
                    block[r, picks] = block[r].max() + float(torch.randint(0, 2, (1,), generator=gen))
                blocks.append(block)
            chosen = top2_rows(blocks)
            assert [len(c) for c in chosen] == [1, 5, 17]
            for block, choices in zip(blocks, chosen):
                for row, c in zip(block, choices):
                    best, at, second, runner = top2(row)
                    want = Choice(*torch.stack([best, second]).float().tolist()[:1], int(at),
                                  torch.stack([best, second]).float().tolist()[1], int(runner))
                    assert c == want
                    a, b = Emitter(4, None, None, ()), Emitter(4, None, None, ())
                    assert a.target_token(row) == b.target_token(c) and a.gen == b.gen
    assert top2_rows([]) == []
    with pytest.raises(ValueError, match="logits hook"):
        Emitter(4, None, lambda pos, row: row, ()).target_token(chosen[0][0])


@pytest.mark.parametrize("setting", ["inf", "nan", "-0.5", "loose"])
def test_the_tolerance_rule_refuses_what_would_excuse_anything(setting):
    from specpilot.runtime.forcing import tolerance_rule
    system = SimpleNamespace(derived_near_ties=lambda prompts, runs: (0.25, 9))
    with pytest.raises(SpecPilotError, match="tie tolerance"):
        tolerance_rule(system, [[1]], [], setting)
    assert tolerance_rule(system, [[1]], [], "auto") == (0.25, 9) == tolerance_rule(system, [[1]], [], None)
    assert tolerance_rule(system, [[1]], [], "0.5") == (0.5, None)


def test_joined_rows_are_a_view_of_consecutive_blocks_and_a_copy_of_others():
    """`decoding.joined_rows`: a packed pass's logits split by request come back as the one tensor they
    are (no copy); blocks from different tensors, out of order or with a gap are concatenated."""
    from specpilot.runtime.decoding import joined_rows
    gen = torch.Generator().manual_seed(7)
    for vocab in (1, 7, 301):
        whole = torch.randn(23, vocab, generator=gen)
        sizes = [5, 1, 0, 9, 8]
        parts = list(whole.split(sizes))
        got = joined_rows(parts)
        assert torch.equal(got, whole) and got.data_ptr() == whole.data_ptr()
        one_row = whole[4:5]
        assert torch.equal(joined_rows([one_row]), one_row)
        # out of order, with a gap, from another tensor, not contiguous
        others = [[parts[1], parts[0]], [parts[0], parts[3]], [parts[0], torch.randn(2, vocab, generator=gen)]]
        if vocab > 2:
            others.append([whole[:3, 1:], whole[3:5, 1:]])
        for blocks in others:
            got = joined_rows(blocks)
            assert torch.equal(got, torch.cat(blocks)) and got.data_ptr() not in (whole.data_ptr(), whole[:, 1:].data_ptr())
