"""The nested 8-bit view on the reference engine, for two-level verification without a build.

`ViewedModel` is a `ReferenceModel` plus ``forward_view``: the same step with every decoder
linear weight (and an untied lm_head) replaced by its W12 hi plane alone (`compiler.w12.decode_hi`: sign, exponent
offset, top three mantissa bits, the rest at its midpoint; escapes exact) -- what a build's
``target_verify_view`` computes.  The view reads the exact model's cache and leaves the state
where it was: keys/values it writes past the state's length are dead, recurrent states are
put back.  Weights that are not bf16 values are rounded to bf16 first: the view is an
approximation either way, and only exact verification accepts tokens.
"""

from __future__ import annotations

import torch

from specpilot.core.w12 import decode_hi, encode, to_bf16
from specpilot.runtime.reference.model import ReferenceModel


def view_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder layers' 2-D weights and lm_head through the nested 8-bit view; the rest as is
    (a tied lm_head is the embedding again, exact, when the model is built)."""
    out = {}
    for name, t in weights.items():
        if (name.startswith("model.layers.") or name == "lm_head.weight") and t.dim() == 2:
            bf, _ = to_bf16(t.float().cpu())
            out[name] = decode_hi(encode(bf)).to(t.dtype)
        else:
            out[name] = t
    return out


class ViewedModel(ReferenceModel):
    def __init__(self, model: ReferenceModel):
        self.__dict__.update(model.__dict__)      # the exact model, shared (no copy of its weights)
        self.view = ReferenceModel(model.cfg, view_weights(model.w), model.dtype, model.device)

    @torch.no_grad()
    def forward_view(self, tokens, state, positions, attn_mask, parents) -> torch.Tensor:
        """Logits of ``tokens`` after ``state`` through the view; the state does not move."""
        snap = state.snapshot()
        try:
            return self.view.forward(tokens, state, positions=positions, attn_mask=attn_mask, parents=parents)
        finally:
            state.restore(snap, keep_history=True)
