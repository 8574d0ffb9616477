"""Drafters that read the target's hidden states (block: DFlash-style, feature: EAGLE-3-style): the
features a target keeps follow its accepted path, the compiled target returns the reference's, the
drafters' incremental state equals a fresh one, the training forwards equal the inference
networks, and every engine with either drafter passes token forcing exactly on all five families."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from specpilot.core import feature_drafter as fd
from specpilot.core.errors import CheckpointError, SpecError, SpecPilotError
from specpilot.core.spec import parse_spec
from specpilot.core.weights import random_weights
from specpilot.runtime.decoding import autoregressive, close_state, speculative, speculative_tree, tree_inputs
from specpilot.runtime.drafters import ranked
from specpilot.runtime.feature_drafter_training import (block_batch, block_forward, feature_forward, init_tensors,
                                                         loss_curve, sample_anchors)
from specpilot.runtime.feature_drafters import BlockDrafter, FeatureDrafter
from specpilot.runtime.features import FeaturePool
from specpilot.runtime.forcing import force_requests
from specpilot.runtime.reference.feature_nets import build_net
from specpilot.runtime.reference.model import ReferenceModel
from specpilot.runtime.systems import from_build, from_spec
from specpilot.runtime.tree import Tree
from tests.conftest import HYBRID, TINY_CONFIGS, assert_block_chains_are_the_level_walk_s, tiny_config

ARCHS = sorted(TINY_CONFIGS)
PROMPTS = [[(7 * i + 5 * r) % 301 for i in range(8 + 5 * r)] for r in range(2)]


def _data(arch: str, kind: str, **drafter) -> dict:
    return {"target": {"architecture": arch, "config": TINY_CONFIGS[arch], "init": {"seed": 2}},
            "drafter": {"kind": kind, "init": {"seed": 4}, "draft_len": 5, "top_k": 3, **drafter},
            "deployment": {"dtype": "float32", "max_seq_len": 256},
            "passes": "tree-verify{budget=10}" + (",gdn-path-recompute" if "linear" in str(tiny_config(arch).layer_types) else "")}


def _target(arch: str, layers=(0, 2)) -> ReferenceModel:
    cfg = tiny_config(arch)
    return ReferenceModel(cfg, random_weights(cfg, 3), feature_layers=layers)


def _net(model: ReferenceModel, kind: str, seed: int = 6, **options):
    cfg = fd.seeded_config(kind, model.cfg, **options)
    tensors = fd.random_init(cfg, seed)
    return cfg, tensors, build_net(cfg, tensors, model.w, torch.float32, "cpu")


@pytest.mark.parametrize("arch", ARCHS)
def test_features_follow_the_accepted_path(arch):
    """After a tree verification and accept_path, the kept rows are those a plain prefill of the
    accepted tokens computes."""
    model = _target(arch)
    rng = random.Random(arch)
    state = model.new_state(64)
    prompt = [rng.randrange(301) for _ in range(9)]
    model.forward(prompt, state)
    tree = Tree([rng.randrange(301) for _ in range(6)], [-1, 0, 0, 1, 3, 2], [1, 2, 2, 3, 4, 3], [0.0] * 6)
    last = rng.randrange(301)
    tokens, positions, mask, parents = tree_inputs(last, tree, state.length)
    base = state.length
    model.forward(tokens, state, positions=positions, attn_mask=mask, record=True, parents=parents)
    path = [1, 2, 4, 5]                                 # root, node 0, node 1, node 3 (a root path)
    model.accept_path(state, base, [0] + path)
    accepted = prompt + [last] + [tree.tokens[i] for i in (0, 1, 3, 4)]
    fresh = model.new_state(64)
    model.forward(accepted, fresh)
    assert state.length == len(accepted)
    # (a hybrid's Gated DeltaNet layers run a tree pass and a prefill in different orders of summation)
    torch.testing.assert_close(state.features.read(0, state.length), fresh.features.read(0, fresh.length),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_a_pool_s_batched_writes_and_moves_equal_each_sequence_s_own(seed):
    """Batches of passes (1-4 sequences of 1-6 tokens, float32 into a float64 pool of odd sizes), each
    sequence then keeping a random root path, its prefix or all of it; moves settled for the batch,
    by the next write or by a read: every sequence's rows are those of its own plain tensor."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    capacity, width = 61, 7
    pool = FeaturePool(5, capacity, width, torch.float64, "cpu")
    stores = [pool.store(r) for r in rng.sample(range(5), 4)]
    want, length = [torch.zeros(capacity, width, dtype=torch.float64) for _ in stores], [0] * 4
    for _ in range(10):
        batch = rng.sample(range(4), rng.randint(1, 4))
        n = [rng.randint(1, 6) for _ in batch]
        features = torch.randn(len(batch), max(n), width, generator=gen)
        pool.write([(stores[i], length[i], k) for i, k in zip(batch, n)], features)
        for j, (i, k) in enumerate(zip(batch, n)):
            want[i][length[i]:length[i] + k] = features[j, :k].double()
            kept = rng.choice(["path", "prefix", "all"])
            if kept == "path":
                path = [0] + sorted(rng.sample(range(1, k), rng.randint(0, k - 1)))
                stores[i].accept(length[i], path)
                want[i][length[i]:length[i] + len(path)] = want[i][[length[i] + r for r in path]].clone()
                length[i] += len(path)
            else:
                length[i] += rng.randint(1, k) if kept == "prefix" else k
        if rng.random() < 0.5:
            pool.settle(stores)
            assert all(s.moves is None for s in stores)
        for i in rng.sample(range(4), 2):
            assert torch.equal(stores[i].read(0, length[i]), want[i][:length[i]])
    for i in range(4):
        assert torch.equal(stores[i].read(0, length[i]), want[i][:length[i]])
    with pytest.raises(SpecPilotError, match="not an ascending path"):
        stores[0].accept(0, [0, 2, 1])


def test_block_network_equals_its_training_forward():
    model = _target("Qwen3ForCausalLM", layers=(0, 1, 2))
    cfg, tensors, net = _net(model, "block", layers=2, block_size=5, target_layers=(0, 1, 2))
    features = torch.randn(11, len(cfg.target_layers) * cfg.target_hidden)
    tokens = torch.tensor([17] + [cfg.mask_token_id] * 4)
    cache = net.new_cache(16)
    net.context(cache, features, 0)
    want = net.block(cache, tokens, 11)
    mask = torch.zeros(1, 5, 16, dtype=torch.bool)
    mask[:, :, :16] = True
    got = block_forward(cfg, tensors, model.w["model.embed_tokens.weight"], model.w["lm_head.weight"],
                        features[None], tokens[None], torch.arange(11, 16)[None], mask)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_feature_network_steps_equal_its_training_forward():
    """Training step s at pair j is the tree node of path t_{j+2} .. t_{j+1+s} below the context
    t_0 .. t_{j+1}: the same keys seen, the same positions."""
    model = _target("LlamaForCausalLM", layers=(0, 1, 2))
    cfg, tensors, net = _net(model, "feature", target_layers=(0, 1, 2))
    seq = [random.Random(1).randrange(301) for _ in range(14)]
    state = model.new_state(64)
    model.forward(seq, state)
    features = state.features.read(0, len(seq))
    steps = feature_forward(cfg, tensors, model.w["model.embed_tokens.weight"], features[None], torch.tensor([seq]),
                            torch.ones(1, len(seq), dtype=torch.bool), 3)
    drafter = FeatureDrafter(net, top_k=3, capacity=64)
    drafter.bind(state)
    j = 8
    expand = drafter.expander(seq[:j + 2])              # its last pair is (feature j, t_{j+1})
    for s in range(3):
        path = seq[j + 2:j + 2 + s]
        expand(path)
        top = dict(expand(path))
        want = torch.log_softmax(steps[s][0, j], -1).topk(3)
        for token, value in zip(want.indices.tolist(), want.values.tolist()):
            assert top[token] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("kind", ["block", "feature"])
def test_a_drafter_kept_in_step_equals_a_fresh_one(kind):
    """After chains of verifications (accepts, rejections, rollbacks), what the drafter derived from
    the context is what a fresh drafter derives from it."""
    model = _target(HYBRID, layers=(1, 3))
    _, _, net = _net(model, kind, block_size=5, target_layers=(1, 3))
    kept = (BlockDrafter if kind == "block" else FeatureDrafter)(net, top_k=3, capacity=128)
    gen = speculative(model, kept, PROMPTS[1], 24, 4, 128)
    context = PROMPTS[1] + gen.tokens[:-1]              # the target's state holds all but the last token
    state = model.new_state(128)
    model.forward(context[:-1], state)
    fresh = (BlockDrafter if kind == "block" else FeatureDrafter)(net, top_k=3, capacity=128)
    fresh.bind(state)
    kept.bind(state)
    a, b = kept.propose(context, 4), fresh.propose(context, 4)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["block", "feature"])
def test_reference_engines_force_exactly(arch, kind):
    system = from_spec(parse_spec(_data(arch, kind)))
    stock = [system.generate("stock", p, 40) for p in PROMPTS]
    for engine in ("stock-spec", "stock-tree"):
        runs = [system.generate(engine, p, 40, force=s.tokens) for p, s in zip(PROMPTS, stock)]
        report = force_requests(stock, runs, tie_tolerance=0.0)
        assert report.passed and not report.excused, (engine, report.first_divergence)
        assert system.generate(engine, PROMPTS[0], 40).tokens == stock[0].tokens


def test_a_drafter_needs_a_target_that_keeps_features():
    model = _target("Qwen3ForCausalLM")
    _, _, net = _net(model, "block")
    plain = ReferenceModel(model.cfg, {k: v for k, v in model.w.items()})
    with pytest.raises(SpecPilotError, match="keeps none"):
        speculative(plain, BlockDrafter(net, 3, 64), PROMPTS[0], 8, 4, 64)
    other = ReferenceModel(model.cfg, dict(model.w), feature_layers=(1,))
    with pytest.raises(SpecPilotError, match="features of width"):
        speculative_tree(other, BlockDrafter(net, 3, 64), PROMPTS[0], 8, 6, 64)
    assert autoregressive(other, PROMPTS[0], 8, 64).tokens == autoregressive(plain, PROMPTS[0], 8, 64).tokens


# -- checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["block", "feature"])
def test_published_layout_round_trip(kind, tmp_path):
    cfg_t = tiny_config("Qwen3ForCausalLM")
    cfg = fd.seeded_config(kind, cfg_t, layers=2, block_size=6)
    tensors = fd.random_init(cfg, 1)
    fd.save(tmp_path / "d", cfg, tensors, cfg_t.num_hidden_layers, "abc", dtype=torch.float32)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    if kind == "block":
        assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 6
        assert config["dflash_config"]["target_layer_ids"] == list(cfg.target_layers)
        assert "fc.weight" in tensors and "layers.1.self_attn.q_norm.weight" in tensors
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(cfg.target_layers)
        assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * cfg.hidden_size
    back, read = fd.load(tmp_path / "d", cfg_t, "abc")
    assert back == cfg and set(read) == set(tensors)
    assert all(torch.equal(read[k], tensors[k]) for k in tensors)
    with pytest.raises(CheckpointError, match="another target"):
        fd.load(tmp_path / "d", cfg_t, "other")


def test_eagle3_draft_vocabulary_maps_to_target_ids(tmp_path):
    """A draft vocabulary smaller than the target's: d2t maps draft ids, other tokens get -inf."""
    model = _target("LlamaForCausalLM", layers=(0, 1, 2))
    cfg = fd.seeded_config("feature", model.cfg, target_layers=(0, 1, 2))
    cfg = fd.DraftNetConfig(**{**cfg.to_dict(), "target_layers": (0, 1, 2), "draft_vocab_size": 50})
    tensors = fd.random_init(cfg, 2)
    tensors["d2t"] = torch.arange(50) * 3          # draft id i -> target id 4 i
    fd.save(tmp_path / "e", cfg, tensors, 3, dtype=torch.float32)
    cfg, tensors = fd.load(tmp_path / "e", model.cfg)
    net = build_net(cfg, tensors, model.w, torch.float32, "cpu")
    logits = net.logits(torch.randn(2, cfg.hidden_size))
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite == [4 * i for i in range(50)]


def test_a_draft_vocabulary_out_of_order_loads_in_target_order(tmp_path):
    """A feature drafter whose d2t does not ascend loads with its draft ids renumbered (head rows with
    them): the same logits over target ids, and ties broken by target id as a build ranks them."""
    model = _target("LlamaForCausalLM", layers=(0, 1, 2))
    cfg = fd.seeded_config("feature", model.cfg, target_layers=(0, 1, 2))
    cfg = fd.DraftNetConfig(**{**cfg.to_dict(), "target_layers": (0, 1, 2), "draft_vocab_size": 40})
    tensors = fd.random_init(cfg, 2)
    ids = torch.randperm(model.cfg.vocab_size, generator=torch.Generator().manual_seed(4))[:40]
    tensors["d2t"] = fd.d2t_of(ids)                    # target ids in no order
    fd.save(tmp_path / "e", cfg, tensors, 3, dtype=torch.float32)
    back, read = fd.load(tmp_path / "e", model.cfg)
    assert fd.vocab_ids(read["d2t"]).tolist() == sorted(ids.tolist())
    as_saved = build_net(cfg, tensors, model.w, torch.float32, "cpu")
    loaded = build_net(back, read, model.w, torch.float32, "cpu")
    h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(loaded.logits(h), as_saved.logits(h), atol=0, rtol=0)
    assert fd.in_target_order(read) is read


def test_a_block_drafter_s_draft_vocabulary_is_the_head_s_rows_of_its_tokens(tmp_path):
    """A block drafter with a draft vocabulary: its logits are the whole head's at the d2t tokens and
    -inf elsewhere, on fresh random features; the vocabulary travels in the published layout (config's
    draft_vocab_size, d2t), and `save_with_vocabulary` adds one to a drafter keeping its weight files."""
    import dataclasses
    model = _target("Qwen3ForCausalLM", layers=(0, 1, 2))
    cfg, tensors, sliced = _net(model, "block", layers=2, block_size=5, target_layers=(0, 1, 2), draft_vocab=77)
    ids = fd.vocab_ids(tensors["d2t"])
    assert fd.sliced_head(cfg) and len(ids) == 77 and bool((ids[1:] > ids[:-1]).all()) and ids[-1] > 76
    whole = build_net(dataclasses.replace(cfg, draft_vocab_size=0), {k: v for k, v in tensors.items() if k != "d2t"},
                      model.w, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(5)
    features, tokens = torch.randn(11, 3 * cfg.target_hidden, generator=gen), torch.randint(0, 301, (5,), generator=gen)
    got, want = [], []
    for net, out in ((sliced, got), (whole, want)):
        cache = net.new_cache(fd.cache_slots(cfg, 64))
        net.context(cache, features, 0)
        out.append(net.block(cache, tokens, 11))
    assert torch.isfinite(got[0]).nonzero()[:, 1].unique().tolist() == ids.tolist()
    torch.testing.assert_close(got[0][:, ids], want[0][:, ids], atol=1e-5, rtol=1e-5)
    fd.save(tmp_path / "v", cfg, tensors, 3, "abc", dtype=torch.float32)
    assert json.loads((tmp_path / "v" / "config.json").read_text())["draft_vocab_size"] == 77
    back, read = fd.load(tmp_path / "v", model.cfg, "abc")
    assert back == cfg and torch.equal(read["d2t"], tensors["d2t"])
    plain = dataclasses.replace(cfg, draft_vocab_size=0)
    fd.save(tmp_path / "plain", plain, {k: v for k, v in tensors.items() if k != "d2t"}, 3, "abc", dtype=torch.float32)
    fd.save_with_vocabulary(tmp_path / "plain", tmp_path / "added", cfg, tensors["d2t"], 3, "abc")
    assert (tmp_path / "added" / "model.safetensors").read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()
    back, read = fd.load(tmp_path / "added", model.cfg, "abc")
    assert back == cfg and set(read) == set(tensors) and all(torch.equal(read[k], tensors[k]) for k in tensors)
    kept = (tmp_path / "added" / "model.safetensors").read_bytes()     # a link shares no later write
    fd.save(tmp_path / "plain", plain, {k: v + 1 for k, v in tensors.items() if k != "d2t"}, 3, "abc",
            dtype=torch.float32)
    assert (tmp_path / "added" / "model.safetensors").read_bytes() == kept != \
        (tmp_path / "plain" / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match=r"new \(or empty\) directory"):
        fd.save_with_vocabulary(tmp_path / "plain", tmp_path / "plain", cfg, tensors["d2t"], 3, "abc")


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: c.update(vocab_size=999), "vocabulary of 999"),
    (lambda c, t: (c.update(draft_vocab_size=400), t.update(d2t=torch.zeros(400, dtype=torch.long))),
     "draft_vocab_size 400"),
    (lambda c, t: (c.update(draft_vocab_size=3), t.update(d2t=torch.tensor([5, 4, 0]))),
     "two draft tokens to one target token"),
    (lambda c, t: (c.update(draft_vocab_size=3), t.update(d2t=torch.tensor([0, 0, 400]))), "outside the target"),
    (lambda c, t: c.update(draft_vocab_size=3), "missing d2t"),
    (lambda c, t: (c.update(draft_vocab_size=c["vocab_size"]), t.update(d2t=torch.zeros(c["vocab_size"], dtype=torch.long)
                                                                     .index_fill_(0, torch.tensor([7]), -3))),
     "two draft tokens to one target token"),
    (lambda c, t: c.update(num_target_layers=7), "target of 7 layers"),
    (lambda c, t: c["dflash_config"].update(target_layer_ids=[0, 9]), "target layer 9"),
    (lambda c, t: c.update(architectures=["Qwen3ForCausalLM"]), "not a drafter read here"),
    (lambda c, t: c.update(hidden_size=64), "hidden size 64"),
    (lambda c, t: c["dflash_config"].update(mask_token_id=5000), "mask_token_id"),
    (lambda c, t: t.pop("norm.weight"), "missing norm.weight"),
    (lambda c, t: t.update(extra=torch.zeros(2)), "unexpected tensor extra"),
    (lambda c, t: t.update({"fc.weight": torch.zeros(3, 3)}), "fc.weight has shape"),
    (lambda c, t: t.update({"norm.weight": torch.full((48,), float("nan"))}), "not finite"),
])
def test_bad_drafter_checkpoints_are_refused(tmp_path, edit, message):
    from safetensors.torch import save_file
    cfg_t = tiny_config("Qwen3ForCausalLM")
    cfg = fd.seeded_config("block", cfg_t)
    tensors = fd.random_init(cfg, 1)
    config = fd.hf_config(cfg, cfg_t.num_hidden_layers)
    edit(config, tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        fd.load(tmp_path, cfg_t)


def test_a_block_drafter_whose_vocabulary_is_every_token_loads_with_the_whole_head(tmp_path):
    """draft_vocab_size equal to the target's vocabulary, d2t a permutation of it: the whole head."""
    from safetensors.torch import save_file
    cfg_t = tiny_config("Qwen3ForCausalLM")
    cfg = fd.seeded_config("block", cfg_t)
    tensors = fd.random_init(cfg, 1)
    order = torch.randperm(cfg_t.vocab_size, generator=torch.Generator().manual_seed(3))
    config = {**fd.hf_config(cfg, cfg_t.num_hidden_layers), "draft_vocab_size": cfg_t.vocab_size}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({**tensors, "d2t": fd.d2t_of(order)}, str(tmp_path / "model.safetensors"))
    back, read = fd.load(tmp_path, cfg_t)
    assert back == cfg and not fd.sliced_head(back) and "d2t" not in read
    assert all(torch.equal(read[k], tensors[k]) for k in tensors)


def test_spec_refuses_what_a_feature_drafter_does_not_take(tmp_path):
    data = _data("Qwen3ForCausalLM", "block")
    with pytest.raises(SpecError, match="checkpoint' or 'init'"):
        parse_spec({**data, "drafter": {"kind": "block"}})
    with pytest.raises(SpecError, match="drafter.architecture"):
        parse_spec({**data, "drafter": {"kind": "feature", "architecture": "LlamaForCausalLM", "init": {"seed": 1}}})
    with pytest.raises(SpecError, match="target_layers"):
        parse_spec({**data, "drafter": {"kind": "ngram", "target_layers": [1]}})
    with pytest.raises(SpecError, match="not among"):
        from_spec(parse_spec({**data, "drafter": {"kind": "block", "init": {"seed": 1}, "target_layers": [0, 5]}}))
    fd.save(tmp_path / "d", fd.seeded_config("block", tiny_config("Qwen3ForCausalLM")), {}, 3)
    with pytest.raises(SpecError, match="drafter.draft_vocab"):
        parse_spec({**data, "drafter": {"kind": "block", "checkpoint": str(tmp_path / "d"), "draft_vocab": 50}})
    with pytest.raises(SpecError, match="drafter.top_k.*vocabulary of 2 tokens"):
        from_spec(parse_spec({**data, "drafter": {"kind": "block", "init": {"seed": 1}, "draft_vocab": 2, "top_k": 3}}))
    with pytest.raises(SpecError, match="draft_vocab are a block cost's"):
        parse_spec({**data, "drafter": {"kind": "replay", "alpha": 0.5, "cost": {"checkpoint": "x", "draft_vocab": 9}}})
    with pytest.raises(SpecError, match="drafter.draft_vocab.*go under 'cost'"):
        parse_spec({**data, "drafter": {"kind": "replay", "alpha": 0.5, "draft_vocab": 9,
                                        "cost": {"kind": "block", "init": {"seed": 1}}}})
    with pytest.raises(SpecError, match="drafter.draft_vocab.*not kind 'ngram'"):
        parse_spec({**data, "drafter": {"kind": "ngram", "draft_vocab": 9}})


def _block_batch_loop(cfg, anchors, tokens, valid_len, gamma):
    """The training batch of blocks, one block at a time (the reference for `block_batch`)."""
    bs, (B, T) = cfg.block_size, tokens.shape
    Q = max(1, max(len(a) for a in anchors)) * bs
    q_tok = torch.full((B, Q), cfg.mask_token_id, dtype=torch.long)
    q_pos = torch.zeros(B, Q, dtype=torch.long)
    mask = torch.zeros(B, Q, T + Q, dtype=torch.bool)
    mask[:, :, T:] = torch.eye(Q, dtype=torch.bool)
    labels = []
    for b, row in enumerate(anchors):
        for j, a in enumerate(row):
            s = j * bs
            q_tok[b, s] = tokens[b, a]
            q_pos[b, s:s + bs] = torch.arange(a, a + bs)
            mask[b, s:s + bs, :a] = True
            mask[b, s:s + bs, T + s:T + s + bs] = True
            labels += [(b, s + k, a + k - 1, math.exp(-(k - 1) / gamma)) for k in range(1, bs) if a + k < valid_len[b]]
    return q_tok, q_pos, mask, sorted(labels)


@pytest.mark.parametrize("seed", range(4))
def test_the_training_batch_of_blocks_equals_one_block_at_a_time(seed):
    rng = random.Random(seed)
    cfg = fd.seeded_config("block", tiny_config("LlamaForCausalLM"), block_size=rng.choice([2, 5, 8]))
    lengths = [rng.choice([1, 2, 3, rng.randrange(4, 40)]) for _ in range(rng.randrange(1, 6))]
    T = max(lengths)
    tokens = torch.randint(0, 301, (len(lengths), T))
    anchors = sample_anchors(lengths, rng.randrange(1, 12), rng)
    for row, n in zip(anchors, lengths):
        assert len(set(row)) == len(row) and all(1 <= a <= n - 2 for a in row) and row == sorted(row)
    q_tok, q_pos, mask, (b, q, t, w) = block_batch(cfg, anchors, tokens, lengths, "cpu", 7.0)
    want_tok, want_pos, want_mask, want_labels = _block_batch_loop(cfg, anchors, tokens, lengths, 7.0)
    assert torch.equal(q_tok, want_tok) and torch.equal(q_pos, want_pos) and torch.equal(mask, want_mask)
    got = sorted(zip(b.tolist(), q.tolist(), t.tolist(), w.tolist()))
    assert [g[:3] for g in got] == [x[:3] for x in want_labels]
    assert all(abs(g[3] - x[3]) < 1e-6 for g, x in zip(got, want_labels))


def test_training_init_takes_the_target_s_tensors_where_shapes_match():
    cfg_t = tiny_config("LlamaForCausalLM")
    weights = random_weights(cfg_t, 1)
    block = init_tensors(fd.seeded_config("block", cfg_t, layers=1), cfg_t, weights, 0)
    assert torch.equal(block["layers.0.mlp.down_proj.weight"], weights["model.layers.2.mlp.down_proj.weight"])
    feature = init_tensors(fd.seeded_config("feature", cfg_t), cfg_t, weights, 0)
    assert torch.equal(feature["lm_head.weight"], weights["lm_head.weight"])
    assert feature["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * cfg_t.hidden_size   # drawn, not copied


# -- compiled builds -------------------------------------------------------------------------
W12_TWO_LEVEL = "fuse-projections,w12-layout,nested-int8-view,tree-verify{budget=8},{gdn}two-level-verify"


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request, tmp_path_factory):
    """A CPU fp32 build of each family with fused projections, W12, the nested view and two-level verification; block
    drafters for some families, feature drafters for the others."""
    from tests.conftest import build_spec
    arch = request.param
    kind = "block" if ARCHS.index(arch) % 2 == 0 else "feature"
    # draft vocabularies (seeded: tokens drawn from the seed) for a block and a feature drafter
    data = _data(arch, kind, block_size=6, **({"draft_vocab": 160} if ARCHS.index(arch) in (2, 3) else {}))
    data["target"]["init"]["round_to"] = "bfloat16"      # W12 holds bf16 values exactly
    hybrid = "gdn-path-recompute" in data["passes"]
    data["passes"] = W12_TWO_LEVEL.replace("{gdn}", "gdn-path-recompute," if hybrid else "")
    tmp = tmp_path_factory.mktemp(arch)
    return build_spec(tmp, data), kind


def test_compiled_engines_force_exactly(compiled):
    out, kind = compiled
    system = from_build(out)
    assert {"compiled-spec", "compiled-tree", "compiled-two-level"} <= set(system.engines)
    stock = [system.generate("stock", p, 24) for p in PROMPTS]
    for engine in ("compiled-spec", "compiled-tree", "compiled-two-level"):
        runs = [system.generate(engine, p, 24, force=s.tokens) for p, s in zip(PROMPTS, stock)]
        report = force_requests(stock, runs, tie_tolerance=0.0)
        assert report.passed and not report.excused, (kind, engine, report.first_divergence)


def test_compiled_target_returns_the_reference_s_features(compiled):
    out, _ = compiled
    system = from_build(out)
    compiled_model, reference = system.engines["compiled"].model, system.engines["stock"].model
    states = [m.new_state(64) for m in (compiled_model, reference)]
    for m, st in zip((compiled_model, reference), states):
        m.forward(PROMPTS[1], st)
        m.forward([5, 6, 7], st, record=True)
    got, want = (st.features.read(0, st.length) for st in states)
    assert got.shape == want.shape == (len(PROMPTS[1]) + 3, len(system.engines["compiled"].model.feature_layers) * 48)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-4, rtol=1e-4)


def test_the_lowered_drafter_equals_its_reference(compiled):
    """The build's drafter functions against the PyTorch network on fresh random features, a context
    cached in two passes, then a block (block) or a pass of tree nodes over scattered slots (feature)."""
    from specpilot.runtime.engine import CompiledModule
    out, kind = compiled
    module = CompiledModule(out)
    cfg, tensors, _ = module.feature_drafter()
    nets = module.draft_net(), build_net(cfg, tensors, module.reference_weights("target"), torch.float32, "cpu")
    caches = [net.new_cache(fd.cache_slots(cfg, module.manifest.capacity)) for net in nets]
    gen = torch.Generator().manual_seed(len(out.name))
    features = torch.randn(13, len(cfg.target_layers) * cfg.target_hidden, generator=gen)
    if kind == "block":
        for net, cache in zip(nets, caches):
            net.context(cache, features[:9], 0)
            net.context(cache, features[9:], 9)
        tokens = torch.randint(0, cfg.vocab_size, (cfg.block_size,), generator=gen)
        got, want = (net.block(cache, tokens, 13) for net, cache in zip(nets, caches))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # a cycle: a few committed tokens' keys/values and the next block, ranked where the build runs, in
        # its one call -- against the reference's context and block, ranked by its logits
        more = torch.randn(3, features.shape[1], generator=gen)
        k = nets[0].ranks
        got = nets[0].ranked_cycle(caches[0], more, 16, tokens, k)
        nets[1].context(caches[1], more, 13)
        logits = nets[1].block(caches[1], tokens, 16)
        want, _ = ranked(logits, k)
        assert torch.equal(torch.from_numpy(got[0]), want)
        torch.testing.assert_close(torch.from_numpy(got[1]), torch.log_softmax(logits, dim=-1).gather(-1, want),
                                   atol=1e-4, rtol=1e-4)
        assert nets[0].ranked_cycle(caches[0], features[:cfg.block_size + 1], 16, tokens, k) is None   # too many
        return
    hidden = [net.fuse(features) for net in nets]
    torch.testing.assert_close(hidden[0], hidden[1], atol=1e-5, rtol=1e-5)
    tokens = torch.randint(0, cfg.vocab_size, (13,), generator=gen)
    context = torch.ones(13, 13, dtype=torch.bool).tril()
    nodes = torch.randint(0, cfg.vocab_size, (5,), generator=gen)
    slots = torch.tensor([13, 15, 14, 20, 17])          # scattered: the mask, not the order, says who sees whom
    mask = torch.zeros(5, 21, dtype=torch.bool)
    mask[:, :13] = True
    mask[torch.arange(5), slots] = True
    mask[3, 13] = True
    for net, cache, h in zip(nets, caches, hidden):
        net.step(cache, h, tokens, torch.arange(13), torch.arange(13), context)
    node_hidden = torch.randn(5, cfg.hidden_size, generator=gen)
    got, want = (net.step(cache, node_hidden, nodes, torch.tensor([13, 13, 13, 14, 13]), slots, mask)
                 for net, cache in zip(nets, caches))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_retrained_drafter_replaces_the_build_s_when_it_reads_the_same_layers(compiled, tmp_path, monkeypatch):
    from specpilot.runtime.engine import CompiledModule
    out, kind = compiled
    module = CompiledModule(out)
    cfg, tensors, own = module.feature_drafter()
    assert own == out / "drafter"
    retrained = fd.random_init(cfg, 99)
    if fd.sliced_head(cfg):     # the build's head rows are of its own vocabulary's tokens
        fd.save(tmp_path / "vocab", cfg, retrained, len(module.manifest.models["target"]["layer_types"]))
        monkeypatch.setenv("SPECPILOT_DRAFTER", str(tmp_path / "vocab"))
        with pytest.raises(SpecPilotError, match="draft vocabulary differs"):
            module.feature_drafter()
        retrained["d2t"] = tensors["d2t"]
    target_layers = module.manifest.features
    fd.save(tmp_path / "same", cfg, retrained, len(module.manifest.models["target"]["layer_types"]), dtype=torch.float32)
    monkeypatch.setenv("SPECPILOT_DRAFTER", str(tmp_path / "same"))
    _, read, directory = module.feature_drafter()
    assert directory == tmp_path / "same"
    assert torch.equal(read["fc.weight"], retrained["fc.weight"])
    swapped = CompiledModule(out).stored_parameters()[0]     # the lowered drafter runs the retrained weights
    stacks = {name: members for name, members in module.manifest.fused.items() if name.startswith("drafter.")}
    assert stacks      # fuse-projections stacked some of the drafter's weights: the swap stacks the retrained ones
    placed = {m: (name, i) for name, members in stacks.items() for i, m in enumerate(members)}
    for k, v in retrained.items():
        if k == "d2t":
            continue
        name, i = placed.get(f"drafter.{k}", (f"drafter.{k}", None))
        if i is None:
            assert torch.equal(swapped[name], v), name
        else:
            start = sum(retrained[m.partition(".")[2]].shape[0] for m in stacks[name][:i])
            assert torch.equal(swapped[name][start:start + v.shape[0]], v), (name, k)
    n_layers = len(module.manifest.models["target"]["layer_types"])
    elsewhere = next(i for i in range(n_layers) if i not in target_layers)
    other = fd.DraftNetConfig(**{**cfg.to_dict(), "target_layers": (elsewhere,)})
    fd.save(tmp_path / "other", other, fd.random_init(other, 1), n_layers)
    monkeypatch.setenv("SPECPILOT_DRAFTER", str(tmp_path / "other"))
    with pytest.raises(SpecPilotError, match="this build's target returns layers"):
        module.feature_drafter()
    wider = fd.DraftNetConfig(**{**cfg.to_dict(), "intermediate_size": cfg.intermediate_size + 8})
    fd.save(tmp_path / "wider", wider, fd.random_init(wider, 1), n_layers)
    monkeypatch.setenv("SPECPILOT_DRAFTER", str(tmp_path / "wider"))
    with pytest.raises(SpecPilotError, match="its intermediate_size is .* lowered a drafter with"):
        module.feature_drafter()


@pytest.mark.parametrize("seed", range(3))
def test_ranking_is_best_first_with_equal_values_in_index_order(seed):
    """`ranked` of a row, of many rows at once, and `ranked_rows` all equal the rule written out
    (sort by value descending, then index) -- bf16-rounded logits have many exact ties."""
    from specpilot.runtime.drafters import ranked_rows
    gen = torch.Generator().manual_seed(seed)
    rows, vocab, k = 1 + seed * 3, 23 + 9 * seed, 1 + 2 * seed
    logp = torch.randint(-6, 0, (rows, vocab), generator=gen).float() / 4     # many exact ties
    want = [sorted(range(vocab), key=lambda t: (-float(row[t]), t))[:k] for row in logp]
    indices, values = ranked(logp, k)
    assert indices.tolist() == want
    assert values.tolist() == [[float(row[t]) for t in w] for row, w in zip(logp, want)]
    assert [ranked(row, k)[0].tolist() for row in logp] == want
    assert [[t for t, _ in r] for r in ranked_rows(logp, k)] == want


@pytest.mark.parametrize("kind", ["block", "feature"])
def test_continuous_batches_with_either_drafter_are_stock_s_tokens(kind):
    """Requests of different lengths in one continuous batch (tree passes shared across them): each
    request's tokens are its own single-request stock tokens."""
    system = from_spec(parse_spec(_data(HYBRID, kind)))
    prompts = PROMPTS + [[(3 * i + 1) % 301 for i in range(5)]]
    lengths = [20, 12, 16]
    want = [system.generate("stock", p, n).tokens for p, n in zip(prompts, lengths)]
    for engine in ("stock-spec", "stock-tree"):
        got = system.generate_batch(engine, prompts, lengths, max_batch=2)
        assert [g.tokens for g in got] == want, engine


def test_the_block_loss_decays_as_dflash_s_for_its_block_size():
    from specpilot.runtime.feature_drafter_training import loss_decay
    assert [loss_decay(k) for k in (4, 8, 9, 10, 12, 16, 32)] == [4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 7.0]


@pytest.mark.parametrize("n", [1, 7, 20, 41, 1003])
def test_loss_curve_is_the_mean_of_equal_spans(n):
    rng = random.Random(n)
    losses = [rng.uniform(0, 9) for _ in range(n)]
    curve = loss_curve(losses)
    spans = min(20, n)
    assert len(curve) == spans
    # every loss in exactly one span, spans of sizes differing by at most one
    sizes = [round((i + 1) * n / spans) - round(i * n / spans) for i in range(spans)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    starts = [sum(sizes[:i]) for i in range(spans)]
    want = [sum(losses[a:a + k]) / k for a, k in zip(starts, sizes)]
    assert curve == pytest.approx(want, abs=1e-4)
    assert loss_curve([]) == []


def test_a_drafter_s_time_limit_counts_generating_its_data(tmp_path, monkeypatch):
    """`--time-limit` bounds the whole run: continuations that take longer to generate than the limit
    leave no time to train (the loop stops before its first step), and a limit with time left trains."""
    import time

    from specpilot.runtime import feature_drafter_training as fdt
    from specpilot.runtime.tokenizer import ByteTokenizer
    cfg_t = tiny_config("LlamaForCausalLM")
    weights = random_weights(cfg_t, 1)
    rows = [[(5 * i + r) % 300 + 3 for i in range(30)] for r in range(8)]

    def slow_sequences(*args, **kwargs):
        time.sleep(0.8)
        return rows
    monkeypatch.setattr(fdt, "target_sequences", slow_sequences)
    cfg = fd.seeded_config("block", cfg_t, layers=1, block_size=4)
    logs = []
    for limit, out in ((0.5, "late"), (60.0, "timely")):
        opts = fdt.Options(steps=2, batch=2, seq_len=24, generated=8, time_limit=limit)
        trainer = fdt.Trainer(cfg, cfg_t, weights, ByteTokenizer(cfg_t.vocab_size), opts, tmp_path / out, log=logs.append)
        logs.append(trainer.run()["steps"])
    assert logs == ["time limit: stopped after step 0", 0, 2], logs


def test_drafter_train_cli_writes_a_loadable_drafter_and_resumes(run_cli, tmp_path):
    import yaml
    data = _data("LlamaForCausalLM", "ngram")
    data["drafter"] = {"kind": "ngram"}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(data))
    args = ["drafter", "train", tmp_path / "t.yaml", "--kind", "feature", "-o", tmp_path / "d", "--batch", "4",
            "--seq-len", "40", "--generate", "6", "--draft-vocab", "120", "--device", "cpu"]
    code, _, err = run_cli(*args, "--steps", "3")
    assert code == 0, err
    report = json.loads((tmp_path / "d" / "training.json").read_text())
    assert report["steps"] == 3 and report["config"]["draft_vocab_size"] == 120
    assert len(report["loss_curve"]) == 3 and report["loss_curve"][0] == pytest.approx(report["first_loss"], abs=1e-4)
    code, _, err = run_cli(*args, "--steps", "5")
    assert code == 0 and "resumed at step 3" in err, err
    assert json.loads((tmp_path / "d" / "training.json").read_text())["steps"] == 5
    spec = {**data, "drafter": {"kind": "feature", "checkpoint": "d", "top_k": 3}}
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(spec))
    from specpilot.core.spec import load_spec
    system = from_spec(load_spec(tmp_path / "f.yaml"))
    assert system.generate("stock-tree", PROMPTS[0], 16).tokens == system.generate("stock", PROMPTS[0], 16).tokens
    code, _, err = run_cli(*args[:3], "--kind", "block", "--target-layers", "1,x", "-o", tmp_path / "b")
    assert code != 0 and "--target-layers" in err


def test_block_drafters_take_a_draft_vocabulary_in_training_or_after(run_cli, tmp_path):
    """`drafter train --kind block --draft-vocab N` trains against the head's rows of the target's N most
    used tokens; `drafter vocab` gives a trained block drafter one (its weight files unchanged); both
    load, and the reference tree engine with either is stock's tokens."""
    import yaml

    from specpilot.core.spec import load_spec
    data = _data("LlamaForCausalLM", "ngram")
    data["drafter"] = {"kind": "ngram"}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(data))
    common = ["--seq-len", "40", "--generate", "6", "--device", "cpu"]
    code, _, err = run_cli("drafter", "train", tmp_path / "t.yaml", "--kind", "block", "--block-size", "4",
                           "-o", tmp_path / "bv", "--batch", "4", "--steps", "2", "--draft-vocab", "90", *common)
    assert code == 0, err
    assert json.loads((tmp_path / "bv" / "config.json").read_text())["draft_vocab_size"] == 90
    assert json.loads((tmp_path / "bv" / "training.json").read_text())["gamma"] == 4.0     # DFlash's for small blocks
    from specpilot.runtime.feature_drafter_training import draft_vocabulary
    sequences = json.loads((tmp_path / "bv" / "training" / "sequences.json").read_text())["sequences"]
    trained = fd.load(tmp_path / "bv", tiny_config("LlamaForCausalLM"))[1]["d2t"]
    assert torch.equal(fd.vocab_ids(trained), draft_vocabulary(sequences, 90))    # the counted tokens
    code, _, err = run_cli("drafter", "train", tmp_path / "t.yaml", "--kind", "block", "--block-size", "4",
                           "-o", tmp_path / "b", "--batch", "4", "--steps", "2", "--gamma", "2.5", *common)
    assert code == 0, err
    assert json.loads((tmp_path / "b" / "training.json").read_text())["gamma"] == 2.5
    code, out, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "b", "--size", "100",
                             "-o", tmp_path / "b100", *common)
    assert code == 0 and "a vocabulary of 100 tokens" in out, err
    assert (tmp_path / "b100" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    code, out, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "b", "--from", tmp_path / "bv",
                             "-o", tmp_path / "bfrom")
    assert code == 0 and "a vocabulary of 90 tokens" in out, err
    taken, given = (fd.load(tmp_path / d, tiny_config("LlamaForCausalLM"))[1]["d2t"] for d in ("bfrom", "bv"))
    assert torch.equal(taken, given)
    code, _, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "b", "-o", tmp_path / "none")
    assert code != 0 and "--size" in err and "--from" in err
    for directory in ("bv", "b100", "bfrom"):
        (tmp_path / "s.yaml").write_text(yaml.safe_dump({**data, "drafter": {"kind": "block", "checkpoint": directory,
                                                                              "top_k": 3, "draft_len": 3}}))
        system = from_spec(load_spec(tmp_path / "s.yaml"))
        assert system.generate("stock-tree", PROMPTS[0], 16).tokens == system.generate("stock", PROMPTS[0], 16).tokens
    code, _, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "b100", "--size", "50",
                           "-o", tmp_path / "again", *common)
    assert code != 0 and "a draft vocabulary already" in err
    code, _, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "b", "--size", "301",
                           "-o", tmp_path / "whole", *common)
    assert code != 0 and "--size" in err
    for output in ("b", "b100"):          # its own folder, a folder with files: nothing is overwritten
        code, _, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "b", "--from", tmp_path / "bv",
                               "-o", tmp_path / output)
        assert code != 0 and "new (or empty) directory" in err
    feature = fd.seeded_config("feature", tiny_config("LlamaForCausalLM"), draft_vocab=50)
    fd.save(tmp_path / "f", feature, fd.random_init(feature, 1), 3, dtype=torch.float32)
    code, _, err = run_cli("drafter", "vocab", tmp_path / "t.yaml", tmp_path / "f", "--size", "40", "-o", tmp_path / "fv")
    assert code != 0 and "a feature drafter" in err


@pytest.mark.parametrize("replay", [False, True])
def test_a_seeded_build_draws_its_drafter_from_the_spec_s_seed(tmp_path, replay):
    """--params seeded: the build carries the drafter's config alone; the engine draws the same weights
    the spec's seed gives, and its engines are stock's tokens (a block drafter, or one with a draft
    vocabulary whose time a replay drafter spends)."""
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    from tests.conftest import build_spec
    data = _data("Qwen3ForCausalLM", "block", block_size=5)
    if replay:
        data["drafter"] = {"kind": "replay", "alpha": 0.8, "top_k": 3,
                           "cost": {"kind": "block", "block_size": 5, "draft_vocab": 150, "init": {"seed": 4}}}
    full = build_spec(tmp_path, data)
    build(BuildRequest(load_spec(tmp_path / "model.yaml"), parse_target("llvm"), tmp_path / "seeded", params="seeded"))
    assert not (tmp_path / "seeded" / "drafter" / "model.safetensors").exists()
    (_, want, _), (_, got, _) = (from_build(b).engines["compiled"].model.module.feature_drafter() for b in
                                 (full, tmp_path / "seeded"))
    assert set(got) == set(want) and all(torch.equal(got[k].float(), want[k].float()) for k in want)
    system = from_build(tmp_path / "seeded")
    stock = system.generate("stock", PROMPTS[0], 24).tokens
    assert system.generate("compiled-tree", PROMPTS[0], 24).tokens == stock


def test_a_referenced_checkpoint_build_takes_a_retrained_drafter(tmp_path, monkeypatch):
    """--params load checks the parameters it makes against the build's digest with the build's own
    drafter; a retrained one (SPECPILOT_DRAFTER) is swapped in after, and its engines are stock's tokens."""
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    from specpilot.core.weights import save_checkpoint
    cfg_t = tiny_config("Qwen3ForCausalLM")
    save_checkpoint(tmp_path / "ckpt", cfg_t, random_weights(cfg_t, 3))
    (tmp_path / "m.yaml").write_text("target: {checkpoint: ckpt}\n"
                                     "drafter: {kind: block, init: {seed: 4}, block_size: 5, top_k: 3}\n"
                                     "deployment: {max_seq_len: 128}\npasses: tree-verify{budget=6}\n")
    build(BuildRequest(load_spec(tmp_path / "m.yaml"), parse_target("llvm"), tmp_path / "load", params="load"))
    from specpilot.runtime.engine import CompiledModule
    cfg = CompiledModule(tmp_path / "load").feature_drafter()[0]
    retrained = fd.random_init(cfg, 77)
    fd.save(tmp_path / "re", cfg, retrained, cfg_t.num_hidden_layers, dtype=torch.float32)
    monkeypatch.setenv("SPECPILOT_DRAFTER", str(tmp_path / "re"))
    system = from_build(tmp_path / "load")
    stored = system.engines["compiled"].model.module.stored_parameters()[0]
    assert torch.equal(stored["drafter.fc.weight"], retrained["fc.weight"])
    assert system.generate("compiled-tree", PROMPTS[0], 24).tokens == system.generate("stock", PROMPTS[0], 24).tokens


# -- block drafters of a batch build: one pool, one call for all their blocks ------------------
@pytest.fixture(scope="module")
def batch_build(tmp_path_factory):
    """A CPU fp32 build of the hybrid with a block drafter (a draft vocabulary of 200 tokens) and a pool
    of three sequences."""
    from tests.conftest import build_spec
    data = _data(HYBRID, "block", block_size=5, draft_vocab=200)
    data["deployment"]["max_batch"] = 3
    data["passes"] += ",node-budget{nodes=12}"
    return build_spec(tmp_path_factory.mktemp("batch-block"), data)


def test_a_batch_s_blocks_in_one_call_equal_each_drafted_alone(batch_build):
    """`cycle_batch` over pool rows against the PyTorch network drafting each sequence alone, on fresh
    random features: contexts of different lengths, new tokens from none to a whole block."""
    from specpilot.runtime.engine import CompiledModule
    module = CompiledModule(batch_build)
    cfg, tensors, _ = module.feature_drafter()
    net = module.draft_net()
    reference = build_net(cfg, tensors, module.reference_weights("target"), torch.float32, "cpu")
    assert net.batched and net.pool_rows == 3
    slots = fd.cache_slots(cfg, module.manifest.capacity)
    caches = [net.new_cache(slots) for _ in range(3)]
    assert sorted(c.row for c in caches) == [0, 1, 2]
    gen = torch.Generator().manual_seed(11)
    width, k = len(cfg.target_layers) * cfg.target_hidden, net.ranks
    entries, want = [], []
    for cache, (cached, new) in zip(caches, [(7, 3), (19, cfg.block_size), (4, 0)]):
        features = torch.randn(cached + new, width, generator=gen)
        tokens = torch.randint(0, cfg.vocab_size, (cfg.block_size,), generator=gen)
        net.context(cache, features[:cached], 0)
        own = reference.new_cache(slots)
        reference.context(own, features, 0)
        logits = reference.block(own, tokens, cached + new)
        want.append((ranked(logits, k)[0], torch.log_softmax(logits, dim=-1)))
        entries.append((cache, features[cached:], cached + new, tokens))
    blocks = net.cycle_batch(entries, k)
    first = blocks.first_ranked()              # placed before the blocks are read: the same tokens
    for b, ((indices, values), (want_indices, logp)) in enumerate(zip(blocks, want)):
        assert torch.equal(torch.from_numpy(indices), want_indices)
        torch.testing.assert_close(torch.from_numpy(values), logp.gather(-1, want_indices), atol=1e-4, rtol=1e-4)
        assert first[b].tolist() == [int(entries[b][3][0])] + want_indices[1:, 0].tolist()
    with pytest.raises(SpecPilotError, match="of its own"):
        net.cycle_batch([entries[0], entries[0]], k)        # two sequences on one row would race
    with pytest.raises(SpecPilotError, match="all 3 rows"):
        net.new_cache(slots)
    del caches[1], entries                         # a dropped handle gives its row back
    assert net.new_cache(slots).row == 1


def test_block_drafters_of_a_continuous_batch_draft_in_one_call_and_keep_stock_s_tokens(batch_build, monkeypatch):
    """Four requests of different lengths joining and leaving a batch of two (more requests than the
    pool's three rows: a leaving request's row goes to the next): the compiled chain, tree and
    scheduled engines draft their blocks together (`draft_blocks`) and emit each request's own
    single-request stock tokens."""
    from specpilot.runtime.compiled_draft_nets import CompiledBlockNet
    calls = []
    batch = CompiledBlockNet.cycle_batch
    monkeypatch.setattr(CompiledBlockNet, "cycle_batch", lambda self, entries, k: calls.append(len(entries))
                        or batch(self, entries, k))
    system = from_build(batch_build)
    prompts = PROMPTS + [[(3 * i + 1) % 301 for i in range(5)], [(11 * i + 2) % 301 for i in range(7)]]
    lengths = [20, 12, 16, 14]
    want = [system.generate("stock", p, n).tokens for p, n in zip(prompts, lengths)]
    for engine in ("compiled-spec", "compiled-tree", "compiled-tree-sched"):
        calls.clear()
        got = system.generate_batch(engine, prompts, lengths, max_batch=2)
        assert [g.tokens for g in got] == want, engine
        assert calls and max(calls) == 2, (engine, calls)


def test_a_batch_s_chains_are_verified_from_where_their_block_drafters_placed_them(batch_build, monkeypatch):
    """Chains of a batch's block drafters (and of replays over them) go to the verification as the
    batched cycle's placed tokens (`PlacedTokens`, the host reading the blocks only when it commits),
    requests joining and leaving a batch of three: the tokens are stock's."""
    from specpilot.runtime.engine import CompiledModel, PlacedTokens, host_array
    seen, events = [], []       # events: ("verified", tokens a row) and ("read", [last] + chain), in order
    forward_batch, scored_chain = CompiledModel.forward_batch, BlockDrafter.scored_chain

    def watched(self, items, record=False):
        placed = record and all(isinstance(it[0], PlacedTokens) for it in items)
        seen.append(len(items) if placed else 0)
        events.append(("verified", [host_array(it[0]).tolist() for it in items] if placed else []))
        return forward_batch(self, items, record)

    def read(self, context, n):
        chain = scored_chain(self, context, n)
        events.append(("read", [context[-1]] + [t for t, _ in chain]))
        return chain
    monkeypatch.setattr(CompiledModel, "forward_batch", watched)
    monkeypatch.setattr(BlockDrafter, "scored_chain", read)
    system = from_build(batch_build)
    prompts = PROMPTS + [[(3 * i + 1) % 301 for i in range(5)], [(11 * i + 2) % 301 for i in range(7)]]
    lengths = [20, 12, 16, 14]
    want = [system.generate("stock", p, n).tokens for p, n in zip(prompts, lengths)]
    seen.clear(), events.clear()
    got = system.generate_batch("compiled-spec", prompts, lengths, max_batch=3)
    assert [g.tokens for g in got] == want
    assert sum(n > 0 for n in seen) >= 3 and 3 in seen, seen
    # what a verification read where it ran is what the host read of the same chains as it committed
    for i, (kind, rows) in enumerate(events):
        if kind == "verified" and rows:
            assert [r for _, r in events[i + 1:i + 1 + len(rows)]] == rows


def test_placed_tokens_verify_as_the_same_tokens_from_the_host(batch_build):
    """`forward_batch` over `PlacedTokens` rows of one tensor (lengths 1 to 5, each row's tail past its
    length other tokens) gives the logits of the same tokens as host lists, from identical states; so
    does a batch mixing placed rows and a host list (the placed ones read to the host)."""
    from specpilot.runtime.engine import CompiledModule, PlacedTokens
    target = CompiledModule(batch_build).model("target")
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, 301, (n,), generator=gen).tolist() for n in (9, 4, 13)]
    rows = torch.randint(0, 301, (3, 6), generator=gen, dtype=torch.int64).to(torch.int32)
    lengths = [5, 1, 3]
    outs = []
    for placed in (0, 3, 2):                   # how many leading rows are given placed
        states = [target.new_state(64) for _ in prompts]
        for p, st in zip(prompts, states):
            target.forward(p, st)
        items = [(PlacedTokens(rows, b, n) if b < placed else rows[b, :n].tolist(), st)
                 for b, (n, st) in enumerate(zip(lengths, states))]
        outs.append(target.forward_batch(items, record=True))
        assert [st.length for st in states] == [len(p) + n for p, n in zip(prompts, lengths)]
        for st in states:
            close_state(st)
    for host, *placed in zip(*outs):
        assert all(torch.equal(host, p) for p in placed)


def test_joining_requests_catch_up_and_draft_their_blocks_with_the_batch(batch_build, monkeypatch):
    """Prompts longer than a block: each joining request's drafter caches its context up to the last
    block of new tokens (a context call of its own), then drafts with the batch in one call; no block
    is drafted by the two-call path, and the tokens are stock's."""
    from specpilot.runtime.compiled_draft_nets import CompiledBlockNet
    batched, two_call = [], []
    cycle_batch, block = CompiledBlockNet.cycle_batch, CompiledBlockNet.block
    monkeypatch.setattr(CompiledBlockNet, "cycle_batch", lambda self, entries, k: batched.append(len(entries))
                        or cycle_batch(self, entries, k))
    monkeypatch.setattr(CompiledBlockNet, "block", lambda self, *a: two_call.append(1) or block(self, *a))
    system = from_build(batch_build)
    prompts = [[(7 * i + 5 * r) % 301 for i in range(12 + 9 * r)] for r in range(2)]    # 12 and 21 > a block of 5
    want = [system.generate("stock", p, 14).tokens for p in prompts]
    for engine in ("compiled-spec", "compiled-tree"):
        batched.clear(), two_call.clear()
        got = system.generate_batch(engine, prompts, [14, 14], max_batch=2)
        assert [g.tokens for g in got] == want, engine
        assert batched and batched[0] == 2 and not two_call, (engine, batched, two_call)


def test_a_batch_s_block_chains_are_the_level_walk_s(batch_build, monkeypatch):
    """A batch's block drafters chain each position's first-ranked token from their one block pass, no
    level of expansions: the same chains and tokens as walking each expander by first-ranked children."""
    prompts = PROMPTS + [[(3 * i + 1) % 301 for i in range(5)]]
    assert_block_chains_are_the_level_walk_s(from_build(batch_build), prompts, [20, 12, 16], BlockDrafter, monkeypatch)


def test_drafting_blocks_together_gives_each_drafter_what_it_drafts_alone(batch_build):
    """`draft_blocks` over two bound drafters (contexts of different lengths, each within a block of
    new tokens): each one's ranked block equals a fresh drafter's on the same target state drafting
    alone; binding again forgets it."""
    from specpilot.runtime.feature_drafters import draft_blocks
    system = from_build(batch_build)
    target, net = system.engines["compiled"].model, system.engines["compiled"].model.module.draft_net()
    prompts = [[(5 * i + r) % 301 for i in range(2 + 2 * r)] for r in range(2)]     # the pool: one row left
    capacity = system.capacity
    states = [target.new_state(capacity) for _ in prompts]
    for prompt, state in zip(prompts, states):
        target.forward(prompt, state)
    contexts = [p + [7 + r] for r, p in enumerate(prompts)]
    together = [BlockDrafter(net, top_k=3, capacity=capacity) for _ in prompts]
    for drafter, state in zip(together, states):
        drafter.bind(state)
    draft_blocks(together, contexts)
    assert all(d.last is not None and d.last[0] == tuple(c) for d, c in zip(together, contexts))
    for drafter, state, context in zip(together, states, contexts):
        alone = BlockDrafter(net, top_k=3, capacity=capacity)
        alone.bind(state)
        want, got = alone.block_ranked(context), drafter.block_ranked(context)
        assert np.array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=1e-4)
        alone.close()                           # its row back for the next
    together[0].bind(states[0])
    assert together[0].last is None


def test_the_drafter_cost_bench_times_a_batch_s_cycles_both_ways_alike(batch_build):
    """bench/drafter_cost.py --batches on the CPU build: one call and a call each rank alike, and the
    batched AR pass runs over the same sequences."""
    from bench.drafter_cost import batched_cycles
    from specpilot.runtime.engine import CompiledModule
    row = batched_cycles(CompiledModule(batch_build), context=9, accepted=2, batch=3, reps=3, warmup=1)
    assert row["batch"] == 3 and row["identical_rankings"] == 1.0 and row["max_top1_logprob_difference"] < 1e-4
    assert all(row[k]["samples"] == 3 and row[k]["median_ms"] > 0 for k in ("one_call", "a_call_each", "ar_pass"))


def test_a_batch_s_block_drafts_fill_the_rows_its_pass_pads():
    """A batched pass computes every request's rows up to its longest item.  Trees under a shared
    budget with a block drafter (expansions are lookups in the drafted block) grow into those rows
    (`BatchPolicy.fill`): the first pass verifies more nodes in the same rows, every row a node or a
    request's last token; without fill the budget's nodes alone.  Each request's stock tokens either way."""
    from dataclasses import replace

    from specpilot.runtime.batching import Arrival, StepClock
    system = from_spec(parse_spec(_data(HYBRID, "block")))
    prompts = PROMPTS + [[(3 * i + 1) % 301 for i in range(5)]]
    want = [system.generate("stock", p, 30).tokens for p in prompts]
    shared = replace(system.batch_policy("stock-tree", 3), budget=7)     # 7 nodes for 3 requests: unequal trees
    first = {}
    for fill in (False, True):
        run = system.serve("stock-tree", [Arrival(0.0, tuple(p), 30) for p in prompts], replace(shared, fill=fill),
                           StepClock())
        assert [g.tokens for g in run.generations] == want
        first[fill] = next(s for s in run.steps if not s.prefill)
        assert all(s.drafted <= 7 for s in run.steps) or fill
    assert first[False].drafted == 7 and first[True].rows == first[False].rows
    assert first[True].drafted == first[True].rows - first[True].running > 7
