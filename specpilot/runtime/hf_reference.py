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


def hf_generate(model, prompt: list[int], max_new: int, compiled: bool = False, cache_length: int | None = None,
                **assist) -> tuple[list[int], float]:
    """Greedy ``generate`` of exactly ``max_new`` tokens: (tokens, seconds).  ``compiled``: a static
    cache of ``cache_length`` positions (so every call has the same shapes and compiles once) and the
    decoding forward under ``torch.compile`` (checked to have happened).  ``assist``: transformers'
    assisted-generation arguments (``assistant_model=`` or ``prompt_lookup_num_tokens=``)."""
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    extra, budget = {}, max_new
    if compiled:
        budget = max(max_new, (cache_length or 0) - len(prompt))
        extra = {"cache_implementation": "static", "compile_config": _compile_config(device),
                 "stopping_criteria": StoppingCriteriaList([_StopAt(len(prompt) + max_new)])}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0, **extra, **assist)
    sync()
    seconds = time.perf_counter() - start
    if compiled and getattr(model, "_compiled_call", None) is None:
        raise SpecPilotError("transformers ran generate without compiling the forward (static cache refused?)")
    return out[0, len(prompt):len(prompt) + max_new].tolist(), seconds


class _StopAt:
    """transformers stopping criterion: done once the sequence has ``length`` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def _compile_config(device: torch.device):
    """transformers' compile settings: its default (CUDA graphs) on a GPU; plain inductor elsewhere,
    where transformers would not compile by itself."""
    from transformers import CompileConfig

    if device.type == "cuda":
        return CompileConfig()
    config = CompileConfig(mode="default")
    config._compile_all_devices = True     # transformers' switch for compiling off the GPU
    return config
