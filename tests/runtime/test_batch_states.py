"""A continuous batch's Gated DeltaNet states on the compiled engine: each request's conv / recurrent
states are rows of the last call's (B, ...) outputs, passed on as they are while the batch keeps its
members in order (restacked only when a request joins or leaves), and the states a verification keeps
are committed in one call for the batch -- with every request's tokens its own greedy ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specpilot.runtime import engine
from specpilot.runtime.batching import Arrival, StepClock
from specpilot.runtime.systems import from_build
from tests.conftest import TINY_CONFIGS, build_spec

HYBRID = {"architecture": "Qwen3_5ForCausalLM", "config": TINY_CONFIGS["Qwen3_5ForCausalLM"], "init": {"seed": 6}}
COST = {"architecture": "LlamaForCausalLM", "init": {"seed": 9},
        "config": {**TINY_CONFIGS["LlamaForCausalLM"], "num_hidden_layers": 1}}
PROMPTS = [[4, 8, 15, 16, 23, 42], [5, 9, 2, 7], [11, 3, 8, 1, 1, 30, 2]]
LENGTHS = [21, 9, 14]
ARRIVALS = [Arrival(0.0, tuple(p), n) for p, n in zip(PROMPTS, LENGTHS)]      # a burst


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    data = {"target": HYBRID, "passes": "tree-verify{budget=8},gdn-path-recompute",
            "drafter": {"kind": "replay", "alpha": 0.8, "cost": COST, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 96, "max_batch": 3}}
    system = from_build(build_spec(tmp_path_factory.mktemp("states"), data))
    alone = [system.generate("compiled", p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    return system, alone


class _Calls:
    """Counts the engine's stacks of several states (copies) and its commit calls' batch sizes."""

    def __init__(self, monkeypatch, model):
        self.stacks, self.commits = 0, []
        stack, commit = engine.CompiledModel._stack, model._commit

        def counted_stack(this, arrays):
            self.stacks += len(arrays) > 1
            return stack(this, arrays)

        def counted_commit(*args):
            self.commits.append(args[0].shape[0])
            return commit(*args)
        monkeypatch.setattr(engine.CompiledModel, "_stack", counted_stack)
        monkeypatch.setattr(model, "_commit", counted_commit)


def _members(run) -> int:
    """How many times the running set changed size over the run's passes (joins and leaves)."""
    sizes = [s.running for s in run.steps if s.running]
    return sum(a != b for a, b in zip(sizes, sizes[1:]))


def test_ar_steps_pass_the_batch_s_states_on_without_copies(system, monkeypatch):
    system, alone = system
    model = system.engines["compiled"].model
    calls = _Calls(monkeypatch, model)
    run = system.serve("compiled", ARRIVALS, system.batch_policy("compiled", 3), StepClock())
    assert [g.tokens for g in run.generations] == alone
    steps = len([s for s in run.steps if s.running])
    # conv and rec restacked once after each change of the running set, never on a step that keeps it
    assert 0 < calls.stacks <= 2 * _members(run) < steps


@pytest.mark.parametrize("name", ["compiled-spec", "compiled-tree"])
def test_a_verification_s_kept_states_are_committed_in_one_call(system, monkeypatch, name):
    system, alone = system
    model = system.engines[name].model
    calls = _Calls(monkeypatch, model)
    run = system.serve(name, ARRIVALS, system.batch_policy(name, 3), StepClock())
    assert [g.tokens for g in run.generations] == alone
    passes = [s for s in run.steps if s.running and not s.prefill]
    assert calls.commits and max(calls.commits) == 3             # the whole batch in one call
    assert len(calls.commits) <= len(passes)                     # never a call per request
    assert calls.stacks <= 2 * _members(run)                     # committed rows are the next pass's input


def test_a_row_is_a_view_only_where_tvm_can_take_it():
    """`_row`: a view of the batch's output where it is 64-byte aligned, a copy where it is not
    (TVM takes no other DLPack tensor) or where the build replays CUDA graphs."""
    import tvm
    for graphs in (False, True):
        fake = SimpleNamespace(module=SimpleNamespace(tvm=tvm, manifest=SimpleNamespace(cuda_graph=graphs)))
        for width, aligned in ((16, True), (5, False)):      # float32 rows of 64 / 20 bytes
            base = torch.arange(3 * width, dtype=torch.float32).reshape(3, width)
            out = tvm.runtime.from_dlpack(base)
            row = engine.CompiledModel._row(fake, out, 1)
            got = torch.from_dlpack(row)
            assert torch.equal(got, base[1:2])
            assert (got.data_ptr() == base[1:2].data_ptr()) == (aligned and not graphs), (width, graphs)

