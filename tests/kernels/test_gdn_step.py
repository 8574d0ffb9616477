"""A prefill / decode step's Gated DeltaNet kernels over the layers' stacked states: the recurrence
reads its layer's state out of all G layers' (B, G, H, dk, dv) and writes its final state into
slice g of one such tensor (layer 0 allocating it, the others in place), and a decode step's conv
(verify's kernel on one token) writes its window into the layers' stack -- on the CPU against the
PyTorch recurrence and the conv written out, random inputs, odd sizes, outputs NaN-poisoned; the
GPU forms compile to sm_90; gdn-path-recompute leaves a step's conv a chain."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot import kernels
from specpilot.runtime.reference.gdn import recurrent_gated_delta_rule
from tests.kernel_helpers import gdn_inputs, sm90_source


def _call(kernel, args):
    """Call a CPU kernel on numpy arrays; every argument comes back (in-place ones as written)."""
    import tvm
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]
    tvm.compile(kernel.with_attr("global_symbol", "k"), target="llvm")["k"](*tensors)
    return [t.numpy() for t in tensors]


@pytest.mark.parametrize("n,G,gi,H,dk,dv", [(1, 3, 0, 3, 8, 5), (1, 3, 2, 2, 6, 7), (4, 2, 1, 1, 8, 4),
                                            (1, 1, 0, 2, 8, 6)])     # a model of one such layer
def test_step_recurrence_reads_and_writes_its_layer_of_the_stack(n, G, gi, H, dk, dv):
    rng = np.random.default_rng(n * 100 + G * 10 + gi)
    B = 2
    q, k, v, g, beta = gdn_inputs(rng, B, n, H, dk, dv)
    s0 = rng.standard_normal((B, G, H, dk, dv)).astype("float32")
    slots = np.tile(np.arange(n, dtype="int32"), (B, 1))
    kernel = kernels.gated_delta_rule(H, dk, dv, False, False, stack=(G, gi))
    o = np.full((B, n, H, dv), np.nan, "float32")
    before = rng.standard_normal((B, G, H, dk, dv)).astype("float32")   # the other layers' slices
    if gi > 0:      # in place: the stack after parents, then o
        *_, state, o = _call(kernel, [q, k, v, g, beta, s0, slots, slots, before.copy(), o])
    else:
        *_, o, state = _call(kernel, [q, k, v, g, beta, s0, slots, slots, o, np.full_like(before, np.nan)])
    t = torch.from_numpy
    for b in range(B):
        want_o, want_state, _ = recurrent_gated_delta_rule(t(q[b]), t(k[b]), t(v[b]), t(g[b]), t(beta[b]), t(s0[b, gi]))
        np.testing.assert_allclose(o[b], want_o.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state[b, gi], want_state.numpy(), rtol=1e-5, atol=1e-5)
    others = [layer for layer in range(G) if layer != gi]
    if gi > 0:
        np.testing.assert_array_equal(state[:, others], before[:, others])
    else:
        assert np.isnan(state[:, others]).all()


@pytest.mark.parametrize("tree,G,gi", [(True, 3, 0), (True, 3, 2), (False, 2, 1)])
def test_verify_recurrence_reads_its_layer_of_the_stack(tree, G, gi):
    """A verification's recurrence reads s0 out of all G layers' states, as the unstacked kernel reads
    that layer's alone (the other layers' NaN), and writes its records into slice g."""
    rng = np.random.default_rng(G * 10 + gi)
    B, n, H, dk, dv = 2, 7, 3, 8, 5
    q, k, v, g, beta = gdn_inputs(rng, B, n, H, dk, dv)
    s0 = rng.standard_normal((B, H, dk, dv)).astype("float32")
    states = np.full((B, G, H, dk, dv), np.nan, "float32")
    states[:, gi] = s0
    slots = np.tile(np.arange(n, dtype="int32"), (B, 1))
    slots[1, -2:] = -1
    parents = np.array([[-1, 0, 0, 1, 2, 2, 5], [-1, 0, 1, 2, 3, 4, 5]], "int32") if tree else slots
    W = kernels.record_width(dk, dv)
    out = [np.full((B, n, H, dv), np.nan, "float32"), np.full((B, n, G, H, W), np.nan, "float32"),
           np.zeros((B, n, H, dk, dv), "float32")]
    stacked = kernels.gated_delta_rule(H, dk, dv, True, False, tree=tree, stack=(G, gi))
    if gi > 0:      # in place: the records' stack after parents, then o and scratch
        *_, rec, o, _ = _call(stacked, [q, k, v, g, beta, states, slots, parents, out[1], out[0], out[2]])
    else:
        *_, o, rec, _ = _call(stacked, [q, k, v, g, beta, states, slots, parents, *out])
    alone = kernels.gated_delta_rule(H, dk, dv, True, False, tree=tree)
    *_, want_o, want_rec, _ = _call(alone, [q, k, v, g, beta, s0, slots, parents, out[0], out[1][:, :, 0], out[2]])
    np.testing.assert_array_equal(o, want_o)
    np.testing.assert_array_equal(rec[:, :, gi], want_rec)


@pytest.mark.parametrize("G,gi,C,K", [(3, 0, 7, 4), (3, 2, 300, 4), (2, 1, 5, 3)])
def test_step_conv_is_the_window_conv_into_the_stack(G, gi, C, K):
    rng = np.random.default_rng(C + gi)
    B, keep = 3, K - 1
    state = rng.standard_normal((B, C, keep)).astype("float32")
    x = rng.standard_normal((B, 1, C)).astype("float32")
    weight = rng.standard_normal((C, 1, K)).astype("float32")
    slots = np.array([[9], [-1], [4]], "int32")[:B]      # a step writes every row, whatever its slot
    kernel = kernels.gdn_conv_verify(C, K, "float32", False, stack=(G, gi), step=True)
    layers = np.full((B, G, C, keep), np.nan, "float32")     # the layers' states: only slice gi is read
    layers[:, gi] = state
    before = rng.standard_normal((B, 1, G, C, keep)).astype("float32")
    conv = np.full((B, 1, C), np.nan, "float32")
    if gi > 0:
        *_, states, conv = _call(kernel, [layers, x, weight, slots, slots, before.copy(), conv])
    else:
        *_, conv, states = _call(kernel, [layers, x, weight, slots, slots, conv, np.full_like(before, np.nan)])
    window = np.concatenate([state, x.transpose(0, 2, 1)], axis=2)          # (B, C, K)
    want = np.zeros((B, C), "float32")
    for tap in range(K):        # float32, in tap order, as the Relax conv sums
        want = want + window[:, :, tap] * weight[None, :, 0, tap]
    np.testing.assert_array_equal(conv[:, 0], want)
    np.testing.assert_array_equal(states[:, 0, gi], window[:, :, 1:])
    if gi > 0:
        others = [layer for layer in range(G) if layer != gi]
        np.testing.assert_array_equal(states[:, 0, others], before[:, 0, others])


@pytest.mark.parametrize("C,K,n,lengths", [(7, 4, 9, (9, 4, 1, 0)), (300, 4, 2, (2, 1, 0, 2)), (5, 3, 1, (1, 0, 1, 1)),
                                            (6, 2, 5, (3, 5, 5, 0))])
def test_prefill_conv_is_the_window_conv_with_each_sequences_last_state(C, K, n, lengths):
    """Sequences of ``lengths`` real tokens (the rest padding: slot -1; 0: padding only) continue
    their states: conv outputs as the Relax conv over [state; inputs] sums them (float32, tap
    order), and the K-1 inputs after each sequence's last real token (its state if it has none)."""
    rng = np.random.default_rng(C * 10 + K + n)
    B, keep = len(lengths), K - 1
    state = rng.standard_normal((B, C, keep)).astype("float32")
    x = rng.standard_normal((B, n, C)).astype("float32")
    weight = rng.standard_normal((C, 1, K)).astype("float32")
    slots = np.full((B, n), -1, "int32")
    for b, length in enumerate(lengths):
        slots[b, :length] = 5 + np.arange(length)
    conv = np.full((B, n, C), np.nan, "float32")
    new = np.full((B, C, keep), np.nan, "float32")
    *_, conv, new = _call(kernels.gdn_conv_prefill(C, K, "float32", False), [state, x, weight, slots, conv, new])
    window = np.concatenate([state, x.transpose(0, 2, 1)], axis=2)          # (B, C, K-1+T)
    for t in range(n):
        want = np.zeros((B, C), "float32")
        for tap in range(K):
            want = want + window[:, :, t + tap] * weight[None, :, 0, tap]
        np.testing.assert_array_equal(conv[:, t], want)
    for b, length in enumerate(lengths):
        np.testing.assert_array_equal(new[b], window[b, :, length:length + keep])


def test_path_recompute_leaves_a_steps_conv_a_chain():
    """A decode step's conv and verify's are one kernel but for ``step``: the pass rewrites the
    verify one only (tests/passes/test_gdn_path_recompute.py checks a whole lowered model)."""
    import tvm
    from specpilot.passes.base import PassContext
    from specpilot.passes.pipeline import parse
    step = kernels.gdn_conv_verify(12, 4, "float32", False, stack=(3, 1), step=True)
    verify = kernels.gdn_conv_verify(12, 4, "float32", False, stack=(3, 1))
    (recompute,) = parse("gdn-path-recompute")
    context = PassContext(hybrid=True)
    context.statistics[recompute.name] = {}      # as `passes.runner.run_pipeline` opens them
    after = recompute.apply(tvm.IRModule({"step": step, "verify": verify}), context)
    assert not bool(after["step"].attrs["gdn.tree"]) and bool(after["verify"].attrs["gdn.tree"])
    with pytest.raises(ValueError, match="follows no tree"):
        kernels.gdn_conv_verify(12, 4, "float32", False, tree=True, step=True)


def test_step_gpu_forms_compile_to_sm90_code_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot import kernels",
                       "{'first': kernels.gated_delta_rule(4, 16, 12, False, True, stack=(3, 0)), "
                       "'later': kernels.gated_delta_rule(4, 16, 12, False, True, stack=(3, 2)), "
                       "'conv': kernels.gdn_conv_verify(300, 4, 'bfloat16', True, stack=(3, 1), step=True)}")
    assert "first_kernel" in text and "later_kernel" in text and "conv_kernel" in text
