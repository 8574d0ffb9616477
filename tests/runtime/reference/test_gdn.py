"""Gated delta rule: the chunked WY form against the per-token recurrence (and transformers'
own torch reference), on random inputs with odd sizes; outputs poisoned before the run."""

from __future__ import annotations

import pytest
import torch

from specpilot.runtime.reference.gdn import chunked_gated_delta_rule, recurrent_gated_delta_rule


def _inputs(T, H, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2.0
    beta = torch.rand(T, H, generator=g)
    state = torch.randn(H, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T,H,dk,dv,chunk", [(1, 1, 4, 4, 64), (7, 3, 5, 6, 4), (37, 2, 8, 6, 16),
                                             (64, 4, 16, 8, 64), (130, 2, 12, 7, 64)],
                         ids=lambda v: str(v))
def test_chunked_matches_recurrent(T, H, dk, dv, chunk):
    q, k, v, g, beta, state = _inputs(T, H, dk, dv, seed=T)
    o_ref, s_ref, states = recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_states=True)
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    assert not o.isnan().any()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[-1], s_ref)


def test_recurrent_per_token_states_continue_exactly():
    """The state recorded after token t, fed the rest, gives the same outputs as one pass."""
    q, k, v, g, beta, state = _inputs(12, 2, 6, 5, seed=1)
    o_all, _, states = recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_states=True)
    o_tail, _, _ = recurrent_gated_delta_rule(q[5:], k[5:], v[5:], g[5:], beta[5:], states[4])
    assert torch.equal(o_tail, o_all[5:])


def test_matches_transformers_reference():
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    T, H, dk, dv = 45, 3, 8, 6
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(T, H, dk, generator=gen), torch.randn(T, H, dk, generator=gen), torch.randn(T, H, dv, generator=gen)
    g, beta = -torch.rand(T, H, generator=gen), torch.rand(T, H, generator=gen)
    want, want_state = qwen.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = torch.nn.functional.normalize(q, dim=-1, eps=0) * dk ** -0.5
    kn = torch.nn.functional.normalize(k, dim=-1, eps=0)
    got, state, _ = recurrent_gated_delta_rule(qn, kn, v, g, beta, torch.zeros(H, dk, dv))
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-4, atol=1e-5)
