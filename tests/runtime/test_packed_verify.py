"""Packed batched verification (`tree-verify{packed=true}`: ``target_verify_packed``): the linear layers
and the head run over a batch's real tokens only, and every output a caller reads -- each real token's
logits, the kept features, the Gated DeltaNet states committed after it -- equals the padded
verification's, bit for bit in float32, on fresh random ragged batches of chains and trees."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.packed_verify import random_tree
from specpilot.core.errors import SpecPilotError
from specpilot.runtime.engine import CompiledModel, packed_rows
from specpilot.runtime.systems import from_build
from specpilot.runtime.tree import Tree
from specpilot.runtime.decoding import tree_inputs
from tests.conftest import TINY_CONFIGS, build_spec

ARCHS = ["LlamaForCausalLM", "Qwen3_5ForCausalLM"]


@pytest.mark.parametrize("seed", range(8))
def test_packed_rows_index_the_real_tokens(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 7)
    lengths = [rng.randint(1, 13) for _ in range(B)]
    T = max(lengths) + rng.choice([0, 0, 3])          # a fixed-size pad past the longest too
    step = rng.choice([1, 1, 4, 16])
    got = packed_rows([[0] * n for n in lengths], T, step)
    if sum(lengths) == B * T:
        assert got is None
        return
    pack, unpack = got
    assert pack.dtype == unpack.dtype == np.int32 and unpack.shape == (B, T)
    real = [b * T + t for b, n in enumerate(lengths) for t in range(n)]
    # the real tokens in order, then copies of the last up to a multiple of step (at most the padded rows)
    assert pack[:len(real)].tolist() == real
    assert len(pack) == min(-(-len(real) // step) * step, B * T) and set(pack[len(real):].tolist()) <= {real[-1]}
    for b, n in enumerate(lengths):
        for t in range(T):
            # a real position finds itself; a padding one its sequence's first real row
            assert unpack[b, t] < len(real) and pack[unpack[b, t]] == b * T + (t if t < n else 0)


def test_nothing_to_pack_where_no_row_pads():
    assert packed_rows([[1, 2], [3, 4]], 2) is None


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory):
    arch = request.param
    passes = "tree-verify{budget=8,packed=true}" + (",gdn-path-recompute" if arch == "Qwen3_5ForCausalLM" else "")
    data = {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 3}},
            "drafter": {"kind": "ngram"}, "passes": passes,
            "deployment": {"dtype": "float32", "max_seq_len": 64, "max_batch": 6}}
    return from_build(build_spec(tmp_path_factory.mktemp("packed"), data))


def _twins(model: CompiledModel, rng: random.Random, n: int):
    """Two models over the build -- one verifying packed, one padded -- whose sequences have the same
    random prompts prefilled."""
    packed, padded = CompiledModel(model.module, "target"), CompiledModel(model.module, "target")
    padded.pack_verify = False
    prompts = [[rng.randrange(model.cfg.vocab_size) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    pairs = []
    for p in prompts:
        a, b = packed.new_state(64), padded.new_state(64)
        assert torch.equal(packed.forward(p, a), padded.forward(p, b))
        pairs.append((a, b))
    return packed, padded, pairs


@pytest.mark.parametrize("seed, step", [(0, 1), (1, 1), (2, 4), (3, 16)])
def test_packed_verification_is_the_padded_one_bit_for_bit(built, seed, step, monkeypatch):
    """With its rows rounded up (``step``: a GPU's `PACKED_ROWS_STEP`) too: the rows added change nothing."""
    rng = random.Random(seed)
    built = built.engines["compiled"].model
    packed, padded, pairs = _twins(built, rng, rng.randint(2, 6))
    packed.packed_rows_step = step
    calls = []
    verify = packed._verify_packed
    monkeypatch.setattr(packed, "_verify_packed", lambda *a: calls.append((a[6].shape[0], len(np.unique(a[6].numpy())), a[0].shape[1]))
                        or verify(*a))
    for _ in range(3):              # passes in a row: each starts from the states the last one committed
        items, trees = {"a": [], "b": []}, []
        for a, b in pairs:
            n = rng.choice([0, 1, 2, 5, 7, 8])
            tree = random_tree(rng, n, built.cfg.vocab_size) if rng.random() < 0.6 or not n \
                else Tree.chain([rng.randrange(built.cfg.vocab_size) for _ in range(n)])
            trees.append(tree)
            last = rng.randrange(built.cfg.vocab_size)
            for key, st in (("a", a), ("b", b)):
                tokens, positions, mask, parents = tree_inputs(last, tree, st.length)
                items[key].append((tokens, st, positions, mask, parents))
        got = packed.forward_batch(items["a"], record=True)
        want = padded.forward_batch(items["b"], record=True)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        # keep a random root path of each tree; the committed states feed the next pass
        for (a, b), tree in zip(pairs, trees):
            path = [0] + [i + 1 for i in tree.path(rng.randrange(len(tree)))] if len(tree) else [0]
            for st, model in ((a, packed), (b, padded)):
                model.accept_path(st, st.length - len(tree) - 1, path)
        packed.settle([a for a, _ in pairs])
        padded.settle([b for _, b in pairs])
        for a, b in pairs:
            assert a.length == b.length
            if built.has_gdn:
                assert np.array_equal(a.conv.numpy(), b.conv.numpy()) and np.array_equal(a.rec.numpy(), b.rec.numpy())
    assert calls, "no pass padded: the packed function was never called"
    assert all(n % step == 0 or n == len(items["a"]) * T for n, _, T in calls)
    assert any(n > real for n, real, _ in calls) == (step > 1)      # rows were added, and only when asked
    # the next decode steps read the keys / values both verifications wrote
    for a, b in pairs:
        token = [rng.randrange(built.cfg.vocab_size)]
        assert torch.equal(packed.forward(token, a), padded.forward(token, b))


def test_rows_past_the_packed_functions_bound_verify_padded(built, monkeypatch):
    """The packed function's memory is planned for rows of at most the build's bound (a tree's budget and
    its root here): a pass with a longer row verifies padded instead -- the packed function not called,
    the logits the padded verification's -- and a pass within the bound still packs."""
    model = built.engines["compiled"].model
    bound = model.module.manifest.memory_bounds["target_verify_packed"]
    assert model.packed_tokens == bound["n"] == 9 and bound["real"] == 6 * 9
    rng = random.Random(5)
    packed, padded, pairs = _twins(model, rng, 3)
    calls = []
    verify = packed._verify_packed
    monkeypatch.setattr(packed, "_verify_packed", lambda *a: calls.append(a[0].shape) or verify(*a))
    for lengths, packs in (((12, 3, 1), False), ((9, 2, 4), True)):
        items = {"a": [], "b": []}
        for (a, b), n in zip(pairs, lengths):
            tokens = [rng.randrange(model.cfg.vocab_size) for _ in range(n)]
            items["a"].append((tokens, a))
            items["b"].append((tokens, b))
        got = packed.forward_batch(items["a"], record=True)
        want = padded.forward_batch(items["b"], record=True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert bool(calls) == packs
        calls.clear()
    # a caller that packed the long row anyway is refused before TVM writes past the planned blocks
    monkeypatch.setattr(packed, "packed_tokens", None)
    long_rows = [([rng.randrange(model.cfg.vocab_size) for _ in range(n)], a) for (a, _), n in zip(pairs, (12, 3, 1))]
    with pytest.raises(SpecPilotError, match="target_verify_packed call with n 12, past the 9"):
        packed.forward_batch(long_rows, record=True)
    assert not calls


@pytest.mark.parametrize("engine, step", [("compiled-spec", 1), ("compiled-tree", 1), ("compiled-tree", 16)])
def test_batched_engines_on_a_packed_build_are_each_request_s_stock_tokens(built, engine, step, monkeypatch):
    prompts = [[4, 8, 15, 16, 23, 42], [5, 9, 2, 7], [11, 3, 8, 1, 1, 30, 2], [2, 2, 2]]
    lengths = [17, 6, 12, 9]
    assert built.engines["compiled"].model.module.manifest.tree.packed
    model = built.engines[engine].model
    monkeypatch.setattr(model, "packed_rows_step", step)
    rounded = []        # each packed call's (rows, real rows)
    verify = model._verify_packed
    monkeypatch.setattr(model, "_verify_packed",
                        lambda *a: rounded.append((a[6].shape[0], len(np.unique(a[6].numpy())))) or verify(*a))
    want = [built.generate("stock", p, n).tokens for p, n in zip(prompts, lengths)]
    got = built.generate_batch(engine, prompts, lengths, max_batch=4)
    assert [g.tokens for g in got] == want
    assert rounded and any(n > real for n, real in rounded) == (step > 1)


def test_the_packed_verify_bench_times_and_profiles_both_forms_beside_the_ar_step(built, tmp_path):
    """bench/packed_verify.py on the tiny packed CPU builds: both verifications and the AR step timed, their
    logits at the real rows identical (float32), and with --kernels each call's kernels listed, covering it."""
    root = Path(__file__).resolve().parents[2]
    build = built.engines["compiled"].model.module.dir
    proc = subprocess.run([sys.executable, str(root / "bench" / "packed_verify.py"), str(build), "--batches", "3",
                           "--sizes", "5,0,2", "--context", "7", "--reps", "2", "--kernels", "50",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("packed-verify-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["real_rows"], row["padded_rows"], row["identical"]) == (3 + 5 + 2, 3 * 6, True)
    assert all(row[name]["median_ms"] > 0 for name in ("packed", "padded", "ar_step"))
    assert set(row["kernels"]) == {"packed", "padded", "ar_step"}
    for ranked in row["kernels"].values():
        assert ranked[-1]["kernel"] == "(all)" and ranked[-1]["us"] > 0
        assert sum(k["us"] for k in ranked[:-1]) == pytest.approx(ranked[-1]["us"])
    # the packing's gathers around every linear layer (`kernels.gather_rows_te`: "packed" / "unpacked", alone or fused)
    gathers = {name: sum(k["calls"] for k in ranked[:-1] if "packed" in k["kernel"]) for name, ranked in row["kernels"].items()}
    assert gathers["packed"] > 0 == gathers["padded"]
    assert all(any(k["kernel"] == "gated_delta_rule*" for k in row["kernels"][name]) for name in ("packed", "padded")) \
        == built.engines["compiled"].model.has_gdn
