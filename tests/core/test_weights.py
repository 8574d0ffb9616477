"""Checkpoints: single file, sharded index, multimodal prefixes; and every way they break."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from specpilot.core.weights import load_checkpoint, parameter_shapes, random_weights, save_checkpoint
from specpilot.core.errors import CheckpointError
from tests.conftest import TINY_CONFIGS, tiny_config


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_round_trip_single_file(arch, tmp_path):
    cfg = tiny_config(arch)
    weights = random_weights(cfg, 3)
    assert set(weights) == set(parameter_shapes(cfg))
    save_checkpoint(tmp_path, cfg, weights)
    cfg2, loaded = load_checkpoint(tmp_path)
    assert cfg2 == cfg
    assert all(torch.equal(loaded[k], weights[k]) for k in weights if k in loaded)


def test_random_init_is_deterministic_per_seed():
    cfg = tiny_config("Qwen3_5ForCausalLM")
    a, b, c = random_weights(cfg, 1), random_weights(cfg, 1), random_weights(cfg, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def _sharded(tmp_path, cfg, weights):
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))


def test_sharded_index(tmp_path):
    cfg = tiny_config("Qwen3NextForCausalLM")
    weights = random_weights(cfg, 0)
    _sharded(tmp_path, cfg, weights)
    _, loaded = load_checkpoint(tmp_path)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_missing_shard_and_bad_index(tmp_path):
    cfg = tiny_config("Qwen3ForCausalLM")
    _sharded(tmp_path, cfg, random_weights(cfg, 0))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is listed but missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": 3}}')
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["../elsewhere.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_an_index_naming_files_outside_the_checkpoint_is_refused(tmp_path, shard):
    cfg = tiny_config("Qwen3ForCausalLM")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _sharded(ckpt, cfg, random_weights(cfg, 0))
    (tmp_path / "elsewhere.safetensors").write_bytes((ckpt / "model-00001-of-00002.safetensors").read_bytes())
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(ckpt)


def test_multimodal_prefix_is_read_as_text_model(tmp_path):
    cfg = tiny_config("Qwen3_5ForCausalLM")
    weights = random_weights(cfg, 0)
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    _, loaded = load_checkpoint(tmp_path)
    assert set(loaded) == set(weights)


@pytest.mark.parametrize("damage,message", [
    ("truncate", "cannot read safetensors"),
    ("drop", "missing tensors model.layers.0.self_attn.q_norm.weight"),
    ("extra", "unexpected tensors vision.weight"),
    ("reshape", "has shape (48, 47), config implies (48, 60)"),
    ("none", "no model.safetensors or model.safetensors.index.json"),
])
def test_broken_checkpoints(tmp_path, damage, message):
    cfg = tiny_config("Qwen3ForCausalLM")
    weights = random_weights(cfg, 0)
    if damage == "drop":
        del weights["model.layers.0.self_attn.q_norm.weight"]
    elif damage == "extra":
        weights["vision.weight"] = torch.zeros(3)
    elif damage == "reshape":
        weights["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(48, 47)
    save_checkpoint(tmp_path, cfg, weights)
    path = tmp_path / "model.safetensors"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "none":
        path.unlink()
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(tmp_path)


def test_not_a_gguf_file(tmp_path):
    from specpilot.core.weights import gguf_to_checkpoint
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        gguf_to_checkpoint(fake)


def test_a_seeded_model_too_large_for_the_machine_is_refused_before_allocating():
    from specpilot.core.config import config_from_hf
    from specpilot.core.errors import SpecPilotError
    cfg = config_from_hf({"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 17,
                          "num_hidden_layers": 64, "num_attention_heads": 128}, architecture="LlamaForCausalLM")
    with pytest.raises(SpecPilotError, match=r"needs ~\d+\.\d GiB; this machine has"):
        random_weights(cfg, 0)


@pytest.mark.parametrize("bad,message", [("nan", "NaN or infinite"), ("int", "not floating point")])
def test_nan_or_integer_weights_are_refused(tmp_path, bad, message):
    cfg = tiny_config("Qwen3ForCausalLM")
    weights = random_weights(cfg, 0)
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name].clone()
    if bad == "nan":
        weights[name][3, 4] = float("nan")
    else:
        weights[name] = weights[name].to(torch.int8)
    save_checkpoint(tmp_path, cfg, weights)
    with pytest.raises(CheckpointError, match=f"{name}.*{message}"):
        load_checkpoint(tmp_path)
