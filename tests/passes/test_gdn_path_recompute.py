"""gdn-path-recompute: the tree forms of the Gated DeltaNet verify kernels against a
reference that walks every root path on its own (random trees, 64 nodes, depth <= 16,
outputs NaN-poisoned first), the pass's rewrite and legality, and compiled tree decoding
on a hybrid target that emits stock's tokens exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm_ffi

from specpilot import kernels
from specpilot.compiler.lower import lower_deployment
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse
from specpilot.passes.runner import run_pipeline
from specpilot.runtime.decoding import speculative_tree
from specpilot.runtime.reference.gdn import recurrent_gated_delta_rule
from specpilot.runtime.systems import from_build
from tests.conftest import DENSE, HYBRID, TINY_CONFIGS, build_spec, tiny_config
from tests.kernel_helpers import random_parents, root_path, run_cpu as _run


@pytest.mark.parametrize("seed,n,max_depth", [(0, 64, 16), (1, 64, 4), (2, 17, 16)])
def test_tree_recurrence_and_commit_match_walking_every_path(seed, n, max_depth):
    """Every node's output from the tree kernel, and the state commit rebuilds for it from the
    kernel's records, equal the reference walking that node's root path alone.  Scratch starts
    NaN: a state read back that the kernel did not store would poison the outputs."""
    rng = np.random.default_rng(seed)
    B, H, dk, dv = 2, 3, 8, 5
    parents = np.stack([random_parents(n, max_depth, rng) for _ in range(B)]).astype("int32")
    q, k = (rng.standard_normal((B, n, H, dk)).astype("float32") for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, n, H, dv)).astype("float32")
    g = -np.abs(rng.standard_normal((B, n, H))).astype("float32") * 0.3
    beta = rng.uniform(0.1, 0.9, (B, n, H)).astype("float32")
    s0 = rng.standard_normal((B, H, dk, dv)).astype("float32")
    slots = np.zeros((B, n), "int32")
    W = kernels.record_width(dk, dv)
    o, rec, scratch = _run(kernels.gated_delta_rule(H, dk, dv, keep_states=True, gpu=False, tree=True),
                           [q, k, v, g, beta, s0, slots, parents],
                           [((B, n, H, dv), "float32"), ((B, n, H, W), "float32"), ((B, n, H, dk, dv), "float32")])
    assert not np.isnan(o).any() and not np.isnan(rec).any()
    # only nodes a later (not the next) node branches from are stored
    branched = [[any(parents[b, c] == t for c in range(t + 2, n)) for t in range(n)] for b in range(B)]
    np.testing.assert_array_equal(~np.isnan(scratch).all(axis=(2, 3, 4)), np.array(branched))
    np.testing.assert_array_equal(rec[..., :dk], k)
    np.testing.assert_array_equal(rec[..., dk:dk + dv], v)
    np.testing.assert_array_equal(rec[..., dk + dv], g)
    np.testing.assert_array_equal(rec[..., dk + dv + 1], beta)
    # commit: every node of both sequences at once (paths padded with -1 to the longest)
    commit = kernels.gdn_commit(1, H, dk, dv, gpu=False)
    for i in range(n):
        paths = [root_path(list(parents[b]), i) for b in range(B)]
        depth = max(len(p) for p in paths)
        padded = np.array([[-1] * (depth - len(p)) + p for p in paths], "int32")
        (state,) = _run(commit, [rec[:, :, None], s0[:, None], padded], [((B, 1, H, dk, dv), "float32")])
        for b in range(B):
            t = lambda x: torch.from_numpy(x[b, paths[b]])   # noqa: E731
            ref_o, ref_s, _ = recurrent_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), torch.from_numpy(s0[b]))
            np.testing.assert_allclose(o[b, i], ref_o[-1].numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(state[b, 0], ref_s.numpy(), rtol=1e-5, atol=1e-5)


def test_commit_keeps_each_layers_state_apart():
    """gdn_commit over a stack of G layers: layer g's state from layer g's records and s0 alone."""
    rng = np.random.default_rng(5)
    B, n, G, H, dk, dv = 1, 9, 3, 2, 6, 7
    W = kernels.record_width(dk, dv)
    rec = rng.standard_normal((B, n, G, H, W)).astype("float32")
    rec[..., :dk] /= np.linalg.norm(rec[..., :dk], axis=-1, keepdims=True)
    rec[..., dk + dv] = -np.abs(rec[..., dk + dv]) * 0.3
    rec[..., dk + dv + 1] = 0.5
    s0 = rng.standard_normal((B, G, H, dk, dv)).astype("float32")
    path = np.array([[0, 2, 5]], "int32")
    (both,) = _run(kernels.gdn_commit(G, H, dk, dv, gpu=False), [rec, s0, path], [((B, G, H, dk, dv), "float32")])
    for gl in range(G):
        (alone,) = _run(kernels.gdn_commit(1, H, dk, dv, gpu=False), [rec[:, :, gl:gl + 1].copy(), s0[:, gl:gl + 1].copy(),
                        path], [((B, 1, H, dk, dv), "float32")])
        np.testing.assert_array_equal(both[:, gl], alone[:, 0])
        r = torch.from_numpy(rec[0, path[0], gl])
        _, ref, _ = recurrent_gated_delta_rule(torch.zeros(3, H, dk), r[..., :dk], r[..., dk:dk + dv], r[..., dk + dv],
                                               r[..., dk + dv + 1], torch.from_numpy(s0[0, gl]))
        np.testing.assert_allclose(both[0, gl], ref.numpy(), rtol=1e-5, atol=1e-5)


def _conv_case(seed: int, B: int, C: int, n: int, K: int, max_depth: int):
    """A random tree per sequence and the conv kernel's inputs, with the unstacked kernel's outputs."""
    rng = np.random.default_rng(seed)
    parents = np.stack([random_parents(n, max_depth, rng) for _ in range(B)]).astype("int32")
    state = rng.standard_normal((B, C, K - 1)).astype("float32")
    x = rng.standard_normal((B, n, C)).astype("float32")
    w = rng.standard_normal((C, 1, K)).astype("float32")
    slots = np.tile(np.arange(n, dtype="int32"), (B, 1))
    out, states = _run(kernels.gdn_conv_verify(C, K, "float32", gpu=False, tree=True), [state, x, w, parents, slots],
                       [((B, n, C), "float32"), ((B, n, C, K - 1), "float32")])
    return (state, x, w, parents, slots), out, states, rng


@pytest.mark.parametrize("K", [4, 2])
def test_tree_conv_windows_follow_ancestors(K):
    B, C, n = 2, 7, 40
    (state, x, w, parents, _), out, states, _ = _conv_case(K, B, C, n, K, 16)
    for b in range(B):
        for i in range(n):
            seq = np.concatenate([state[b], x[b][root_path(list(parents[b]), i)].T], axis=1)   # (C, K-1+depth)
            np.testing.assert_allclose(out[b, i], (seq[:, -K:] * w[:, 0]).sum(1), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(states[b, i], seq[:, -(K - 1):])


def test_a_padding_tokens_conv_is_zero_and_its_states_unwritten():
    """Tokens with slot < 0 (a batch's padding after a shorter draft): conv output 0, their kept inputs left
    as they were; every real token's output and states those of the pass without padding."""
    import tvm
    B, C, n, K = 3, 6, 11, 4
    (state, x, w, parents, slots), out, states, rng = _conv_case(5, B, C, n, K, 5)
    real = (n, 4, 1)                           # tokens a sequence; a tree's first tokens are its real ones
    padded = slots.copy()
    for b, m in enumerate(real):
        padded[b, m:] = -1
    lib = tvm.compile(kernels.gdn_conv_verify(C, K, "float32", gpu=False, tree=True).with_attr("global_symbol", "k"),
                      target="llvm")
    before = rng.standard_normal((B, n, C, K - 1)).astype("float32")
    o, st = tvm.runtime.tensor(np.full((B, n, C), np.nan, "float32")), tvm.runtime.tensor(before.copy())
    lib["k"](*(tvm.runtime.tensor(a) for a in (state, x, w, parents, padded)), o, st)
    for b, m in enumerate(real):
        np.testing.assert_array_equal(o.numpy()[b, :m], out[b, :m])
        np.testing.assert_array_equal(st.numpy()[b, :m], states[b, :m])
        assert (o.numpy()[b, m:] == 0).all()
        np.testing.assert_array_equal(st.numpy()[b, m:], before[b, m:])


def test_stacked_conv_states_write_their_own_slot_in_place():
    """stack=(G, g): the state before the pass read out of all G layers' (B, G, C, K-1) at g; layer 0
    makes the (B, T, G, C, K-1) tensor (its slot written), layer g > 0 takes it and writes slot g in
    place, every other slot untouched -- equal to the unstacked kernel's."""
    import tvm
    B, C, n, K, G = 2, 5, 13, 4, 3
    (state, x, w, parents, slots), out, alone, rng = _conv_case(9, B, C, n, K, 6)

    def layers(g):      # the layers' states before the pass: only slice g may be read
        every = np.full((B, G, C, K - 1), np.nan, "float32")
        every[:, g] = state
        return every
    out0, stacked = _run(kernels.gdn_conv_verify(C, K, "float32", gpu=False, tree=True, stack=(G, 0)),
                         [layers(0), x, w, parents, slots], [((B, n, C), "float32"), ((B, n, G, C, K - 1), "float32")])
    np.testing.assert_array_equal(out0, out)
    np.testing.assert_array_equal(stacked[:, :, 0], alone)
    before = rng.standard_normal((B, n, G, C, K - 1)).astype("float32")
    lib = tvm.compile(kernels.gdn_conv_verify(C, K, "float32", gpu=False, tree=True, stack=(G, 2))
                      .with_attr("global_symbol", "k"), target="llvm")
    st = tvm.runtime.tensor(before.copy())
    o = tvm.runtime.tensor(np.full((B, n, C), np.nan, "float32"))
    lib["k"](*(tvm.runtime.tensor(a) for a in (layers(2), x, w, parents, slots)), st, o)
    np.testing.assert_array_equal(o.numpy(), out)
    np.testing.assert_array_equal(st.numpy()[:, :, 2], alone)
    np.testing.assert_array_equal(st.numpy()[:, :, :2], before[:, :, :2])
    with pytest.raises(ValueError, match="stack"):
        kernels.gdn_conv_verify(C, K, "float32", gpu=False, stack=(2, 2))


def test_rewrites_the_verify_kernels_and_nothing_else():
    cfg = tiny_config(HYBRID)
    before, _ = lower_deployment(cfg, None, "float32", 64, gpu=False)
    ctx = PassContext(hybrid=True)
    after, records = run_pipeline(parse("tree-verify,gdn-path-recompute"), before, ctx)
    # the verify conv and the verify recurrence of each layer (each writes its own slot of the
    # stacked per-token conv states / records: layer 0 makes each stack, the others write in place)
    n_gdn = cfg.layer_types.count("linear_attention")
    assert n_gdn >= 2 and records[1].statistics["kernels_rewritten"] == 2 * n_gdn
    changed = [gv.name_hint for gv in before.get_global_vars()
               if not tvm_ffi.structural_equal(after[gv.name_hint], before[gv])]
    assert len(changed) == 2 * n_gdn
    assert sorted(str(after[name].attrs["gdn.kernel"]) for name in changed) == ["conv"] * n_gdn + ["recurrence"] * n_gdn
    for kind in ("conv", "recurrence"):
        stacks = sorted(tuple(int(x) for x in after[name].attrs["gdn.stack"]) for name in changed
                        if str(after[name].attrs["gdn.kernel"]) == kind)
        assert stacks == [(n_gdn, g) for g in range(n_gdn)]
    for name in changed:
        assert bool(after[name].attrs["gdn.tree"]) and not bool(before[name].attrs["gdn.tree"])


@pytest.mark.parametrize("text,context,reason", [
    ("tree-verify,gdn-path-recompute", PassContext(hybrid=False), "only for targets with Gated DeltaNet layers"),
    ("gdn-path-recompute", PassContext(hybrid=True), "requires tree-verify"),
    ("tree-verify", PassContext(hybrid=True), "needs gdn-path-recompute"),
])
def test_illegal_pipelines_name_the_rule(text, context, reason):
    cfg = tiny_config(HYBRID if context.hybrid else DENSE)
    mod, _ = lower_deployment(cfg, None, "float32", 64, gpu=False)
    with pytest.raises(SpecPilotError, match=reason):
        run_pipeline(parse(text), mod, context)


@pytest.mark.parametrize("pool_rows", [False, True])
@pytest.mark.slow
def test_compiled_tree_decoding_on_a_hybrid_target_is_exact(tmp_path, monkeypatch, pool_rows):
    """pool_rows: prefill and verification attention through `kernels.attention_rows_partial`
    (the default; its CPU form here) or gathered keys and matmuls; verification's 16 key splits
    over these short contexts merge several splits of a few keys, some empty."""
    from functools import partial

    from specpilot.compiler import build as build_module
    monkeypatch.setattr(build_module, "lower_deployment", partial(lower_deployment, pool_rows=pool_rows))
    data = {"target": {"architecture": HYBRID, "config": TINY_CONFIGS[HYBRID], "init": {"seed": 1}},
            "drafter": {"kind": "early-exit", "layers": 2, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 300, "max_batch": 2},
            "passes": "tree-verify{budget=16},gdn-path-recompute"}
    out = build_spec(tmp_path, data)
    import tvm
    kernel_names = [gv.name_hint for gv in tvm.ir.load_json((out / "kernels.json").read_text()).get_global_vars()]
    assert any("attention_rows" in name for name in kernel_names) == pool_rows
    system = from_build(out)
    compiled, make = system.engines["compiled"].model, system.engines["compiled-tree"].drafter
    off_rank = 0
    for r in range(2):
        prompt = [(7 * i + 3 + r) % 301 for i in range(15 + 6 * r)]
        stock = system.generate("stock", prompt, 48)
        for budget in (8, 32, 64):
            gen = speculative_tree(compiled, make(), prompt, 48, budget, 300, force=stock.tokens)
            assert gen.choices == stock.tokens, (r, budget)
            off_rank += gen.off_first_rank
        assert system.generate("compiled-tree", prompt, 48).tokens == stock.tokens
        assert system.generate("compiled-spec", prompt, 48).tokens == stock.tokens
    assert off_rank > 0
