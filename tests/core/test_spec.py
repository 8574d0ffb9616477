"""model.yaml validation: every bad input gets one line naming the file, the key and what
was expected; through the CLI, exit status 2 and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specpilot.core.loader import load_models
from specpilot.core.spec import load_spec
from specpilot.core.weights import random_weights, save_checkpoint
from specpilot.core.errors import SpecError, SpecPilotError
from tests.conftest import TINY_CONFIGS, tiny_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RANDOM_TARGET = {"architecture": "LlamaForCausalLM", "config": TINY_CONFIGS["LlamaForCausalLM"], "init": {"seed": 1}}


def write(tmp_path, data, name="model.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("name", ["tiny-llama.yaml", "tiny-hybrid.yaml", "smollm2.yaml", "smollm2-adapter.yaml",
                                  "smollm2-adapter-l12.yaml"])
def test_examples_validate(name):
    spec = load_spec(EXAMPLES / name)
    assert spec.deployment.dtype == "float32"


def test_defaults_and_relative_checkpoint(tmp_path):
    cfg = tiny_config("Qwen3ForCausalLM")
    save_checkpoint(tmp_path / "ckpt", cfg, random_weights(cfg, 0))
    spec = load_spec(write(tmp_path, {"target": {"checkpoint": "ckpt"}}))
    assert spec.drafter.kind == "ngram" and spec.deployment.max_seq_len == 2048
    target, drafter = load_models(spec)
    assert target.cfg == cfg and drafter is None


BAD_SPECS = [
    ("target:\n  architecture: [unclosed\n", "", "malformed YAML: line"),
    ("- just\n- a list\n", "", "expected a mapping"),
    ({"target": RANDOM_TARGET, "colour": "blue"}, "colour", "unknown key"),
    ({"target": {**RANDOM_TARGET, "seed": 3}}, "target.seed", "unknown key"),
    ({"target": RANDOM_TARGET, "deployment": {"max_seq_len": "long"}}, "deployment.max_seq_len", "valid integer"),
    ({"target": RANDOM_TARGET, "deployment": {"dtype": "float8"}}, "deployment.dtype", "expected one of"),
    ({"target": {**RANDOM_TARGET, "init": {"seed": -1}}}, "target.init.seed", "greater than or equal to 0"),
    ({"target": {"checkpoint": "nowhere"}}, "target.checkpoint", "does not exist"),
    ({"target": {"gguf": "missing.gguf"}}, "target.gguf", "does not exist"),
    ({"target": {"gguf": "package://no_such_pkg/x.gguf"}}, "target.gguf", "is not installed"),
    ({"target": {**RANDOM_TARGET, "architecture": "GPT2LMHeadModel"}}, "target.architecture",
     "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM"),
    ({"target": {"architecture": "LlamaForCausalLM", "init": {"seed": 1}}}, "target.config", "needs its config"),
    ({"drafter": {"kind": "ngram"}}, "target", "missing required key"),
    ({"target": {**RANDOM_TARGET, "checkpoint": "x"}}, "target", "one model source"),
    ({"target": RANDOM_TARGET, "drafter": {"kind": "early-exit"}}, "drafter.layers", "missing"),
    ({"target": RANDOM_TARGET, "drafter": {"kind": "ngram", "architecture": "LlamaForCausalLM"}},
     "drafter.architecture", "takes no model"),
    ({"target": RANDOM_TARGET, "drafter": {"kind": "ngram", "min_ngram": 5, "max_ngram": 2}},
     "drafter.min_ngram", "exceeds max_ngram"),
    ({"target": RANDOM_TARGET, "drafter": {"kind": "beam"}}, "drafter.kind", "expected one of"),
    ({"target": RANDOM_TARGET, "drafter": {"kind": "early-exit", "layers": 1, "temperature": 0}},
     "drafter.temperature", "greater than 0"),
    ({"target": RANDOM_TARGET, "drafter": {"kind": "ngram", "adapter": "a.safetensors"}},
     "drafter.adapter", "takes none"),
]


@pytest.mark.parametrize("data,key,message", BAD_SPECS, ids=[f"{k or 'file'}-{m[:20]}" for _, k, m in BAD_SPECS])
def test_bad_spec_is_one_clear_line(tmp_path, run_cli, data, key, message):
    path = write(tmp_path, data)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = str(err.value)
    assert text.startswith(str(path)) and message in text
    assert f": {key}:" in text if key else True
    code, out, errout = run_cli("generate", path, "--prompt-ids", "1,2")
    assert code == 2 and errout.strip() == f"error: {text}" and "Traceback" not in errout


LOAD_ERRORS = [
    ({"vocab_size": 0}, "target", "vocab_size: expected a positive integer"),
    ({"num_key_value_heads": 4}, "target", "must be a multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "target", "hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "target", "rope type 'yarn'"),
]


@pytest.mark.parametrize("override,key,message", LOAD_ERRORS, ids=[m[:24] for *_, m in LOAD_ERRORS])
def test_bad_random_config_names_the_key(tmp_path, run_cli, override, key, message):
    target = {**RANDOM_TARGET, "config": {**RANDOM_TARGET["config"], **override}}
    path = write(tmp_path, {"target": target})
    with pytest.raises(SpecPilotError, match=message):
        load_models(load_spec(path))
    code, _, errout = run_cli("generate", path, "--prompt-ids", "1,2")
    assert code == 2 and message in errout and f"{key}" in errout and "Traceback" not in errout


def test_hybrid_moe_is_refused_with_the_way_out(tmp_path):
    cfg = {**TINY_CONFIGS["Qwen3NextForCausalLM"], "num_experts": 8}
    path = write(tmp_path, {"target": {"architecture": "Qwen3NextForCausalLM", "config": cfg, "init": {"seed": 0}}})
    with pytest.raises(SpecPilotError, match="mixture-of-experts .* mlp_only_layers"):
        load_models(load_spec(path))


def test_drafter_vocabulary_must_match(tmp_path, run_cli):
    other = {**TINY_CONFIGS["LlamaForCausalLM"], "vocab_size": 300}
    path = write(tmp_path, {"target": RANDOM_TARGET,
                            "drafter": {"kind": "model", "architecture": "LlamaForCausalLM", "config": other,
                                        "init": {"seed": 2}}})
    with pytest.raises(SpecError, match="drafter: vocabulary size 300 differs from the target's 301"):
        load_models(load_spec(path))
    code, _, errout = run_cli("verify", path)
    assert code == 2 and "vocabulary size 300" in errout


def test_early_exit_must_keep_fewer_layers(tmp_path):
    path = write(tmp_path, {"target": RANDOM_TARGET, "drafter": {"kind": "early-exit", "layers": 3}})
    with pytest.raises(SpecError, match="drafter.layers: 3 is not fewer than the target's 3 layers"):
        load_models(load_spec(path))


def test_spec_file_not_found(run_cli, tmp_path):
    code, _, errout = run_cli("verify", tmp_path / "absent.yaml")
    assert code == 2 and "spec file not found" in errout


def test_checkpoint_config_json_garbage(tmp_path, run_cli):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    path = write(tmp_path, {"target": {"checkpoint": "ckpt"}})
    code, _, errout = run_cli("generate", path, "--prompt-ids", "1")
    assert code == 2 and "config.json: not valid JSON" in errout
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    code, _, errout = run_cli("generate", path, "--prompt-ids", "1")
    assert code == 2 and "unsupported architecture 'BertModel'" in errout
