"""Drafters that read the target's hidden states: their configs, and checkpoints in the layouts the
published projects use.

- ``block`` (DFlash, z-lab/dflash): a few Qwen3-style layers over a block of ``block_size``
  positions -- the last accepted token, then mask tokens -- whose attention also sees the
  context's target features (``fc`` over the concatenated target layers, ``hidden_norm``, each
  layer's own k/v projections); all positions are predicted in one pass.  Files: ``config.json``
  (``architectures: [DFlashDraftModel]``, ``block_size``, ``num_target_layers``,
  ``dflash_config: {mask_token_id, target_layer_ids}``) and ``model.safetensors`` with ``fc``,
  ``hidden_norm``, ``layers.{i}.*``, ``norm``; embeddings and head are the target's.  An extension
  here: ``draft_vocab_size`` in config.json and a ``d2t`` tensor (as EAGLE-3's) keep the head to the
  target head's rows of those tokens -- a pass over the head is most of a small drafter's cost.
- ``feature`` (EAGLE-3, SafeAILab/EAGLE): one decoder layer over [embedding of the next token;
  fused target feature], autoregressive over the draft on its own pre-norm output.  Files:
  ``config.json`` (``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``,
  ``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` with ``fc``,
  ``midlayer.*`` (q/k/v take 2 * hidden inputs), ``norm``, ``lm_head`` over the draft vocabulary
  and ``d2t`` (target id = draft id + d2t[draft id]); embeddings are the target's.  Loaded draft ids
  are renumbered so their target ids ascend (`in_target_order`).

Layer ids name decoder layers whose *output* is read (SGLang's and SpecForge's convention).
Files written here carry ``specpilot_target_digest`` in config.json; a published checkpoint
without one is checked by shapes and vocabulary alone.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specpilot.core.config import ModelConfig
from specpilot.core.errors import CheckpointError
from specpilot.core.files import atomic_save_tensors, atomic_write_text

KINDS = ("block", "feature")
ARCHITECTURES = {"block": "DFlashDraftModel", "feature": "LlamaForCausalLMEagle3"}


@dataclass(frozen=True)
class DraftNetConfig:
    kind: str                         # "block" | "feature"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: tuple[int, ...]
    target_hidden: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False
    block_size: int = 0               # block: positions per pass (the last token + block_size - 1 drafts)
    mask_token_id: int = -1           # block
    # the head's rows (d2t names their target ids): feature, its own head; block, the target head's rows
    # of those tokens (0: the whole head)
    draft_vocab_size: int = 0

    @property
    def drafts_per_pass(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "target_layers": list(self.target_layers)}

    @staticmethod
    def from_dict(d: dict) -> "DraftNetConfig":
        return DraftNetConfig(**{**d, "target_layers": tuple(d["target_layers"])})


def cache_slots(cfg: DraftNetConfig, capacity: int) -> int:
    """Key/value slots a drafter's cache holds for sequences of ``capacity`` tokens: the context by
    position, then a block drafter's block or a feature drafter's draft nodes (up to ``capacity``)."""
    return capacity + cfg.block_size if cfg.kind == "block" else 2 * capacity


def cache_shape(cfg: DraftNetConfig, capacity: int, rows: int = 1) -> tuple[int, ...]:
    """The lowered drafter's key/value cache: (layers, 2, rows, kv heads, slots, head dim); a row a
    sequence (a block drafter's pool holds deployment.max_batch of them)."""
    return (cfg.num_layers, 2, rows, cfg.num_kv_heads, cache_slots(cfg, capacity), cfg.head_dim)


def layer_config(cfg: DraftNetConfig) -> ModelConfig:
    """The drafter's decoder layers as a model config (plain RMSNorm, full rotary, no biases)."""
    return ModelConfig(
        architecture="Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM", vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=1 << 20,
        tie_word_embeddings=False, qk_norm=cfg.qk_norm, layer_types=("full_attention",) * cfg.num_layers)


def sliced_head(cfg: DraftNetConfig) -> bool:
    """Whether a block drafter's head is the target head's rows of a draft vocabulary."""
    return cfg.kind == "block" and cfg.draft_vocab_size > 0


def vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of draft ids 0, 1, .. (target id = draft id + d2t[draft id]), where d2t is."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def d2t_of(ids: torch.Tensor) -> torch.Tensor:
    """The d2t of a draft vocabulary of target ids ``ids`` (ascending)."""
    return ids.long() - torch.arange(len(ids))


def packing_view(cfg: DraftNetConfig, tensors: dict[str, torch.Tensor], target_weights: dict[str, torch.Tensor]):
    """The drafter as `core.weights.packed_parameters` reads a model (``cfg``: its layers' model
    config, ``weights`` by the names the lowered drafter uses): its own tensors but d2t (the runtime
    maps draft ids), and the target's embeddings and head -- the same tensor objects, stored once
    (a block drafter's draft vocabulary: the head's rows of its tokens, as ``lm_head.weight``)."""
    from types import SimpleNamespace

    embed = target_weights["model.embed_tokens.weight"]
    head = target_weights.get("lm_head.weight", embed)
    weights = {k: v for k, v in tensors.items() if k != "d2t"}
    weights.update(embed=embed, head=head)
    if sliced_head(cfg):
        weights["lm_head.weight"] = head[vocab_ids(tensors["d2t"]).to(head.device)]
    return SimpleNamespace(cfg=layer_config(cfg), weights=weights)


def default_layers(kind: str, num_target_layers: int, n: int | None = None) -> tuple[int, ...]:
    """The published projects' default target layers: DFlash spreads ``n`` (5) evenly from layer 1 to
    layer T-3; EAGLE-3 reads low, middle and high (layers 1, T//2-1, T-4).  Small targets clip."""
    T = num_target_layers
    if kind == "feature":
        picks = (1, T // 2 - 1, T - 4)
    else:
        n = n or 5
        picks = (T // 2,) if n == 1 else tuple(int(round(1 + i * (T - 4) / (n - 1))) for i in range(n))
    out: list[int] = []
    for p in picks:
        p = min(max(p, 0), T - 1)
        if p not in out:
            out.append(p)
    return tuple(out)


def seeded_config(kind: str, target: ModelConfig, layers: int = 1, block_size: int = 8,
                  target_layers: tuple[int, ...] | None = None, mask_token_id: int | None = None,
                  draft_vocab: int | None = None) -> DraftNetConfig:
    """A drafter of the target's width (its heads, MLP and rotary base).  ``draft_vocab``: its head's
    rows (a block drafter's: of the target's head), their tokens `random_init`'s until training picks
    them (d2t); a block drafter of the whole vocabulary has none."""
    if draft_vocab is not None and not 1 <= draft_vocab <= target.vocab_size:
        raise CheckpointError(f"a draft vocabulary of {draft_vocab} tokens; the target has {target.vocab_size}")
    if kind not in KINDS:
        raise CheckpointError(f"unknown feature drafter kind {kind!r}; expected one of {', '.join(KINDS)}")
    picks = tuple(target_layers) if target_layers else default_layers(kind, target.num_hidden_layers)
    return DraftNetConfig(
        kind=kind, hidden_size=target.hidden_size, num_layers=layers if kind == "block" else 1,
        num_heads=target.num_attention_heads, num_kv_heads=target.num_key_value_heads, head_dim=target.head_dim,
        intermediate_size=target.intermediate_size, target_layers=picks, target_hidden=target.hidden_size,
        vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        qk_norm=kind == "block", block_size=block_size if kind == "block" else 0,
        mask_token_id=(target.vocab_size - 1 if mask_token_id is None else mask_token_id) if kind == "block" else -1,
        draft_vocab_size=(draft_vocab or target.vocab_size) if kind == "feature" else
        (draft_vocab if draft_vocab and draft_vocab < target.vocab_size else 0))


def parameter_shapes(cfg: DraftNetConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a drafter file's tensors (the published layouts)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    fc = {"fc.weight": (H, len(cfg.target_layers) * cfg.target_hidden), "norm.weight": (H,)}
    if cfg.kind == "block":
        out = {**fc, "hidden_norm.weight": (H,), **({"d2t": (cfg.draft_vocab_size,)} if sliced_head(cfg) else {})}
        prefixes, width = [f"layers.{i}." for i in range(cfg.num_layers)], H
    else:
        out = {**fc, "midlayer.hidden_norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
               "d2t": (cfg.draft_vocab_size,)}
        prefixes, width = ["midlayer."], 2 * H
    for p in prefixes:
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (q, width), p + "self_attn.k_proj.weight": (kv, width),
                    p + "self_attn.v_proj.weight": (kv, width), p + "self_attn.o_proj.weight": (H, q),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return out


def random_init(cfg: DraftNetConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights: matrices ~ N(0, 1/fan_in), norms near 1.  A feature drafter's draft vocabulary
    is the target's first tokens; a block drafter's, tokens drawn from the seed (its own generator: the
    weights are the same with or without one)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(parameter_shapes(cfg).items()):
        if name == "d2t" and cfg.kind == "feature":
            out[name] = torch.zeros(shape, dtype=torch.long)
        elif name == "d2t":
            picks = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:shape[0]]
            out[name] = d2t_of(picks.sort().values)
        elif len(shape) == 1:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return out


def hf_config(cfg: DraftNetConfig, num_target_layers: int, digest: str | None = None) -> dict:
    """The published config.json of ``cfg``."""
    common = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
              "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False}
    if cfg.kind == "block":
        out = {"architectures": [ARCHITECTURES["block"]], "model_type": "qwen3", **common,
               "block_size": cfg.block_size, "num_target_layers": num_target_layers,
               "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layers)},
               **({"draft_vocab_size": cfg.draft_vocab_size} if sliced_head(cfg) else {})}
    else:
        out = {"architectures": [ARCHITECTURES["feature"]], "model_type": "llama", **common,
               "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.target_layers),
                                "use_aux_hidden_state": True}}
    if digest:
        out["specpilot_target_digest"] = digest
    return out


def _int(d: dict, key: str, where: str) -> int:
    value = d.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{where}: config.json {key} must be a non-negative integer, got {value!r}")
    return value


def config_from_hf(d: dict, target: ModelConfig, where: str) -> DraftNetConfig:
    """A published config.json -> DraftNetConfig, checked against the target it will draft for."""
    arch = (d.get("architectures") or [None])[0]
    kind = next((k for k, a in ARCHITECTURES.items() if a == arch), None)
    if kind is None:
        raise CheckpointError(f"{where}: architecture {arch!r} is not a drafter read here "
                              f"(expected {' or '.join(ARCHITECTURES.values())})")
    if d.get("rope_scaling") not in (None, {}) and (d["rope_scaling"] or {}).get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: rope_scaling {d['rope_scaling']!r} is not supported for drafters")
    H = _int(d, "hidden_size", where)
    heads = _int(d, "num_attention_heads", where)
    vocab = _int(d, "vocab_size", where)
    if vocab != target.vocab_size:
        raise CheckpointError(f"{where}: trained for a vocabulary of {vocab} tokens; the target has {target.vocab_size}")
    common = dict(hidden_size=H, num_layers=_int(d, "num_hidden_layers", where), num_heads=heads,
                  num_kv_heads=d.get("num_key_value_heads", heads), head_dim=d.get("head_dim") or H // max(heads, 1),
                  intermediate_size=_int(d, "intermediate_size", where), vocab_size=vocab,
                  rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(d.get("rope_theta", 10000.0)))
    if kind == "block":
        extra = d.get("dflash_config") or {}
        block = d.get("block_size", extra.get("block_size"))
        if not isinstance(block, int) or block < 2:
            raise CheckpointError(f"{where}: block_size must be an integer >= 2, got {block!r}")
        n_target = d.get("num_target_layers", target.num_hidden_layers)
        if n_target != target.num_hidden_layers:
            raise CheckpointError(f"{where}: trained for a target of {n_target} layers; this one has "
                                  f"{target.num_hidden_layers}")
        layers = extra.get("target_layer_ids") or default_layers("block", n_target, common["num_layers"])
        mask = extra.get("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < vocab:
            raise CheckpointError(f"{where}: dflash_config.mask_token_id {mask!r} is not a token of the vocabulary")
        draft_vocab = d.get("draft_vocab_size") or 0
        if not isinstance(draft_vocab, int) or not 0 <= draft_vocab <= vocab:
            raise CheckpointError(f"{where}: draft_vocab_size {draft_vocab!r} is not a vocabulary of at most {vocab} tokens")
        cfg = DraftNetConfig(kind="block", target_layers=tuple(layers), target_hidden=target.hidden_size, qk_norm=True,
                             block_size=block, mask_token_id=mask, draft_vocab_size=0 if draft_vocab == vocab else draft_vocab,
                             **common)
    else:
        extra = d.get("eagle_config") or {}
        layers = extra.get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids") \
            or default_layers("feature", target.num_hidden_layers)
        cfg = DraftNetConfig(kind="feature", target_layers=tuple(layers),
                             target_hidden=d.get("target_hidden_size") or H,
                             draft_vocab_size=d.get("draft_vocab_size") or vocab, **common)
    return _check_target(cfg, target, where)


def _check_target(cfg: DraftNetConfig, target: ModelConfig, where: str) -> DraftNetConfig:
    bad = [i for i in cfg.target_layers if not (isinstance(i, int) and 0 <= i < target.num_hidden_layers)]
    if bad:
        raise CheckpointError(f"{where}: target layer {bad[0]!r} is not among the target's {target.num_hidden_layers} layers")
    if cfg.target_hidden != target.hidden_size:
        raise CheckpointError(f"{where}: reads target features of width {cfg.target_hidden}; the target's hidden size "
                              f"is {target.hidden_size}")
    if cfg.hidden_size != target.hidden_size:
        raise CheckpointError(f"{where}: hidden size {cfg.hidden_size} differs from the target's {target.hidden_size} "
                              "(the drafter reads the target's embeddings)")
    if cfg.num_heads % max(cfg.num_kv_heads, 1):
        raise CheckpointError(f"{where}: {cfg.num_heads} heads are not a multiple of {cfg.num_kv_heads} KV heads")
    return cfg


def save(directory: Path, cfg: DraftNetConfig, tensors: dict[str, torch.Tensor], num_target_layers: int,
         digest: str | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write a drafter in its published layout (config.json + model.safetensors), each file atomically;
    no tensors: the config alone (a seeded build's drafter, drawn again from its seed where it runs)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if tensors:
        atomic_save_tensors(directory / "model.safetensors",
                            {k: (v if not v.is_floating_point() else v.to(dtype)).detach().cpu().contiguous()
                             for k, v in sorted(tensors.items())}, {"format": "pt"})
    atomic_write_text(directory / "config.json", json.dumps(hf_config(cfg, num_target_layers, digest), indent=2))


def save_with_vocabulary(source: Path, directory: Path, cfg: DraftNetConfig, d2t: torch.Tensor,
                         num_target_layers: int, digest: str | None) -> None:
    """``source``'s drafter with a draft vocabulary, in ``directory``: its weight files as they are
    (hard links where the file system allows: every write here replaces a file, never rewrites one in
    place; else copies), d2t in ``vocab.safetensors``, ``cfg`` (with the vocabulary's size) as config.json."""
    directory = Path(directory)
    if directory.resolve() == Path(source).resolve() or (directory.is_dir() and any(directory.iterdir())):
        raise CheckpointError(f"{directory}: the drafter with a vocabulary goes to a new (or empty) directory")
    directory.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).glob("*.safetensors")):
        _link_or_copy(f, directory / f.name)
    atomic_save_tensors(directory / "vocab.safetensors", {"d2t": d2t.long().contiguous()}, {"format": "pt"})
    atomic_write_text(directory / "config.json", json.dumps(hf_config(cfg, num_target_layers, digest), indent=2))


def _link_or_copy(source: Path, dest: Path) -> None:
    """``source`` at ``dest``, whole or not at all: a hard link, or a copy where links cannot cross."""
    import shutil
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    tmp.replace(dest)


def read_config(directory: Path, target: ModelConfig, digest: str | None = None) -> DraftNetConfig:
    """A drafter directory's config.json, checked against the target (and its digest where the file
    carries one)."""
    directory, where = Path(directory), str(directory)
    try:
        d = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no config.json (expected a DFlash or EAGLE-3 drafter directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}/config.json: cannot read it ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}/config.json: not a mapping")
    cfg = config_from_hf(d, target, where)
    if digest and d.get("specpilot_target_digest") not in (None, digest):
        raise CheckpointError(f"{where}: trained for another target (its target digest does not match this target's "
                              "embeddings and final norm)")
    return cfg


def load(directory: Path, target: ModelConfig, digest: str | None = None) -> tuple[DraftNetConfig, dict[str, torch.Tensor]]:
    """A drafter directory in a published layout, checked against the target (shapes, vocabulary,
    layers; and the target digest when the files carry one)."""
    from safetensors import SafetensorError, safe_open
    cfg = read_config(directory, target, digest)
    directory, where = Path(directory), str(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{where}: no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{where}: cannot read the weights ({e})") from None
    tensors = {k: v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight")}   # derived / the target's
    if cfg.kind == "block" and not sliced_head(cfg) and "d2t" in tensors \
            and tuple(tensors["d2t"].shape) == (cfg.vocab_size,):
        _check_d2t(tensors.pop("d2t"), cfg, where)   # a vocabulary of every token: the whole head, in another order
    expected = parameter_shapes(cfg)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: " + (f"missing {missing[0]}" if missing else f"unexpected tensor {unexpected[0]}"))
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, the config implies {shape}")
        if name == "d2t":
            _check_d2t(t, cfg, where)
        elif not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: {name} is not finite floating point")
    return cfg, in_target_order(tensors)


def in_target_order(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with draft ids renumbered so their target ids ascend (d2t and a feature drafter's head
    rows together): every ranking then breaks ties by target id, in the build as in the reference."""
    if "d2t" not in tensors:
        return tensors
    ids = vocab_ids(tensors["d2t"])
    if bool((ids[1:] > ids[:-1]).all()):
        return tensors
    order = torch.argsort(ids)
    out = {**tensors, "d2t": d2t_of(ids[order]).to(tensors["d2t"].dtype)}
    if "lm_head.weight" in tensors:
        out["lm_head.weight"] = tensors["lm_head.weight"][order]
    return out


def _check_d2t(t: torch.Tensor, cfg: DraftNetConfig, where: str) -> None:
    """d2t maps each draft token to a distinct token of the target's vocabulary."""
    if t.is_floating_point():
        raise CheckpointError(f"{where}: d2t is not integer offsets")
    ids = vocab_ids(t)
    if bool(((ids < 0) | (ids >= cfg.vocab_size)).any()):
        raise CheckpointError(f"{where}: d2t maps draft tokens outside the target's vocabulary")
    if len(torch.unique(ids)) < len(ids):
        raise CheckpointError(f"{where}: d2t maps two draft tokens to one target token")


def for_target(cfg: DraftNetConfig, target: ModelConfig) -> DraftNetConfig:
    """``cfg`` checked against ``target`` (a drafter recorded in a build, say)."""
    return _check_target(cfg, target, "drafter")
