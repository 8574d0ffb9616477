"""Early-exit adapters: the batched training forward is the reference model's arithmetic, the
drafter a trained adapter file makes is the one that was trained, training lowers the KL, and a
build with an adapter drafter is lossless and stores the shared weights once."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
import yaml

from specpilot.core import adapter
from specpilot.core.loader import early_exit, load_models
from specpilot.core.spec import load_spec
from specpilot.core.weights import random_weights
from specpilot.core.errors import CheckpointError, SpecError, SpecPilotError
from specpilot.runtime import drafter_training as dt
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.reference.model import ReferenceModel
from specpilot.runtime.tokenizer import ByteTokenizer
from tests.conftest import HYBRID, TINY_CONFIGS, tiny_config

ATTENTION_ONLY = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def _target(arch, seed=0, **overrides):
    cfg = tiny_config(arch, **overrides)
    return cfg, random_weights(cfg, seed)


def _rows(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", ATTENTION_ONLY)
def test_batched_forward_is_the_reference(arch):
    """Right-padded rows of odd lengths: every valid position's logits and every exit's hidden
    state (through the final norm and head) equal the per-sequence reference's."""
    cfg, w = _target(arch, seed=3)
    rows = _rows([13, 7, 1], cfg.vocab_size, seed=4)
    tokens, valid = dt.pad_rows(rows, "cpu")
    logits, hidden = dt.forward(cfg, w, tokens, valid, exits={1, 2})
    ref = ReferenceModel(cfg, w)
    for b, row in enumerate(rows):
        want = ref.forward(row, ref.new_state(32))
        torch.testing.assert_close(logits[b, :len(row)], want, rtol=1e-5, atol=1e-5)
    from specpilot.core.loader import LoadedModel
    for L in (1, 2):
        sub = early_exit(LoadedModel(cfg, w, None, "t"), L)
        small = ReferenceModel(sub.cfg, sub.weights)
        got = dt.head(cfg, {**w, "lm_head.weight": ref.w["lm_head.weight"]}, hidden[L], w["model.norm.weight"])
        for b, row in enumerate(rows):
            torch.testing.assert_close(got[b, :len(row)], small.forward(row, small.new_state(32)), rtol=1e-5, atol=1e-5)


def test_generate_left_padded_is_greedy_reference():
    cfg, w = _target("Qwen3ForCausalLM", seed=5)
    prompts = _rows([9, 2, 5], cfg.vocab_size, seed=6)
    outs = dt.generate(cfg, w, prompts, 11, stop=set())
    ref = ReferenceModel(cfg, w)
    for p, o in zip(prompts, outs):
        assert o == autoregressive(ref, p, 11, 64).tokens
    # a stop token ends its row (included) and not the others
    stop = outs[0][3]
    cut = dt.generate(cfg, w, prompts, 11, stop={stop})
    assert cut[0] == outs[0][:outs[0].index(stop) + 1]
    for o, c in zip(outs, cut):
        assert c == (o[:o.index(stop) + 1] if stop in o else o)


def test_sampling_is_seeded_and_cools_to_greedy():
    cfg, w = _target("LlamaForCausalLM", seed=5)
    prompts = _rows([4, 4], cfg.vocab_size, seed=7)
    sample = lambda t, s: dt.generate(cfg, w, prompts, 12, set(), temperature=t,  # noqa: E731
                                      rng=torch.Generator().manual_seed(s))
    assert sample(1.0, 3) == sample(1.0, 3) and sample(1.0, 3) != sample(1.0, 4)
    assert sample(1e-4, 3) == dt.generate(cfg, w, prompts, 12, set())


def _corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    rng = random.Random(0)
    for i in range(4):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {rng.randrange(100)} + {j}\n\n\n" for j in range(30))
        (d / f"m{i}.py").write_text(f"class C{i}:\n    pass\n\n\n" + body)
    return d


def test_code_prompts_are_dedented_starts_of_whole_lines(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    body = "".join(f"class K{j}:\n    def m{j}(self, a):\n        b = a + {j}\n        c = b * 2\n        return c - 1\n\n"
                   for j in range(40))
    (d / "k.py").write_text(body)
    prompts = dt.code_prompts(dt.stdlib_files(d), random.Random(3), 60, max_chars=70, max_lines=3)
    assert prompts == dt.code_prompts(dt.stdlib_files(d), random.Random(3), 60, max_chars=70, max_lines=3)
    assert len(prompts) == 60
    lengths = {p.count("\n") for p in prompts}
    assert lengths == {1, 2, 3}                      # 1 to max_lines whole lines, each ending in a newline
    for p in prompts:
        assert p.endswith("\n") and len(p) <= 70 and p[0] in "dc"        # dedented: methods start at column 0
        assert p in body.replace("\n    ", "\n") or p in body        # a verbatim start, up to the indent


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapter")
    cfg, w = _target("LlamaForCausalLM", seed=2, vocab_size=300)   # >= 256: byte tokenizer
    results, info = dt.train_adapters(cfg, w, ByteTokenizer(cfg.vocab_size), [1, 2], steps=40, batch=4, seq_len=48,
                                      generated=8, lr=1e-3, seed=1, corpus=_corpus(tmp), max_new=24, log=lambda m: None)
    return tmp, cfg, w, results, info


def test_training_lowers_the_kl_and_beats_the_bare_exit(trained):
    _, cfg, w, results, info = trained
    assert info["steps"] == 40 and info["target_digest"] == adapter.target_digest(w)
    for r in results:
        first, last = sum(r.losses[:5]) / 5, sum(r.losses[-5:]) / 5
        assert last < 0.9 * first, (r.layers, first, last)
        assert r.heldout["top1"] > r.heldout["top1_no_adapter"]
        assert set(r.tensors) == set(adapter.adapter_shapes(cfg, r.layers))


def test_time_limited_training_ends_annealed(tmp_path):
    """A run cut by its time limit (far more steps asked than fit) still decays the learning
    rate to ~0 by the end, instead of stopping mid-schedule at a high rate; a step-limited run
    ends at the schedule's end too."""
    cfg, w = _target("LlamaForCausalLM", seed=3, vocab_size=300)
    corpus = _corpus(tmp_path)
    kw = dict(batch=2, seq_len=32, generated=2, lr=1e-3, seed=1, corpus=corpus, max_new=8, log=lambda m: None)
    _, info = dt.train_adapters(cfg, w, ByteTokenizer(cfg.vocab_size), [1], steps=10**6, time_limit=4.0, **kw)
    assert 0 < info["steps"] < 10**6
    assert info["last_lr"] < 0.05 * 1e-3, info
    _, info = dt.train_adapters(cfg, w, ByteTokenizer(cfg.vocab_size), [1], steps=30, **kw)
    assert info["steps"] == 30 and info["last_lr"] < 0.01 * 1e-3, info


def test_the_learning_rate_warms_up_then_follows_the_further_of_steps_and_time():
    assert dt.lr_factor(0, 1000) == pytest.approx(1 / 50)              # warm-up: 5 % of the steps
    assert dt.lr_factor(49, 1000) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.049)))
    assert dt.lr_factor(500, 1000) == pytest.approx(0.5)               # half way: the cosine's middle
    assert dt.lr_factor(500, 1000, elapsed=9.0, budget=10.0) == pytest.approx(0.5 * (1 + math.cos(0.9 * math.pi)))
    assert dt.lr_factor(900, 1000, elapsed=1.0, budget=10.0) == pytest.approx(0.5 * (1 + math.cos(0.9 * math.pi)))
    assert dt.lr_factor(10, 1000, elapsed=20.0, budget=10.0) == pytest.approx(0.0, abs=1e-12)
    assert dt.lr_factor(5000, 10**6) == pytest.approx(1.0, abs=1e-4)   # warm-up capped at 100 steps


def test_the_drafter_is_what_was_trained(trained):
    """An adapter file read back onto the target gives the drafter (reference model) the
    training forward computed: same logits on fresh rows."""
    tmp, cfg, w, results, _ = trained
    r = results[1]
    path = tmp / "a.safetensors"
    adapter.save(path, r.tensors, r.layers, adapter.target_digest(w))
    dcfg, dw, own = adapter.attach(path, cfg, w, r.layers)
    assert dcfg.num_hidden_layers == r.layers + 1
    assert own == frozenset(adapter.adapter_shapes(cfg, r.layers))
    assert all(dw[k] is w[k] for k in dw if k not in own)        # shared, not copied
    drafter = ReferenceModel(dcfg, dw)
    rows = _rows([10, 3], cfg.vocab_size, seed=9)
    tokens, valid = dt.pad_rows(rows, "cpu")
    _, hidden = dt.forward(cfg, w, tokens, valid, exits={r.layers})
    got = dt._adapter_logits(cfg, w, r.tensors, r.layers, hidden[r.layers], valid)
    for b, row in enumerate(rows):
        torch.testing.assert_close(got[b, :len(row)], drafter.forward(row, drafter.new_state(16)), rtol=1e-5, atol=1e-5)


def test_adapter_errors(trained, tmp_path):
    _, cfg, w, results, _ = trained
    r = results[0]
    good = tmp_path / "good.safetensors"
    adapter.save(good, r.tensors, r.layers, adapter.target_digest(w))
    with pytest.raises(CheckpointError, match="follows 1 target layers, the spec keeps 2"):
        adapter.attach(good, cfg, w, 2)
    other = random_weights(cfg, 99)
    with pytest.raises(CheckpointError, match="trained for another target"):
        adapter.attach(good, cfg, other, 1)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(good.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="cannot read the adapter"):
        adapter.attach(corrupt, cfg, w, 1)
    missing = tmp_path / "missing.safetensors"
    adapter.save(missing, {k: v for k, v in r.tensors.items() if "q_proj" not in k}, 1, adapter.target_digest(w))
    with pytest.raises(CheckpointError, match="missing model.layers.1.self_attn.q_proj"):
        adapter.attach(missing, cfg, w, 1)
    shaped = tmp_path / "shaped.safetensors"
    adapter.save(shaped, {**r.tensors, "model.norm.weight": torch.ones(7)}, 1, adapter.target_digest(w))
    with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
        adapter.attach(shaped, cfg, w, 1)
    nan = tmp_path / "nan.safetensors"
    adapter.save(nan, {**r.tensors, "model.norm.weight": torch.full_like(r.tensors["model.norm.weight"], float("nan"))},
                 1, adapter.target_digest(w))
    with pytest.raises(CheckpointError, match="not finite"):
        adapter.attach(nan, cfg, w, 1)
    from safetensors.torch import save_file
    plain = tmp_path / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in r.tensors.items()}, str(plain))
    with pytest.raises(CheckpointError, match="not an early-exit adapter"):
        adapter.attach(plain, cfg, w, 1)


def test_training_refuses_hybrid_targets_and_bad_exits():
    cfg, w = _target(HYBRID)
    with pytest.raises(SpecPilotError, match="Gated DeltaNet"):
        dt.train_adapters(cfg, w, ByteTokenizer(512), [1], steps=1, batch=2, seq_len=16, generated=2)
    cfg, w = _target("LlamaForCausalLM")
    with pytest.raises(SpecPilotError, match="exit layer 3 is not in 1..2"):
        dt.train_adapters(cfg, w, ByteTokenizer(512), [3], steps=1, batch=2, seq_len=16, generated=2)


def _spec(tmp_path, drafter, arch="LlamaForCausalLM"):
    data = {"target": {"architecture": arch, "config": {**TINY_CONFIGS[arch], "vocab_size": 300},
                       "init": {"seed": 2}},
            "drafter": drafter, "deployment": {"dtype": "float32", "max_seq_len": 300}}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_train_bad_input_is_one_line(tmp_path, run_cli):
    spec = _spec(tmp_path, {"kind": "ngram"})
    code, _, err = run_cli("drafter", "train", spec, "--layers", "1", "-o", tmp_path / "o", "--device", "tpu")
    assert code == 2 and "expected cpu, cuda or auto" in err
    bad = tmp_path / "holdout.json"
    bad.write_text("{not json")
    code, _, err = run_cli("drafter", "train", spec, "--layers", "1", "-o", tmp_path / "o", "--holdout", bad,
                           "--device", "cpu")
    assert code == 2 and "not JSON" in err
    hybrid = _spec(tmp_path, {"kind": "ngram"}, arch=HYBRID)
    code, _, err = run_cli("drafter", "train", hybrid, "--layers", "1", "-o", tmp_path / "o", "--device", "cpu")
    assert code == 2 and "Gated DeltaNet" in err and not (tmp_path / "o").exists()


def test_missing_adapter_file_names_the_key(tmp_path):
    spec = load_spec(_spec(tmp_path, {"kind": "early-exit", "layers": 1, "adapter": "nope.safetensors"}))
    with pytest.raises(SpecError, match="drafter.adapter.*does not exist"):
        load_models(spec)


def test_cli_train_then_compiled_build_is_lossless(tmp_path, trained, run_cli):
    """`specpilot drafter train` writes adapters a spec then uses; the compiled build of that
    spec (llvm) passes token forcing against stock, and stores the target's shared layers once."""
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.target import parse_target
    from specpilot.runtime.forcing import force_requests
    from specpilot.runtime.systems import from_build

    corpus = _corpus(tmp_path)
    holdout = tmp_path / "holdout.json"
    holdout.write_text(json.dumps(["def f0_0(x):"]))
    code, out, err = run_cli("drafter", "train", _spec(tmp_path, {"kind": "ngram"}), "--layers", "2", "-o",
                             tmp_path / "ad", "--steps", "6", "--batch", "2", "--seq-len", "32", "--generate", "4",
                             "--corpus", corpus, "--holdout", holdout, "--device", "cpu")
    assert code == 0, err
    report = json.loads((tmp_path / "ad" / "training.json").read_text())
    assert report["steps"] == 6 and report["adapters"][0]["file"] == "adapter-L2.safetensors"
    spec = load_spec(_spec(tmp_path, {"kind": "early-exit", "layers": 2, "adapter": "ad/adapter-L2.safetensors",
                                      "draft_len": 4, "top_k": 3}))
    manifest = build(BuildRequest(spec, parse_target("llvm"), tmp_path / "build"))
    assert manifest.aliases["target.model.layers.0.self_attn.q_proj.weight"] == \
        "drafter.model.layers.0.self_attn.q_proj.weight"
    assert not any(k.startswith("target.model.layers.2.") for k in manifest.aliases)   # the adapter's own
    assert "drafter.model.layers.2.mlp.up_proj.weight" in manifest.params
    system = from_build(tmp_path / "build")
    prompts = [[(7 * i + r) % 300 for i in range(5 + 6 * r)] for r in range(2)]
    stock = [system.generate("stock", p, 64) for p in prompts]
    for engine in ("stock-spec", "compiled-spec"):
        runs = [system.generate(engine, p, 64, force=s.tokens) for p, s in zip(prompts, stock)]
        report = force_requests(stock, runs, tie_tolerance=0.0)
        assert report.passed and not report.excused, (engine, report.first_divergence)


class _ChatBytes(ByteTokenizer):
    """Bytes plus the two ChatML markers as single tokens (ids 256, 257)."""
    SPECIAL = {"<|im_start|>": 256, "<|im_end|>": 257}

    def encode(self, text):
        out = []
        for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            out += [self.SPECIAL[part]] if part in self.SPECIAL else list(part.encode())
        return out


@pytest.mark.parametrize("ends", [True, False])
def test_chat_questions_the_target_samples_become_prompts(monkeypatch, tmp_path, ends):
    """With ChatML markers, half the prompts are questions the target samples after
    '<|im_start|>user\\n': kept only when they end with <|im_end|>, are not empty and are not a
    held-out prompt; a target that never ends one stops after a bounded number of samples."""
    cfg, w = _target("LlamaForCausalLM", seed=4, vocab_size=300)
    tok = _ChatBytes(cfg.vocab_size)
    samples = [list(b"what is 1?"), list(b"held question"), list(b"no end in sight"), [], list(b" why ")]
    real, greedy_prompts, sampled = dt.generate, [], []

    def fake(cfg_, w_, prompts, max_new, stop, temperature=0.0, rng=None):
        if temperature == 0.0:
            greedy_prompts.extend(prompts)
            return real(cfg_, w_, prompts, max_new, stop)
        assert prompts == [tok.encode("<|im_start|>user\n")] * len(prompts) and stop == {257}
        out = []
        for _ in prompts:
            s = samples[len(sampled) % len(samples)]
            sampled.append(s)
            out.append(s + [257] if ends and s is not samples[2] else s)
        return out

    monkeypatch.setattr(dt, "generate", fake)
    logs = []
    dt.train_adapters(cfg, w, tok, [1], steps=2, batch=2, seq_len=32, generated=8, seed=1,
                      holdout=["held question"], corpus=_corpus(tmp_path), max_new=4, log=logs.append)
    chats = [tok.decode(p) for p in greedy_prompts if p[:1] == [256]]
    line = next(m for m in logs if m.startswith("sampled"))
    if ends:
        assert chats and set(chats) <= {"user\nwhat is 1?\nassistant\n", "user\nwhy\nassistant\n"}, chats
        assert len(chats) == 4 and line.startswith("sampled 4 questions"), line
    else:
        assert chats == [] and line.startswith("sampled 0 questions"), line
        assert len(sampled) <= 64 * 4 + 64      # 64 samples a wanted question, and one batch (64 rows on the CPU)
