"""The chunked tree form of the gated delta rule (compiler/gdn_tree.py): its CPU form against a
reference that walks every node's root path on its own (PyTorch recurrence), on random trees,
chains, odd head sizes and padding tokens, outputs NaN-poisoned; its records feed commit; too
many tokens is a clear error; the GPU form compiles to sm_90 with its dynamic shared memory;
gdn-path-recompute picks the form."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from specpilot import kernels
from specpilot.kernels import gdn_tree
from specpilot.compiler.lower import lower_deployment
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse
from specpilot.passes.runner import run_pipeline
from specpilot.runtime.reference.gdn import recurrent_gated_delta_rule
from tests.conftest import HYBRID, tiny_config
from tests.kernel_helpers import gdn_inputs, random_parents, root_path, run_cpu, sm90_source


def _case(rng, B, n, H, dk, dv, parents):
    q, k, v, g, beta = gdn_inputs(rng, B, n, H, dk, dv)
    s0 = rng.standard_normal((B, H, dk, dv)).astype("float32")
    return q, k, v, g, beta, s0, np.asarray(parents, "int32")


def _reference(q, k, v, g, beta, s0, slots, parents, b, i):
    """Node i of sequence b: its root path walked alone, padding tokens skipped (they leave the
    state as it is); its output (0 for padding) and the state after it."""
    path = [t for t in root_path(list(parents[b]), i) if slots[b, t] >= 0]
    if not path:
        return np.zeros(v.shape[-2:], "float32"), s0[b]
    t = lambda x: torch.from_numpy(x[b, path])   # noqa: E731
    out, state, _ = recurrent_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), torch.from_numpy(s0[b]))
    return (out[-1].numpy() if slots[b, i] >= 0 else np.zeros(v.shape[-2:], "float32")), state.numpy()


@pytest.mark.parametrize("seed,n,max_depth,H,dk,dv", [
    (0, 65, 16, 3, 8, 5),        # a best-first-sized tree, odd value width
    (1, 64, 3, 2, 16, 12),       # wide and shallow
    (2, 17, 16, 1, 6, 7),        # odd key width
    (3, 40, 40, 2, 8, 8),        # a chain (every node the child of the one before)
    (4, 104, 12, 1, 8, 4),       # as many tokens as the form holds
])
def test_chunked_tree_form_matches_walking_every_path(seed, n, max_depth, H, dk, dv):
    rng = np.random.default_rng(seed)
    B = 2
    if max_depth >= n:
        parents = np.tile(np.arange(-1, n - 1), (B, 1))
    else:
        parents = np.stack([random_parents(n, max_depth, rng) for _ in range(B)])
    q, k, v, g, beta, s0, parents = _case(rng, B, n, H, dk, dv, parents)
    slots = np.zeros((B, n), "int32")
    slots[1, rng.choice(n, size=max(1, n // 8), replace=False)] = -1     # padding inside sequence 1's tree
    W = kernels.record_width(dk, dv)
    o, rec, _ = run_cpu(gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=False),
                        [q, k, v, g, beta, s0, slots, parents],
                        [((B, n, H, dv), "float32"), ((B, n, H, W), "float32"), ((B, n, H, dk, dv), "float32")])
    assert not np.isnan(o).any() and not np.isnan(rec).any()
    np.testing.assert_array_equal(rec[..., :dk], k)
    np.testing.assert_array_equal(rec[..., dk:dk + dv], v)
    np.testing.assert_array_equal(rec[..., dk + dv], g)
    np.testing.assert_array_equal(rec[..., dk + dv + 1], beta)
    scale = np.abs(o).max()
    for b in range(B):
        for i in range(n):
            ref_o, _ = _reference(q, k, v, g, beta, s0, slots, parents, b, i)
            np.testing.assert_allclose(o[b, i], ref_o, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{b} {i}")
    assert (o[1][slots[1] < 0] == 0).all()
    # commit rebuilds a deep node's state from these records (no padding in sequence 0)
    deepest = max(range(n), key=lambda i: len(root_path(list(parents[0]), i)))
    path = np.array([root_path(list(parents[0]), deepest)], "int32")
    (state,) = run_cpu(kernels.gdn_commit(1, H, dk, dv, gpu=False), [rec[:1, :, None], s0[:1, None], path],
                       [((1, 1, H, dk, dv), "float32")])
    _, ref_s = _reference(q, k, v, g, beta, s0, slots, parents, 0, deepest)
    np.testing.assert_allclose(state[0, 0], ref_s, rtol=1e-5, atol=1e-5 * np.abs(ref_s).max())


def test_stacked_form_reads_its_layers_state_and_writes_its_records_in_place():
    rng = np.random.default_rng(5)
    B, n, H, dk, dv, G = 2, 12, 2, 8, 4, 3
    q, k, v, g, beta, s0, parents = _case(rng, B, n, H, dk, dv, [random_parents(n, 5, rng) for _ in range(B)])
    W = kernels.record_width(dk, dv)
    slots = np.zeros((B, n), "int32")
    import tvm
    lib = tvm.compile(gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=False, stack=(G, 1)).with_attr("global_symbol", "k"),
                      target="llvm")
    states = np.full((B, G, H, dk, dv), np.nan, "float32")      # only layer 1's states may be read
    states[:, 1] = s0
    stack = np.full((B, n, G, H, W), 7.0, "float32")
    arrays = [tvm.runtime.tensor(a) for a in (q, k, v, g, beta, states, slots, parents, stack)]
    o, scratch = tvm.runtime.tensor(np.zeros((B, n, H, dv), "float32")), \
        tvm.runtime.tensor(np.zeros((B, n, H, dk, dv), "float32"))
    lib["k"](*arrays, o, scratch)
    out = arrays[-1].numpy()
    np.testing.assert_array_equal(out[:, :, 1, :, :dk], k)
    np.testing.assert_array_equal(out[:, :, [0, 2]], 7.0)          # the other layers' slots untouched
    want, _, _ = run_cpu(gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=False), [q, k, v, g, beta, s0, slots, parents],
                         [((B, n, H, dv), "float32"), ((B, n, H, W), "float32"), ((B, n, H, dk, dv), "float32")])
    np.testing.assert_array_equal(o.numpy(), want)


def test_more_tokens_than_the_form_holds_is_a_clear_error():
    B, H, dk, dv, n = 1, 2, 8, 5, 17
    kern = gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=False, nmax=16)
    args = [np.zeros((B, n, H, dk), "float32")] * 2 + [np.zeros((B, n, H, dv), "float32")] + \
        [np.zeros((B, n, H), "float32")] * 2 + [np.zeros((B, H, dk, dv), "float32"), np.zeros((B, n), "int32"),
                                                np.full((B, n), -1, "int32")]
    with pytest.raises(Exception, match=r"more tokens than its nmax \(16\)"):
        run_cpu(kern, args, [((B, n, H, dv), "float32"), ((B, n, H, dk + dv + 2), "float32"),
                             ((B, n, H, dk, dv), "float32")])
    with pytest.raises(ValueError, match="nmax"):
        gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=False, nmax=gdn_tree.NMAX_LIMIT + 8)
    with pytest.raises(ValueError, match="level form holds at most 72"):
        gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=True, levels=True, nmax=80)
    with pytest.raises(ValueError, match="probe"):
        gdn_tree.gated_delta_rule_tree(H, dk, dv, gpu=True, probe=True)


def test_gpu_form_compiles_to_sm90_code_without_a_gpu(tmp_path):
    """27B-class heads (2 blocks of 64 value columns a head, 8 warps), a narrow head and a
    stacked layer; the k / q rows, S_0 block and deltas in dynamic shared memory (> 48 KB at
    27B-class heads: TVM raises the kernel's limit at launch)."""
    text = sm90_source(tmp_path, "from specpilot.kernels.gdn_tree import gated_delta_rule_tree as f",
                       "{'big': f(48, 128, 128, True), 'narrow': f(3, 8, 5, True), "
                       "'stacked': f(4, 16, 12, True, stack=(3, 1))}")
    for name in ("big", "narrow", "stacked"):
        assert f"{name}_kernel" in text
    assert "extern __shared__" in text and "__shfl_xor_sync" in text
    script = gdn_tree.gated_delta_rule_tree(48, 128, 128, True).script()
    assert 'T.thread_binding(8, thread="threadIdx.y")' in script and "batch * T.int64(96)" in script


@pytest.mark.slow
def test_level_form_compiles_to_sm90_code_without_a_gpu(tmp_path):
    """The level form (what a budget-64 build runs on the GPU): 27B-class heads in blocks of 32
    value columns, odd head sizes (4-byte copies), a stacked layer and the probe form; every load
    of the k rows, S_0 and v blocks a cp.async before the first barrier, 32-bit indexing, the
    8-lane groups' shuffles."""
    f = gdn_tree.gated_delta_rule_tree
    text = sm90_source(tmp_path, "from specpilot.kernels.gdn_tree import gated_delta_rule_tree as f",
                       "{'big': f(48, 128, 128, True, levels=True, nmax=72, columns=32), "
                       "'odd': f(3, 10, 5, True, levels=True, nmax=16, columns=32), "
                       "'stacked': f(4, 16, 12, True, stack=(3, 1), levels=True, nmax=24, columns=32), "
                       "'probe': f(48, 128, 128, True, levels=True, nmax=72, columns=32, probe=True)}")
    kernels_ = {}
    for name in ("big", "odd", "stacked", "probe"):
        start = re.search(rf"void __launch_bounds__\(256\) {name}_kernel\([^)]*\) {{", text).end()
        kernels_[name] = text[start:text.index("\n}\n", start)]
    for name, body in kernels_.items():
        first_barrier = body.index("__syncthreads()")
        assert "ptx_cp_async_cg" in body[:first_barrier] or "ptx_cp_async_ca" in body[:first_barrier], name
        assert name == "probe" or "int64_t" not in body, name     # 32-bit indexing throughout
        assert "__shfl_xor_sync(__activemask(), " in body and ", 4, 32)" in body, name
        assert ("clock64()" in body) == (name == "probe"), name
    big = kernels_["big"]
    assert "ptx_cp_async_cg" in big and "ptx_cp_async_cg" not in kernels_["odd"]   # 16-byte copies where aligned
    script = f(48, 128, 128, True, levels=True, nmax=72, columns=32).script()
    assert "batch * 192" in script        # 48 heads x 4 blocks of 32 columns
    assert f(48, 128, 128, True, levels=True, nmax=72, columns=32).attrs["gdn.solve"] == "levels"


@pytest.mark.parametrize("shape", [(4, 16, 12), (3, 10, 5), (48, 128, 128), (2, 64, 64)])
@pytest.mark.parametrize("kwargs", [{}, {"levels": True, "nmax": 72, "columns": 32},
                                    {"levels": True, "nmax": 16, "columns": 32}])
def test_gpu_forms_shared_memory_launches(shape, kwargs):
    """TVM raises a kernel's dynamic shared memory limit only from 48 KB of dynamic memory; static +
    dynamic past 48 KB with less dynamic fails at launch (CUDA_ERROR_INVALID_VALUE, seen on the H200
    with the tiny hybrid's heads).  Every GPU form: all of it within 48 KB, or 48 KB dynamic."""
    script = gdn_tree.gated_delta_rule_tree(*shape, True, **kwargs).script()
    static = sum(int(n) * 4 for n in re.findall(r"T\.alloc_shared\(\((\d+),\)", script))
    dynamic = sum(int(n) * 4 for n in re.findall(r'T\.alloc_buffer\(\((\d+),\), scope="shared\.dyn"\)', script))
    assert static and dynamic
    assert static + dynamic <= 48 * 1024 or dynamic >= 48 * 1024, (static, dynamic)
    assert static <= 48 * 1024


@pytest.mark.parametrize("text,form,solve,tokens", [
    ("tree-verify,gdn-path-recompute", "chunked", "levels", 72),
    ("tree-verify{budget=71},gdn-path-recompute", "chunked", "levels", 72),
    ("tree-verify{budget=72},gdn-path-recompute", "chunked", "substitution", 104),  # more than the level form holds
    ("tree-verify,gdn-path-recompute{form=sequential}", None, None, None),
    ("tree-verify{budget=200},gdn-path-recompute", None, None, None),   # more nodes than the chunked forms hold
])
def test_the_pass_picks_the_form(text, form, solve, tokens):
    """On the GPU lowering (the CPU form solves by substitution whatever the limit)."""
    before, _ = lower_deployment(tiny_config(HYBRID), None, "float32", 64, gpu=True)
    pipeline = parse(text)
    context = PassContext(hybrid=True)
    after, _ = run_pipeline(pipeline, before, context)
    trees = [f for _, f in after.functions.items()
             if f.attrs is not None and "gdn.kernel" in f.attrs and str(f.attrs["gdn.kernel"]) == "recurrence"
             and bool(f.attrs["gdn.tree"])]
    got = lambda key: {str(f.attrs[key]) if key in f.attrs else None for f in trees}  # noqa: E731
    assert got("gdn.form") == {form} and got("gdn.solve") == {solve}
    assert got("gdn.max_tokens") == {str(tokens) if tokens else None}
    recompute = next(p for p in pipeline.passes if p.name == "gdn-path-recompute")
    assert recompute.manifest_entry(context) == ({"form": "chunked", "max_tokens": tokens} if tokens else {"form": "sequential"})


@pytest.mark.slow
def test_a_chunked_build_verifies_at_most_its_limit(tmp_path, monkeypatch):
    """The limit travels in the manifest: within it tree decoding is exact, past it the engine
    says so before calling the kernel (the kernel's own check is the backstop)."""
    from specpilot.core.errors import SpecPilotError
    from specpilot.runtime.decoding import speculative_tree
    from specpilot.runtime.systems import from_build
    from tests.conftest import TINY_CONFIGS, build_spec
    monkeypatch.setattr(gdn_tree, "NMAX_LIMIT", 8)
    data = {"target": {"architecture": HYBRID, "config": TINY_CONFIGS[HYBRID], "init": {"seed": 3}},
            "drafter": {"kind": "early-exit", "layers": 2, "top_k": 3},
            "deployment": {"dtype": "float32", "max_seq_len": 200, "max_batch": 2},
            "passes": "tree-verify{budget=7},gdn-path-recompute"}
    system = from_build(build_spec(tmp_path, data))
    compiled, make = system.engines["compiled"].model, system.engines["compiled-tree"].drafter
    assert compiled.max_verify_tokens == 8
    prompt = [(5 * i + 2) % 301 for i in range(11)]
    stock = system.generate("stock", prompt, 24)
    assert speculative_tree(compiled, make(), prompt, 24, 7, 200, force=stock.tokens).choices == stock.tokens
    with pytest.raises(SpecPilotError, match="at most 8"):
        speculative_tree(compiled, make(), prompt, 24, 12, 200, force=stock.tokens)
