"""Early-exit adapters: a drafter that is the target's first L layers, one trained decoder layer
and its own final norm, reading the target's embeddings and head (self-speculation with an
adapter, as in Kangaroo, arXiv 2404.18911).  The first L layers and the head are the target's
own tensors, so an adapter file holds one layer: small enough to ship beside a spec.

The file is safetensors: the adapter layer under its place in the drafter
(``model.layers.{L}.*``), ``model.norm.weight``, and metadata: ``format``, ``layers`` (L) and
``target_digest`` (of the target's embeddings and final norm: an adapter trained for another
model is refused).  `specpilot drafter train` (runtime.drafter_training) trains them and
`save` writes them; `attach` reads one onto a target.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from specpilot.core.config import ModelConfig
from specpilot.core.weights import parameter_shapes
from specpilot.core.errors import CheckpointError
from specpilot.core.files import atomic_save_tensors

FORMAT = "specpilot-early-exit-adapter/1"


def drafter_config(target: ModelConfig, layers: int) -> ModelConfig:
    """The drafter's config: the target's first ``layers`` layers and one attention layer."""
    if "full_attention" not in target.layer_types:
        raise CheckpointError(f"{target.architecture}: an adapter is an attention layer; this target has none to "
                              "take its shapes from")
    return replace(target, num_hidden_layers=layers + 1,
                   layer_types=tuple(target.layer_types[:layers]) + ("full_attention",))


def adapter_shapes(target: ModelConfig, layers: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of what an adapter file holds for this target and exit layer."""
    prefix = f"model.layers.{layers}."
    return {n: s for n, s in parameter_shapes(drafter_config(target, layers)).items()
            if n.startswith(prefix) or n == "model.norm.weight"}


def target_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the target's embeddings and final norm as float32 (what the adapter reads
    and what its features were trained against)."""
    h = hashlib.sha256()
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        h.update(name.encode())
        h.update(weights[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def save(path: Path, tensors: dict[str, torch.Tensor], layers: int, digest: str, extra: dict | None = None) -> None:
    meta = {"format": FORMAT, "layers": str(layers), "target_digest": digest}
    if extra:
        meta["training"] = json.dumps(extra, sort_keys=True)
    atomic_save_tensors(path, {k: v.detach().to("cpu").contiguous() for k, v in sorted(tensors.items())}, meta)


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: adapter file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot read the adapter ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an early-exit adapter (format {meta.get('format')!r}, expected {FORMAT!r})")
    return tensors, meta


def attach(path: Path, target_cfg: ModelConfig, target_weights: dict[str, torch.Tensor], layers: int,
           check_digest: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], frozenset[str]]:
    """The drafter (config, weights, names of its own tensors) of ``layers`` target layers plus
    the adapter in ``path``.  Shared tensors are the target's own objects."""
    tensors, meta = read(path)
    if meta.get("layers") != str(layers):
        raise CheckpointError(f"{path}: the adapter follows {meta.get('layers')} target layers, the spec keeps {layers}")
    expected = adapter_shapes(target_cfg, layers)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointError(f"{path}: {what}; the adapter does not fit a {target_cfg.architecture} of this size")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, the target implies {shape}")
        if not tensors[name].is_floating_point() or not bool(torch.isfinite(tensors[name]).all()):
            raise CheckpointError(f"{path}: {name} is not finite floating point")
    if check_digest and target_weights and meta.get("target_digest") != target_digest(target_weights):
        raise CheckpointError(f"{path}: trained for another target (its target digest does not match this "
                              "target's embeddings and final norm)")
    cfg = drafter_config(target_cfg, layers)
    dtype = target_weights["model.embed_tokens.weight"].dtype if target_weights else torch.float32
    keep = {k: v for k, v in target_weights.items()
            if k != "model.norm.weight" and (not k.startswith("model.layers.") or int(k.split(".")[2]) < layers)}
    keep.update({k: v.to(dtype) for k, v in tensors.items()})
    return cfg, keep, frozenset(expected)
