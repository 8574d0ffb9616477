"""Weights for a `ModelConfig`: from a Hugging Face checkpoint directory, a GGUF file, or a
seeded random init.  Every path ends in the same thing: a dict of Hugging Face parameter
names to tensors, checked against the shapes the config implies.

Nothing here unpickles: safetensors and JSON only.  GGUF files are dequantized once through
transformers' GGUF reader and cached as a safetensors checkpoint keyed by the file's hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specpilot.core.config import ModelConfig, config_from_hf
from specpilot.core.errors import CheckpointError, SpecPilotError
from specpilot.core.files import atomic_save_tensors, atomic_write_text, swap_in_dir


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape for every parameter the model reads."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
        if kind == "full_attention":
            a = p + "self_attn."
            q_out = nh * d * (2 if cfg.attn_output_gate else 1)
            shapes.update({a + "q_proj.weight": (q_out, H), a + "k_proj.weight": (nkv * d, H),
                           a + "v_proj.weight": (nkv * d, H), a + "o_proj.weight": (H, nh * d)})
            if cfg.qkv_bias:
                shapes.update({a + "q_proj.bias": (q_out,), a + "k_proj.bias": (nkv * d,),
                               a + "v_proj.bias": (nkv * d,)})
            if cfg.o_bias:
                shapes[a + "o_proj.bias"] = (H,)
            if cfg.qk_norm:
                shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        else:
            g = p + "linear_attn."
            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv_dim = 2 * nk * dk + nv * dv
            if cfg.architecture == "Qwen3NextForCausalLM":
                shapes.update({g + "in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, H),
                               g + "in_proj_ba.weight": (2 * nv, H)})
            else:
                shapes.update({g + "in_proj_qkv.weight": (conv_dim, H), g + "in_proj_z.weight": (nv * dv, H),
                               g + "in_proj_b.weight": (nv, H), g + "in_proj_a.weight": (nv, H)})
            shapes.update({g + "conv1d.weight": (conv_dim, 1, cfg.linear_conv_kernel_dim),
                           g + "dt_bias": (nv,), g + "A_log": (nv,), g + "norm.weight": (dv,),
                           g + "out_proj.weight": (H, nv * dv)})
    return shapes


def check_fits(nbytes: int, what: str) -> None:
    """Refuse, before allocating, what would not fit this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if nbytes > 0.8 * total:
        raise SpecPilotError(f"{what} needs ~{nbytes / 2 ** 30:.1f} GiB; this machine has {total / 2 ** 30:.1f} GiB")


def random_weights(cfg: ModelConfig, seed: int, round_to: str | None = None, draw: str = "host",
                   device=None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A seeded random model whose greedy output is varied rather than flat.

    Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms near their identity, Gated
    DeltaNet decay parameters in their trained ranges.  ``draw="host"``: float32 on the host,
    drawn in sorted-name order from one generator.  ``draw="device"``: counter-based
    (`core.counter_draw`: the same values on every device), bf16 values held in ``dtype`` on
    ``device`` -- for models too large to draw in float32 on the host.
    """
    if draw == "device":
        return _counter_weights(cfg, seed, device, dtype or torch.float32)
    if draw != "host":
        raise SpecPilotError(f"init.draw must be 'host' or 'device', not {draw!r}")
    shapes = parameter_shapes(cfg)
    check_fits(sum(math.prod(s) for s in shapes.values()) * 4, "drawing this model's float32 weights")
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
        elif len(shape) == 1:  # norms and biases: small perturbation of identity / zero
            t = _vector_base(cfg, name) + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen) * _matrix_std(cfg, name, shape)
        else:   # divided, not multiplied by `_matrix_std`: that rounding is what these seeds give
            t = torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
        weights[name] = t.to(torch.bfloat16).float() if round_to == "bfloat16" else t.float()
    return weights


def _vector_base(cfg: ModelConfig, name: str) -> float:
    """A norm's identity (1, or 0 for zero-centred norms) or a bias's 0."""
    if name.endswith(".bias"):
        return 0.0
    return 0.0 if (cfg.zero_centered_norm and "norm" in name and "linear_attn.norm" not in name) else 1.0


def _matrix_std(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> float:
    if name == "model.embed_tokens.weight":
        # with a tied head, a unit-scale embedding dominates the residual stream and the model
        # echoes its input token; a smaller one lets the layers decide
        return 0.1 if cfg.tie_word_embeddings else 1.0
    return 1.0 / math.sqrt(math.prod(shape[1:]))


def _counter_weights(cfg: ModelConfig, seed: int, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from specpilot.core import counter_draw

    shapes = parameter_shapes(cfg)
    if torch.device(device or "cpu").type == "cpu":
        check_fits(sum(math.prod(s) for s in shapes.values()) * dtype.itemsize, "drawing this model's weights")
    weights = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:           # small vectors: drawn on the host in float64, then rounded
            if name.endswith("A_log"):
                t = counter_draw.uniform(seed, name, shape, 1.0, 16.0).log()
            elif name.endswith("dt_bias"):
                t = counter_draw.uniform(seed, name, shape, -1.0, 1.0)
            else:
                t = _vector_base(cfg, name) + 0.1 * counter_draw.normal(seed, name, shape).double()
            weights[name] = t.to(torch.bfloat16).to(device=device, dtype=dtype)
        else:
            weights[name] = counter_draw.normal(seed, name, shape, _matrix_std(cfg, name, shape), device, dtype)
    return weights


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Every expected parameter present with its shape; unexpected names are an error too."""
    expected = parameter_shapes(cfg)
    if cfg.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{source}: missing tensors {', '.join(missing[:3])}{more} for {cfg.architecture}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise CheckpointError(f"{source}: unexpected tensors {', '.join(unexpected[:3])}{more}; "
                              "is the config from another model?")
    for name, shape in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"config implies {shape}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: tensor {name} is {str(tensor.dtype).split('.')[-1]}, not floating point "
                                  "(a quantized checkpoint? only float weights are read)")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{source}: tensor {name} holds NaN or infinite values")
    return weights


def _normalize_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Multimodal Qwen3.5 checkpoints keep the text model under model.language_model.*; drop the rest."""
    if not any(k.startswith("model.language_model.") for k in weights):
        return {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    return {k.replace("model.language_model.", "model.", 1): v for k, v in weights.items()
            if k.startswith("model.language_model.") or k == "lm_head.weight"}


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors ({e})") from None


def load_checkpoint(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face checkpoint directory: config.json plus model.safetensors or a sharded index."""
    directory = Path(directory)
    cfg = config_from_hf(read_hf_config(directory), where=str(directory / "config.json"))
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    weights: dict[str, torch.Tensor] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a safetensors index (expected a 'weight_map' object "
                                  "of tensor name -> shard file)") from None
        root = directory.resolve()
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if shard_path.resolve().parent != root:    # a shard is a file of the checkpoint, not a path elsewhere
                raise CheckpointError(f"{index}: shard {shard!r} is outside the checkpoint directory")
            if not shard_path.is_file():
                raise CheckpointError(f"{index}: shard {shard} is listed but missing")
            weights.update(_load_safetensors(shard_path))
        listed_missing = sorted(set(weight_map) - set(weights))
        if listed_missing:
            raise CheckpointError(f"{index}: tensor {listed_missing[0]} is listed but not in its shard")
    elif single.is_file():
        weights = _load_safetensors(single)
    else:
        raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json "
                              "(only safetensors checkpoints are read; .bin pickles are not)")
    return cfg, check_weights(cfg, _normalize_names(weights), str(directory))


def save_checkpoint(directory: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    directory = Path(directory)
    atomic_write_text(directory / "config.json", json.dumps(cfg.to_hf_dict(), indent=2))
    tensors = {k: v.contiguous() for k, v in weights.items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    atomic_save_tensors(directory / "model.safetensors", tensors, {"format": "pt"})


def cache_dir() -> Path:
    root = os.environ.get("SPECPILOT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specpilot")
    return Path(root)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_to_checkpoint(path: Path) -> Path:
    """Dequantize a GGUF file once into a cached Hugging Face checkpoint (weights + tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
    out = cache_dir() / "gguf" / file_digest(path)[:24]
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds for unreadable or unsupported files
        raise CheckpointError(f"{path}: cannot dequantize GGUF ({type(e).__name__}: {e})") from None
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))   # a name of its own per process
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        cfg_path = tmp / "config.json"
        hf = json.loads(cfg_path.read_text())
        hf.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(hf, indent=2))
        swap_in_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Exactly the reference model's frequencies (computed by torch, passed as a parameter)."""
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))


def packed_parameters(names: list[str], target, drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The values of a build's packed parameters in packed order, by name.  ``target`` /
    ``drafter`` have ``cfg`` and ``weights`` (HF names); a weight the drafter shares with the
    target (early exit) is the same tensor object under both names (see `dedupe`)."""
    converted: dict[int, torch.Tensor] = {}
    models = {"target": target, "drafter": drafter}
    full = {}
    for name in names:
        prefix, _, hf = name.partition(".")
        model = models[prefix]
        if hf == "rope_inv_freq":
            full[name] = rope_inv_freq(model.cfg)
            continue
        source = model.weights[hf]
        if id(source) not in converted:
            converted[id(source)] = source.to(dtype).contiguous()
        full[name] = converted[id(source)]
    return full


def params_digest(params: dict[str, torch.Tensor]) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in order: equal iff the same values."""
    h = hashlib.sha256()
    for name, tensor in params.items():
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def dedupe(full: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(unique tensors by their first name, alias map other name -> that name)."""
    stored, aliases, first = {}, {}, {}
    for name, tensor in full.items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
            stored[name] = tensor
    return stored, aliases


FUSED = "+"   # fused parameter name: member names joined, in order (rows stacked along dim 0)


def fuse_params(params: dict, groups: dict[str, list[str]]) -> dict:
    """Packed parameters with each group's members replaced, at the first member's place, by one
    tensor stacking them along dim 0 (``groups``: fused name -> member names).  A group whose
    members are the same tensors as an earlier group's (an early-exit drafter sharing the target's
    layers) gets the same stacked tensor, so `dedupe` stores it once.  Values may be None (a seeded
    build): the names come out the same."""
    first = {members[0]: fused for fused, members in groups.items()}
    dropped = {m for members in groups.values() for m in members[1:]}
    missing = {m for members in groups.values() for m in members} - set(params)
    if missing:
        raise SpecPilotError(f"fused parameters not among the parameters: {', '.join(sorted(missing))}")
    stacked: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, value in params.items():
        if name in dropped:
            continue
        if name not in first:
            out[name] = value
            continue
        members = [params[m] for m in groups[first[name]]]
        if any(v is None for v in members):
            out[first[name]] = None
            continue
        key = tuple(id(v) for v in members)
        if key not in stacked:
            stacked[key] = torch.cat(members, dim=0).contiguous()
        out[first[name]] = stacked[key]
    return out


def rewritten_parameters(manifest, target, drafter, device: str | None = None, consume: bool = False) -> dict:
    """A seeded build's packed parameters from its redrawn weights, with the passes' parameter
    rewrites redone as the build did them (manifest ``fused``: stacked projections, then ``w12``:
    the planes, converted on ``device`` when given, and left there): the names and values a build
    with the weights would have stored.  ``consume``: each model weight is dropped from
    ``target`` / ``drafter`` once stacked or converted, so a 27B-class model's weights and their
    stacks or planes need not fit on one GPU together."""
    from specpilot.core import w12
    dtype = getattr(torch, manifest.dtype)
    recipe, fused = manifest.w12, manifest.fused or {}
    names = w12.plain_names(manifest.params) if recipe else list(manifest.params)
    packed = packed_parameters([x for n in names for x in fused.get(n, [n])], target, drafter, dtype)
    wanted = set(recipe["weights"]) if recipe else set(names)
    # shared stacks are found by the identity of their members, taken while every tensor is alive
    keys = {name: (tuple(id(packed[m]) for m in fused.get(name, [name])), name in wanted) for name in names}
    models = {"target": target, "drafter": drafter}
    main, planes, done = {}, {}, {}
    for name in names:     # one weight at a time, stacked then converted, the stacked copy dropped
        members = fused.get(name, [name])
        if keys[name] not in done:
            value = fuse_params({m: packed[m] for m in members}, {name: members} if name in fused else {})
            done[keys[name]] = value if not recipe else \
                w12.convert_params(value, [name] if name in wanted else [], recipe["layout"], device=device,
                                   keep_on_device=True)
        (_, hi), *rest = done[keys[name]].items()
        main[name] = hi
        planes.update({f"{name}.{plane.rsplit('.', 1)[1]}": t for plane, t in rest})
        if consume and name in wanted:
            for m in members:
                which, _, hf = m.partition(".")
                packed.pop(m, None)
                models[which].weights.pop(hf, None)
    return {**main, **planes}
