"""The layers every lowered model is made of (`compiler.lower`, `compiler.lower_drafter`): linear
layers accumulated in float32, RMSNorm as one kernel, the gated MLP, grouped-query attention over
the KV-cache pool and Gated DeltaNet -- the math of `runtime.reference.model`, line for line."""

from __future__ import annotations

import json
from dataclasses import dataclass

import tvm
from tvm import relax as rx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.core import wrap_nested

from specpilot import kernels
from specpilot.kernels.norms import NORM_ATTR, attention_heads_te, gated_norm_te, rms_norm_te
from specpilot.kernels.rows import gather_rows_te
from specpilot.core.config import ModelConfig


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b accumulated in float32 and rounded once to the operands' dtype, as torch/cuBLAS do
    (TVM's matmul otherwise accumulates in bf16, which drifts far from the reference)."""
    out = op.matmul(a, b, out_dtype="float32")
    return out if a.dtype == "float32" else op.astype(out, a.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    y = matmul(x, op.permute_dims(weight))
    return y + bias if bias is not None else y


def slice_axis(x: Tensor, axis: int, begin, end, name: str) -> Tensor:
    return wrap_nested(rx.op.strided_slice(x._expr, axes=[axis], begin=[begin], end=[end], assume_inbound=True), name)


class Weight(nn.Module):
    """A bare weight under its Hugging Face name (embed_tokens.weight, lm_head.weight, conv1d.weight)."""

    def __init__(self, shape, dtype: str):
        self.weight = nn.Parameter(shape, dtype)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str):
        self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis as one kernel: h = float32(x), h / sqrt(sum(h * h) / n + eps),
    then ``dtype(h) * w`` (or ``dtype(h * (w + 1))`` zero-centered, Qwen3-Next / Qwen3.5) -- the
    reference's arithmetic, operation for operation.  Written as Relax operators it would be three
    kernels a norm (the cast, the sum of squares, the scaling: x feeds both of the last two, and
    FuseOps fuses no reduction with what reads its result); one tensor expression (the sum's
    block and the elementwise block that reads it) is one PrimFunc, which dlight's
    GeneralReduction rule schedules on GPUs as one kernel."""

    def __init__(self, dim: int, eps: float, zero_centered: bool, dtype: str, gpu: bool):
        self.weight = nn.Parameter((dim,), dtype)
        self.eps, self.zero_centered, self.dtype, self.gpu = eps, zero_centered, dtype, gpu

    def forward(self, x: Tensor) -> Tensor:
        # the attribute lets a GPU build's decode GEMV take this norm as its prologue (`schedules.decode_gemv`)
        attrs = {NORM_ATTR: json.dumps({"eps": self.eps, "zero_centered": self.zero_centered, "spelled": not self.gpu})}
        return op.tensor_expr_op(rms_norm_te(self.eps, self.zero_centered, self.dtype, not self.gpu), "rms_norm",
                                 [x, self.weight], attrs=attrs)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str):
        H, I, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj = Linear(H, I, b, dtype), Linear(H, I, b, dtype)
        self.down_proj = Linear(I, H, b, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(op.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class StepInputs:
    batch: object       # B (symbolic)
    tokens: object      # T per sequence (symbolic or 1)
    slots: Tensor       # (B, T)
    mask: Tensor        # (B, T, L)
    rows: Tensor        # (B,)
    rotary: Tensor      # (2, B, T, rot): cos, sin (`rotary_te`); each layer slices its own (fused into its heads kernel)
    parents: Tensor | None = None   # (B, T), verify only: token t's parent among the new tokens
    counters: Tensor | None = None  # (B * KV heads,) int32 zeros, GPU decode: `kernels.attention_decode`'s counters
    few_rows: bool = False          # a few query rows over a long cache (drafter passes): split the keys as verify does
    # packed verification (`target_verify_packed`): the linear layers see only the batch's N real tokens,
    # ``pack`` (N,) their flat indices in (B*T); ``unpack`` (B*T,) each padded position's row among them
    pack: Tensor | None = None
    unpack: Tensor | None = None

    def expand(self, x: Tensor) -> Tensor:
        """Rows of the real tokens (N, ...) -> (B*T, ...), a padding position a copy of a real row (its
        outputs are dropped, its keys written nowhere); unpacked rows are returned as they are."""
        if self.unpack is None:
            return x
        return op.tensor_expr_op(gather_rows_te(), "unpacked", [x, self.unpack], attrs={"op_pattern": 2})

    def compact(self, x: Tensor) -> Tensor:
        """(B*T, ...) -> the real tokens' rows (N, ...); unpacked rows are returned as they are."""
        if self.pack is None:
            return x
        return op.tensor_expr_op(gather_rows_te(), "packed", [x, self.pack], attrs={"op_pattern": 2})

    def cos_sin(self) -> tuple[Tensor, Tensor]:
        """The layer's own slices of ``rotary``: cos, sin (B, T, rot)."""
        _, B, T, rot = self.rotary.shape
        return tuple(op.reshape(slice_axis(self.rotary, 0, i, i + 1, name), (B, T, rot))
                     for i, name in enumerate(("cos", "sin")))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, gpu: bool, capacity: int, n_rows: int, n_attn: int,
                 pool_rows: bool | None = None, in_features: int | None = None):
        """``in_features``: the projections' input width (the hidden size unless given)."""
        H, d = in_features or cfg.hidden_size, cfg.head_dim
        self.cfg, self.dtype, self.gpu, self.capacity, self.n_attn = cfg, dtype, gpu, capacity, n_attn
        self.n_rows = n_rows
        # many query rows (prefill, verification) read the pool in place on GPUs where the rows kernel
        # serves the heads, and on float32 CPU builds (its loop: decode's arithmetic, and faster than
        # gathered keys and matmuls, bench/README "End to end"); elsewhere gathered keys and matmuls
        # (a bf16 CPU build through the rows loop failed forcing under stock's derived tolerance:
        # tests/agent/test_executor.py)
        if pool_rows is None:
            pool_rows = kernels.rows_kernel_fits(d, dtype) if gpu else dtype == "float32"
        self.pool_rows = pool_rows
        q_out = cfg.num_attention_heads * d * (2 if cfg.attn_output_gate else 1)
        self.q_proj = Linear(H, q_out, cfg.qkv_bias, dtype)
        self.k_proj = Linear(H, cfg.num_key_value_heads * d, cfg.qkv_bias, dtype)
        self.v_proj = Linear(H, cfg.num_key_value_heads * d, cfg.qkv_bias, dtype)
        self.o_proj = Linear(cfg.num_attention_heads * d, cfg.hidden_size, cfg.o_bias, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.zero_centered_norm, dtype, gpu)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.zero_centered_norm, dtype, gpu)

    def _heads(self, q: Tensor, k: Tensor, v: Tensor, s: StepInputs) -> Tensor:
        """q, k (normed when the model norms them, then rotary) and v as one (B, T, nh + 2 nkv, d)
        tensor, one kernel (`attention_heads_te`)."""
        cfg = self.cfg
        norm = [self.q_norm.weight, self.k_norm.weight] if cfg.qk_norm else []
        return op.tensor_expr_op(
            attention_heads_te(self.dtype, cfg.rotary_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                               cfg.rms_norm_eps if cfg.qk_norm else None, cfg.zero_centered_norm, not self.gpu),
            "attention_heads", [q, k, v, *norm, *s.cos_sin()], attrs={"op_pattern": 2})

    def forward(self, x: Tensor, s: StepInputs, kv: Tensor, layer: int):
        """x (B*T, hidden) -> (B*T, hidden) (packed: the real tokens' rows, `StepInputs.pack`); writes the
        new keys/values into the pool."""
        cfg = self.cfg
        B, T_, d, nh, nkv = s.batch, s.tokens, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q = s.expand(self.q_proj(x))
        gate = None
        if cfg.attn_output_gate:
            qg = op.reshape(q, (B, T_, nh, 2 * d))
            q, gate = slice_axis(qg, 3, 0, d, "q"), op.reshape(slice_axis(qg, 3, d, 2 * d, "gate"), (B * T_, nh * d))
        q = op.reshape(q, (B, T_, nh, d))
        k = op.reshape(s.expand(self.k_proj(x)), (B, T_, nkv, d))
        v = op.reshape(s.expand(self.v_proj(x)), (B, T_, nkv, d))
        heads = self._heads(q, k, v, s)      # queries, keys, values: (B, T, nh + 2 nkv, d)
        decode = isinstance(T_, int) and T_ == 1
        if decode and self.gpu:     # the decode kernel writes the new keys / values into the pool itself
            out, kv = self._attend_in_place(heads, s, kv, layer)
        else:
            kernel = kernels.kv_write(self.n_attn, layer, self.n_rows, nkv, self.capacity, d, self.dtype, self.gpu,
                                      heads_at=(nh, nh + nkv))
            kv = op.tensor_ir_inplace_op(kernel, f"kv_write_{layer}", [kv, heads, s.slots, s.rows], [0],
                                         Tensor.placeholder(kv.shape, self.dtype))
            out = self._attend_in_place(heads, s, kv, layer)[0] if decode or self.pool_rows else \
                self._attend_gathered(slice_axis(heads, 2, 0, nh, "q"), s, kv, layer)
        if gate is not None:
            out = out * op.sigmoid(gate)
        return self.o_proj(s.compact(out)), kv

    def _attend_in_place(self, heads: Tensor, s: StepInputs, kv: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """Attention read straight from the pool, split over the keys (flash decoding): one query
        row per sequence (decode; `kernels.attention_decode` on the GPU) or many (prefill,
        verification; `kernels.attention_rows_partial`), the splits merged by
        `kernels.attention_combine`; the queries are the first heads of ``heads``.  Returns the
        attention output and the pool: the GPU's decode kernel writes the new keys and values
        and merges the splits itself (`attention_decode`); everything else reads a pool already written."""
        cfg = self.cfg
        B, T_, d, nh, nkv = s.batch, s.tokens, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        grp = nh // nkv
        decode = isinstance(T_, int) and T_ == 1
        # keys per split and most splits: decode's 64-key splits; verification's >= 256 keys, at most
        # ROWS_SPLITS, on GPUs, and decode's splits on the CPU (its rows then add what decode adds, in the
        # same order: a chain's verified row is decode's row bit for bit); prefill: one split
        verify = s.parents is not None or s.few_rows
        split, most = (kernels.ATTN_CHUNK, 0) if decode or (verify and not self.gpu) else \
            (kernels.ROWS_SPLIT, kernels.ROWS_SPLITS) if verify else (0, 1)
        splits = kernels.key_splits(s.mask.shape[2], split, most)
        parts = [Tensor.placeholder((B, nkv, splits, T_ * grp, d), "float32"),
                 Tensor.placeholder((B, nkv, splits, T_ * grp, 2), "float32")]
        if decode and self.gpu:     # the new keys / values written, the splits merged where the merge is small
            merges = grp * d <= kernels.DECODE_MERGE_MAX
            kernel = kernels.attention_decode(self.n_attn, layer, self.n_rows, nkv, self.capacity, d, grp, self.dtype,
                                              q_heads=heads.shape[2], write_at=(nh, nh + nkv), merges=merges)
            kv, s.counters, acc, ml, out = op.tensor_ir_inplace_op(
                kernel, "attention_decode", [heads, kv, s.rows, s.mask, s.slots, s.counters], [1, 5, -1, -1, -1],
                [Tensor.placeholder(kv.shape, self.dtype), Tensor.placeholder(s.counters.shape, "int32"), *parts,
                 Tensor.placeholder((B, T_, nh, d), self.dtype)])
            if merges:
                return op.reshape(out, (B * T_, nh * d)), kv
        else:   # the CPU's decode too: the rows kernel's loop
            partial = kernels.attention_rows_partial(self.n_attn, layer, self.n_rows, nkv, self.capacity, d, grp,
                                                     self.dtype, self.gpu, split=split, splits=most,
                                                     q_heads=heads.shape[2])
            acc, ml = op.tensor_ir_op(partial, "attention_decode" if decode else "attention_rows",
                                      [heads, kv, s.rows, s.mask], parts)
        out = op.tensor_ir_op(kernels.attention_combine(nkv, d, grp, self.dtype, self.gpu),
                              "attention_combine", [acc, ml], Tensor.placeholder((B, T_, nh, d), self.dtype))
        return op.reshape(out, (B * T_, nh * d)), kv

    def _attend_gathered(self, q: Tensor, s: StepInputs, kv: Tensor, layer: int) -> Tensor:
        """Attention over the sequence's live keys gathered from the pool, through matmuls
        (prefill and verification: many query rows)."""
        cfg = self.cfg
        B, T_, d, nh, nkv = s.batch, s.tokens, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        L, grp = s.mask.shape[2], nh // nkv
        own = op.reshape(slice_axis(slice_axis(kv, 0, layer, layer + 1, "layer_kv"), 4, 0, L, "live_kv"),
                         (2, self.n_rows, nkv, L, d))
        own = wrap_nested(rx.op.take(own._expr, s.rows._expr, axis=1, mode="clip"), "rows_kv")  # (2, B, nkv, L, d)
        keys = op.reshape(slice_axis(own, 0, 0, 1, "keys"), (B, nkv, L, d))
        values = op.reshape(slice_axis(own, 0, 1, 2, "values"), (B, nkv, L, d))
        # grouped queries: the grp = nh / nkv query heads of a KV head (heads h = kv * grp + i) are
        # rows of one matmul against that head's keys, so no step copies the keys grp times
        qg = op.reshape(op.permute_dims(q, [0, 2, 1, 3]), (B, nkv, grp * T_, d))
        scores = op.reshape(matmul(qg, op.permute_dims(keys, [0, 1, 3, 2])) * (d ** -0.5), (B, nkv, grp, T_, L))
        neg = op.full(scores.shape, wrap_nested(rx.const(float("-inf"), self.dtype), "neg_inf"), self.dtype)
        mask = op.broadcast_to(op.reshape(s.mask, (B, 1, 1, T_, L)), scores.shape)
        scores = op.where(mask, scores, neg)                                                # (B, nkv, grp, T, L)
        probs = op.astype(op.softmax(op.astype(scores, "float32"), axis=-1), self.dtype)
        out = matmul(op.reshape(probs, (B, nkv, grp * T_, L)), values)                      # (B, nkv, grp*T, d)
        return op.reshape(op.permute_dims(op.reshape(out, (B, nh, T_, d)), [0, 2, 1, 3]), (B * T_, nh * d))


def _index(i: int) -> Tensor:
    return wrap_nested(rx.const([i], "int32"), "index")


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, gpu: bool):
        H = cfg.hidden_size
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.cfg, self.dtype, self.gpu = cfg, dtype, gpu
        self.conv_dim = 2 * nk * dk + nv * dv
        if cfg.architecture == "Qwen3NextForCausalLM":
            self.in_proj_qkvz = Linear(H, 2 * nk * dk + 2 * nv * dv, False, dtype)
            self.in_proj_ba = Linear(H, 2 * nv, False, dtype)
        else:
            self.in_proj_qkv = Linear(H, self.conv_dim, False, dtype)
            self.in_proj_z = Linear(H, nv * dv, False, dtype)
            self.in_proj_b = Linear(H, nv, False, dtype)
            self.in_proj_a = Linear(H, nv, False, dtype)
        self.conv1d = Weight((self.conv_dim, 1, K), dtype)
        self.dt_bias = nn.Parameter((nv,), dtype)
        self.A_log = nn.Parameter((nv,), dtype)
        self.norm = RMSNorm(dv, cfg.rms_norm_eps, False, dtype, gpu)
        self.out_proj = Linear(nv * dv, H, False, dtype)

    def _projections(self, x: Tensor):
        cfg = self.cfg
        T_, nk, nv = x.shape[0], cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
        if cfg.architecture == "Qwen3NextForCausalLM":
            qkvz = op.reshape(self.in_proj_qkvz(x), (T_, nk, 2 * dk + 2 * r * dv))
            q = slice_axis(qkvz, 2, 0, dk, "q")
            k = slice_axis(qkvz, 2, dk, 2 * dk, "k")
            v = slice_axis(qkvz, 2, 2 * dk, 2 * dk + r * dv, "v")
            z = slice_axis(qkvz, 2, 2 * dk + r * dv, 2 * dk + 2 * r * dv, "z")
            ba = op.reshape(self.in_proj_ba(x), (T_, nk, 2 * r))
            b, a = slice_axis(ba, 2, 0, r, "b"), slice_axis(ba, 2, r, 2 * r, "a")
            mixed = op.concat([op.reshape(q, (T_, nk * dk)), op.reshape(k, (T_, nk * dk)),
                               op.reshape(v, (T_, nv * dv))], dim=1)
            return mixed, op.reshape(z, (T_, nv, dv)), op.reshape(b, (T_, nv)), op.reshape(a, (T_, nv))
        return (self.in_proj_qkv(x), op.reshape(self.in_proj_z(x), (T_, nv, dv)),
                self.in_proj_b(x), self.in_proj_a(x))

    def forward(self, x: Tensor, s: StepInputs, conv_state: Tensor, rec_state: Tensor, keep_states: bool,
                stack: tuple[int, int] | None = None, stacked: Tensor | None = None,
                stacked_conv: Tensor | None = None):
        """x (B*T, hidden) (packed: the real tokens' rows, `StepInputs.pack`; so is ``out``), conv_state
        (B, C, K-1), rec_state (B, H, dk, dv), or with ``stack`` all G layers' (B, G, C, K-1) and
        (B, G, H, dk, dv) -> out (B*T, hidden), and the new
        states: final (B, ...) or, with ``keep_states``, the conv state after every token and every
        token's recurrence record (B, T, ...; `kernels.gated_delta_rule`).  ``stack`` = (G, g):
        the per-token records and conv states (a decode step's: its one token's), or the final
        recurrent states, go into slice g of the tensors of all G layers (``stacked`` /
        ``stacked_conv``, made by layer 0), returned in their place."""
        nv, dv = self.cfg.linear_num_value_heads, self.cfg.linear_value_head_dim
        B, T_ = s.batch, s.tokens
        mixed, z, b, a = self._projections(x)      # packed: the real tokens' rows (z stays so)
        mixed, b, a = (s.expand(t) for t in (mixed, b, a))
        conv, new_conv = self._conv(op.reshape(mixed, (B, T_, self.conv_dim)), s, conv_state, keep_states, stack,
                                    stacked_conv)
        q, k, v = self._heads(conv, B, T_)                                                     # (B, T, H, d)
        beta, g = self._gates(b, a, B, T_)
        o, new_rec = self._recurrence(q, k, v, g, beta, rec_state, s, keep_states, stack, stacked)
        o = s.compact(op.reshape(o, (B * T_, nv, dv)))
        o = op.tensor_expr_op(gated_norm_te(self.norm.eps, self.dtype, not self.gpu), "gated_norm",
                              [o, self.norm.weight, z], attrs={"op_pattern": 2})
        return self.out_proj(op.reshape(o, (o.shape[0], nv * dv))), new_conv, new_rec

    def _conv(self, mixed: Tensor, s: StepInputs, conv_state: Tensor, keep_states: bool, stack, stacked_conv):
        """The causal conv over (B, T, C) -> (its output, float32 before SiLU; the new conv states)."""
        B, T_, C, K = s.batch, s.tokens, self.conv_dim, self.cfg.linear_conv_kernel_dim
        # a decode step runs verify's conv kernel on its one token: no window concatenated and
        # transposed, and its state goes into the layers' stack (dlight's schedule of the Relax conv
        # over the window takes 100 us a layer at 16 sequences on the H200)
        step = not keep_states and stack is not None and isinstance(T_, int) and T_ == 1
        if keep_states or step:   # verify: the window of every token follows its parents (a chain unless rewritten)
            conv_kernel = kernels.gdn_conv_verify(C, K, self.dtype, self.gpu, stack=stack, step=step)
            args = [conv_state, mixed, self.conv1d.weight, s.parents if keep_states else s.slots, s.slots]
            conv_type = Tensor.placeholder((B, T_, C), "float32")
            states_type = Tensor.placeholder((B, T_, stack[0], C, K - 1) if stack else (B, T_, C, K - 1), self.dtype)
            if stack and stack[1] > 0:
                new_conv, conv = op.tensor_ir_inplace_op(conv_kernel, "gdn_conv_verify", [*args, stacked_conv],
                                                         [len(args), -1], [states_type, conv_type])
            else:
                conv, new_conv = op.tensor_ir_op(conv_kernel, "gdn_conv_verify", args, [conv_type, states_type])
        else:     # prefill: the conv and the state after each sequence's last real token
            if stack is not None:
                conv_state = op.squeeze(slice_axis(conv_state, 1, stack[1], stack[1] + 1, "conv_state"), 1)
            conv, new_conv = op.tensor_ir_op(kernels.gdn_conv_prefill(C, K, self.dtype, self.gpu), "gdn_conv_prefill",
                                             [conv_state, mixed, self.conv1d.weight, s.slots],
                                             [Tensor.placeholder((B, T_, C), "float32"),
                                              Tensor.placeholder((B, C, K - 1), self.dtype)])
        return conv, new_conv

    def _heads(self, conv: Tensor, B, T_) -> tuple[Tensor, Tensor, Tensor]:
        """From the conv output (B, T, C) float32: q, k (SiLU'd in the layer's dtype, L2-normed, q
        scaled, repeated to the value heads) and v, float32 (B, T, H, d) (`kernels.gdn_heads`)."""
        cfg = self.cfg
        nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
            cfg.linear_value_head_dim
        kernel = kernels.gdn_heads(nk, nv, dk, dv, self.dtype, self.gpu)
        return op.tensor_ir_op(kernel, "gdn_heads", [conv], [Tensor.placeholder((B, T_, nv, dk), "float32"),
                                                             Tensor.placeholder((B, T_, nv, dk), "float32"),
                                                             Tensor.placeholder((B, T_, nv, dv), "float32")])

    def _gates(self, b: Tensor, a: Tensor, B, T_) -> tuple[Tensor, Tensor]:
        """beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias), float32 (B, T, H)."""
        nv = self.cfg.linear_num_value_heads
        beta = op.reshape(op.sigmoid(op.astype(b, "float32")), (B, T_, nv))
        g = op.negative(op.exp(op.astype(self.A_log, "float32"))) * \
            op.softplus(op.astype(a, "float32") + op.astype(self.dt_bias, "float32"))
        return beta, op.reshape(g, (B, T_, nv))

    def _recurrence(self, q, k, v, g, beta, rec_state, s: StepInputs, keep_states: bool, stack, stacked):
        """The gated delta rule -> (o (B, T, H, dv), the new recurrent states or per-token records)."""
        cfg = self.cfg
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        B, T_ = s.batch, s.tokens
        kernel = kernels.gated_delta_rule(nv, dk, dv, keep_states, self.gpu, stack=stack)
        # prefill / decode follow the previous token: parents is not read there
        args = [q, k, v, g, beta, rec_state, s.slots, s.parents if keep_states else s.slots]
        o_type = Tensor.placeholder((B, T_, nv, dv), "float32")
        if keep_states:   # verify: the per-token records commit rebuilds states from (+ the kernel's scratch)
            width = kernels.record_width(dk, dv)
            rec_type = Tensor.placeholder((B, T_, stack[0], nv, width) if stack else (B, T_, nv, width), "float32")
            scratch = Tensor.placeholder((B, T_, nv, dk, dv), "float32")
            if stack and stack[1] > 0:
                new_rec, o, _ = op.tensor_ir_inplace_op(kernel, "gated_delta_rule", [*args, stacked],
                                                        [len(args), -1, -1], [rec_type, o_type, scratch])
            else:
                o, new_rec, _ = op.tensor_ir_op(kernel, "gated_delta_rule", args, [o_type, rec_type, scratch])
            return o, new_rec
        state_type = Tensor.placeholder((B, stack[0], nv, dk, dv) if stack else (B, nv, dk, dv), "float32")
        if stack and stack[1] > 0:
            new_rec, o = op.tensor_ir_inplace_op(kernel, "gated_delta_rule", [*args, stacked], [len(args), -1],
                                                 [state_type, o_type])
        else:
            o, new_rec = op.tensor_ir_op(kernel, "gated_delta_rule", args, [o_type, state_type])
        return o, new_rec


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, dtype: str, gpu: bool, capacity: int, n_rows: int,
                 n_attn: int, pool_rows: bool | None = None):
        eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, zc, dtype, gpu)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zc, dtype, gpu)
        if kind == "full_attention":
            self.self_attn = Attention(cfg, dtype, gpu, capacity, n_rows, n_attn, pool_rows)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype, gpu)
        self.mlp = MLP(cfg, dtype)
