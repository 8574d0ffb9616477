"""The stock reference: a readable PyTorch decoder for the five supported families.

Weights are a flat dict keyed by Hugging Face parameter names, so a checkpoint loads
without renaming and parity with transformers is a direct comparison.  One sequence at a
time; ``forward`` appends tokens to a `ModelState` and returns float32 logits.

Positions and the attention mask are inputs (defaulting to a causal chain) because tree
verification feeds depth positions and an ancestor-only mask through the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.core.config import ModelConfig
from specpilot.core.errors import SpecPilotError
from specpilot.runtime.features import FeatureStore
from specpilot.runtime.reference.gdn import chunked_gated_delta_rule, recurrent_gated_delta_rule
from specpilot.runtime.reference.state import KVCache, ModelState, RecurrentState


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:  # Qwen3-Next / Qwen3.5: (x * (1 + w)) then cast
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)  # Llama / Qwen2 / Qwen3: cast, then scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    weight, bias = w[name + ".weight"], w.get(name + ".bias")
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    y = weight.linear(x)    # a W12 matrix (weight_format="w12")
    return y + bias if bias is not None else y


class ConvertOnUse(dict):
    """Weights by name, each converted to ``dtype`` when read (`ReferenceModel`'s ``stored`` format)."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__(weights)
        self.dtype = dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return super().__getitem__(name).to(self.dtype)

    def get(self, name: str, default=None):
        return self[name] if name in self else default


class ReferenceModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", weight_format: str = "dense",
                 feature_layers: tuple[int, ...] | None = None):
        """weight_format: ``dense`` (weights in ``dtype``), ``stored`` (weights kept in the dtype they
        come in, converted to ``dtype`` at each use: a float32 reference of a bf16 model whose float32
        copy would not fit; the same values, so the same results) or ``w12``: the decoder layers' linear
        weights held in the W12 layout and multiplied by the Triton W12 kernel on GPUs
        (`runtime.reference.w12_triton`); they must be bf16 values (random models: ``round_to: bfloat16``)."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.feature_layers = tuple(feature_layers) if feature_layers else None   # outputs a state keeps (`runtime.features`)
        if weight_format not in ("dense", "stored", "w12"):
            raise SpecPilotError(f"unknown weight format {weight_format!r}; expected dense, stored or w12")
        if weight_format == "stored":
            self.w = ConvertOnUse({name: t.to(device=self.device) for name, t in weights.items()}, dtype)
        else:
            self.w = {name: t.to(device=self.device, dtype=dtype) for name, t in weights.items()}
        if weight_format == "w12":
            from specpilot.core.w12 import to_bf16
            from specpilot.runtime.reference.w12_triton import W12Matrix
            for name, t in weights.items():
                if name.startswith("model.layers.") and t.dim() == 2:
                    bf, exact = to_bf16(t)
                    if not exact:
                        raise SpecPilotError(f"{name}: not bf16-representable; the W12 layout holds bf16 weights")
                    self.w[name] = W12Matrix(bf, self.device)
        if cfg.tie_word_embeddings:
            dict.__setitem__(self.w, "lm_head.weight", dict.__getitem__(self.w, "model.embed_tokens.weight"))
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.inv_freq = (1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))).to(self.device)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_state(self, capacity: int) -> ModelState:
        state = ModelState(self.cfg, capacity, self.dtype, self.device)
        if self.feature_layers:
            state.features = FeatureStore(capacity, len(self.feature_layers) * self.cfg.hidden_size, self.dtype,
                                          self.device)
        return state

    def accept_path(self, state: ModelState, base: int, rows: list[int]) -> None:
        """After a tree verification starting at ``base``: keep the new tokens ``rows`` (a root
        path, ascending) at base, base+1, ...; drop the rest."""
        state.accept_path(base, rows)
        if state.features is not None:
            state.features.accept(base, rows)

    def settle(self, states) -> None:
        """The compiled engine's batched commit of kept paths (`CompiledModel.settle`): the
        reference's states are current already."""

    def forward_batch(self, items, record: bool = False) -> list[torch.Tensor]:
        """`forward` for several sequences, one after the other (the compiled engine's batched
        interface; the reference keeps one sequence per call)."""
        out = []
        for tokens, state, *rest in items:
            positions, attn_mask, parents = (list(rest) + [None] * 3)[:3]
            out.append(self.forward(tokens, state, positions, attn_mask, record=record, parents=parents))
        return out

    # -- one step ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens, state: ModelState, positions=None, attn_mask=None, record: bool = False,
                parents=None):
        """Run ``tokens`` (T,) after the ``state.length`` tokens already in ``state``.

        positions: (T,) rotary positions, default state.length + arange(T).
        attn_mask: (T, state.length + T) bool, True where a query may attend; default causal.
        record: keep each Gated DeltaNet layer's state after every token, for ``state.truncate``.
        parents: (T,) for tree verification: token t's parent among the new tokens (-1: the last
            token before the pass); Gated DeltaNet layers then follow each token's root path, and
            `accept_path` keeps one of them.
        Returns float32 logits (T, vocab) and advances ``state.length`` by T.
        """
        cfg, w = self.cfg, self.w
        dev = self.device
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=dev)
        T, start = tokens.shape[0], state.length
        state.check_room(T)
        positions = torch.arange(start, start + T, device=dev) if positions is None else \
            torch.as_tensor(positions, device=dev)
        attn_mask = torch.ones(T, start + T, dtype=torch.bool, device=dev).tril(start) if attn_mask is None else \
            torch.as_tensor(attn_mask, device=dev)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

        h = F.embedding(tokens, w["model.embed_tokens.weight"])
        kept = []
        for i, layer_state in enumerate(state.layers):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
            if isinstance(layer_state, KVCache):
                x = self._attention(x, p + "self_attn.", layer_state, start, cos, sin, attn_mask)
            else:
                x = self._gated_delta_net(x, p + "linear_attn.", layer_state, start, record, parents)
            h = h + x
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
            gate = F.silu(linear(x, w, p + "mlp.gate_proj"))
            h = h + linear(gate * linear(x, w, p + "mlp.up_proj"), w, p + "mlp.down_proj")
            if self.feature_layers and state.features is not None and i in self.feature_layers:
                kept.append((self.feature_layers.index(i), h))
        if kept:
            state.features.write(start, torch.cat([t for _, t in sorted(kept, key=lambda x: x[0])], dim=-1))
        h = rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        state.length = start + T
        return F.linear(h, w["lm_head.weight"]).float()

    # -- layers --------------------------------------------------------------------------
    def _attention(self, x, p, cache: KVCache, start, cos, sin, attn_mask):
        cfg, w = self.cfg, self.w
        T, d, rot = x.shape[0], cfg.head_dim, cfg.rotary_dim
        q = linear(x, w, p + "q_proj")
        gate = None
        if cfg.attn_output_gate:  # per head: [query | gate]
            q, gate = q.view(T, cfg.num_attention_heads, 2 * d).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)
        q = q.reshape(T, cfg.num_attention_heads, d)
        k = linear(x, w, p + "k_proj").view(T, cfg.num_key_value_heads, d)
        v = linear(x, w, p + "v_proj").view(T, cfg.num_key_value_heads, d)
        if cfg.qk_norm:
            q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
            k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        c, s = cos[:, None, :], sin[:, None, :]
        q = torch.cat((q[..., :rot] * c + rotate_half(q[..., :rot]) * s, q[..., rot:]), dim=-1)
        k = torch.cat((k[..., :rot] * c + rotate_half(k[..., :rot]) * s, k[..., rot:]), dim=-1)
        cache.write(start, k.transpose(0, 1), v.transpose(0, 1))
        L = start + T
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = cache.k[:, :L].repeat_interleave(group, dim=0)        # (H, L, d)
        values = cache.v[:, :L].repeat_interleave(group, dim=0)
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) * d ** -0.5  # (H, T, L)
        scores = scores.masked_fill(~attn_mask[None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = (probs @ values).transpose(0, 1).reshape(T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, w, p + "o_proj")

    def _gdn_projections(self, x, p):
        """(mixed_qkv (T, conv_dim), z (T, Hv, dv), b (T, Hv), a (T, Hv)) for either layout."""
        cfg, w = self.cfg, self.w
        T, nk, nv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
        if cfg.architecture == "Qwen3NextForCausalLM":
            # one projection, grouped per key head: [q | k | v (r heads) | z (r heads)]
            qkvz = linear(x, w, p + "in_proj_qkvz").view(T, nk, 2 * dk + 2 * r * dv)
            q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
            ba = linear(x, w, p + "in_proj_ba").view(T, nk, 2 * r)
            b, a = torch.split(ba, [r, r], dim=-1)
            mixed = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
            return mixed, z.reshape(T, nv, dv), b.reshape(T, nv), a.reshape(T, nv)
        mixed = linear(x, w, p + "in_proj_qkv")
        z = linear(x, w, p + "in_proj_z").view(T, nv, dv)
        return mixed, z, linear(x, w, p + "in_proj_b"), linear(x, w, p + "in_proj_a")

    def _gdn_qkv(self, mixed, b, a, p):
        cfg, w = self.cfg, self.w
        T, nk, nv = mixed.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], dim=-1)
        q, k = q.reshape(T, nk, dk).float(), k.reshape(T, nk, dk).float()
        v = v.reshape(T, nv, dv).float()
        if nv != nk:
            q, k = q.repeat_interleave(nv // nk, dim=1), k.repeat_interleave(nv // nk, dim=1)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(b.float())
        g = -w[p + "A_log"].float().exp() * F.softplus(a.float() + w[p + "dt_bias"].float())
        return q, k, v, g, beta

    def _gdn_out(self, out, z, x, p):
        """Gated RMSNorm per value head, norm(o) * w * silu(z), then the output projection."""
        cfg, w = self.cfg, self.w
        o = rms_norm(out.to(x.dtype), w[p + "norm.weight"], cfg.rms_norm_eps, zero_centered=False)
        o = (o.float() * F.silu(z.float())).to(x.dtype)
        return linear(o.reshape(x.shape[0], -1), w, p + "out_proj")

    def _gated_delta_net_tree(self, x, p, st: RecurrentState, mixed, z, b, a, parents):
        """Tree verification: every token continues its parent's conv window and recurrent
        state (parent -1: the state before the pass), walking each root path as a chain would.
        The state after every token is kept in ``st.tree_rows`` for `ModelState.accept_path`."""
        inputs = mixed.transpose(0, 1).to(st.conv.dtype)                              # (C, T)
        weight = self.w[p + "conv1d.weight"]
        windows, conv = [], []
        for t, parent in enumerate(parents):
            before = st.conv if parent < 0 else windows[parent]
            window = torch.cat((before, inputs[:, t:t + 1]), dim=-1)                  # (C, K)
            conv.append(F.conv1d(window[None], weight, groups=window.shape[0])[0])    # (C, 1)
            windows.append(window[:, 1:].clone())
        mixed = F.silu(torch.cat(conv, dim=-1)).transpose(0, 1)
        q, k, v, g, beta = self._gdn_qkv(mixed, b, a, p)
        out = torch.empty_like(v)
        states = []
        for t, parent in enumerate(parents):
            before = st.recurrent if parent < 0 else states[parent]
            o, after, _ = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                     before)
            out[t] = o[0]
            states.append(after)
        st.tree_rows = list(zip(windows, states))
        return self._gdn_out(out, z, x, p)

    def _gated_delta_net(self, x, p, st: RecurrentState, start, record, parents=None):
        T, K = x.shape[0], self.cfg.linear_conv_kernel_dim
        mixed, z, b, a = self._gdn_projections(x, p)
        if parents is not None:
            return self._gated_delta_net_tree(x, p, st, mixed, z, b, a, parents)
        # causal depthwise conv over [previous K-1 inputs | new inputs], then SiLU
        window = torch.cat((st.conv, mixed.transpose(0, 1).to(st.conv.dtype)), dim=-1)  # (C, K-1+T)
        conv = F.conv1d(window[None], self.w[p + "conv1d.weight"], groups=window.shape[0])[0]
        q, k, v, g, beta = self._gdn_qkv(F.silu(conv).transpose(0, 1), b, a, p)
        if record:
            st.history.setdefault(start, (st.conv.clone(), st.recurrent.clone()))
        if record or T == 1:
            out, st.recurrent, states = recurrent_gated_delta_rule(q, k, v, g, beta, st.recurrent, keep_states=record)
        else:
            out, st.recurrent = chunked_gated_delta_rule(q, k, v, g, beta, st.recurrent)
        if record:
            for t in range(T):
                st.history[start + t + 1] = (window[:, t + 1:t + K].clone(), states[t])
        st.conv = window[:, -(K - 1):].clone() if K > 1 else window[:, :0].clone()
        return self._gdn_out(out, z, x, p)
