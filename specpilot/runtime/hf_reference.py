"""What a user has without SpecPilot: Hugging Face transformers' own ``generate`` on the same weights
(greedy; assisted generation where transformers supports the pair), for the benchmark's reference rows.

The transformers model shares the reference model's tensors (built on the meta device, then the
weights assigned), so a large model is not held twice.
"""

from __future__ import annotations

import time

import torch

from specpilot.core.errors import SpecPilotError


def hf_model(cfg, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """A transformers model of ``cfg`` holding ``weights`` (Hugging Face names; moved only if needed)."""
    import transformers

    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    state = {name: t.to(device=device, dtype=dtype) for name, t in weights.items()
             if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SpecPilotError(f"transformers' {cfg.architecture} does not take these weights: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    _rebuild_meta_buffers(model, device)
    return model.eval()


def _rebuild_meta_buffers(model, device) -> None:
    """Non-persistent buffers (the rotary frequencies) are not in a state dict: modules still holding
    one on the meta device are made again on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        rebuilt = type(module)(config=module.config).to(device) if hasattr(module, "config") else None
        if rebuilt is None or any(b.is_meta for b in rebuilt.buffers()):
            raise SpecPilotError(f"cannot rebuild transformers module {name} ({type(module).__name__}) off meta")
        setattr(parent, name.rsplit(".", 1)[-1], rebuilt)


def hf_generate(model, prompt: list[int], max_new: int, compiled: bool = False, **assist) -> tuple[list[int], float]:
    """Greedy ``generate`` of exactly ``max_new`` tokens: (tokens, seconds).  ``assist``: transformers'
    assisted-generation arguments (``assistant_model=`` or ``prompt_lookup_num_tokens=``)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    extra = {"cache_implementation": "static"} if compiled else {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0, **extra, **assist)
    sync()
    return out[0, len(prompt):].tolist(), time.perf_counter() - start
