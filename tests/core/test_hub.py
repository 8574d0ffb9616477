"""Hugging Face ids resolve from the local cache only: in a spec, on the command line, and as the
served model's name; an id not in the cache is one clear error."""

from __future__ import annotations

import pytest

from specpilot.core.errors import SpecPilotError
from specpilot.core.hub import is_hub_id
from specpilot.core.loader import load_models
from specpilot.core.spec import load_spec, parse_spec
from specpilot.core.weights import random_weights, save_checkpoint
from tests.conftest import TINY_CONFIGS, tiny_config


def fake_cache(root, repo_id: str, cfg, seed: int = 0):
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<revision>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    save_checkpoint(repo / "snapshots" / revision, cfg, random_weights(cfg, seed))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_ids_and_paths():
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for text in ("model.yaml", "/abs/path", "a/b/c", "./x/y", "org/", "/name"):
        assert not is_hub_id(text)


def test_a_cached_id_in_a_spec_and_on_the_command_line(hub, tmp_path):
    cfg = tiny_config("Qwen3ForCausalLM")
    snapshot = fake_cache(hub, "acme/tiny-qwen3", cfg)
    spec = parse_spec({"target": {"checkpoint": "acme/tiny-qwen3"}}, tmp_path / "model.yaml")
    target, _ = load_models(spec)
    assert target.cfg.to_dict() == cfg.to_dict()
    assert spec.resolve("acme/tiny-qwen3", "target.checkpoint") == snapshot
    bare = load_spec("acme/tiny-qwen3")
    assert bare.target.checkpoint == "acme/tiny-qwen3" and bare.drafter.kind == "ngram"


def test_an_id_not_in_the_cache_is_one_clear_error(hub, tmp_path, run_cli):
    with pytest.raises(SpecPilotError, match="not in the local cache"):
        load_models(parse_spec({"target": {"checkpoint": "acme/missing"}}, tmp_path / "model.yaml"))
    code, out, err = run_cli("generate", "acme/missing", "--prompt-ids", "1,2")
    assert code == 2 and err.startswith("error:") and "acme/missing" in err and "Traceback" not in err


def test_the_served_name_is_the_id(hub):
    from specpilot.serve.launch import served_name
    assert served_name("build/x", {"target": {"checkpoint": "acme/tiny-qwen3"}}) == "acme/tiny-qwen3"
    assert served_name("build/x", {"target": {"config": TINY_CONFIGS["Qwen3ForCausalLM"]}}) == "x"
