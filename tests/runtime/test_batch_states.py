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
            "drafter": {"kind": "replay", "alpha": 0.6, "cost": COST, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 96, "max_batch": 3}}
    system = from_build(build_spec(tmp_path_factory.mktemp("states"), data))
    alone = [system.generate("compiled", p, n).tokens for p, n in zip(PROMPTS, LENGTHS)]
    return system, alone


class _Calls:
    """Counts the engine's stacks of several states (copies of their row views), its picks of some
    rows of a call's outputs, the (1, ...) views of a state it makes, its commit calls' batch sizes and
    its calls moving accepted tree paths' keys / values (their batch sizes)."""

    def __init__(self, monkeypatch, model):
        self.stacks, self.picks, self.rows, self.commits, self.moves = 0, 0, 0, [], []
        stack, row, commit, compact = engine.CompiledModel._stack, engine.CompiledModel.row, model._commit, \
            model._compact_kv
        pick = engine.CompiledModel._pick

        def counted_pick(this, array, picks):
            self.picks += 1
            return pick(this, array, picks)

        def counted_row(this, array, *args):
            self.rows += array.shape[0] > 1      # a row of a batch's outputs (a single sequence's are themselves)
            return row(this, array, *args)

        def counted_stack(this, arrays):
            self.stacks += len(arrays) > 1
            return stack(this, arrays)

        def counted_commit(*args):
            self.commits.append(args[0].shape[0])
            return commit(*args)
        def counted_compact(kv, rows, *args):
            self.moves.append(rows.shape[0])
            return compact(kv, rows, *args)
        monkeypatch.setattr(engine.CompiledModel, "_stack", counted_stack)
        monkeypatch.setattr(engine.CompiledModel, "_pick", counted_pick)
        monkeypatch.setattr(engine.CompiledModel, "row", counted_row)
        monkeypatch.setattr(model, "_commit", counted_commit)
        monkeypatch.setattr(model, "_compact_kv", counted_compact)


def _members(run) -> int:
    """How many times the running set changed over the run's passes: joins (each a prefill pass of
    fresh states) and leaves."""
    sizes = [s.running for s in run.steps if s.running]
    return sum(a != b for a, b in zip(sizes, sizes[1:])) + sum(s.prefill for s in run.steps)


def test_ar_steps_pass_the_batch_s_states_on_without_copies(system, monkeypatch):
    system, alone = system
    model = system.engines["compiled"].model
    calls = _Calls(monkeypatch, model)
    run = system.serve("compiled", ARRIVALS, system.batch_policy("compiled", 3), StepClock())
    assert [g.tokens for g in run.generations] == alone
    steps = len([s for s in run.steps if s.running])
    # conv and rec restacked (or their rows picked) once after each change of the running set, never on a
    # step that keeps it; a state's row views are made only to be restacked (at most 3 states a stack here)
    assert 0 < calls.stacks + calls.picks <= 2 * _members(run) < steps
    assert calls.picks > 0 and calls.rows <= 3 * calls.stacks


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
    assert calls.stacks + calls.picks <= 2 * _members(run)       # committed rows are the next pass's input
    assert calls.rows <= 3 * calls.stacks + 4 * sum(s.running == 1 for s in passes)   # to restack or commit one alone
    assert len(calls.moves) <= len(passes)                       # a tree pass's path moves in one call


def test_accepted_tree_paths_move_in_one_call_and_continue_as_if_fed_alone(system, monkeypatch):
    """Two sequences verify a tree each in one pass and keep a path that is not a prefix of the
    pass (root -> the second child): one ``compact_kv`` call moves both, and the next step's logits
    are those of the same tokens fed to fresh states as plain chains (fp32; other kernels, so to
    rounding: a key / value left at the wrong slot moves them by far more)."""
    from specpilot.runtime.decoding import tree_inputs
    from specpilot.runtime.tree import Tree
    system, _ = system
    model = system.engines["compiled-tree"].model
    calls = _Calls(monkeypatch, model)
    tree = Tree([7, 9, 3], [-1, -1, 0], [1, 1, 2], [0.0, 0.0, 0.0])    # x, y under the root; z under x
    states, kept = [model.new_state(96) for _ in PROMPTS[:2]], []
    model.forward_batch([(p, st) for p, st in zip(PROMPTS, states)])
    items = []
    for p, st in zip(PROMPTS, states):
        tokens, positions, mask, parents = tree_inputs(p[-1], tree, st.length)
        items.append((tokens, st, positions, mask, parents))
    model.forward_batch(items, record=True)
    for (tokens, st, *_), p in zip(items, PROMPTS):
        base = st.length - len(tokens)
        model.accept_path(st, base, [0, 2])                   # root, then y (node 2 of the pass)
        kept.append(p + [tokens[0], tokens[2]])
    got = model.forward_batch([([5], st) for st in states])
    for tokens, logits in zip(kept, got):
        fresh = model.new_state(96)
        want = model.forward(tokens + [5], fresh)[-1]
        fresh.close()
        torch.testing.assert_close(logits[-1], want, rtol=1e-5, atol=1e-5)
    assert calls.moves == [2]


def test_a_row_is_a_view_only_where_tvm_can_take_it():
    """`row`: a view of the batch's output where it is 64-byte aligned, a copy where it is not
    (TVM takes no other DLPack tensor) or where the build replays CUDA graphs."""
    import tvm
    for graphs in (False, True):
        fake = SimpleNamespace(module=SimpleNamespace(tvm=tvm, manifest=SimpleNamespace(cuda_graph=graphs)))
        for width, aligned in ((16, True), (5, False)):      # float32 rows of 64 / 20 bytes
            base = torch.arange(3 * width, dtype=torch.float32).reshape(3, width)
            out = tvm.runtime.from_dlpack(base)
            row = engine.CompiledModel.row(fake, out, 1)
            got = torch.from_dlpack(row)
            assert torch.equal(got, base[1:2])
            assert (got.data_ptr() == base[1:2].data_ptr()) == (aligned and not graphs), (width, graphs)



@pytest.mark.parametrize("seed", range(6))
def test_some_rows_of_a_call_s_outputs_are_picked_in_order(seed):
    """`_pick` (a batch that lost members): rows ``picks`` of the outputs, in their order -- consecutive
    aligned ones a view of the outputs, others one gather (repeats and any order included)."""
    import random
    import tvm
    rng = random.Random(seed)
    fake = SimpleNamespace(module=SimpleNamespace(tvm=tvm))
    B, width = rng.randint(2, 9), rng.choice([16, 5, 48, 7])       # float32 rows of 64, 20, 192, 28 bytes
    base = torch.randn(B, width, 3)
    n = rng.randint(1, B)
    lo = rng.randrange(B - n + 1)
    for picks in (list(range(lo, lo + n)), rng.sample(range(B), n), [rng.randrange(B)] * 2):
        got = torch.from_dlpack(engine.CompiledModel._pick(fake, tvm.runtime.from_dlpack(base), picks))
        assert torch.equal(got, base[picks])
        consecutive = picks == list(range(picks[0], picks[0] + len(picks)))
        view = got.data_ptr() == base[picks[0]:].data_ptr()
        assert view == (consecutive and (picks[0] * width * 3 * 4) % 64 == 0), (picks, width)


def test_a_cuda_graph_build_s_rows_are_copies_stacked_again(system, monkeypatch):
    """Where the build replays CUDA graphs (its outputs may be a replay's buffers), each state is a copy
    of its row and every call of several requests stacks them again; a verification's states commit one
    request at a time from those copies -- nothing holds on to or passes on a call's outputs."""
    system, alone = system
    model = system.engines["compiled-spec"].model
    monkeypatch.setattr(model.module.manifest, "cuda_graph", True)
    calls = _Calls(monkeypatch, model)
    for name in ("compiled", "compiled-spec"):
        run = system.serve(name, ARRIVALS, system.batch_policy(name, 3), StepClock())
        assert [g.tokens for g in run.generations] == alone, name
        multi = [s for s in run.steps if s.running > 1]
        assert calls.stacks >= 2 * len(multi), name
    assert calls.commits and max(calls.commits) == 1


def test_a_single_sequence_s_commits_are_timed_as_commit(system, monkeypatch):
    """The lazy commits of a generation's kept tokens run in the decoding loop's commit part (the chain
    and tree loops settle after each verification), so the bench's cycle breakdown (a timed engine, as
    `runtime.bench` builds it) charges them to commit, not to the next verification."""
    from specpilot.runtime.cycle_timing import Clock, TimedDrafter, TimedModel
    from specpilot.runtime.systems import Engine
    system, alone = system

    class Noting(Clock):          # the part being timed when the build's commit runs
        def __init__(self):
            super().__init__()
            self.parts = []

        def timed(self, part, fn, *args, **kwargs):
            self.parts.append(part)
            try:
                return super().timed(part, fn, *args, **kwargs)
            finally:
                self.parts.pop()
    for name in ("compiled-spec", "compiled-tree"):
        engine, clock, seen = system.engines[name], Noting(), []
        commit = engine.model._commit
        with monkeypatch.context() as patch:
            patch.setattr(engine.model, "_commit", lambda *args: seen.append(clock.parts[-1]) or commit(*args))
            system.engines["timed"] = Engine(TimedModel(engine.model, clock),
                                             lambda sampling=None: TimedDrafter(engine.drafter(sampling), clock),
                                             engine.tree_budget, engine.two_level)
            try:
                got = system.generate("timed", PROMPTS[0], LENGTHS[0])
            finally:
                del system.engines["timed"]
        assert got.tokens == alone[0] and seen and set(seen) == {"commit"}, (name, seen)


def test_the_batch_host_bench_splits_each_part_into_host_and_build_calls(system, tmp_path):
    """bench/batch_host.py on this build: every pass's verification spends time in the build's calls and
    on the host, and the parts' host times are what the rows report."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    build = system[0].engines["compiled"].model.module.dir
    proc = subprocess.run([sys.executable, str(root / "bench" / "batch_host.py"), str(build), "--batches", "3",
                           "--engines", "compiled-spec,compiled-tree", "--new-tokens", "6", "--prompt-tokens", "5",
                           "--reps", "2", "--out", str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("batch-host-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [("compiled-spec", 3), ("compiled-tree", 3)]
    for r in rows:
        assert len(r["runs"]) == 2 and r["passes"] > 0
        for run in r["runs"]:
            assert run["verify"]["calls_ms"] > 0 and run["verify"]["host_ms"] > 0 and run["commit"]["host_ms"] > 0
        assert r["host_ms_best"] == {p: min(run[p]["host_ms"] for run in r["runs"]) for p in r["host_ms_best"]}


def test_the_timeline_bench_counts_device_time_by_part_against_a_brute_force_clock():
    """bench/batch_timeline.py's interval arithmetic on random traces: the union of device intervals and
    each window's covered time equal a unit grid's count (integer endpoints, overlaps and nesting
    included), and a trace's parts split into busy and idle time that add up to their wall time."""
    import random
    from bench.batch_timeline import CALL, covered, split, union
    rng = random.Random(7)
    for _ in range(200):
        spans = [(s, s + rng.randrange(0, 9)) for s in (rng.randrange(0, 60) for _ in range(rng.randrange(0, 12)))]
        merged = union(spans)
        grid = {t for s, e in spans for t in range(s, e)}
        assert sum(e - s for s, e in merged) == len(grid)
        assert all(a[1] < b[0] for a, b in zip(merged, merged[1:]))
        starts = [s for s, _ in merged]
        for _ in range(5):
            lo = rng.randrange(0, 70)
            hi = lo + rng.randrange(0, 20)
            assert covered(merged, starts, lo, hi) == len({t for t in grid if lo <= t < hi})
    events = [{"ph": "X", "cat": "user_annotation", "name": p, "ts": t, "dur": d}
              for p, t, d in (("draft", 0, 10), ("verify", 10, 30), ("commit", 40, 5),
                              ("draft", 45, 10), ("verify", 55, 30), ("commit", 85, 5))]
    events += [{"ph": "X", "cat": "kernel", "name": "k", "ts": t, "dur": d} for t, d in ((2, 3), (12, 25), (38, 4), (60, 20))]
    events += [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": t, "dur": 0.5} for t in (1, 11, 36, 58)]
    events += [{"ph": "X", "cat": "user_annotation", "name": CALL, "ts": t, "dur": d} for t, d in ((1, 3), (11, 3), (56, 5))]
    out = split({"traceEvents": events})
    assert abs(out["verify"]["in_calls_ms"] - 8 / 2e3) < 1e-12
    assert abs(out["verify"]["idle_in_calls_ms"] - (1 + 4) / 2e3) < 1e-12        # 11-12 and 56-60 idle
    assert abs(out["draft"]["idle_in_calls_ms"] - 1 / 2e3) < 1e-12               # 1-2 idle, 2-4 busy
    assert out["passes"]["count"] == 2 and abs(out["passes"]["wall_ms"] - 0.045) < 1e-12
    assert abs(out["verify"]["busy_ms"] - (25 + 2 + 20) / 2e3) < 1e-12
    assert abs(out["commit"]["busy_ms"] - 2 / 2e3) < 1e-12
    assert out["draft"]["launches"] == 0.5 and out["verify"]["launches"] == 1.5
    for part in ("draft", "verify", "commit"):
        assert abs(out[part]["busy_ms"] + out[part]["idle_ms"] - out[part]["wall_ms"]) < 1e-12
    # a named function's range inside a part: its own busy and idle time (12-37 and 38-39 busy of 11-39)
    named = "pkg.mod:Class.method"
    out = split({"traceEvents": events + [{"ph": "X", "cat": "user_annotation", "name": named, "ts": 11, "dur": 28}]},
                (named,))
    assert abs(out[named]["busy_ms"] - 26 / 2e3) < 1e-12 and abs(out[named]["idle_ms"] - 2 / 2e3) < 1e-12


def test_the_timeline_bench_ranges_a_named_function_where_it_is_defined(monkeypatch):
    """`functions_ranged` replaces a method and a module-level function by wrappers that run them inside
    a profiler range of their name: same results, the range recorded once a call."""
    import types
    import sys as system
    from torch.profiler import ProfilerActivity, profile
    from bench.batch_timeline import functions_ranged
    mod = types.ModuleType("ranged_fixture")
    exec("class Box:\n    def twice(self, x):\n        return 2 * x\n"
         "def thrice(x):\n    return 3 * x\ndef caller(x):\n    return thrice(x) + 1\n", mod.__dict__)
    monkeypatch.setitem(system.modules, "ranged_fixture", mod)
    names = functions_ranged(["ranged_fixture:Box.twice", "ranged_fixture:thrice"])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert mod.Box().twice(4) == 8 and mod.caller(5) == 16
    seen = [e.name for e in prof.events()]
    assert all(seen.count(n) == 1 for n in names)


def test_the_timeline_benchs_runtime_ranges_name_functions_that_exist():
    """`--ranges runtime` names runtime functions by module and qualified name: each resolves to a callable."""
    import importlib
    from bench.batch_timeline import RUNTIME_RANGES
    for name in RUNTIME_RANGES:
        module_name, _, qualname = name.partition(":")
        owner = importlib.import_module(module_name)
        for part in qualname.split("."):
            owner = getattr(owner, part)
        assert callable(owner), name
