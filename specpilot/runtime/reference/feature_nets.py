"""PyTorch networks of the drafters that read the target's hidden states (`core.feature_drafter`).

Both use the target's token embeddings; the block network also its head (the rows of its draft
vocabulary, where it has one: logits of other tokens are -inf).  Norms are plain
RMSNorm (Llama / Qwen3), attention is grouped-query with rotate-half rotary embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.core.feature_drafter import DraftNetConfig, sliced_head, vocab_ids
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
        self.identity_vocab = identity_vocab(cfg, self.w.get("d2t"))
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

    def new_cache(self, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: a keys and a values buffer (slots, kv heads, d) the passes write by slot."""
        cfg = self.cfg
        shape = (slots, cfg.num_kv_heads, cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]

    def _write_keys(self, p: str, x: torch.Tensor, positions: torch.Tensor, layer, slots: torch.Tensor) -> None:
        """The keys (rotated at ``positions``) and values of ``x`` into the layer's cache at ``slots``."""
        cfg = self.cfg
        k = self._proj(x, p + "self_attn.k_proj.weight").view(x.shape[0], cfg.num_kv_heads, cfg.head_dim)
        v = self._proj(x, p + "self_attn.v_proj.weight").view(x.shape[0], cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = plain_rms_norm(k, self.w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        K, V = layer
        K[slots], V[slots] = self._rope(k, positions), v

    def _attend(self, p: str, x: torch.Tensor, positions, layer, mask) -> torch.Tensor:
        """Queries of ``x`` at ``positions`` over the layer's cached slots 0 .. L-1; ``mask`` (T, L)
        True where a query may look."""
        cfg = self.cfg
        T, L = x.shape[0], mask.shape[1]
        q = self._proj(x, p + "self_attn.q_proj.weight").view(T, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = plain_rms_norm(q, self.w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
        q = self._rope(q, positions)
        group = cfg.num_heads // cfg.num_kv_heads
        k = layer[0][:L].transpose(0, 1).repeat_interleave(group, dim=0)       # (H, L, d)
        v = layer[1][:L].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * cfg.head_dim ** -0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out = (torch.softmax(scores.float(), dim=-1).to(x.dtype) @ v).transpose(0, 1).reshape(T, -1)
        return self._proj(out, p + "self_attn.o_proj.weight")

    def _mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        x = plain_rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps)
        gate = F.silu(self._proj(x, p + "mlp.gate_proj.weight"))
        return self._proj(gate * self._proj(x, p + "mlp.up_proj.weight"), p + "mlp.down_proj.weight")

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (T, layers * target hidden) -> (T, hidden)."""
        return self._proj(features.to(device=self.device, dtype=self.dtype), "fc.weight")


class BlockNet(_Net):
    """DFlash: the context's target features enter every layer as extra keys/values before the block;
    the block's positions see all of them and each other (no causal mask)."""

    def context(self, cache, features: torch.Tensor, start: int) -> None:
        """Every layer's keys and values of context tokens start, start+1, .. with these features,
        written into ``cache`` at their positions."""
        h = plain_rms_norm(self.fuse(features), self.w["hidden_norm.weight"], self.cfg.rms_norm_eps)
        positions = torch.arange(start, start + features.shape[0], device=self.device)
        for i, layer in enumerate(cache):
            self._write_keys(f"layers.{i}.", h, positions, layer, positions)

    def block(self, cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logits (block, vocab) of a block (the last token, then mask tokens) at positions ``start`` ..,
        after the context cached at 0 .. start-1 (the block's own keys go to the slots after it)."""
        cfg = self.cfg
        positions = torch.arange(start, start + tokens.shape[0], device=self.device)
        mask = torch.ones(tokens.shape[0], start + tokens.shape[0], dtype=torch.bool, device=self.device)
        h = F.embedding(tokens.to(self.device), self.embed)
        for i, layer in enumerate(cache):
            p = f"layers.{i}."
            x = plain_rms_norm(h, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            self._write_keys(p, x, positions, layer, positions)
            h = h + self._attend(p, x, positions, layer, mask)
            h = h + self._mlp(p, h)
        logits = F.linear(plain_rms_norm(h, self.w["norm.weight"], cfg.rms_norm_eps), self.head).float()
        return scatter_draft_vocab(logits, self.w.get("d2t"), cfg.vocab_size, self.identity_vocab)


class FeatureNet(_Net):
    """EAGLE-3: one layer over [norm(embedding of the next token); norm(feature)], the feature being
    the fused target feature for context positions and the layer's own pre-norm output for drafts."""

    p = "midlayer."

    def step(self, cache, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, mask: torch.Tensor):
        """Pairs (hidden (T, H), next token (T,)) at ``positions``: their keys and values go into
        ``cache`` at ``slots``, then each attends to the cached slots 0 .. L-1 under ``mask`` (T, L).
        Returns (output hidden (T, H), logits over the target vocabulary (T, vocab))."""
        cfg, p = self.cfg, self.p
        e = plain_rms_norm(F.embedding(tokens.to(self.device), self.embed), self.w[p + "input_layernorm.weight"],
                           cfg.rms_norm_eps)
        x = torch.cat([e, plain_rms_norm(hidden, self.w[p + "hidden_norm.weight"], cfg.rms_norm_eps)], dim=-1)
        positions, slots = positions.to(self.device), slots.to(self.device)
        self._write_keys(p, x, positions, cache[0], slots)
        h = hidden + self._attend(p, x, positions, cache[0], mask.to(self.device))
        h = h + self._mlp(p, h)
        return h, self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over the draft vocabulary, scattered into the target's (other tokens -inf)."""
        draft = F.linear(plain_rms_norm(h, self.w["norm.weight"], self.cfg.rms_norm_eps), self.w["lm_head.weight"]).float()
        return scatter_draft_vocab(draft, self.w["d2t"], self.cfg.vocab_size, self.identity_vocab)


def identity_vocab(cfg: DraftNetConfig, d2t: torch.Tensor | None) -> bool:
    """Whether a drafter's head covers the target's vocabulary in its order (no d2t to apply)."""
    if cfg.kind == "block":
        return not sliced_head(cfg)
    return cfg.draft_vocab_size == cfg.vocab_size and not bool(d2t.any())


def scatter_draft_vocab(draft: torch.Tensor, d2t: torch.Tensor, vocab_size: int, identity: bool) -> torch.Tensor:
    """Logits over a draft vocabulary (T, draft vocab) as logits over the target's: draft id i is
    target id i + d2t[i]; other tokens -inf."""
    if identity:
        return draft
    ids = vocab_ids(d2t).to(draft.device)
    out = torch.full((draft.shape[0], vocab_size), float("-inf"), device=draft.device)
    out[:, ids] = draft
    return out


def build_net(cfg: DraftNetConfig, tensors: dict[str, torch.Tensor], target_weights: dict[str, torch.Tensor],
              dtype: torch.dtype, device) -> BlockNet | FeatureNet:
    """The network of ``cfg`` with the target's embeddings (and, for a block drafter, its head: the
    rows of its draft vocabulary where it has one)."""
    embed = target_weights["model.embed_tokens.weight"]
    head = target_weights.get("lm_head.weight", embed)
    if cfg.kind == "block":
        if sliced_head(cfg):
            head = head[vocab_ids(tensors["d2t"]).to(head.device)]
        return BlockNet(cfg, tensors, embed, head, dtype, device)
    return FeatureNet(cfg, tensors, embed, None, dtype, device)
