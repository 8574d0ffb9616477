"""Distilling an early-exit adapter (compiler.adapter) from its target.

The drafter is the target's first L layers, one trained decoder layer and a trained final norm,
with the target's embeddings and head.  Training needs only the target: every batch runs the
frozen target once (its logits are the teacher, its hidden state after L layers is the
adapter's input) and each adapter learns KL(target || drafter) over the whole vocabulary, so the
drafter's top-k -- what a best-first tree expands -- is trained, not just its argmax.

Data: windows of a code corpus (the Python standard library by default) and the target's own
greedy continuations of code prompts and, for chat models, of questions the target itself
samples (self-distillation: the drafter learns the outputs it will be asked to predict).
Prompts listed in ``holdout`` (a benchmark's) are never trained on.

Attention-only targets (Llama, Qwen2/3): the batched forward here is the reference model's
arithmetic (`runtime.reference.model`) for whole padded batches, differentiable; a test holds
the two equal.
"""

from __future__ import annotations

import math
import random
import re
import sysconfig
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specpilot.core.adapter import adapter_shapes, target_digest
from specpilot.core.config import ModelConfig
from specpilot.core.errors import SpecPilotError
from specpilot.runtime.reference.model import linear, rms_norm, rotate_half


# -- the batched forward ----------------------------------------------------------------
def rotary(cfg: ModelConfig, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rot = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float, device=positions.device) / rot))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def attention_layer(cfg: ModelConfig, w: dict, p: str, h: torch.Tensor, cos, sin, mask, cache=None):
    """One attention decoder layer over (B, T, H); ``mask`` (B, 1, T, S) bool, True = attend;
    ``cache``: [k, v] of earlier positions (B, nkv, S - T, d), extended in place."""
    B, T, _ = h.shape
    d, nh, nkv, rot = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rotary_dim
    x = rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    a = p + "self_attn."
    q = linear(x, w, a + "q_proj")
    gate = None
    if cfg.attn_output_gate:
        q, gate = q.view(B, T, nh, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
    q = q.reshape(B, T, nh, d)
    k = linear(x, w, a + "k_proj").view(B, T, nkv, d)
    v = linear(x, w, a + "v_proj").view(B, T, nkv, d)
    if cfg.qk_norm:
        q = rms_norm(q, w[a + "q_norm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
        k = rms_norm(k, w[a + "k_norm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    q = torch.cat((q[..., :rot] * c + rotate_half(q[..., :rot]) * s, q[..., rot:]), dim=-1)
    k = torch.cat((k[..., :rot] * c + rotate_half(k[..., :rot]) * s, k[..., rot:]), dim=-1)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        if cache:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        cache[:] = [k, v]
    group = nh // nkv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
    out = out.transpose(1, 2).reshape(B, T, nh * d)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    h = h + linear(out, w, a + "o_proj")
    x = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, cfg.zero_centered_norm)
    return h + linear(F.silu(linear(x, w, p + "mlp.gate_proj")) * linear(x, w, p + "mlp.up_proj"), w,
                       p + "mlp.down_proj")


def head(cfg: ModelConfig, w: dict, h: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    h = rms_norm(h, norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
    return F.linear(h, w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"])


def masks(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, attention mask) for left- or right-padded rows: causal over valid keys; a
    padding query sees itself (so no row is empty)."""
    B, T = valid.shape
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=valid.device)
    return positions, ((causal & valid[:, None, :]) | eye)[:, None]


def forward(cfg: ModelConfig, w: dict, tokens: torch.Tensor, valid: torch.Tensor, exits=()):
    """Target logits (B, T, V) and {L: hidden state after L layers} for L in ``exits`` (0 .. layers)."""
    positions, mask = masks(valid)
    cos, sin = rotary(cfg, positions, w["model.embed_tokens.weight"].dtype)
    h = F.embedding(tokens, w["model.embed_tokens.weight"])
    hidden = {}
    for i in range(cfg.num_hidden_layers):
        if i in exits:
            hidden[i] = h
        h = attention_layer(cfg, w, f"model.layers.{i}.", h, cos, sin, mask)
    if cfg.num_hidden_layers in exits:
        hidden[cfg.num_hidden_layers] = h
    return head(cfg, w, h, w["model.norm.weight"]), hidden


@torch.no_grad()
def generate(cfg: ModelConfig, w: dict, prompts: list[list[int]], max_new: int, stop: set[int],
             temperature: float = 0.0, rng: torch.Generator | None = None) -> list[list[int]]:
    """Greedy (or sampled) continuations of left-padded prompts with a KV cache; each stops
    after a token in ``stop`` (included)."""
    dev = w["model.embed_tokens.weight"].device
    dtype = w["model.embed_tokens.weight"].dtype
    B, T = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
    valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, T - len(p):] = torch.tensor(p, device=dev)
        valid[b, T - len(p):] = True
    caches = [[] for _ in range(cfg.num_hidden_layers)]
    steps: list[torch.Tensor] = []
    stop_ids = torch.tensor(sorted(stop) or [-1], device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    positions, mask = masks(valid)
    step_tokens = tokens
    for _ in range(max_new):
        cos, sin = rotary(cfg, positions, dtype)
        h = F.embedding(step_tokens, w["model.embed_tokens.weight"])
        for i in range(cfg.num_hidden_layers):
            h = attention_layer(cfg, w, f"model.layers.{i}.", h, cos, sin, mask, caches[i])
        logits = head(cfg, w, h[:, -1], w["model.norm.weight"]).float()
        if temperature > 0:   # Gumbel-max: a sample of softmax(logits / temperature)
            u = torch.rand(logits.shape, generator=rng, device=dev).clamp_(min=1e-20)
            nxt = (logits / temperature - torch.log(-torch.log(u))).argmax(-1)
        else:
            nxt = logits.argmax(-1)
        steps.append(torch.where(done, -1, nxt))
        done |= torch.isin(nxt, stop_ids)
        if len(steps) % 16 == 0 and bool(done.all()):   # one device sync per 16 tokens
            break
        valid = torch.cat((valid, torch.ones(B, 1, dtype=torch.bool, device=dev)), dim=1)
        positions = valid.long().sum(-1, keepdim=True) - 1
        mask = valid[:, None, None, :]
        step_tokens = nxt[:, None]
    if not steps:
        return [[] for _ in range(B)]
    table = torch.stack(steps, 1).tolist()
    return [[t for t in row if t >= 0] for row in table]


# -- data ------------------------------------------------------------------------------
def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise SpecPilotError(f"{root}: no .py files to train on")
    return files


def code_prompts(files: list[Path], rng: random.Random, n: int, max_chars: int = 160, max_lines: int = 4) -> list[str]:
    """Starts of function and class definitions, dedented: the first 1 to ``max_lines`` whole lines
    (at most ``max_chars``), so the target continues from bare signatures as well as from longer
    starts (as many per file as ``n`` needs over all files, at least 3)."""
    out = []
    per_file = max(3, -(-3 * n // max(len(files), 1)))
    for path in rng.sample(files, len(files)):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        starts = [m.start() for m in re.finditer(r"(?m)^[ \t]*(?:def|class) ", text)]
        for i in rng.sample(starts, min(per_file, len(starts))):
            lines = text[i:i + max_chars].splitlines(keepends=True)
            whole = [line for line in lines if line.endswith("\n")] or lines
            out.append(textwrap.dedent("".join(whole[:rng.randint(1, max_lines)])))
            if len(out) == n:
                return out
    return out


def code_windows(files: list[Path], tokenizer, rng: random.Random, seq_len: int):
    """Endless windows of ``seq_len`` tokens from the corpus, files in a seeded order."""
    while True:
        for path in rng.sample(files, len(files)):
            try:
                ids = tokenizer.encode(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
            for s in range(0, max(len(ids) - seq_len // 2, 1), seq_len):
                window = ids[s:s + seq_len]
                if len(window) >= seq_len // 2:
                    yield window


def chat_markers(tokenizer) -> tuple[str, str] | None:
    """ChatML markers when the tokenizer has them as single tokens."""
    try:
        if len(tokenizer.encode("<|im_start|>")) == 1 and len(tokenizer.encode("<|im_end|>")) == 1:
            return "<|im_start|>", "<|im_end|>"
    except SpecPilotError:
        pass
    return None


def target_sequences(cfg: ModelConfig, w: dict, tokenizer, generated: int, seq_len: int, files: list[Path],
                     rng: random.Random, seed: int, holdout=(), max_new: int = 96, log=print) -> list[list[int]]:
    """The target's own outputs to distil from, shuffled: greedy continuations of code prompts and,
    for chat models, of questions the target itself samples (prompt tokens first in each)."""
    started = time.perf_counter()
    device = w["model.embed_tokens.weight"].device
    gen = torch.Generator(device=device).manual_seed(seed)
    held = {t.strip() for t in holdout}
    # the target's own outputs: greedy continuations of code prompts and of questions it samples
    markers = chat_markers(tokenizer)
    texts = [t for t in code_prompts(files, rng, generated // 2 if markers else generated) if t.strip() not in held]
    stop = set(cfg.eos_token_ids)
    sequences: list[list[int]] = []
    # rows a generation pass: a GPU decode step costs about the same at 128 or 1024 rows; on the CPU a step of
    # this reference costs 86 / 160 / 245 ms at 8 / 32 / 64 rows (SmolLM2, 2 cores)
    gen_batch = 1024 if device.type != "cpu" else 64
    if markers:
        start, end = markers
        end_id = tokenizer.encode(end)[0]
        head_ids = tokenizer.encode(f"{start}user\n")
        questions, tries = [], 0
        want = generated - len(texts)
        while len(questions) < want and tries < 64 * want + gen_batch:   # a target that rarely ends one
            # whole batches: most samples that do not end within the limit are long, not broken
            # on the CPU no more than about what is still wanted (about 1 in 8 samples ends in time)
            n = gen_batch if device.type != "cpu" else min(gen_batch, 8 * (want - len(questions)))
            tries += n
            for q in generate(cfg, w, [head_ids] * n, 64, {end_id}, temperature=0.9, rng=gen):
                text = tokenizer.decode([t for t in q if t != end_id]).strip()
                if q and q[-1] == end_id and text and text not in held:
                    questions.append(text)
        questions = questions[:want]
        texts += [f"{start}user\n{q}{end}\n{start}assistant\n" for q in questions]
        log(f"sampled {len(questions)} questions ({tries} samples, {len(questions) / max(tries, 1):.0%} kept: "
            f"ended within 64 tokens, not held out) in {time.perf_counter() - started:.0f} s")
        stop.add(end_id)
    prompts = [tokenizer.encode(t) for t in texts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))   # similar lengths per batch
    for s in range(0, len(order), gen_batch):
        idx = order[s:s + gen_batch]
        outs = generate(cfg, w, [prompts[i] for i in idx], max_new, stop)
        sequences += [(prompts[i] + o)[:seq_len] for i, o in zip(idx, outs)]
    rng.shuffle(sequences)
    log(f"generated {len(sequences)} target continuations ({sum(map(len, sequences))} tokens) in "
        f"{time.perf_counter() - started:.0f} s")
    for seq in sequences[:3]:
        log("  e.g. " + repr(tokenizer.decode(seq)[:160]))
    return sequences


# -- training --------------------------------------------------------------------------
@dataclass
class AdapterResult:
    layers: int
    tensors: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)
    heldout: dict = field(default_factory=dict)


def _init_adapter(cfg: ModelConfig, weights: dict, layers: int, device) -> dict[str, torch.nn.Parameter]:
    """The adapter starts as the target's layer ``layers`` and its final norm."""
    return {name: torch.nn.Parameter(weights[name].detach().to(device, torch.float32).clone())
            for name in adapter_shapes(cfg, layers)}


def pad_rows(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), T, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = torch.tensor(r, device=device)
        valid[b, :len(r)] = True
    return tokens, valid


def _adapter_logits(cfg, w, params, L, hidden, valid):
    positions, mask = masks(valid)
    cos, sin = rotary(cfg, positions, hidden.dtype)
    layer = {**w, **{k: v.to(hidden.dtype) for k, v in params.items()}}
    h = attention_layer(cfg, layer, f"model.layers.{L}.", hidden, cos, sin, mask)
    return head(cfg, w, h, layer["model.norm.weight"])


def lr_factor(step: int, steps: int, elapsed: float = 0.0, budget: float | None = None) -> float:
    """The learning rate's factor at ``step``: a linear warm-up over the first 5 % of the steps (at most
    100), then a cosine over the run's progress -- steps done or the share of the time ``budget`` spent,
    whichever is further, so a run stopped by its time limit still ends annealed."""
    warm = max(1, min(steps // 20, 100))
    done = step / steps if budget is None else max(step / steps, elapsed / budget)
    return min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))


def time_left(time_limit: float | None, started: float) -> float | None:
    """The seconds a run's ``time_limit`` leaves now, counted from ``started`` (``time.perf_counter``):
    generating its data counts too; at most 0 leaves no training step.  None: no limit."""
    return None if time_limit is None else time_limit - (time.perf_counter() - started)


def train_adapters(cfg: ModelConfig, weights: dict, tokenizer, layers: list[int], *, steps: int, batch: int,
                   seq_len: int, generated: int, device: str = "cpu", lr: float = 3e-4, seed: int = 0,
                   holdout: list[str] = (), corpus: Path | None = None, max_new: int = 96,
                   time_limit: float | None = None, log=print) -> tuple[list[AdapterResult], dict]:
    """Distil one adapter per exit layer in ``layers`` (all from the same target passes)."""
    _check_exits(cfg, layers)
    started = time.perf_counter()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    w = {k: v.to(device, dtype) for k, v in weights.items()}
    files = stdlib_files(corpus)
    sequences = target_sequences(cfg, w, tokenizer, generated, seq_len, files, rng, seed, holdout, max_new, log)
    n_held = max(1, len(sequences) // 10)
    heldout, train_seqs = sequences[:n_held], sequences[n_held:]
    gen_seconds = time.perf_counter() - started

    windows = code_windows(files, tokenizer, rng, seq_len)
    params = {L: _init_adapter(cfg, weights, L, device) for L in layers}
    opts = {L: torch.optim.AdamW(list(p.values()), lr=lr, weight_decay=0.0) for L, p in params.items()}
    results = {L: AdapterResult(L, {}) for L in layers}
    train_start = time.perf_counter()
    budget = time_left(time_limit, started)
    done, factor, next_log = 0, 0.0, 0.0
    for step in range(steps):
        elapsed = time.perf_counter() - train_start
        if budget is not None and elapsed >= budget:
            log(f"time limit: stopped after {step} steps")
            break
        factor = lr_factor(step, steps, elapsed, budget)
        rows = [next(windows) if i % 2 == 0 or not train_seqs else train_seqs[rng.randrange(len(train_seqs))]
                for i in range(batch)]
        for L, loss in _adapter_step(cfg, w, params, opts, rows, device, lr * factor).items():
            results[L].losses.append(loss)
        done = step + 1
        if max(step / steps, 0.0 if budget is None else elapsed / budget) >= next_log or step == steps - 1:
            next_log += 0.1
            log(f"step {step}: " + ", ".join(f"L{L} KL {results[L].losses[-1]:.3f}" for L in layers))
    _evaluate_adapters(cfg, w, params, results, heldout, device, log)
    info = {"steps": done, "batch": batch, "seq_len": seq_len, "lr": lr, "last_lr": lr * factor, "seed": seed,
            "generated_sequences": len(sequences), "heldout_sequences": len(heldout),
            "generation_seconds": round(gen_seconds, 1), "seconds": round(time.perf_counter() - started, 1),
            "corpus": str(corpus or "python stdlib"), "device": device, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device != "cpu" else None, "teacher_dtype": str(dtype).split(".")[1],
            "target_digest": target_digest(weights)}
    return [results[L] for L in layers], info


def _check_exits(cfg: ModelConfig, layers: list[int]) -> None:
    if cfg.is_hybrid:
        raise SpecPilotError("adapter training runs attention-only targets (Llama, Qwen2/3); this target has "
                             "Gated DeltaNet layers")
    bad = [L for L in layers if not 1 <= L < cfg.num_hidden_layers]
    if bad:
        raise SpecPilotError(f"exit layer {bad[0]} is not in 1..{cfg.num_hidden_layers - 1}")


def _adapter_step(cfg, w, params: dict, opts: dict, rows, device: str, lr: float) -> dict[int, float]:
    """One optimizer step of every adapter on the target's own distribution over ``rows`` (one target pass,
    its exits' hidden states shared); exit layer -> the KL divergence before the step."""
    tokens, valid = pad_rows(rows, device)
    with torch.no_grad():
        logits, hidden = forward(cfg, w, tokens, valid, exits=set(params))
        teacher = torch.log_softmax(logits.float(), -1)
    keep = valid.reshape(-1)
    t = teacher.reshape(-1, teacher.shape[-1])[keep]
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device != "cpu" else torch.autocast(
        device_type="cpu", enabled=False)
    losses = {}
    for L, opt in opts.items():
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast:
            student = _adapter_logits(cfg, w, params[L], L, hidden[L], valid)
        logp = torch.log_softmax(student.float(), -1).reshape(-1, student.shape[-1])[keep]
        loss = F.kl_div(logp, t, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params[L].values()), 1.0)
        opt.step()
        losses[L] = float(loss.detach())
    return losses


def _evaluate_adapters(cfg, w, params: dict, results: dict, heldout, device: str, log) -> None:
    for L, p in params.items():
        results[L].heldout = evaluate(cfg, w, {k: v.detach() for k, v in p.items()}, L, heldout, device)
        results[L].tensors = {k: v.detach().to("cpu", torch.float32) for k, v in p.items()}
        log(f"L{L}: held-out top-1 agreement {results[L].heldout['top1']:.3f} "
            f"(early exit without adapter {results[L].heldout['top1_no_adapter']:.3f}), "
            f"target's token in top 4 {results[L].heldout['top4']:.3f}")


@torch.no_grad()
def evaluate(cfg, w, params, L, sequences, device, batch: int = 32) -> dict:
    """On held-out target continuations: how often the drafter's argmax is the target's
    (the adapter, and the bare early exit) and how often the target's is in its top 4."""
    top1 = top4 = bare = n = 0
    for s in range(0, len(sequences), batch):
        tokens, valid = pad_rows(sequences[s:s + batch], device)
        logits, hidden = forward(cfg, w, tokens, valid, exits={L})
        want = logits.argmax(-1)[valid]
        student = _adapter_logits(cfg, w, params, L, hidden[L], valid)[valid]
        top1 += int((student.argmax(-1) == want).sum())
        top4 += int((student.topk(4, -1).indices == want[:, None]).any(-1).sum())
        bare += int((head(cfg, w, hidden[L], w["model.norm.weight"])[valid].argmax(-1) == want).sum())
        n += int(valid.sum())
    n = max(n, 1)
    return {"positions": n, "top1": top1 / n, "top4": top4 / n, "top1_no_adapter": bare / n}
