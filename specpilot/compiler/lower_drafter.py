"""The drafters that read the target's hidden states, lowered to Relax beside the target
(`core.feature_drafter`; the PyTorch reference is `runtime.reference.feature_nets`, line for line).

Each runs over a key/value cache ``dkv[layers, 2, rows, kv heads, slots, d]`` (`cache_slots`), a
row a sequence, written in place like the target's pool; ``rows`` says which row each sequence of a
call owns and ``mask[B, T, L]`` which of the slots 0 .. L-1 a new position may attend to.  A feature
drafter's cache holds one row; a block drafter's pool holds deployment.max_batch, so that one call
drafts the blocks of a whole batch.  Functions (prefix ``drafter_``), one sequence each unless said:

    block (DFlash):
      context(features[1, T, F], positions, slots, rows, dkv) -> dkv   the context's keys/values
      block(tokens[1, K], positions, slots, mask, rows, dkv)   -> logits[1, K, head rows] (K: the block size, static)
      cycle(features[1, K, F], context_positions, context_slots, tokens[1, K], positions, slots, mask, rows, dkv)
                                                               -> ranked[1, K, top_k, 2]   context, then block,
                                                                  each position's top_k (`kernels.rank_rows`)
      cycle_batch(the same, B sequences: features[B, K, F], ..., mask[B, K, L], rows[B])
                                                               -> ranked[B, K, top_k, 2]   (pools of more than one row)
    feature (EAGLE-3):
      fuse(features[1, T, F])                                     -> hidden[1, T, H]
      step(hidden[1, T, H], tokens, positions, slots, mask, rows, dkv)
                                                                  -> (hidden out[1, T, H], logits[1, T, draft vocab])

Parameters are ``drafter.<published name>``; the token embeddings (and the block drafter's head)
are the target's own.  A block drafter with a draft vocabulary has ``drafter.lm_head.weight``, the
target head's rows of its tokens (`core.feature_drafter.packing_view`): its logits and ranks are
draft ids, mapped to the target's where they are read.
"""

from __future__ import annotations

from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.core import wrap_nested

from specpilot import kernels
from specpilot.compiler.layers import MLP, Attention, DecoderLayer, Linear, RMSNorm, StepInputs, Weight, matmul
from specpilot.core.feature_drafter import DraftNetConfig, cache_shape, cache_slots, layer_config, sliced_head
from specpilot.kernels.norms import attention_heads_te, rotary_te


class _DraftNet(nn.Module):
    def __init__(self, cfg: DraftNetConfig, dtype: str, gpu: bool, capacity: int, embed: nn.Parameter,
                 n_rows: int = 1):
        self.cfg, self.dtype, self.gpu, self.n_rows = cfg, dtype, gpu, n_rows
        self.layer_cfg = layer_config(cfg)
        self.slots = cache_slots(cfg, capacity)
        self.fc = Linear(len(cfg.target_layers) * cfg.target_hidden, cfg.hidden_size, False, dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False, dtype, gpu)
        self.rope_inv_freq = nn.Parameter((cfg.head_dim // 2,), "float32")
        self.embed = embed          # the target's token embeddings (its parameter: stored once)

    def inputs(self, positions: Tensor, slots: Tensor, mask: Tensor | None, rows: Tensor) -> StepInputs:
        B, T = positions.shape
        rotary = op.tensor_expr_op(rotary_te(self.dtype), "rotary", [positions, self.rope_inv_freq])
        return StepInputs(B, T, slots, mask, rows, rotary, few_rows=True)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        B, T = tokens.shape
        return wrap_nested(rx.op.take(self.embed._expr, op.reshape(tokens, (B * T,))._expr, axis=0, mode="clip"),
                           "embed")

    def attention(self, n_layers: int, in_features: int | None = None) -> Attention:
        return Attention(self.layer_cfg, self.dtype, self.gpu, self.slots, self.n_rows, n_layers, pool_rows=None,
                         in_features=in_features)

    def fuse(self, features: Tensor) -> Tensor:
        B, T, F = features.shape
        return self.fc(op.reshape(features, (B * T, F)))


def write_keys(attn: Attention, x: Tensor, s: StepInputs, dkv: Tensor, layer: int) -> Tensor:
    """The keys (normed, rotated) and values of ``x`` (B*T, in) into the cache at ``s.slots``,
    without queries: the heads kernel takes the keys in the queries' place."""
    cfg = attn.cfg
    B, T, nkv, d = s.batch, s.tokens, cfg.num_key_value_heads, cfg.head_dim
    k = op.reshape(attn.k_proj(x), (B, T, nkv, d))
    v = op.reshape(attn.v_proj(x), (B, T, nkv, d))
    norm = [attn.k_norm.weight, attn.k_norm.weight] if cfg.qk_norm else []
    heads = op.tensor_expr_op(
        attention_heads_te(attn.dtype, cfg.rotary_dim, nkv, nkv, cfg.rms_norm_eps if cfg.qk_norm else None,
                           False, not attn.gpu),
        "attention_heads", [k, k, v, *norm, *s.cos_sin()], attrs={"op_pattern": 2})
    kernel = kernels.kv_write(attn.n_attn, layer, attn.n_rows, nkv, attn.capacity, d, attn.dtype, attn.gpu,
                              heads_at=(nkv, 2 * nkv))
    return op.tensor_ir_inplace_op(kernel, f"kv_write_{layer}", [dkv, heads, s.slots, s.rows], [0],
                                   Tensor.placeholder(dkv.shape, attn.dtype))


class BlockDraftNet(_DraftNet):
    """DFlash: the context's fused features give every layer extra keys/values; a block's positions
    attend to them and to each other."""

    def __init__(self, cfg: DraftNetConfig, dtype: str, gpu: bool, capacity: int, embed: nn.Parameter,
                 head: nn.Parameter, ranks: int, n_rows: int = 1):
        super().__init__(cfg, dtype, gpu, capacity, embed, n_rows)
        self.head_rows = cfg.draft_vocab_size if sliced_head(cfg) else cfg.vocab_size
        self.ranks = min(ranks, self.head_rows)      # the proposals a cycle ranks a position (the spec's top_k)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False, dtype, gpu)
        self.layers = nn.ModuleList([DecoderLayer(self.layer_cfg, "full_attention", dtype, gpu, self.slots, n_rows,
                                                  cfg.num_layers) for _ in range(cfg.num_layers)])
        # the target's head (its parameter: stored once), or its rows of the draft vocabulary
        self.lm_head = Weight((cfg.draft_vocab_size, cfg.hidden_size), dtype) if sliced_head(cfg) else None
        self.head = head if self.lm_head is None else None

    def context(self, features, positions, slots, rows, dkv):
        h = self.hidden_norm(self.fuse(features))
        s = self.inputs(positions, slots, None, rows)
        for i, layer in enumerate(self.layers):
            dkv = write_keys(layer.self_attn, h, s, dkv, i)
        return dkv

    def block(self, tokens, positions, slots, mask, rows, dkv):
        B, K = tokens.shape
        s = self.inputs(positions, slots, mask, rows)
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x, dkv = layer.self_attn(layer.input_layernorm(h), s, dkv, i)
            h = h + x
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        head = self.head if self.lm_head is None else self.lm_head.weight
        logits = op.astype(matmul(self.norm(h), op.permute_dims(head)), "float32")
        return op.reshape(logits, (B, K, self.head_rows))

    def cycle(self, features, context_positions, context_slots, tokens, positions, slots, mask, rows, dkv):
        """A drafting cycle in one call: the newly committed tokens' keys/values (at most a block's,
        padded with slot -1: written nowhere), then the block, ranked where it ran (one small read-back
        instead of the logits and a dozen host-side ranking launches)."""
        dkv = self.context(features, context_positions, context_slots, rows, dkv)
        B, K = tokens.shape
        logits = op.reshape(self.block(tokens, positions, slots, mask, rows, dkv), (B * K, self.head_rows))
        ranked = op.tensor_ir_op(kernels.rank_rows(self.head_rows, self.ranks, self.gpu), "rank_rows", [logits],
                                 Tensor.placeholder((B * K, self.ranks, 2), "float32"))
        return op.reshape(ranked, (B, K, self.ranks, 2))


class _MidLayer(nn.Module):
    """EAGLE-3's layer: attention over [norm(embedding); norm(hidden)] (2 H inputs), the residual
    stream being the hidden state."""

    def __init__(self, net: _DraftNet):
        cfg = net.cfg
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, False, net.dtype, net.gpu)
        self.hidden_norm = RMSNorm(H, eps, False, net.dtype, net.gpu)
        self.post_attention_layernorm = RMSNorm(H, eps, False, net.dtype, net.gpu)
        self.self_attn = net.attention(1, in_features=2 * H)
        self.mlp = MLP(net.layer_cfg, net.dtype)


class FeatureDraftNet(_DraftNet):
    def __init__(self, cfg: DraftNetConfig, dtype: str, gpu: bool, capacity: int, embed: nn.Parameter):
        super().__init__(cfg, dtype, gpu, capacity, embed)
        self.midlayer = _MidLayer(self)
        self.lm_head = Weight((cfg.draft_vocab_size, cfg.hidden_size), dtype)

    def fuse_features(self, features):
        B, T, _ = features.shape
        return op.reshape(self.fuse(features), (B, T, self.cfg.hidden_size))

    def step(self, hidden, tokens, positions, slots, mask, rows, dkv):
        B, T, H = hidden.shape
        m = self.midlayer
        flat = op.reshape(hidden, (B * T, H))
        x = op.concat([m.input_layernorm(self.embed_tokens(tokens)), m.hidden_norm(flat)], dim=-1)
        out, dkv = m.self_attn(x, self.inputs(positions, slots, mask, rows), dkv, 0)
        h = flat + out
        h = h + m.mlp(m.post_attention_layernorm(h))
        logits = op.astype(matmul(self.norm(h), op.permute_dims(self.lm_head.weight)), "float32")
        return op.reshape(h, (B, T, H)), op.reshape(logits, (B, T, self.cfg.draft_vocab_size))


def draft_net(cfg: DraftNetConfig, dtype: str, gpu: bool, capacity: int, embed: nn.Parameter,
              head: nn.Parameter, ranks: int, n_rows: int = 1) -> _DraftNet:
    """``ranks``: a block drafter's proposals a position, ranked in its cycle; ``n_rows``: the
    sequences its cache pool holds (a feature drafter's holds one)."""
    if cfg.kind == "block":
        return BlockDraftNet(cfg, dtype, gpu, capacity, embed, head, ranks, n_rows)
    return FeatureDraftNet(cfg, dtype, gpu, capacity, embed)


def draft_specs(cfg: DraftNetConfig, dtype: str, capacity: int, n_rows: int = 1) -> dict[str, dict]:
    """The exported drafter functions' argument specs, by function name (``n_rows``: a block
    drafter's pool rows; with more than one, ``drafter_cycle_batch`` too)."""
    F, H = len(cfg.target_layers) * cfg.target_hidden, cfg.hidden_size
    rows = n_rows if cfg.kind == "block" else 1
    dkv = nn.spec.Tensor(list(cache_shape(cfg, capacity, rows)), dtype)
    mode = {"$": {"param_mode": "packed", "effect_mode": "none"}}

    def where(n, b=1):
        return {"positions": nn.spec.Tensor([b, n], "int32"), "slots": nn.spec.Tensor([b, n], "int32")}

    def attend(n, b=1):
        return {**where(n, b), "mask": nn.spec.Tensor([b, n, "kv_len"], "bool"), "rows": nn.spec.Tensor([b], "int32"),
                "dkv": dkv, **mode}

    def cycle(b=1):
        K = cfg.block_size
        return {"features": nn.spec.Tensor([b, K, F], dtype), "context_positions": nn.spec.Tensor([b, K], "int32"),
                "context_slots": nn.spec.Tensor([b, K], "int32"), "tokens": nn.spec.Tensor([b, K], "int32"),
                **attend(K, b)}
    if cfg.kind == "block":
        specs = {"drafter_context": {"features": nn.spec.Tensor([1, "n", F], dtype), **where("n"),
                                     "rows": nn.spec.Tensor([1], "int32"), "dkv": dkv, **mode},
                 # a block is always block_size positions: static shapes, so a graph build replays the pass's
                 # kernels as CUDA graphs (its rows take the few-row tensor-core GEMM, as verification's)
                 "drafter_block": {"tokens": nn.spec.Tensor([1, cfg.block_size], "int32"), **attend(cfg.block_size)},
                 # a cycle commits at most a block's tokens (the last one and the accepted drafts)
                 "drafter_cycle": cycle()}
        if rows > 1:     # a batch's blocks in one pass over the weights
            specs["drafter_cycle_batch"] = cycle("batch")
        return specs
    return {"drafter_fuse": {"features": nn.spec.Tensor([1, "n", F], dtype), **mode},
            "drafter_step": {"hidden": nn.spec.Tensor([1, "n", H], dtype), "tokens": nn.spec.Tensor([1, "n"], "int32"),
                             **attend("n")}}
