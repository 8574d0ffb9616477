"""Bad input, generated: model configs, specs (as data and as bytes), build manifests, server requests
and request files -- every one either accepted or refused with the project's own error, never any
other exception; and a `compile` killed with SIGKILL leaves the previous build whole.

CI runs a bounded slice (about 700 generated inputs); SPECPILOT_FUZZ=N multiplies the examples
(`make fuzz`: N = 20).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specpilot.core.config import SUPPORTED_ARCHITECTURES, config_from_hf
from specpilot.core.errors import SpecPilotError
from specpilot.core.spec import load_spec, parse_spec
from tests.conftest import TINY_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
SCALE = int(os.environ.get("SPECPILOT_FUZZ", "1"))


def budget(n: int):
    return settings(max_examples=n * SCALE, deadline=None, derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# values of every kind a hand-edited file holds: edge integers, odd floats, strings, containers
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.sampled_from([0, 1, -1, 2, 3, 7, 2 ** 31, 2 ** 63, 10 ** 9]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["\ud800", "1e-6", "default", "linear_attention"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
CONFIG_KEYS = sorted({k for c in TINY_CONFIGS.values() for k in c} | {
    "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "eos_token_id", "layer_types",
    "partial_rotary_factor", "tie_word_embeddings", "mlp_only_layers", "decoder_sparse_step", "text_config",
    "max_position_embeddings", "hidden_act", "full_attention_interval"})


@st.composite
def mutated_config(draw):
    arch = draw(st.sampled_from(sorted(TINY_CONFIGS)))
    config = dict(TINY_CONFIGS[arch])
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), min_size=1, max_size=3)):
        if draw(st.booleans()):
            config[key] = draw(values)
        else:
            config.pop(key, None)
    return arch, config


@budget(250)
@given(mutated_config())
def test_model_configs_are_accepted_or_refused_clearly(case):
    arch, config = case
    try:
        cfg = config_from_hf(config, architecture=arch)
    except SpecPilotError as e:
        assert str(e) and len(str(e)) < 2000
        return
    assert cfg.architecture in SUPPORTED_ARCHITECTURES and cfg.vocab_size > 0 and cfg.head_dim > 0


VALID_SPEC = {"target": {"architecture": "LlamaForCausalLM", "config": TINY_CONFIGS["LlamaForCausalLM"],
                         "init": {"seed": 1}},
              "drafter": {"kind": "ngram", "draft_len": 4, "top_k": 3},
              "deployment": {"dtype": "float32", "max_seq_len": 256, "max_batch": 1},
              "passes": "tree-verify{budget=8}"}
SPEC_PATHS = [("target",), ("target", "init"), ("target", "init", "seed"), ("target", "architecture"),
              ("drafter",), ("drafter", "kind"), ("drafter", "draft_len"), ("drafter", "top_k"),
              ("drafter", "layers"), ("deployment",), ("deployment", "dtype"), ("deployment", "max_seq_len"),
              ("deployment", "max_batch"), ("passes",), ("target", "checkpoint"), ("drafter", "alpha")]


@st.composite
def mutated_spec(draw):
    spec = json.loads(json.dumps(VALID_SPEC))
    for path in draw(st.lists(st.sampled_from(SPEC_PATHS), min_size=1, max_size=3)):
        node = spec
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        if draw(st.booleans()):
            node[path[-1]] = draw(values)
        else:
            node.pop(path[-1], None)
    return spec


@budget(200)
@given(mutated_spec())
def test_specs_are_accepted_or_refused_with_the_key(tmp_path_factory, spec):
    path = tmp_path_factory.mktemp("spec") / "model.yaml"
    try:
        path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    except (yaml.YAMLError, UnicodeEncodeError):
        return                                      # not writable as YAML: nothing to read back
    try:
        parse_spec(spec, path)
        load_spec(path)
    except SpecPilotError as e:
        assert str(e).startswith(str(path)) and len(str(e)) < 2000


@budget(100)
@given(st.binary(max_size=300))
def test_spec_files_of_any_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("raw") / "model.yaml"
    path.write_bytes(data)
    try:
        load_spec(path)
    except SpecPilotError:
        pass


REQUEST_KEYS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "stop", "n",
                "logprobs", "presence_penalty", "messages", "max_completion_tokens", "echo", "return_token_ids"]


@budget(150)
@given(st.dictionaries(st.sampled_from(REQUEST_KEYS), values, max_size=6))
def test_server_requests_validate_or_refuse(body):
    from specpilot.serve.protocol import ChatCompletionRequest, CompletionRequest
    for model in (CompletionRequest, ChatCompletionRequest):
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            assert e.errors()
            continue
        req.sampling(0)                             # a validated request always yields its sampling


@budget(60)
@given(st.lists(st.one_of(values.map(json.dumps), st.text(max_size=20)), max_size=4))
def test_request_files_are_read_or_refused(tmp_path_factory, lines):
    from types import SimpleNamespace

    from specpilot.cli import read_requests
    path = tmp_path_factory.mktemp("req") / "requests.jsonl"
    try:
        path.write_text("\n".join(lines))
    except UnicodeEncodeError:
        return
    system = SimpleNamespace(vocab_size=301, tokenizer=SimpleNamespace(encode=lambda text: list(text.encode())[:8]))
    try:
        for ids, limit in read_requests(path, system, 8):
            assert all(isinstance(t, int) for t in ids) and limit > 0
    except SpecPilotError:
        pass


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.target import parse_target
    tmp = tmp_path_factory.mktemp("fuzzbuild")
    (tmp / "model.yaml").write_text(yaml.safe_dump({**VALID_SPEC, "passes": ""}))
    build(BuildRequest(load_spec(tmp / "model.yaml"), parse_target("llvm"), tmp / "b"))
    return tmp


MANIFEST_KEYS = ["format", "version", "capacity", "max_batch", "dtype", "functions", "params", "hashes", "serving",
                 "tree", "drafter", "models", "target_kind", "params_source", "weights", "seeds", "aliases"]


@budget(80)
@given(st.lists(st.tuples(st.sampled_from(MANIFEST_KEYS), st.one_of(st.just("delete"), values)), min_size=1,
                max_size=3))
def test_mutated_manifests_load_or_are_refused(tiny_build, tmp_path_factory, edits):
    from specpilot.core.manifest import read_manifest
    data = json.loads((tiny_build / "b" / "manifest.json").read_text())
    for key, value in edits:
        if value == "delete":
            data.pop(key, None)
        else:
            data[key] = value
    folder = tmp_path_factory.mktemp("manifest")
    (folder / "manifest.json").write_text(json.dumps(data))
    try:
        read_manifest(folder)
    except SpecPilotError as e:
        assert "manifest" in str(e) or "field" in str(e)


@pytest.mark.slow
def test_compile_killed_at_random_points_leaves_the_previous_build(tiny_build):
    """SIGKILL during a recompile into the same folder, at three points: the folder still holds the
    previous build, whole (its hashes check when it is loaded); the next compile cleans up."""
    from specpilot.core.manifest import read_manifest
    from specpilot.runtime.systems import from_build
    out = tiny_build / "b"
    pipelines = {read_manifest(out).pipeline, "tree-verify{budget=4}"}     # the old build's, or the new one's
    for delay in (1.0, 4.0, 8.0):
        proc = subprocess.Popen([sys.executable, "-m", "specpilot.cli", "compile", str(tiny_build / "model.yaml"),
                                 "-o", str(out), "--passes", "tree-verify{budget=4}"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert read_manifest(out).pipeline in pipelines
        from_build(out)                        # loads: hashes, params, module all of one build
    subprocess.run([sys.executable, "-m", "specpilot.cli", "compile", str(tiny_build / "model.yaml"), "-o", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    assert not [p for p in tiny_build.iterdir() if p.name.startswith(".b.")]


@pytest.mark.slow
def test_memory_import_killed_at_random_points_keeps_a_readable_memory(tmp_path):
    """SIGKILL during `memory import`: the memory still opens, holds a subset of the export's
    entries, each whole; the import run again completes it."""
    from specpilot.agent.reproduce import reproduce_hash
    from specpilot.compiler.build import system_hash
    from specpilot.core.target import parse_target
    from specpilot.memory.store import Applicability, Entry, Memory
    spec_path = ROOT / "examples" / "tiny-llama.yaml"
    spec = load_spec(spec_path)
    scope = Applicability(family="LlamaForCausalLM", hybrid=False, target_kind="llvm", dtype="float32",
                          drafter_kind="model")
    source = Memory(tmp_path / "source.sqlite")
    for n in (2, 3, 4):
        pipeline = f"draft-length{{length={n}}}"
        source.add(Entry(pipeline=pipeline, source_hash=system_hash(spec, parse_target("llvm"), pipeline),
                         applicability=scope, target="llvm", spec=spec.model_dump(mode="json"),
                         spec_path=str(spec_path), results={"speedup": 1.1, "lcb": 0.01}), reproduce_hash)
    export = tmp_path / "export.json"
    export.write_text(json.dumps(source.export()))
    want = {e.id for e in source.entries()}
    target = tmp_path / "m.sqlite"
    for delay in (2.0, 4.0, 6.0):
        proc = subprocess.Popen([sys.executable, "-m", "specpilot.cli", "memory", "import", str(export), "--memory",
                                 str(target)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if target.exists():
            with Memory(target, create=False) as mem:
                got = mem.entries()
                assert {e.id for e in got} <= want and not mem.unreadable
    subprocess.run([sys.executable, "-m", "specpilot.cli", "memory", "import", str(export), "--memory", str(target)],
                   cwd=ROOT, check=True, capture_output=True)
    with Memory(target, create=False) as mem:
        assert {e.id for e in mem.entries()} == want


@pytest.mark.slow
@pytest.mark.skipif(SCALE == 1, reason="minutes of search: run by `make fuzz` (SPECPILOT_FUZZ=20)")
def test_search_killed_then_resumed_finishes(tmp_path):
    """SIGKILL of a running `specpilot search` (its workers die with it), then the same command again:
    it resumes from its log and finishes with a report and a readable memory."""
    from specpilot.memory.store import Memory
    out, memory = tmp_path / "search", tmp_path / "memory.sqlite"
    cmd = [sys.executable, "-m", "specpilot.cli", "-q", "search", str(ROOT / "examples" / "tiny-llama.yaml"),
           "--target", "llvm", "--rounds", "1", "-o", str(out), "--dev-requests", "2", "--dev-tokens", "8",
           "--time-tokens", "8", "--sealed-tokens", "32", "--repeats", "1", "--memory", str(memory)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "run.jsonl").is_file() and not (out / "report.json").exists()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["sealed"] and "result" in report
    if memory.exists():
        with Memory(memory, create=False) as mem:
            mem.entries()
            assert not mem.unreadable
