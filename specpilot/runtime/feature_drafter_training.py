"""Distilling block (DFlash) and feature (EAGLE-3) drafters from their target alone.

Data are the target's own outputs (`drafter_training.target_sequences`: greedy continuations of
code prompts and of chat questions it samples) mixed with code windows; every batch runs the
frozen target once for its features and its next-token distributions (the teacher), and the
drafter learns KL(target || drafter) over the vocabulary at each position it predicts.

- block: blocks [t_a, mask, ...] at random anchors a see the target features of positions < a
  and each other; block position k learns the target's distribution after t_{a+k-1}, weighted
  exp(-(k-1)/gamma) (DFlash's recipe: gamma 7, 5, 4 for blocks of 16, 10, 8; `loss_decay`).
- feature: the pair (feature j, t_{j+1}) learns the target after t_{j+1}; ``steps`` > 1 trains
  later draft steps on the drafter's own outputs (EAGLE-3's training-time test: step s sees the
  context's pairs and its own earlier steps at the same position).

The batched forwards here are the inference networks' arithmetic (`reference.feature_nets`) for
padded batches, differentiable; a test holds them equal.  Training resumes from the output
directory: state.safetensors (weights and optimizer moments, no pickles) and state.json.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.core import feature_drafter as fd
from specpilot.core.adapter import target_digest
from specpilot.core.config import ModelConfig
from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_save_tensors, atomic_write_text
from specpilot.runtime.drafter_training import (code_windows, forward, lr_factor, pad_rows, stdlib_files, time_left,
                                                 target_sequences)
from specpilot.runtime.reference.feature_nets import plain_rms_norm
from specpilot.runtime.reference.model import rotate_half


def _rope(cfg: fd.DraftNetConfig, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, d) rotated at positions (B, T)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float, device=x.device) / cfg.head_dim))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos().to(x.dtype)[:, :, None] + rotate_half(x) * emb.sin().to(x.dtype)[:, :, None]


def _heads(cfg, w, p: str, x: torch.Tensor, positions: torch.Tensor, which: str) -> torch.Tensor:
    n = cfg.num_heads if which == "q" else cfg.num_kv_heads
    y = F.linear(x, w[f"{p}self_attn.{which}_proj.weight"]).view(*x.shape[:2], n, cfg.head_dim)
    if which != "v" and cfg.qk_norm:
        y = plain_rms_norm(y, w[f"{p}self_attn.{which}_norm.weight"], cfg.rms_norm_eps)
    return _rope(cfg, y, positions) if which != "v" else y


def _mlp(cfg, w, p: str, h: torch.Tensor) -> torch.Tensor:
    x = plain_rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    return F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                    w[p + "mlp.down_proj.weight"])


def _expand(cfg, t: torch.Tensor) -> torch.Tensor:
    """(B, S, kv heads, d) -> (B, heads, S, d)."""
    return t.transpose(1, 2).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)


def block_forward(cfg: fd.DraftNetConfig, w: dict, embed: torch.Tensor, head: torch.Tensor, features: torch.Tensor,
                  tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits (B, Q, vocab) of query tokens (B, Q) at ``positions`` after context ``features``
    (B, T, F) at positions 0 .. T-1; ``mask`` (B, Q, T + Q): True where a query may look."""
    B, T = features.shape[:2]
    ctx = plain_rms_norm(F.linear(features.to(embed.dtype), w["fc.weight"]), w["hidden_norm.weight"], cfg.rms_norm_eps)
    ctx_pos = torch.arange(T, device=features.device).expand(B, T)
    h = F.embedding(tokens, embed)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        x = plain_rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = _heads(cfg, w, p, x, positions, "q").transpose(1, 2)
        k = torch.cat([_heads(cfg, w, p, ctx, ctx_pos, "k"), _heads(cfg, w, p, x, positions, "k")], dim=1)
        v = torch.cat([_heads(cfg, w, p, ctx, ctx_pos, "v"), _heads(cfg, w, p, x, positions, "v")], dim=1)
        out = F.scaled_dot_product_attention(q, _expand(cfg, k), _expand(cfg, v), attn_mask=mask[:, None])
        h = h + F.linear(out.transpose(1, 2).reshape(*h.shape[:2], -1), w[p + "self_attn.o_proj.weight"])
        h = h + _mlp(cfg, w, p, h)
    return F.linear(plain_rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), head)


def feature_forward(cfg: fd.DraftNetConfig, w: dict, embed: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                    valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per draft step s, logits (B, T, draft vocab) of pair j's prediction: step 0 pairs (feature j,
    t_{j+1}), step s (its step s-1 output, t_{j+1+s}) at position j + s, attending to the pairs of
    positions <= j (step 0) and to its own earlier steps at j."""
    B, T = tokens.shape
    p = "midlayer."
    hidden = F.linear(features.to(embed.dtype), w["fc.weight"])
    base = torch.arange(T, device=tokens.device).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()[None] & valid[:, None, :]
    keys, values, out = [], [], []
    for s in range(steps):
        nxt = F.pad(tokens[:, 1 + s:], (0, 1 + s))      # t_{j+1+s}; past the end: padding, not trained
        x = torch.cat([plain_rms_norm(F.embedding(nxt, embed), w[p + "input_layernorm.weight"], cfg.rms_norm_eps),
                       plain_rms_norm(hidden, w[p + "hidden_norm.weight"], cfg.rms_norm_eps)], dim=-1)
        q = _heads(cfg, w, p, x, base + s, "q").transpose(1, 2)                   # (B, H, T, d)
        keys.append(_expand(cfg, _heads(cfg, w, p, x, base + s, "k")))
        values.append(_expand(cfg, _heads(cfg, w, p, x, base + s, "v")))
        scale = cfg.head_dim ** -0.5
        first = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal[:, None], float("-inf"))
        diag = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]          # the same position's later steps
        probs = torch.softmax(torch.cat([first, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        att = probs[..., :T] @ values[0]
        for i, v in enumerate(values[1:]):
            att = att + probs[..., T + i:T + i + 1] * v
        h = hidden + F.linear(att.transpose(1, 2).reshape(B, T, -1), w[p + "self_attn.o_proj.weight"])
        h = h + _mlp(cfg, w, p, h)
        out.append(F.linear(plain_rms_norm(h, w["norm.weight"], cfg.rms_norm_eps), w["lm_head.weight"]))
        hidden = h
    return out


# -- training --------------------------------------------------------------------------
@dataclass
class Options:
    steps: int = 2000
    batch: int = 16
    seq_len: int = 256
    generated: int = 2048
    lr: float = 6e-4
    seed: int = 0
    device: str = "cpu"
    blocks: int = 32           # block: anchors per sequence (distinct)
    gamma: float | None = None   # block: position weights exp(-(k - 1) / gamma) (None: `loss_decay`'s)
    ttt: int = 3               # feature: draft steps trained
    time_limit: float | None = None
    holdout: list = field(default_factory=list)
    corpus: Path | None = None
    save_every: int = 200
    teacher_dtype: str | None = None   # the frozen target's dtype (None: bfloat16 on GPUs, float32 on the CPU)


def draft_vocabulary(sequences: list[list[int]], size: int) -> torch.Tensor:
    """The ``size`` tokens the target's outputs use most (ties: lower id first), ascending: a drafter's
    draft vocabulary (EAGLE-3 keeps 32k of Llama 3's 128k)."""
    counts = torch.bincount(torch.tensor([t for s in sequences for t in s], dtype=torch.long))
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))[:size]
    if len(order) < size:
        order += [t for t in range(size * 2) if t not in set(order)][:size - len(order)]
    return torch.tensor(sorted(order))


def init_tensors(cfg: fd.DraftNetConfig, target_cfg: ModelConfig, weights: dict, seed: int,
                 vocab_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Seeded weights, with what the target has of the same shape copied in: its last layers' MLPs and
    attention where shapes match, its final norm, and (feature) its head's rows of the draft vocabulary
    (``vocab_ids``, default the whole vocabulary); d2t maps the draft vocabulary (either kind)."""
    out = fd.random_init(cfg, seed)
    last = target_cfg.num_hidden_layers - 1
    if vocab_ids is not None:
        out["d2t"] = fd.d2t_of(vocab_ids)
    for name in out:
        if name == "lm_head.weight":
            head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
            source = head[vocab_ids] if vocab_ids is not None else head
        elif name.startswith(("layers.", "midlayer.")):
            rest = name.split(".", 2)[2] if name.startswith("layers.") else name.split(".", 1)[1]
            i = int(name.split(".")[1]) if name.startswith("layers.") else 0
            source = weights.get(f"model.layers.{max(last - cfg.num_layers + 1 + i, 0)}.{rest}")
        else:
            source = None
        if source is not None and tuple(source.shape) == tuple(out[name].shape):
            out[name] = source.detach().float().clone()
    return out


def sample_anchors(valid_len: list[int], blocks: int, rng: random.Random) -> list[list[int]]:
    """Up to ``blocks`` distinct anchors a row, ascending, each with at least one label after it
    (1 <= a <= n - 2): DFlash trains many blocks of one sequence against one teacher pass."""
    return [sorted(rng.sample(range(1, n - 1), min(blocks, n - 2))) if n > 2 else [] for n in valid_len]


def block_batch(cfg, anchors: list[list[int]], tokens: torch.Tensor, valid_len: list[int], device, gamma: float):
    """The blocks at ``anchors`` as one padded batch: query tokens (B, Q), positions (B, Q), the mask
    (B, Q, T + Q) and the labels (row, query, teacher position, weight) as four tensors.  Block j of
    row b holds [t_a, mask, ...] at positions a .. a + bs - 1; it sees the features of positions < a
    and its own block; its query k >= 1 learns the teacher after t_{a+k-1}, weighted
    exp(-(k-1)/gamma), where a + k is inside the row.  Padding queries see only themselves."""
    bs, B, T = cfg.block_size, tokens.shape[0], tokens.shape[1]
    n = max((len(a) for a in anchors), default=0)
    Q = max(n, 1) * bs
    anchor = torch.zeros(B, max(n, 1), dtype=torch.long)
    keep = torch.zeros(B, max(n, 1), dtype=torch.bool)
    for b, row in enumerate(anchors):
        anchor[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        keep[b, :len(row)] = True
    block, k = torch.arange(Q) // bs, torch.arange(Q) % bs
    a_q, keep_q = anchor[:, block], keep[:, block]                          # (B, Q)
    q_pos = torch.where(keep_q, a_q + k, 0)
    first = keep_q & (k == 0)
    q_tok = torch.where(first, tokens.gather(1, a_q.clamp(max=T - 1)), cfg.mask_token_id)
    context = (torch.arange(T)[None, None, :] < a_q[:, :, None]) & keep_q[:, :, None]
    same = (block[:, None] == block[None, :])[None] & keep_q[:, :, None]
    own = torch.eye(Q, dtype=torch.bool)[None] & ~keep_q[:, :, None]
    mask = torch.cat([context, same | own], dim=-1)
    lengths = torch.tensor(valid_len, dtype=torch.long)[:, None]
    labelled = keep_q & (k >= 1) & (a_q + k < lengths)
    rows, queries = labelled.nonzero(as_tuple=True)
    steps = k[queries]
    labels = (rows, queries, a_q[rows, queries] + steps - 1, torch.exp(-(steps - 1).float() / gamma))
    return q_tok.to(device), q_pos.to(device), mask.to(device), tuple(t.to(device) for t in labels)


def loss_curve(losses: list[float], points: int = 20) -> list[float]:
    """The mean loss of each of ``points`` equal spans of the run (fewer for short runs): whether a run
    still learned at its end, in a report small enough to read."""
    n = min(points, len(losses))
    edges = [round(i * len(losses) / n) for i in range(n + 1)] if n else []
    return [round(sum(losses[a:b]) / (b - a), 4) for a, b in zip(edges, edges[1:])]


def _kl(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(student.float(), -1)
    per = (teacher.exp() * (teacher - logp)).sum(-1)
    return (per * weights).sum() / weights.sum()


def loss_decay(block_size: int) -> float:
    """DFlash's position-weight decay for a block size: 7 for blocks of 16, 5 of 10, 4 of 8 (a smaller
    block weights its later positions less, its first drafts being the ones a verification reaches)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


class Trainer:
    def __init__(self, cfg: fd.DraftNetConfig, target_cfg: ModelConfig, weights: dict, tokenizer, opts: Options,
                 out_dir: Path, log=print):
        if target_cfg.is_hybrid:
            raise SpecPilotError("drafter training runs attention-only targets (Llama, Qwen2/3); this target has "
                                 "Gated DeltaNet layers")
        self.cfg, self.target_cfg, self.opts, self.out, self.log = cfg, target_cfg, opts, Path(out_dir), log
        self.created = time.perf_counter()       # the time limit counts generating the data too
        self.digest = target_digest(weights)
        self.dtype = getattr(torch, opts.teacher_dtype) if opts.teacher_dtype else \
            torch.bfloat16 if opts.device != "cpu" else torch.float32
        self.w = {k: v.to(opts.device, self.dtype) for k, v in weights.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w.get("lm_head.weight", self.embed)
        self.tokenizer, self.rng = tokenizer, random.Random(opts.seed)
        self.gamma = opts.gamma if opts.gamma is not None else loss_decay(cfg.block_size)
        self.sequences = self.data()
        self.vocab_ids = draft_vocabulary(self.sequences, cfg.draft_vocab_size) \
            if 0 < cfg.draft_vocab_size < cfg.vocab_size else None
        if fd.sliced_head(cfg):     # a block drafter's head: the target head's rows of its vocabulary
            self.head = self.head[self.vocab_ids.to(opts.device)]
        init = init_tensors(cfg, target_cfg, weights, opts.seed, self.vocab_ids)
        self.params = {k: torch.nn.Parameter(v.to(opts.device, torch.float32)) for k, v in init.items()
                       if v.is_floating_point()}
        self.fixed = {"d2t": init["d2t"].to(opts.device)} if "d2t" in init else {}
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=opts.lr, weight_decay=0.0)
        self.step, self.losses = 0, []
        self._resume()

    # -- state ------------------------------------------------------------------------
    def _resume(self) -> None:
        meta = self.out / "state.json"
        if not meta.is_file():
            return
        from safetensors.torch import load_file
        info = json.loads(meta.read_text())
        if info.get("target_digest") != self.digest or info.get("config") != self.cfg.to_dict():
            raise SpecPilotError(f"{self.out}: holds training of another drafter or target; use a new directory")
        state = load_file(str(self.out / "state.safetensors"), device=self.opts.device)
        names = list(self.params)
        with torch.no_grad():
            for n in names:
                self.params[n].copy_(state[f"w.{n}"])
        self.opt.load_state_dict({"state": {i: {"step": torch.tensor(float(info["step"])),
                                                "exp_avg": state[f"m.{n}"], "exp_avg_sq": state[f"v.{n}"]}
                                            for i, n in enumerate(names) if f"m.{n}" in state},
                                  "param_groups": self.opt.state_dict()["param_groups"]})
        self.step, self.losses = int(info["step"]), list(info.get("losses", []))
        self.log(f"resumed at step {self.step}")

    def save_state(self) -> None:
        tensors = {f"w.{n}": p.detach() for n, p in self.params.items()}
        for i, n in enumerate(self.params):
            st = self.opt.state.get(self.params[n])
            if st:
                tensors[f"m.{n}"], tensors[f"v.{n}"] = st["exp_avg"], st["exp_avg_sq"]
        atomic_save_tensors(self.out / "state.safetensors", {k: v.contiguous() for k, v in tensors.items()})
        atomic_write_text(self.out / "state.json", json.dumps({"step": self.step, "target_digest": self.digest,
                                                               "config": self.cfg.to_dict(), "losses": self.losses}))

    def autocast(self):
        """Low-precision teachers: the drafter's float32 weights meet them in that dtype."""
        return torch.autocast(device_type=torch.device(self.opts.device).type, dtype=self.dtype,
                              enabled=self.dtype != torch.float32)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**{k: v.detach().to("cpu", torch.float32) for k, v in self.params.items()}, **self.fixed}

    # -- data and loss ------------------------------------------------------------------
    def data(self) -> list[list[int]]:
        """The target's sequences, generated once per output directory (sequences.json)."""
        cached = self.out / "sequences.json"
        if cached.is_file():
            info = json.loads(cached.read_text())
            if info.get("target_digest") == self.digest and info.get("seed") == self.opts.seed:
                return info["sequences"]
        o = self.opts
        seqs = target_sequences(self.target_cfg, self.w, self.tokenizer, o.generated, o.seq_len,
                                stdlib_files(o.corpus), random.Random(o.seed), o.seed, o.holdout, log=self.log)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cached, json.dumps({"target_digest": self.digest, "seed": o.seed, "sequences": seqs}))
        return seqs

    def teacher(self, rows: list[list[int]]):
        tokens, valid = pad_rows(rows, self.opts.device)
        with torch.no_grad():
            logits, hidden = forward(self.target_cfg, self.w, tokens, valid, exits={i + 1 for i in self.cfg.target_layers})
            features = torch.cat([hidden[i + 1] for i in self.cfg.target_layers], dim=-1)
        return tokens, valid, features, logits.float()

    def loss(self, rows: list[list[int]]) -> torch.Tensor:
        tokens, valid, features, logits = self.teacher(rows)
        if self.vocab_ids is not None:    # the target's distribution over the draft vocabulary
            logits = logits[..., self.vocab_ids.to(logits.device)]
        teacher = torch.log_softmax(logits, -1)
        w = {**self.params, **self.fixed}
        lengths = [len(r) for r in rows]
        if self.cfg.kind == "block":
            anchors = sample_anchors(lengths, self.opts.blocks, self.rng)
            q_tok, q_pos, mask, (b, q, t, wt) = block_batch(self.cfg, anchors, tokens.cpu(), lengths, self.opts.device,
                                                            self.gamma)
            student = block_forward(self.cfg, w, self.embed, self.head, features, q_tok, q_pos, mask)
            return _kl(student[b, q], teacher[b, t], wt)
        steps = feature_forward(self.cfg, w, self.embed, features, tokens, valid, self.opts.ttt)
        total = 0.0
        for s, student in enumerate(steps):
            keep = torch.zeros_like(valid)
            keep[:, :max(tokens.shape[1] - 1 - s, 0)] = valid[:, 1 + s:]
            target = F.pad(teacher[:, 1 + s:], (0, 0, 0, 1 + s))
            total = total + 0.8 ** s * _kl(student[keep], target[keep], torch.ones(int(keep.sum()), device=keep.device))
        return total / sum(0.8 ** s for s in range(len(steps)))

    # -- the run ------------------------------------------------------------------------
    def run(self, progress=None) -> dict:
        """Train to ``opts.steps`` (or the time limit) from where the directory left off; returns the
        run's facts.  ``progress(done, total, loss)`` hears every step."""
        o, started = self.opts, time.perf_counter()
        budget = time_left(o.time_limit, self.created)
        seqs = self.sequences
        n_held = max(1, len(seqs) // 10)
        heldout, train = seqs[:n_held], seqs[n_held:] or seqs
        windows = code_windows(stdlib_files(o.corpus), self.tokenizer, self.rng, o.seq_len)
        while self.step < o.steps:
            elapsed = time.perf_counter() - started
            if budget is not None and elapsed >= budget:
                self.log(f"time limit: stopped after step {self.step}")
                break
            for g in self.opt.param_groups:
                g["lr"] = o.lr * lr_factor(self.step, o.steps, elapsed, budget)
            rows = [next(windows) if i % 4 == 3 else train[self.rng.randrange(len(train))] for i in range(o.batch)]
            with self.autocast():
                loss = self.loss(rows)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), 1.0)
            self.opt.step()
            self.step += 1
            self.losses.append(round(float(loss.detach()), 5))
            if progress is not None:
                progress(self.step, o.steps, self.losses[-1])
            if self.step % o.save_every == 0:
                self.save_state()
        self.save_state()
        return {"steps": self.step, "batch": o.batch, "seq_len": o.seq_len, "lr": o.lr, "seed": o.seed,
                **({"blocks_per_sequence": o.blocks, "gamma": self.gamma} if self.cfg.kind == "block" else {}),
                "generated_sequences": len(seqs), "heldout_sequences": len(heldout),
                "seconds": round(time.perf_counter() - started, 1), "device": o.device, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if o.device != "cpu" else None, "target_digest": self.digest,
                "first_loss": self.losses[0] if self.losses else None, "last_loss": self.losses[-1] if self.losses else None,
                "loss_curve": loss_curve(self.losses), "heldout": self.evaluate(heldout)}

    @torch.no_grad()
    def evaluate(self, sequences: list[list[int]], batch: int = 16) -> dict:
        """Held-out top-1 agreement with the target's greedy token (over its whole vocabulary), per draft
        position (block: per block position at every anchor; feature: per trained step)."""
        hits: dict[int, list[int]] = {}
        w = {**self.params, **self.fixed}
        for s in range(0, len(sequences), batch):
            rows = sequences[s:s + batch]
            with self.autocast():
                tokens, valid, features, logits = self.teacher(rows)
                hits = self._hits(rows, tokens, valid, features, logits.argmax(-1), w, hits)
        return {f"top1@{k}": round(sum(v) / max(len(v), 1), 4) for k, v in sorted(hits.items())}

    def _hits(self, rows, tokens, valid, features, want, w, hits: dict) -> dict:
        """Add one batch's agreements (draft position -> list of 0/1) to ``hits``."""
        if self.cfg.kind == "block":
            lengths = [len(r) for r in rows]
            anchors = [list(range(1, n - 1, max(1, (n - 2) // 8))) for n in lengths]
            q_tok, q_pos, mask, (b, q, t, _) = block_batch(self.cfg, anchors, tokens.cpu(), lengths, self.opts.device,
                                                           self.gamma)
            got = block_forward(self.cfg, w, self.embed, self.head, features, q_tok, q_pos, mask).argmax(-1)
            if self.vocab_ids is not None:
                got = self.vocab_ids.to(got.device)[got]
            for k, same in zip((q % self.cfg.block_size).tolist(), (got[b, q] == want[b, t]).int().tolist()):
                hits.setdefault(k, []).append(same)
            return hits
        for i, student in enumerate(feature_forward(self.cfg, w, self.embed, features, tokens, valid, self.opts.ttt)):
            n = tokens.shape[1] - 1 - i
            keep = valid[:, 1 + i:] & valid[:, :n]
            got = student.argmax(-1)[:, :n]
            if self.vocab_ids is not None:
                got = self.vocab_ids.to(got.device)[got]
            hits.setdefault(i + 1, []).extend((got == want[:, 1 + i:])[keep].int().tolist())
        return hits
