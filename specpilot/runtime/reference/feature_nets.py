"""PyTorch networks of the drafters that read the target's hidden states (`core.feature_drafter`).

Both use the target's token embeddings; the block network also its head.  Norms are plain
RMSNorm (Llama / Qwen3), attention is grouped-query with rotate-half rotary embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.core.feature_drafter import DraftNetConfig
from specpilot.runtime.reference.model import rotate_half


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama / Qwen3 compute it: the statistics in float32, the scale in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _Net:
    def __init__(self, cfg: DraftNetConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 head: torch.Tensor | None, dtype: torch.dtype, device):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=dtype if v.is_floating_point() else v.dtype)
                  for k, v in weights.items()}
        self.embed = embed.to(device=self.device, dtype=dtype)
        self.head = head.to(device=self.device, dtype=dtype) if head is not None else None
        self.identity_vocab = cfg.kind != "feature" or (cfg.draft_vocab_size == cfg.vocab_size
                                                          and not bool(self.w["d2t"].any()))
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float, device=self.device) / d))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (T, heads, d) rotated at ``positions`` (T,)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        return x * cos + rotate_half(x) * sin

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name])

    def _keys(self, p: str, x: torch.Tensor, positions: torch.Tensor):
        cfg = self.cfg
        k = self._proj(x, p + "self_attn.k_proj.weight").view(x.shape[0], cfg.num_kv_heads, cfg.head_dim)
        v = self._proj(x, p + "self_attn.v_proj.weight").view(x.shape[0], cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = plain_rms_norm(k, self.w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        return self._rope(k, positions), v

    def _attend(self, p: str, x: torch.Tensor, positions, keys, values, mask) -> torch.Tensor:
        """Queries of ``x`` at ``positions`` over ``keys``/``values`` (S, kv heads, d); ``mask`` (T, S)
        True where a query may look (None: everywhere)."""
        cfg = self.cfg
        T = x.shape[0]
        q = self._proj(x, p + "self_attn.q_proj.weight").view(T, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = plain_rms_norm(q, self.w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
        q = self._rope(q, positions)
        group = cfg.num_heads // cfg.num_kv_heads
        k = keys.transpose(0, 1).repeat_interleave(group, dim=0)       # (H, S, d)
        v = values.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * cfg.head_dim ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask[None], float("-inf"))
        out = (torch.softmax(scores.float(), dim=-1).to(x.dtype) @ v).transpose(0, 1).reshape(T, -1)
        return self._proj(out, p + "self_attn.o_proj.weight")

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        x = plain_rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps)
        gate = F.silu(self._proj(x, p + "mlp.gate_proj.weight"))
        return self._proj(gate * self._proj(x, p + "mlp.up_proj.weight"), p + "mlp.down_proj.weight")

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (T, layers * target hidden) -> (T, hidden)."""
        return self._proj(features.to(self.dtype), "fc.weight")


class BlockNet(_Net):
    """DFlash: the context's target features enter every layer as extra keys/values before the block;
    the block's positions see all of them and each other (no causal mask)."""

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: keys and values (T, kv heads, d) of context tokens with these features."""
        h = plain_rms_norm(self.fuse(features), self.w["hidden_norm.weight"], self.cfg.rms_norm_eps)
        return [self._keys(f"layers.{i}.", h, positions) for i in range(self.cfg.num_layers)]

    def block(self, tokens: torch.Tensor, start: int, context: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits (block, vocab) of a block (the last token, then mask tokens) at positions ``start`` ..,
        after the context whose per-layer keys/values are ``context``."""
        cfg = self.cfg
        positions = torch.arange(start, start + tokens.shape[0], device=self.device)
        h = F.embedding(tokens.to(self.device), self.embed)
        for i, (ck, cv) in enumerate(context):
            p = f"layers.{i}."
            x = plain_rms_norm(h, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            k, v = self._keys(p, x, positions)
            h = h + self._attend(p, x, positions, torch.cat([ck, k]), torch.cat([cv, v]), None)
            h = h + self._mlp(p, h)
        return F.linear(plain_rms_norm(h, self.w["norm.weight"], cfg.rms_norm_eps), self.head).float()


class FeatureNet(_Net):
    """EAGLE-3: one layer over [norm(embedding of the next token); norm(feature)], the feature being
    the fused target feature for context positions and the layer's own pre-norm output for drafts."""

    p = "midlayer."

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor, mask: torch.Tensor):
        """Pairs (hidden (T, H), next token (T,)) at ``positions``, attending to the cached ``keys``/
        ``values`` (S, kv heads, d) and to each other under ``mask`` (T, S + T).  Returns (output
        hidden (T, H), logits over the target vocabulary (T, vocab), the new keys, values)."""
        cfg, p = self.cfg, self.p
        e = plain_rms_norm(F.embedding(tokens.to(self.device), self.embed), self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        x = torch.cat([e, plain_rms_norm(hidden, self.w[p + "hidden_norm.weight"], cfg.rms_norm_eps)], dim=-1)
        k, v = self._keys(p, x, positions)
        h = hidden + self._attend(p, x, positions, torch.cat([keys, k]), torch.cat([values, v]), mask)
        h = h + self._mlp(p, h)
        return h, self.logits(h), k, v

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over the draft vocabulary, scattered into the target's (other tokens -inf)."""
        draft = F.linear(plain_rms_norm(h, self.w["norm.weight"], self.cfg.rms_norm_eps), self.w["lm_head.weight"]).float()
        if self.identity_vocab:
            return draft
        ids = torch.arange(self.cfg.draft_vocab_size, device=self.device) + self.w["d2t"].long()
        out = torch.full((h.shape[0], self.cfg.vocab_size), float("-inf"), device=self.device)
        out[:, ids] = draft
        return out


def build_net(cfg: DraftNetConfig, tensors: dict[str, torch.Tensor], target_weights: dict[str, torch.Tensor],
              dtype: torch.dtype, device) -> BlockNet | FeatureNet:
    """The network of ``cfg`` with the target's embeddings (and, for a block drafter, its head)."""
    embed = target_weights["model.embed_tokens.weight"]
    head = target_weights.get("lm_head.weight", embed)
    if cfg.kind == "block":
        return BlockNet(cfg, tensors, embed, head, dtype, device)
    return FeatureNet(cfg, tensors, embed, None, dtype, device)
