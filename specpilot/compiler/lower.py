"""Lowering: every step of speculative decoding as Relax functions in one IRModule.

For the target and the drafter (prefix ``target_`` / ``drafter_``), over a batch of B
sequences with T new tokens each (shorter requests padded):

    prefill(tokens[B, T], positions[B, T], slots[B, T], mask[B, T, L], rows[B], caches...)
                                -> logits[B, T, V], new recurrent states
    decode (tokens[B, 1], ...)  same, one token per sequence (GPU builds: B = 1 static, so the
                                projections get GEMV schedules; decode_batch takes any B)
    verify (tokens[B, T], ..., rows[B], parents[B, T], caches...)  -> logits[B, T, V], the Gated
                                DeltaNet conv state after *every* token and every token's
                                recurrence record (k, v, g, beta: commit rebuilds the recurrent
                                state after any token from them); parents[b, t] is token t's parent
                                among the new tokens (-1: the cache); attention follows the mask,
                                Gated DeltaNet layers follow the previous token unless the
                                gdn-path-recompute pass makes them follow parents
    commit (conv_states[B, T, ...], rec_records[B, T, ...], rec_state[B, ...], path[B, D], index[B])
                                -> the states after token index[b] of each sequence (path: its
                                root path among the T tokens; rec_state: before the pass)

``positions`` are rotary positions, ``slots`` the cache positions the new tokens are written to
(slot < 0: padding, written nowhere), ``mask[b, t, j]`` says whether token t may attend cache
position j < L of its sequence: a chain is causal, a tree is ancestor-only, with the same
functions.  The KV cache is a pool ``kv[A, 2, R, n_kv, S, d]`` of R = deployment.max_batch
sequence rows (A attention layers), written in place; ``rows[b]`` is batch entry b's row, so
requests join and leave a running batch without moving their cache.  Recurrent states are
values per batch entry: ``conv[B, G, C, K-1]`` and ``rec[B, G, H, dk, dv]`` (float32) for the
G Gated DeltaNet layers.  Weights are function parameters (packed), named
``target.<Hugging Face name>``, so passes can transform them ahead of time.  Linear layers see
the batch flattened to (B*T, hidden).  The math follows `runtime.reference.model` line for line.
"""

from __future__ import annotations

from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.core import wrap_nested

from specpilot import kernels
from specpilot.kernels.norms import rotary_te
from specpilot.core.config import ModelConfig, cache_shapes
from specpilot.core.sampling import KEY_WORDS
from specpilot.compiler.lower_drafter import draft_net, draft_specs
from specpilot.core.feature_drafter import DraftNetConfig
from specpilot.compiler.layers import DecoderLayer, RMSNorm, StepInputs, Weight, matmul, slice_axis


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, gpu: bool, capacity: int, n_rows: int,
                 pool_rows: bool | None = None):
        n_attn = cfg.layer_types.count("full_attention")
        self.embed_tokens = Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, kind, dtype, gpu, capacity, n_rows, n_attn, pool_rows)
                                     for kind in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm, dtype, gpu)


class CausalLM(nn.Module):
    """One model's step functions; parameter names are its Hugging Face names."""

    def __init__(self, cfg: ModelConfig, dtype: str, gpu: bool, capacity: int, n_rows: int,
                 pool_rows: bool | None = None, feature_layers: tuple[int, ...] = ()):
        """``feature_layers``: every step also returns the residual stream after these layers,
        concatenated, (B, T, len * hidden), last among its outputs (`runtime.features`)."""
        self.cfg, self.dtype, self.capacity, self.gpu = cfg, dtype, capacity, gpu
        self.feature_layers = tuple(feature_layers)
        self.model = Backbone(cfg, dtype, gpu, capacity, n_rows, pool_rows)
        self.lm_head = Weight((cfg.vocab_size, cfg.hidden_size), dtype) if not cfg.tie_word_embeddings else None
        self.rope_inv_freq = nn.Parameter((len(range(0, int(cfg.head_dim * cfg.partial_rotary_factor), 2)),),
                                          "float32")

    @property
    def n_attn(self) -> int:
        return self.cfg.layer_types.count("full_attention")

    @property
    def n_gdn(self) -> int:
        return self.cfg.layer_types.count("linear_attention")

    def step(self, tokens, positions, slots, mask, rows, kv, conv, rec, keep_states: bool, parents=None,
             pack=None, unpack=None):
        """``pack`` (N,) / ``unpack`` (B, T): the linear layers and the head run over the batch's N real
        tokens only (`StepInputs.pack`); the logits are theirs (N, vocab), the other outputs the padded
        batch's as without them."""
        cfg = self.cfg
        B, T_ = tokens.shape
        s = StepInputs(B, T_, slots, mask, rows, op.tensor_expr_op(rotary_te(self.dtype), "rotary",
                                                                   [positions, self.rope_inv_freq]), parents)
        if pack is not None:
            s.pack, s.unpack = pack, op.reshape(unpack, (B * T_,))
        if self.gpu and self.n_attn and isinstance(T_, int) and T_ == 1:   # one zeroing a step, for every layer
            s.counters = op.zeros((B * cfg.num_key_value_heads,), "int32")
        h = wrap_nested(rx.op.take(self.model.embed_tokens.weight._expr, s.compact(op.reshape(tokens, (B * T_,)))._expr,
                                   axis=0, mode="clip"), "embed")                          # (B*T or N, hidden)
        convs, recs, a, g = [], [], 0, 0
        kept: dict[int, Tensor] = {}
        for i, (layer, kind) in enumerate(zip(self.model.layers, cfg.layer_types)):
            x = layer.input_layernorm(h)
            if kind == "full_attention":
                x, kv = layer.self_attn(x, s, kv, a)
                a += 1
            else:
                # the kernels read their layer's states out of the stacks (`kernels.gated_delta_rule`)
                x, c_new, r_new = layer.linear_attn(x, s, conv, rec, keep_states, (self.n_gdn, g),
                                                    recs[-1] if recs else None, convs[-1] if convs else None)
                convs.append(c_new)
                recs.append(r_new)
                g += 1
            h = h + x
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in self.feature_layers:
                kept[i] = h
        h = self.model.norm(h)
        head = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight
        logits = op.astype(matmul(h, op.permute_dims(head)), "float32")
        if pack is None:     # packed: the real tokens' rows (N, vocab), in ``pack``'s order, as the runtime reads them
            logits = op.reshape(logits, (B, T_, cfg.vocab_size))
        outputs = [logits]
        if self.n_gdn:
            # per-token states / records (B, T, G, ...) and final recurrent states (B, G, ...): the layers
            # already share one stacked tensor of each kind; a decode step's conv states too (T = 1)
            if keep_states:
                conv_out = convs[-1]
            elif isinstance(T_, int) and T_ == 1:
                conv_out = op.reshape(convs[-1], (B, self.n_gdn, *convs[-1].shape[3:]))
            else:
                conv_out = op.concat([op.unsqueeze(c, 1) for c in convs], dim=1)
            outputs += [conv_out, recs[-1]]
        if self.feature_layers:
            features = s.expand(op.concat([kept[i] for i in self.feature_layers], dim=-1))
            outputs.append(op.reshape(features, (B, T_, len(self.feature_layers) * cfg.hidden_size)))
        return tuple(outputs) if len(outputs) > 1 else logits

    def commit(self, conv_states, rec_records, rec_state, path, index):
        """The recurrent states after token ``index[b]`` of each sequence's verify pass: its conv
        window as verify kept it, its recurrent state rebuilt from ``rec_state`` (before the
        pass) along ``path[b]`` (the token's root path, root first; -1 pads) with the pass's
        records (`kernels.gdn_commit`)."""
        B, T_, *rest = conv_states.shape
        width = 1
        for r in rest:
            width *= int(r)
        kernel = kernels.select_token(width, conv_states.dtype, self.gpu)
        flat = op.tensor_ir_op(kernel, "select_token", [op.reshape(conv_states, (B, T_, width)), index],
                               Tensor.placeholder((B, width), conv_states.dtype))
        conv = op.reshape(flat, (B, *rest))
        cfg = self.cfg
        G, nv, dk, dv = self.n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        rec = op.tensor_ir_op(kernels.gdn_commit(G, nv, dk, dv, self.gpu), "gdn_commit", [rec_records, rec_state, path],
                              Tensor.placeholder((B, G, nv, dk, dv), "float32"))
        return conv, rec

    # the exported entry points; the cache arguments exist only where the model has such layers
    def prefill(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.step(tokens, positions, slots, mask, rows, kv, conv, rec, keep_states=False)

    def verify(self, tokens, positions, slots, mask, rows, parents, kv, conv, rec, pack=None, unpack=None):
        return self.step(tokens, positions, slots, mask, rows, kv, conv, rec, keep_states=True, parents=parents,
                         pack=pack, unpack=unpack)


class Deployment(nn.Module):
    """The target and the drafter (a model's, or a network reading the target's hidden states:
    `compiler.lower_drafter`); each method is one exported function."""

    def __init__(self, target: CausalLM, drafter):
        # drafter first: a weight a drafter shares with the target is read, by every function,
        # from the slot named last -- the target's, where target passes rewrite it
        self.drafter, self.target = drafter, target

    def target_prefill(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.target.prefill(tokens, positions, slots, mask, rows, kv, conv, rec)

    def target_decode(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.target.prefill(tokens, positions, slots, mask, rows, kv, conv, rec)

    def target_decode_batch(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.target.prefill(tokens, positions, slots, mask, rows, kv, conv, rec)

    def target_verify(self, tokens, positions, slots, mask, rows, parents, kv, conv, rec):
        return self.target.verify(tokens, positions, slots, mask, rows, parents, kv, conv, rec)

    def target_verify_tree(self, tokens, positions, slots, mask, rows, parents, kv, conv, rec):
        return self.target.verify(tokens, positions, slots, mask, rows, parents, kv, conv, rec)

    def target_verify_packed(self, tokens, positions, slots, mask, rows, parents, pack, unpack, kv, conv, rec):
        return self.target.verify(tokens, positions, slots, mask, rows, parents, kv, conv, rec, pack, unpack)

    def target_commit(self, conv_states, rec_records, rec_state, path, index):
        return self.target.commit(conv_states, rec_records, rec_state, path, index)

    def drafter_prefill(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.drafter.prefill(tokens, positions, slots, mask, rows, kv, conv, rec)

    def drafter_decode(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.drafter.prefill(tokens, positions, slots, mask, rows, kv, conv, rec)

    def drafter_decode_batch(self, tokens, positions, slots, mask, rows, kv, conv, rec):
        return self.drafter.prefill(tokens, positions, slots, mask, rows, kv, conv, rec)

    def drafter_verify(self, tokens, positions, slots, mask, rows, parents, kv, conv, rec):
        return self.drafter.verify(tokens, positions, slots, mask, rows, parents, kv, conv, rec)

    def drafter_commit(self, conv_states, rec_records, rec_state, path, index):
        return self.drafter.commit(conv_states, rec_records, rec_state, path, index)

    def drafter_context(self, features, positions, slots, rows, dkv):
        return self.drafter.context(features, positions, slots, rows, dkv)

    def drafter_block(self, tokens, positions, slots, mask, rows, dkv):
        return self.drafter.block(tokens, positions, slots, mask, rows, dkv)

    def drafter_cycle(self, features, context_positions, context_slots, tokens, positions, slots, mask, rows, dkv):
        return self.drafter.cycle(features, context_positions, context_slots, tokens, positions, slots, mask, rows, dkv)

    def drafter_cycle_batch(self, features, context_positions, context_slots, tokens, positions, slots, mask, rows,
                            dkv):
        return self.drafter.cycle(features, context_positions, context_slots, tokens, positions, slots, mask, rows, dkv)

    def drafter_fuse(self, features):
        return self.drafter.fuse_features(features)

    def drafter_step(self, hidden, tokens, positions, slots, mask, rows, dkv):
        return self.drafter.step(hidden, tokens, positions, slots, mask, rows, dkv)

    def sample_scores(self, logits, keys, controls):
        """Sampling's scores for rows of logits (`kernels.sample_scores`): their argmax is the
        sampled token; the noise is made here from each row's (seed, position) key."""
        kernel = kernels.sample_scores(self.target.cfg.vocab_size, self.target.gpu)
        return op.tensor_ir_op(kernel, "sample_scores", [logits, keys, controls],
                               Tensor.placeholder(logits.shape, "float32"))

    def choose(self, logits):
        """Each row's argmax (ties to the lowest index) where the build runs (`kernels.argmax_rows`):
        a runtime holding logits on the device reads back a token a row."""
        vocab, rows = self.target.cfg.vocab_size, logits.shape[0]
        if not self.target.gpu:
            return op.tensor_ir_op(kernels.argmax_rows(vocab), "argmax_rows", [logits], Tensor.placeholder((rows,), "int32"))
        parts = op.tensor_ir_op(kernels.argmax_parts(vocab), "argmax_parts", [logits],
                                Tensor.placeholder((rows, kernels.ARGMAX_PARTS, 2), "float32"))
        return op.tensor_ir_op(kernels.argmax_merge(vocab), "argmax_merge", [parts], Tensor.placeholder((rows,), "int32"))


def _share_parameters(drafter: CausalLM, target: CausalLM, own: frozenset[str]) -> None:
    """An early-exit drafter reads the target's own weights: point its parameters at them
    (all but ``own``: an adapter's layer and final norm)."""
    target_params = dict(target.named_parameters())
    for name, _ in list(drafter.named_parameters()):
        if name in own:
            continue
        *path, leaf = name.split(".")
        owner = drafter
        for part in path:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        setattr(owner, leaf, target_params[name])


def _step_spec(cfg: ModelConfig, capacity: int, n_rows: int, dtype: str, tokens, batch="batch",
               parents: bool = False, packed: bool = False) -> dict:
    caches = cache_shapes(cfg, capacity, n_rows, dtype)
    absent = nn.spec.Tensor([1], "float32")   # a model without such layers takes a placeholder
    per_sequence = lambda name: nn.spec.Tensor([batch, *caches[name][0]], caches[name][1])  # noqa: E731
    return {
        "tokens": nn.spec.Tensor([batch, tokens], "int32"),
        "positions": nn.spec.Tensor([batch, tokens], "int32"),
        "slots": nn.spec.Tensor([batch, tokens], "int32"),
        "mask": nn.spec.Tensor([batch, tokens, "kv_len"], "bool"),
        "rows": nn.spec.Tensor([batch], "int32"),
        **({"parents": nn.spec.Tensor([batch, tokens], "int32")} if parents else {}),
        **({"pack": nn.spec.Tensor(["real"], "int32"), "unpack": nn.spec.Tensor([batch, tokens], "int32")}
           if packed else {}),
        "kv": nn.spec.Tensor(*caches["kv"]) if "kv" in caches else absent,
        "conv": per_sequence("conv") if "conv" in caches else absent,
        "rec": per_sequence("rec") if "rec" in caches else absent,
        "$": {"param_mode": "packed", "effect_mode": "none"},
    }


def _sampling_spec(cfg: ModelConfig) -> dict:
    return {
        "logits": nn.spec.Tensor(["rows", cfg.vocab_size], "float32"),
        "keys": nn.spec.Tensor(["rows", KEY_WORDS], "int32"),
        "controls": nn.spec.Tensor(["rows", 2], "float32"),
        "$": {"param_mode": "none", "effect_mode": "none"},
    }


def _commit_spec(cfg: ModelConfig, capacity: int, n_rows: int, dtype: str) -> dict:
    caches = cache_shapes(cfg, capacity, n_rows, dtype)
    (conv_shape, conv_dtype), (rec_shape, _) = caches["conv"], caches["rec"]
    G, H, dk, dv = rec_shape
    return {
        "conv_states": nn.spec.Tensor(["batch", "n", *conv_shape], conv_dtype),
        "rec_records": nn.spec.Tensor(["batch", "n", G, H, kernels.record_width(dk, dv)], "float32"),
        "rec_state": nn.spec.Tensor(["batch", *rec_shape], "float32"),
        "path": nn.spec.Tensor(["batch", "depth"], "int32"),
        "index": nn.spec.Tensor(["batch"], "int32"),
        "$": {"param_mode": "none", "effect_mode": "none"},
    }


def lower_deployment(target_cfg: ModelConfig, drafter_cfg: ModelConfig | None, dtype: str, capacity: int,
                     gpu: bool, drafter_own: frozenset[str] | None = None, n_rows: int = 1,
                     pool_rows: bool | None = None, draft: DraftNetConfig | None = None,
                     verify_tokens: int | None = None, draft_ranks: int = 4, packed_verify: bool = False):
    """-> (IRModule, [parameter names in packed order]).  Parameter names are ``target.<HF name>``,
    ``drafter.<HF name>`` and ``<model>.rope_inv_freq``; shared drafter weights appear once.
    ``n_rows``: sequences the KV-cache pool holds (deployment.max_batch).  ``drafter_own``: for a
    drafter that reads the target's weights (early exit), the names of those it does not.
    ``pool_rows``: prefill and verification attention read the pool in place
    (`kernels.attention_rows_partial`); None: in float32 on the CPU, and on GPUs where its GPU form
    serves the heads.
    ``draft``: a drafter network reading the target's hidden states (block / feature): the target's
    steps also return the layers it reads, and its functions join the module (`compiler.lower_drafter`).
    ``verify_tokens``: also ``target_verify_tree``, the target's verification of one sequence of exactly
    this many tokens (static shapes; `passes.tree_verify`'s ``fixed``).  ``draft_ranks``: a block
    drafter's proposals a position, ranked in its cycle (the spec's top_k).  ``packed_verify``: also
    ``target_verify_packed``, the target's batched verification whose linear layers and head run over
    the batch's real tokens only (`passes.tree_verify`'s ``packed``)."""
    target = CausalLM(target_cfg, dtype, gpu, capacity, n_rows, pool_rows, draft.target_layers if draft else ())
    drafter = CausalLM(drafter_cfg, dtype, gpu, capacity, n_rows, pool_rows) if drafter_cfg is not None else None
    if drafter is not None and drafter_own is not None:
        _share_parameters(drafter, target, drafter_own)
    spec = {}
    if draft is not None:
        embed = target.model.embed_tokens.weight
        drafter = draft_net(draft, dtype, gpu, capacity, embed, embed if target.lm_head is None else target.lm_head.weight,
                            draft_ranks, n_rows)
        spec.update(draft_specs(draft, dtype, capacity, n_rows))
    for prefix, model, cfg in (("target", target, target_cfg), ("drafter", drafter, drafter_cfg)):
        if model is None or cfg is None:
            continue
        spec[f"{prefix}_prefill"] = _step_spec(cfg, capacity, n_rows, dtype, "n")
        spec[f"{prefix}_decode"] = _step_spec(cfg, capacity, n_rows, dtype, 1, batch=1 if gpu else "batch")
        if gpu:   # batch 1 static: its projections get the GEMV schedule; larger batches use decode_batch
            spec[f"{prefix}_decode_batch"] = _step_spec(cfg, capacity, n_rows, dtype, 1)
        spec[f"{prefix}_verify"] = _step_spec(cfg, capacity, n_rows, dtype, "n", parents=True)
        if prefix == "target" and verify_tokens:
            spec["target_verify_tree"] = _step_spec(cfg, capacity, n_rows, dtype, verify_tokens, batch=1, parents=True)
        if prefix == "target" and packed_verify:
            spec["target_verify_packed"] = _step_spec(cfg, capacity, n_rows, dtype, "n", parents=True, packed=True)
        if model.n_gdn:
            spec[f"{prefix}_commit"] = _commit_spec(cfg, capacity, n_rows, dtype)
    spec["sample_scores"] = _sampling_spec(target_cfg)
    spec["choose"] = {"logits": nn.spec.Tensor(["rows", target_cfg.vocab_size], "float32"),
                      "$": {"param_mode": "none", "effect_mode": "none"}}
    mod, params = Deployment(target, drafter).export_tvm(spec=spec)
    return mod, [name for name, _ in params]
