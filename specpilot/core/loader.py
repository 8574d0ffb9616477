"""From a validated spec to configs and weights for the target and the drafter."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specpilot.core.adapter import attach as attach_adapter
from specpilot.core.config import ModelConfig, config_from_hf
from specpilot.core.spec import ModelSource, Spec, conditioned_source, load_spec
from specpilot.core.weights import gguf_to_checkpoint, load_checkpoint, random_weights
from specpilot.core.errors import CheckpointError, SpecError, SpecPilotError


@dataclass
class LoadedModel:
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_path: Path | None   # a directory with tokenizer.json, or the file itself
    description: str
    own: frozenset[str] | None = None   # an early-exit drafter's tensors that are not the target's (None: all)


def load_source(spec: Spec, source: ModelSource, key: str, weights: bool = True) -> LoadedModel:
    """``weights=False`` (seeded random models only): the config alone, no tensors drawn."""
    try:
        if source.checkpoint:
            directory = spec.resolve(source.checkpoint, f"{key}.checkpoint")
            cfg, weights = load_checkpoint(directory)
            tok, desc = directory, str(directory)
        elif source.gguf:
            path = spec.resolve(source.gguf, f"{key}.gguf")
            directory = gguf_to_checkpoint(path)
            cfg, weights = load_checkpoint(directory)
            tok, desc = directory, str(path)
        else:
            cfg = config_from_hf(source.config, where=f"{spec.path}: {key}.config", architecture=source.architecture)
            weights = random_weights(cfg, **source.init.model_dump()) if weights else {}
            tok, desc = None, f"{source.architecture} (random, seed {source.init.seed})"
    except (CheckpointError, SpecError):
        raise
    except SpecPilotError as e:  # config problems: say which spec key led there
        raise SpecError(spec.path, key, str(e)) from None
    if source.tokenizer:
        tok = spec.resolve(source.tokenizer, f"{key}.tokenizer")
    if tok is not None and tok.is_dir() and not (tok / "tokenizer.json").is_file():
        tok = None
    return LoadedModel(cfg, weights, tok, desc)


def early_exit(target: LoadedModel, layers: int, adapter: Path | None = None) -> LoadedModel:
    """The target's first ``layers`` layers with its final norm and head: a self-drafter; with
    ``adapter`` (compiler.adapter), a trained layer and final norm follow them instead."""
    cfg = target.cfg
    if adapter is not None:
        cut, keep, own = attach_adapter(adapter, cfg, target.weights, layers)
        return LoadedModel(cut, keep, target.tokenizer_path,
                           f"first {layers} layers of the target + adapter {Path(adapter).name}", own)
    cut = replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])
    keep = {k: v for k, v in target.weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    return LoadedModel(cut, keep, target.tokenizer_path, f"first {layers} layers of the target", frozenset())


def load_models(spec: Spec, weights: bool = True) -> tuple[LoadedModel, LoadedModel | None]:
    """Target and (for model drafters) drafter, with the drafter's vocabulary checked."""
    target = load_source(spec, spec.target, "target", weights)
    d = spec.drafter
    if d.kind in ("ngram", "block", "feature") or conditioned_source(d) is not None:   # `conditioned_drafter`
        return target, None
    if d.kind == "early-exit":
        if d.layers >= target.cfg.num_hidden_layers:
            raise SpecError(spec.path, "drafter.layers",
                            f"{d.layers} is not fewer than the target's {target.cfg.num_hidden_layers} layers")
        adapter = spec.resolve(d.adapter, "drafter.adapter") if d.adapter else None
        return target, early_exit(target, d.layers, adapter)
    drafter = load_source(spec, d.cost, "drafter.cost", weights) if d.kind == "replay" else \
        load_source(spec, d, "drafter", weights)
    if drafter.cfg.vocab_size != target.cfg.vocab_size:
        raise SpecError(spec.path, "drafter", f"vocabulary size {drafter.cfg.vocab_size} differs from the "
                        f"target's {target.cfg.vocab_size}; a drafter must share the target's vocabulary")
    return target, drafter


def conditioned_drafter(spec: Spec, target: LoadedModel, weights: bool = True):
    """A block / feature drafter's (DraftNetConfig, tensors): its checkpoint directory (published
    DFlash / EAGLE-3 layout, checked against the target) or seeded at the target's width (a replay
    drafter's block cost: seeded)."""
    from specpilot.core import feature_drafter as fd
    from specpilot.core.adapter import target_digest

    d = conditioned_source(spec.drafter)
    if d.checkpoint:
        digest = target_digest(target.weights) if target.weights else None
        cfg, tensors = fd.load(spec.resolve(d.checkpoint, "drafter.checkpoint"), target.cfg, digest)
        if cfg.kind != d.kind:
            raise SpecError(spec.path, "drafter.checkpoint", f"a {cfg.kind} drafter checkpoint; the spec asks for {d.kind}")
    else:
        try:
            cfg = fd.for_target(fd.seeded_config(d.kind, target.cfg, d.layers or 1, d.block_size,
                                                 tuple(d.target_layers) if d.target_layers else None,
                                                 draft_vocab=d.draft_vocab), target.cfg)
        except CheckpointError as e:
            raise SpecError(spec.path, "drafter.cost" if spec.drafter.kind == "replay" else "drafter", str(e)) from None
        tensors = fd.random_init(cfg, d.init.seed) if weights else {}
    rows = cfg.draft_vocab_size or cfg.vocab_size
    if spec.drafter.top_k > rows:
        raise SpecError(spec.path, "drafter.top_k", f"{spec.drafter.top_k} proposals a position from a draft "
                        f"vocabulary of {rows} tokens")
    return cfg, tensors


def source_digest(path: Path) -> str:
    """A checkpoint's identity: the GGUF file's sha256, or a directory's config.json and weight files'."""
    import hashlib

    from specpilot.core.weights import file_digest
    path = Path(path)
    if path.is_file():
        return file_digest(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors") and p.name != "tokenizer.json")
    return hashlib.sha256("".join(f"{p.name}:{file_digest(p)}\n" for p in files).encode()).hexdigest()


def weights_reference(spec: Spec) -> dict:
    """What a build made with ``--params load`` records about its target's weights instead of carrying
    them: the checkpoint or GGUF file it was built from and that file's digest."""
    source = spec.target
    if not (source.checkpoint or source.gguf):
        raise SpecError(spec.path, "target", "--params load references a checkpoint or GGUF file; this target "
                        "is a seeded random model (use --params seeded)")
    d = spec.drafter
    if d.kind == "model" and d.init is None or d.kind == "replay" and d.cost.init is None:
        raise SpecError(spec.path, "drafter", "--params load covers the target's weights; a drafter model from a "
                        "checkpoint would have to travel too (use --params file)")
    kind = "gguf" if source.gguf else "checkpoint"
    path = spec.resolve(source.gguf or source.checkpoint, f"target.{kind}")
    return {"kind": kind, "path": str(path), "sha256": source_digest(path)}


def load_referenced(reference: dict, override: Path | None = None) -> LoadedModel:
    """The target of a ``--params load`` build, from ``override`` (the same weights, elsewhere) or the
    recorded path, checked against the recorded digest."""
    path = Path(override) if override else Path(reference["path"])
    if not path.exists():
        raise CheckpointError(f"{path}: the build's weights are not there; point SPECPILOT_WEIGHTS at the "
                              f"{reference['kind']} it was built from")
    if source_digest(path) != reference["sha256"]:
        raise CheckpointError(f"{path}: not the {reference['kind']} this build was made from (its digest differs)")
    directory = gguf_to_checkpoint(path) if reference["kind"] == "gguf" else path
    cfg, weights = load_checkpoint(directory)
    return LoadedModel(cfg, weights, directory, str(path))


def model_weights(spec_or_checkpoint: str | Path) -> dict:
    """The target's weights from a model.yaml or a Hugging Face checkpoint directory."""
    path = Path(spec_or_checkpoint)
    if path.is_dir():
        return load_checkpoint(path)[1]
    spec = load_spec(path)
    return load_source(spec, spec.target, "target").weights
