"""One normalized description of a decoder-only model, read from a Hugging Face config.

The five supported families differ in a handful of switches (biases, q/k norms, an output
gate on attention, zero-centred RMSNorm, Gated DeltaNet layers); `ModelConfig` turns each
Hugging Face ``config.json`` into those switches so that the reference model, the lowering
and the cost model read one thing.  Defaults follow transformers' own configuration classes
(5.x) so a partial config in model.yaml means what it means there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from specpilot.core.errors import SpecPilotError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
)

HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM")

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
}

# transformers' defaults for the keys a tiny config may leave out, per family.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                             tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                             tie_word_embeddings=False),
    "Qwen3ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                             tie_word_embeddings=False, attention_bias=False, head_dim=128),
    "Qwen3NextForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                                 tie_word_embeddings=False, attention_bias=False, head_dim=256,
                                 partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                                 linear_key_head_dim=128, linear_value_head_dim=128,
                                 linear_num_key_heads=16, linear_num_value_heads=32,
                                 num_experts=512, decoder_sparse_step=1),
    "Qwen3_5ForCausalLM": dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
                               tie_word_embeddings=False, attention_bias=False, head_dim=256,
                               partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                               linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_num_key_heads=16, linear_num_value_heads=32),
}

REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False       # bias on q/k/v/o (Llama); Qwen2 has q/k/v bias only
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False              # per-head RMSNorm on q and k (Qwen3, Qwen3-Next, Qwen3.5)
    attn_output_gate: bool = False     # q_proj also yields a sigmoid gate on the attention output
    zero_centered_norm: bool = False   # RMSNorm weight applied as (1 + w)
    layer_types: tuple[str, ...] = ()  # "full_attention" | "linear_attention" per layer
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def rotary_dim(self) -> int:
        # transformers takes frequencies for arange(0, int(head_dim * factor), 2) and rotates twice
        # as many dims, so an odd partial dimension rounds up
        return 2 * ((int(self.head_dim * self.partial_rotary_factor) + 1) // 2)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_dict(d: dict) -> "ModelConfig":
        """Inverse of `to_dict` (build manifests store configs that way)."""
        return ModelConfig(**{**d, "layer_types": tuple(d["layer_types"]), "eos_token_ids": tuple(d["eos_token_ids"])})

    def to_hf_dict(self) -> dict:
        """The config.json transformers would write for this model (for checkpoints we save)."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        if self.partial_rotary_factor != 1.0:
            hf["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
        if self.architecture == "LlamaForCausalLM":
            hf.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        if self.architecture in ("Qwen3ForCausalLM", *HYBRID_ARCHITECTURES):
            hf["attention_bias"] = self.attention_bias
        if self.architecture in HYBRID_ARCHITECTURES:
            hf.update(layer_types=list(self.layer_types),
                      linear_conv_kernel_dim=self.linear_conv_kernel_dim,
                      linear_key_head_dim=self.linear_key_head_dim,
                      linear_value_head_dim=self.linear_value_head_dim,
                      linear_num_key_heads=self.linear_num_key_heads,
                      linear_num_value_heads=self.linear_num_value_heads)
        if self.architecture == "Qwen3NextForCausalLM":
            hf.update(num_experts=0, mlp_only_layers=[])
        if self.bos_token_id is not None:
            hf["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            hf["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return hf


def _expect(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise SpecPilotError(f"{where}: {message}")


LIMITS = {"vocab_size": 1 << 22, "num_hidden_layers": 1024, "num_experts": 1 << 12}   # beyond any model these kernels serve
DIM_LIMIT = 1 << 18
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                  "decoder_sparse_step", "full_attention_interval")


def _size(c: dict, key: str, where: str) -> None:
    """A present size field: a positive integer within its limit."""
    value = c[key]
    _expect(isinstance(value, int) and not isinstance(value, bool) and value > 0, where,
            f"{key}: expected a positive integer, got {_short(value)}")
    _expect(value <= LIMITS.get(key, DIM_LIMIT), where, f"{key}: {value} is beyond {LIMITS.get(key, DIM_LIMIT)}")


def _number(value, where: str, key: str, low: float = 0.0, high: float = float("inf")) -> float:
    """A float field: a finite number in (low, high]."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and low < value <= high
    _expect(ok, where, f"{key}: expected a number in ({low:g}, {high:g}], got {_short(value)}")
    return float(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def config_from_hf(hf: dict, where: str = "config", architecture: str | None = None) -> ModelConfig:
    """Normalize a Hugging Face config dict (as in config.json, or a partial one from model.yaml).

    ``where`` prefixes error messages so they name the file or spec key.
    """
    arch, hf = _architecture(hf, where, architecture)
    c = {**_DEFAULTS[arch], **hf}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    _expect(isinstance(rope, dict), where, f"rope_parameters: expected a mapping, got {_short(rope)}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _expect(rope_type == "default", where,
            f"rope type {rope_type!r} is not supported yet; supported: 'default'")
    _check_sizes(c, where)
    common = _common_fields(arch, c, rope, where)
    if arch == "LlamaForCausalLM":
        bias = bool(c.get("attention_bias", False))
        return ModelConfig(**common, attention_bias=bias, qkv_bias=bias, o_bias=bias,
                           mlp_bias=bool(c.get("mlp_bias", False)))
    if arch == "Qwen2ForCausalLM":
        return ModelConfig(**common, qkv_bias=True)
    if arch == "Qwen3ForCausalLM":
        bias = bool(c.get("attention_bias", False))
        return ModelConfig(**common, attention_bias=bias, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return _hybrid_config(arch, c, common, where)


def _architecture(hf: dict, where: str, architecture: str | None) -> tuple[str, dict]:
    """(the supported architecture, the config of its text model)."""
    arch = architecture or (hf.get("architectures") or [None])[0]
    if arch is None:
        raise SpecPilotError(f"{where}: no 'architectures' entry; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecPilotError(f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if "text_config" in hf and "hidden_size" not in hf:  # a multimodal wrapper's config: use its text part
        _expect(isinstance(hf["text_config"], dict), where, "text_config: expected a mapping")
        hf = {**hf["text_config"], "architectures": [arch]}
    return arch, hf


def _check_sizes(c: dict, where: str) -> None:
    """Required and optional sizes, expert counts and the MLP-only layer list are well formed."""
    for key in REQUIRED_KEYS:
        _expect(key in c, where, f"missing key {key!r} (required: {', '.join(REQUIRED_KEYS)})")
        _size(c, key, where)
    for key in OPTIONAL_SIZES:
        if c.get(key) is not None:
            _size(c, key, where)
    experts = c.get("num_experts", 0)
    _expect(isinstance(experts, int) and not isinstance(experts, bool) and 0 <= experts <= LIMITS["num_experts"],
            where, f"num_experts: expected a count, got {_short(experts)}")
    only = c.get("mlp_only_layers") or []
    _expect(isinstance(only, list) and all(isinstance(i, int) for i in only), where,
            f"mlp_only_layers: expected a list of layer indices, got {_short(only)}")


def _common_fields(arch: str, c: dict, rope: dict, where: str) -> dict:
    """The ModelConfig fields every architecture has, checked."""
    n_heads = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads") or n_heads
    _expect(n_heads % n_kv == 0, where,
            f"num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv})")
    head_dim = c.get("head_dim") or c["hidden_size"] // n_heads
    _expect(head_dim > 0, where, f"head_dim: hidden_size {c['hidden_size']} over {n_heads} heads leaves none")
    _expect(c.get("hidden_act", "silu") == "silu", where,
            f"hidden_act {c.get('hidden_act')!r} is not supported; expected 'silu'")
    if arch == "Qwen2ForCausalLM":
        _expect(not c.get("use_sliding_window", False), where, "use_sliding_window=true is not supported")
    eos = c.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    _expect(all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < c["vocab_size"] for t in eos_ids), where,
            f"eos_token_id: expected token ids below vocab_size, got {_short(eos)}")
    return dict(
        architecture=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=_number(c["rms_norm_eps"], where, "rms_norm_eps", high=1.0),
        rope_theta=_number(rope.get("rope_theta", c.get("rope_theta", 10000.0)), where, "rope_theta"),
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        partial_rotary_factor=_number(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)), where,
                                      "partial_rotary_factor", high=1.0),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=eos_ids,
        layer_types=("full_attention",) * c["num_hidden_layers"],
    )


def _hybrid_config(arch: str, c: dict, common: dict, where: str) -> ModelConfig:
    """The two hybrids: Gated DeltaNet layers with gated full attention, zero-centred norms."""
    if arch == "Qwen3NextForCausalLM":
        mlp_only = set(c.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(c["num_hidden_layers"])
                      if i not in mlp_only and c.get("num_experts", 0) > 0
                      and (i + 1) % c.get("decoder_sparse_step", 1) == 0]
        _expect(not moe_layers, where,
                f"mixture-of-experts layers {moe_layers} are not supported yet; set num_experts: 0 "
                "or list them in mlp_only_layers (dense MLP)")
    layer_types = c.get("layer_types")
    _expect(layer_types is None or (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)),
            where, f"layer_types: expected a list of names, got {_short(layer_types)}")
    if layer_types is None:
        interval = c.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                       for i in range(c["num_hidden_layers"])]
    _expect(len(layer_types) == c["num_hidden_layers"], where,
            f"layer_types has {len(layer_types)} entries for {c['num_hidden_layers']} layers")
    bad = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    _expect(not bad, where, f"layer_types: unknown {bad}; expected 'full_attention' or 'linear_attention'")
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    _expect(nv % nk == 0, where,
            f"linear_num_value_heads ({nv}) must be a multiple of linear_num_key_heads ({nk})")
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **{**common, "layer_types": tuple(layer_types)}, attention_bias=bias, qkv_bias=bias, o_bias=bias,
        qk_norm=True, attn_output_gate=True, zero_centered_norm=True,
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
        linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
        linear_num_key_heads=nk, linear_num_value_heads=nv,
    )


def cache_shapes(cfg: ModelConfig, capacity: int, n_rows: int, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of a model's caches: ``kv`` is the pool of ``n_rows`` sequences the
    step functions write in place; ``conv`` / ``rec`` are one sequence's recurrent states (the
    step functions take a batch of them)."""
    shapes = {}
    n_attn = cfg.layer_types.count("full_attention")
    n_gdn = cfg.layer_types.count("linear_attention")
    if n_attn:
        shapes["kv"] = ((n_attn, 2, n_rows, cfg.num_key_value_heads, capacity, cfg.head_dim), dtype)
    if n_gdn:
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
            + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        shapes["conv"] = ((n_gdn, conv_dim, cfg.linear_conv_kernel_dim - 1), dtype)
        shapes["rec"] = ((n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim), "float32")
    return shapes
