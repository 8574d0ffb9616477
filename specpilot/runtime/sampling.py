"""Sampled decoding on every engine: a model wrapper whose rows are sampling scores, not logits.

`core.sampling` defines the draw: the token at position p is the argmax of logits / T plus
Gumbel noise keyed by (seed, p), over the tokens top-k / top-p keep.  `Sampled` turns a model's
logits rows into those scores, each row keyed by the position of the token it predicts; the
greedy loops of `runtime.decoding` then run unchanged on the scores (their argmax, ties to the
lowest index, is the sampled token), so speculative sampling accepts a draft exactly when
autoregressive sampling would have drawn it.

The scores come from the build's ``sample_scores`` function (the noise made inside the compiled
module) for compiled models, and from `reference_scores` (the same hash in PyTorch) for the
stock reference.  Which tokens top-k / top-p keep is decided here, where the logits are: the
lowest kept logit per row (`controls`) goes to the scoring function with 1 / T.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from specpilot.core.sampling import GOLDEN, KEY_WORDS, MASKED, MIX, WORD, SamplingParams


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 over int64 tensors holding uint32 values (products wrap mod 2**64, then masked)."""
    x = x ^ (x >> 16)
    x = (x * MIX[0]) & WORD
    x = x ^ (x >> 15)
    x = (x * MIX[1]) & WORD
    return x ^ (x >> 16)


def reference_scores(logits: torch.Tensor, keys: np.ndarray, controls: torch.Tensor) -> torch.Tensor:
    """`kernels.sample_scores` in PyTorch: logits (R, V) float32, keys (R, 3) int32 words, controls
    (R, 2) = (1 / T, lowest kept logit) -> scores (R, V) float32."""
    device = logits.device
    words = torch.as_tensor(np.asarray(keys, dtype=np.int64) & WORD, device=device)
    h = _mix((words[:, 0] + GOLDEN) & WORD)
    for w in range(1, KEY_WORDS):
        h = _mix(h ^ ((words[:, w] + GOLDEN) & WORD))
    token = torch.arange(logits.shape[1], device=device, dtype=torch.int64)
    h = _mix(h[:, None] ^ ((token[None, :] + GOLDEN) & WORD))
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    noisy = logits.float() * controls[:, :1] - torch.log(-torch.log(u))
    return torch.where(logits >= controls[:, 1:], noisy, torch.full_like(noisy, MASKED))


def controls(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(R, 2) float32 where the logits are: 1 / T and the lowest logit top-k then top-p keep (top-p
    over the top-k tokens' renormalised softmax(logits / T): the smallest set whose mass reaches
    top_p, the token that crosses it included; -inf when nothing is cut).  Every token with a
    logit at or above the threshold is kept, so equal logits are kept or cut together."""
    rows, vocab = logits.shape
    inv_t = float(np.float32(1.0 / params.temperature))
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:      # nothing cut: the same controls for any logits
        return _uncut(inv_t, str(logits.device)).expand(rows, 2)
    values = torch.topk(logits.float(), k, dim=-1).values       # descending
    low = values[:, -1] if k < vocab else torch.full((rows,), float("-inf"), device=logits.device)
    if params.top_p < 1.0:
        probs = torch.softmax(values * inv_t, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        keep = (before < params.top_p).sum(-1).clamp(min=1)
        low = values.gather(1, (keep - 1)[:, None])[:, 0]
    return torch.stack([torch.full_like(low, inv_t), low], dim=1)


@functools.lru_cache(maxsize=64)
def _uncut(inv_t: float, device: str) -> torch.Tensor:
    """(1, 2) controls that cut nothing, made once per temperature and device (a copy to a GPU
    from host memory would wait for the device)."""
    return torch.tensor([[inv_t, float("-inf")]], device=device)


def keys(params: SamplingParams, positions) -> np.ndarray:
    """(R, 3) int32 key words for rows predicting the tokens at ``positions``."""
    return np.array([params.key_words(int(p)) for p in positions], dtype=np.int32).reshape(-1, KEY_WORDS)


def _positions(tokens, state, positions) -> list[int]:
    """The sequence positions of a step's input tokens (their rows predict the next ones)."""
    if positions is None:
        return list(range(state.length, state.length + len(tokens)))
    if isinstance(positions, torch.Tensor):
        return positions.reshape(-1).tolist()
    return [int(p) for p in np.asarray(positions).reshape(-1)]


def scorer_for(model):
    """The scoring function for ``model``'s rows: its build's ``sample_scores`` for a compiled
    model (it carries its ``module``), the PyTorch reference otherwise."""
    module = getattr(model, "module", None)
    return module.sample_scores if module is not None and hasattr(module, "sample_scores") else reference_scores


def sampled(model, params: SamplingParams | None):
    """``model`` sampling under ``params``; the model itself for greedy decoding (None or T = 0)."""
    if params is None or params.greedy:
        return model
    return Sampled(model, params, scorer_for(model))


class Sampled:
    """``model`` with each logits row replaced by its sampling scores under ``params`` (rows keyed
    by the position of the token they predict).  ``score(logits, keys, controls)``: the build's
    ``sample_scores`` or `reference_scores`.  Everything else is the model's own."""

    def __init__(self, model, params: SamplingParams, score):
        if params.greedy:
            raise ValueError("Sampled needs a temperature > 0 (temperature 0 is the model itself)")
        self.model, self.params, self.score = model, params, score

    def __getattr__(self, name):
        return getattr(self.model, name)

    def scores(self, logits: torch.Tensor, predicted_positions) -> torch.Tensor:
        return self.score(logits, keys(self.params, predicted_positions), controls(logits, self.params))

    def forward(self, tokens, state, positions=None, attn_mask=None, record: bool = False, parents=None):
        pos = _positions(tokens, state, positions)
        rows = self.model.forward(tokens, state, positions, attn_mask, record, parents)
        return self.scores(rows, [p + 1 for p in pos])

    def forward_batch(self, items, record: bool = False) -> list[torch.Tensor]:
        pos = [_positions(it[0], it[1], it[2] if len(it) > 2 else None) for it in items]
        rows = self.model.forward_batch(items, record)
        return [self.scores(r, [p + 1 for p in ps]) for r, ps in zip(rows, pos)]

    def forward_view(self, tokens, state, positions, attn_mask, parents):
        pos = _positions(tokens, state, positions)
        rows = self.model.forward_view(tokens, state, positions, attn_mask, parents)
        return self.scores(rows, [p + 1 for p in pos])

    @property
    def step_on_device(self):
        """The model's on-device decode step, sampled (absent where the model has none)."""
        step = self.model.step_on_device

        def sampled_step(token, state):
            position = state.length + 1
            return self.scores(step(token, state)[None], [position])[0]
        return sampled_step
