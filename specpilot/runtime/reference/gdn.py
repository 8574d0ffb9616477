"""The gated delta rule (Gated DeltaNet), two ways: per token, and chunked in WY form.

Per head, with a state S (dk x dv), decay g_t <= 0 (log space), write strength beta_t:

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - k_t^T S_t))^T      (delta rule: correct what k_t reads)
    o_t = S_t^T q_t

``recurrent_gated_delta_rule`` walks the tokens one at a time and can hand back the state
after every token (what rollback after speculative verification needs).
``chunked_gated_delta_rule`` processes chunks of C tokens at once: inside a chunk the delta
rule's corrections form a unit lower-triangular system (the WY / UT representation), solved
once per chunk, so the work is matrix products instead of a C-step loop.  Both return the
same outputs to float rounding; tests hold them to each other.

Inputs here are already per value head: q, k (T, H, dk) L2-normalized and q scaled by
dk**-0.5; v (T, H, dv); g, beta (T, H).  All float32.
"""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(q, k, v, g, beta, state, keep_states: bool = False):
    """Returns (o (T, H, dv), final state (H, dk, dv), per-token states (T, H, dk, dv) or None)."""
    T = q.shape[0]
    out = torch.empty_like(v)
    states = torch.empty((T, *state.shape), dtype=state.dtype, device=state.device) if keep_states else None
    S = state
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        read = torch.einsum("hk,hkv->hv", k[t], S)
        delta = (v[t] - read) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
        if keep_states:
            states[t] = S
    return out, S, states


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """Same result as the recurrent form; returns (o (T, H, dv), final state (H, dk, dv))."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk_size
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n, C = (T + pad) // chunk_size, chunk_size
    # (H, n, C, d): heads outermost so each chunk is a batch of small matrices
    q, k, v = (x.reshape(n, C, H, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, C, H).permute(2, 0, 1) for x in (g, beta))
    cum = g.cumsum(-1)                                        # log decay from chunk start
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + A) W = rhs with A strictly lower: the corrections each token makes to later ones
    strictly_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    U = torch.linalg.solve_triangular(eye + A, vb, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(eye + A, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay                # includes the diagonal
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    S = state
    out = torch.empty(H, n, C, dv, dtype=v.dtype, device=v.device)
    for c in range(n):
        v_new = U[:, c] - W[:, c] @ S                          # values minus what the state already holds
        out[:, c] = q_decayed[:, c] @ S + intra[:, c] @ v_new
        S = S * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
    out = out.permute(1, 2, 0, 3).reshape(n * C, H, dv)[:T]
    return out, S
