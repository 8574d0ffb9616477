"""Best-first trees and tree verification on the reference engine: the tree is exactly the
budget's best nodes, acceptance replays from recorded expansions without the models, and
tree speculative decoding emits stock's tokens exactly (dense and hybrid targets, model and
n-gram drafters, budgets 8 / 32 / 64), including steps whose accepted path is not the
first-ranked one."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from specpilot.runtime.decoding import autoregressive, speculative, speculative_tree
from specpilot.runtime.drafters import ModelDrafter, NGramDrafter, catch_up_chains, chain_levels
from specpilot.runtime.tree import (Tree, accept, best_first, best_first_shared, prefetch_shared, prefix,
                                    replay_acceptance)
from tests.conftest import DENSE, HYBRID, noisy_copy, tiny_model


def _synthetic(k: int, seed: int):
    """A deterministic drafter over paths: top-k (token, logprob) from a hash of the path."""
    def expand(path):
        g = torch.Generator().manual_seed(hash((seed, *path)) % (2 ** 31))
        logp = torch.log_softmax(torch.randn(50, generator=g) * 2, dim=0)
        top = logp.topk(k)
        return list(zip(top.indices.tolist(), top.values.tolist()))
    return expand


@pytest.mark.parametrize("budget,depth,k", [(1, 5, 3), (7, 3, 2), (33, 6, 3), (64, 16, 4)])
def test_best_first_keeps_exactly_the_best_nodes(budget, depth, k):
    expand = _synthetic(k, budget)
    tree = best_first(expand, budget, depth)
    # brute force: every node up to `depth` with its cumulative score
    every = []
    frontier = [((), 0.0)]
    for d in range(1, depth + 1):
        nxt = []
        for path, score in frontier:
            for token, lp in expand(list(path)):
                nxt.append((path + (token,), score + lp))
        every += nxt
        frontier = nxt
        if len(every) > 20000:
            break
    best = sorted(every, key=lambda e: (-e[1], len(e[0])))[:budget]
    got = sorted((tuple(tree.path_tokens(i)), tree.scores[i]) for i in range(len(tree)))
    assert len(tree) == min(budget, len(every))
    assert [p for p, _ in got] == sorted(p for p, _ in best)
    for i, (p, d) in enumerate(zip(tree.parents, tree.depths)):
        assert p < i and d == (1 if p < 0 else tree.depths[p] + 1) and d <= depth
        assert math.isclose(tree.scores[i], (0.0 if p < 0 else tree.scores[p]) + dict(expand(tree.path_tokens(p) if p >= 0 else []))[tree.tokens[i]], rel_tol=0, abs_tol=1e-12)
    assert tree.scores == sorted(tree.scores, reverse=True)   # popped best first
    assert best_first(expand, budget, depth) == tree             # deterministic


def test_ties_break_deterministically_by_depth_then_parent_then_rank():
    flat = lambda path: [(10 + len(path), -1.0), (20 + len(path), -1.0)]   # noqa: E731
    tree = best_first(flat, 6, 3)
    assert tree.tokens == [10, 20, 11, 21, 11, 21] and tree.parents == [-1, -1, 0, 0, 1, 1]


def test_ancestor_mask_and_acceptance_walk():
    tree = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 2, 1], depths=[1, 1, 2, 3, 2], scores=[0] * 5)
    mask = tree.ancestor_mask()
    for a in range(6):
        anc = {0} | ({j + 1 for j in tree.path(a - 1)} if a else set())
        assert {b for b in range(6) if mask[a, b]} == anc
    # target says 6 (node 1), then 9 (node 4), then 3 (no child): path [1, 4], bonus 3
    choices = {0: 6, 2: 9, 5: 3}
    nodes, emitted = accept(tree, lambda row: choices[row])
    assert nodes == [1, 4] and emitted == [6, 9, 3]
    assert accept(Tree(), lambda row: 42) == ([], [42])


def _check_forcing(target, make_drafter, prompt, n, budget):
    stock = autoregressive(target, prompt, n, 300)
    forced = speculative_tree(target, make_drafter(), prompt, n, budget, 300, force=stock.tokens)
    assert forced.choices == stock.tokens
    free = speculative_tree(target, make_drafter(), prompt, n, budget, 300)
    assert free.tokens == stock.tokens and free.accepted == forced.accepted
    return free, stock


@pytest.mark.parametrize("arch,budgets,n", [(DENSE, (8, 32, 64), 40), (HYBRID, (8, 64), 28)])
def test_tree_decoding_is_exact_with_a_model_drafter(arch, budgets, n):
    target = tiny_model(arch, seed=0)
    draft = noisy_copy(target, 0.3)
    prompt = [(7 * i + 3) % 301 for i in range(13)]
    off_rank = 0
    for budget in budgets:
        gen, stock = _check_forcing(target, lambda: ModelDrafter(draft, 3, 300), prompt, n, budget)
        off_rank += gen.off_first_rank
        assert gen.mean_accepted > 1.0
    assert off_rank > 0   # some accepted paths went through a runner-up branch
    chain = speculative(target, ModelDrafter(draft, 3, 300), prompt, n, 6, 300)
    assert chain.tokens == stock.tokens


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_tree_decoding_is_exact_with_the_ngram_drafter(arch):
    target = tiny_model(arch, seed=2)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 6, 1, 2, 7] * 3
    for budget in (8, 32, 64):
        gen, stock = _check_forcing(target, lambda: NGramDrafter(4, 1, 4), prompt, 48, budget)


def test_acceptance_replays_from_expansions_without_the_target():
    """Accepted tokens per verification, recomputed from stock's tokens and the drafter's
    expansions alone, equal what the live tree decoding accepted."""
    target = tiny_model(DENSE, seed=2)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 6, 1, 2, 7] * 3
    live = speculative_tree(target, NGramDrafter(4, 1, 4), prompt, 48, 16, 300)
    drafter = NGramDrafter(4, 1, 4)
    replayed = replay_acceptance(lambda p: drafter.expander(prompt + live.tokens[:p]), live.tokens, 16, 48)
    assert replayed == live.accepted[1:]


def test_reference_accept_path_moves_kv_and_keeps_the_paths_state():
    """After a tree pass, keeping a root path leaves the state exactly as if only that path
    had been fed: the next logits agree with a plain chain."""
    for arch in (DENSE, HYBRID):
        model = tiny_model(arch, seed=1)
        ctx = [(3 * i + 1) % 301 for i in range(9)]
        tree = Tree(tokens=[11, 12, 13, 14], parents=[-1, -1, 1, 2], depths=[1, 1, 2, 3], scores=[0] * 4)
        st = model.new_state(64)
        model.forward(ctx, st)
        base = st.length
        mask = np.concatenate([np.ones((5, base), bool), tree.ancestor_mask()], axis=1)
        rows = model.forward([99] + tree.tokens, st, positions=[base] + [base + d for d in tree.depths],
                             attn_mask=mask, record=True, parents=[-1] + [p + 1 for p in tree.parents])
        chain_state = model.new_state(64)
        model.forward(ctx, chain_state)
        chain = model.forward([99, 12, 13, 14], chain_state, record=True)
        torch.testing.assert_close(rows[[0, 2, 3, 4]], chain, rtol=1e-5, atol=1e-5)
        model.accept_path(st, base, [0, 2, 3])      # root, node 1, node 2
        chain_state.truncate(base + 3)
        torch.testing.assert_close(model.forward([7], st), model.forward([7], chain_state), rtol=1e-5, atol=1e-5)
        with pytest.raises(Exception, match="ascending path"):
            model.accept_path(st, base, [2, 1])


def _with_batch(expand):
    """The same synthetic drafter, also answering many paths per call (counted)."""
    calls = []

    def one(path):
        calls.append(1)
        return expand(path)
    one.batch = lambda paths: (calls.append(len(paths)), [expand(p) for p in paths])[1]
    return one, calls


@pytest.mark.parametrize("budget,depth,k,seed", [(2, 4, 2, 0), (9, 5, 3, 1), (33, 6, 3, 2), (64, 16, 4, 3),
                                                 (64, 40, 2, 4), (17, 3, 5, 5)])
def test_level_wise_prefetch_builds_the_same_tree_in_one_call_per_level(budget, depth, k, seed):
    expand = _synthetic(k, seed)
    batched, calls = _with_batch(expand)
    tree = best_first(batched, budget, depth)
    assert tree == best_first(expand, budget, depth)
    # one call for the root, then one batched call per level below it -- never one per node
    assert calls[0] == 1 and len(calls) - 1 <= max(tree.depths) and sum(calls) >= len(tree)
    assert all(n <= budget for n in calls[1:])


def test_level_wise_prefetch_keeps_ties_at_the_bound():
    flat = lambda path: [(10 + len(path), -1.0), (20 + len(path), -1.0)]   # noqa: E731
    batched, _ = _with_batch(flat)
    assert best_first(batched, 6, 3) == best_first(flat, 6, 3)


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_batched_drafter_expansion_matches_node_by_node(arch):
    """One tree-shaped drafter pass scores many paths as separate per-path passes would, and
    leaves the drafter's state where it was."""
    draft = noisy_copy(tiny_model(arch, seed=3), 0.3)
    context = [(5 * i + 2) % 301 for i in range(11)]
    gen = torch.Generator().manual_seed(7)
    paths = [[int(t) for t in torch.randint(0, 301, (d,), generator=gen)] for d in (1, 3, 2, 5)]
    paths.append(paths[1][:2])                       # a prefix of another path
    batch_drafter = ModelDrafter(draft, 4, 300)
    batched = batch_drafter.expander(context).batch(paths)
    # a dense network keeps the scored nodes in its cache (until its next sync); a hybrid's is put back
    nodes = len({tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)})
    assert batch_drafter.state.length == len(context) + (nodes if arch == DENSE else 0)
    assert batch_drafter.consumed == context
    node_drafter = ModelDrafter(draft, 4, 300)
    expand = node_drafter.expander(context)
    for path, got in zip(paths, batched):
        want = expand(path)
        assert [t for t, _ in got] == [t for t, _ in want]
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], rtol=1e-4, atol=1e-5)
    # the state is still usable: a later step continues exactly like a fresh drafter
    nxt = context + paths[3][:2]
    fresh = ModelDrafter(draft, 4, 300)
    assert batch_drafter.propose(nxt, 4).chain() == fresh.propose(nxt, 4).chain()


@pytest.mark.parametrize("seed", range(4))
def test_a_dense_drafters_levels_score_only_their_new_nodes(seed):
    """Tree levels one after another (each path's children, then theirs): a dense drafter's pass
    scores only the nodes no earlier pass of the tree scored, attending to those in its cache, and
    answers as node-by-node expansion does; the next context syncs from the cut-back cache."""
    draft = noisy_copy(tiny_model(DENSE, seed=3), 0.3)
    rng = np.random.default_rng(seed)
    context = [int(t) for t in rng.integers(0, 301, 5 + seed * 3)]
    drafter, sizes = ModelDrafter(draft, 3, 300), []

    class Counted:               # the drafter's batched passes' sizes recorded
        def __getattr__(self, name):
            return getattr(draft, name)

        def forward_batch(self, items, record=False):
            sizes.extend(len(item[0]) for item in items)
            return draft.forward_batch(items, record=record)
    drafter.model = Counted()
    expand = drafter.expander(context)
    reference = ModelDrafter(draft, 3, 300).expander(context)
    level, scored = [[t] for t, _ in expand([])[:2]], set()
    for _ in range(3):
        sizes.clear()
        got = expand.batch(level)
        new = {tuple(p[:d]) for p in level for d in range(1, len(p) + 1)} - scored
        assert sizes == [len(new)]
        scored |= new
        for path, below in zip(level, got):
            want = reference(path)
            assert [t for t, _ in below] == [t for t, _ in want]
            np.testing.assert_allclose([lp for _, lp in below], [lp for _, lp in want], rtol=1e-4, atol=1e-5)
        level = [path + [t] for path, below in zip(level, got) for t, _ in below[:int(rng.integers(1, 3))]]
    again = [level[0][:1], level[0][:2], level[-1]]          # paths already scored get rows of their own
    sizes.clear()
    for path, below in zip(again, expand.batch(again)):
        assert [t for t, _ in below] == [t for t, _ in reference(path)]
    assert sizes == [len(again)]
    nxt = context + level[0][:2]
    assert drafter.propose(nxt, 4).chain() == ModelDrafter(draft, 3, 300).propose(nxt, 4).chain()


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_chains_run_where_the_network_runs_equal_each_drafters_own(arch):
    """`catch_up_chains` + `chain_levels`: several requests' chains (different contexts and lengths,
    0 and 1 included) from one batched pass a position, the chosen tokens fed back without leaving
    the network, equal each drafter's own chain (`propose`) in tokens and log-probabilities -- and
    again on the next step, after each request accepted part of its chain."""
    draft = noisy_copy(tiny_model(arch, seed=3), 0.3)
    rng = np.random.default_rng(11)
    contexts = [[int(t) for t in rng.integers(0, 301, n)] for n in (5, 9, 2, 13)]
    lengths = [4, 1, 6, 0]
    passes: list[list[int]] = []

    class Counted:
        def __getattr__(self, name):
            return getattr(draft, name)

        def forward_batch(self, items, record=False):
            passes.append([len(item[0]) for item in items])
            return draft.forward_batch(items, record=record)
    counted = Counted()            # one network for every request's drafter, as a build has
    drafters = [ModelDrafter(counted, 3, 300) for _ in contexts]
    for step in range(2):
        passes.clear()
        groups = catch_up_chains(drafters, contexts, lengths)
        chains, ran = chain_levels(groups, len(drafters))
        # first calls prefill alone; the others catch up in one pass (step 1), then one pass a position
        assert ran == max(lengths) - 1 and len(passes) == ran + step and all(set(p) == {1} for p in passes[step:])
        for context, n, chain in zip(contexts, lengths, chains):
            want = ModelDrafter(draft, 3, 300).propose(context, n)
            assert [t for t, _ in chain] == want.chain()
            np.testing.assert_allclose([v for _, v in chain], want.logprobs[:, 0].tolist(), rtol=1e-5, atol=1e-5)
        # each request accepts part of its chain, then the target's own token
        contexts = [c + [t for t, _ in chain[:int(rng.integers(0, len(chain) + 1))]] + [int(rng.integers(0, 301))]
                    for c, chain in zip(contexts, chains)]
        lengths = [3, 5, 2, 4]


def test_batched_expansion_past_the_models_verify_limit_goes_node_by_node():
    """A compiled hybrid verifies at most ``max_verify_tokens`` tokens a pass (its GDN tree
    kernel's nmax): a level whose paths need more nodes is expanded path by path, with the same
    answers, and no drafter pass ever takes more than the limit."""
    draft = noisy_copy(tiny_model(HYBRID, seed=3), 0.3)
    context = [(5 * i + 2) % 301 for i in range(11)]
    paths = [[7], [7, 9], [12, 4, 5], [30]]              # 6 distinct nodes
    want = ModelDrafter(draft, 4, 300).expander(context).batch(paths)
    limited = ModelDrafter(draft, 4, 300)
    sizes = []
    forward = draft.forward

    class Limited:               # the model with a compiled build's limit, its passes' sizes recorded
        max_verify_tokens = 4

        def __getattr__(self, name):
            return getattr(draft, name)

        def forward(self, tokens, state, **kw):
            sizes.append(len(tokens))
            return forward(tokens, state, **kw)
    limited.model = Limited()
    got = limited.expander(context).batch(paths)
    assert max(sizes[1:]) <= 4                           # sizes[0]: the context's prefill
    for a, b in zip(got, want):
        assert [t for t, _ in a] == [t for t, _ in b]
        np.testing.assert_allclose([lp for _, lp in a], [lp for _, lp in b], rtol=1e-4, atol=1e-5)


def test_drafter_temperature_reshapes_trees_not_chains_and_stays_exact():
    """A drafter temperature scales the log-probabilities a tree is built from: the chain's
    drafted tokens are the same, the batched expansion agrees with node-by-node, the tree may
    differ, and tree decoding is still stock's tokens."""
    target = tiny_model(DENSE, seed=0)
    draft = noisy_copy(target, 0.3)
    context = [(7 * i + 3) % 301 for i in range(13)]
    plain, hot = ModelDrafter(draft, 4, 300), ModelDrafter(draft, 4, 300, temperature=2.5)
    assert plain.propose(context, 5).chain() == hot.propose(context, 5).chain()
    a = ModelDrafter(draft, 4, 300, temperature=2.5).expander(context)([])
    b = torch.log_softmax(ModelDrafter(draft, 4, 300)._sync(context) / 2.5, dim=-1)
    np.testing.assert_allclose([lp for _, lp in a], b.topk(4).values.tolist(), rtol=1e-5)
    paths = [[5], [5, 9], [17, 2, 4]]
    batched = ModelDrafter(draft, 4, 300, temperature=0.5).expander(context).batch(paths)
    single = ModelDrafter(draft, 4, 300, temperature=0.5).expander(context)
    for path, got in zip(paths, batched):
        np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in single(path)], rtol=1e-4, atol=1e-5)
    shapes = {t: best_first(ModelDrafter(draft, 4, 300, temperature=t).expander(context), 32, 10).depths
              for t in (0.3, 3.0)}
    assert max(shapes[0.3]) > max(shapes[3.0])      # sharper scores: a deeper, narrower tree
    for t in (0.3, 3.0):
        gen, _ = _check_forcing(target, lambda t=t: ModelDrafter(draft, 3, 300, temperature=t), context, 30, 32)
        assert gen.mean_accepted > 1.0
    with pytest.raises(Exception, match="temperature must be positive"):
        ModelDrafter(draft, 4, 300, temperature=0.0)


def _bf16_valued(model):
    from specpilot.runtime.reference.model import ReferenceModel
    tied = model.cfg.tie_word_embeddings
    return ReferenceModel(model.cfg, {k: v.to(torch.bfloat16).float() for k, v in model.w.items()
                                      if not (tied and k == "lm_head.weight")}, torch.float32)


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_reference_two_level_decoding_is_exact_and_the_view_only_proposes(arch):
    from specpilot.runtime.decoding import speculative_two_level
    from specpilot.runtime.reference.view import ViewedModel
    target = ViewedModel(_bf16_valued(tiny_model(arch, seed=4)))
    draft = noisy_copy(target, 0.3)
    prompt = [(11 * i + 5) % 301 for i in range(12)]
    stock = autoregressive(target, prompt, 32, 300)
    for budget in (8, 32):
        forced = speculative_two_level(target, ModelDrafter(draft, 3, 300), prompt, 32, budget, 300, force=stock.tokens)
        assert forced.choices == stock.tokens, budget
        assert speculative_two_level(target, ModelDrafter(draft, 3, 300), prompt, 32, budget, 300).tokens == stock.tokens
    # the view: close to the exact logits, not equal, and the state does not move
    state = target.new_state(64)
    target.forward(prompt, state, record=True)
    n = state.length
    mask = np.ones((3, n + 3), bool)
    mask[:, n:] = np.tril(np.ones((3, 3), bool))
    view = target.forward_view([5, 6, 7], state, [n, n + 1, n + 2], mask, [-1, 0, 1])
    assert state.length == n
    exact = target.forward([5, 6, 7], state, record=True)
    rel = float((view - exact).abs().max() / exact.abs().max())
    assert 0 < rel < 0.5
    fresh = target.new_state(64)
    target.forward(prompt + [5, 6, 7], fresh)
    torch.testing.assert_close(target.forward([9], state), target.forward([9], fresh), rtol=1e-5, atol=1e-5)


def _random_lattice(seed: int, k: int):
    """An Expand over a fixed random tree: k children a node, distinct strictly negative log-probs."""
    import random

    def expand(path: list[int]) -> list[tuple[int, float]]:
        rng = random.Random(f"{seed}:{path}")
        tokens = rng.sample(range(1000), k)
        return sorted(((t, -rng.uniform(0.01, 3.0)) for t in tokens), key=lambda c: -c[1])
    return expand


def _all_nodes(expand, max_depth: int) -> list[tuple[float, tuple[int, ...]]]:
    out, frontier = [], [((), 0.0)]
    for _ in range(max_depth):
        frontier = [(path + (t,), score + lp) for path, score in frontier for t, lp in expand(list(path))]
        out += [(score, path) for path, score in frontier]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_a_shared_budget_takes_the_best_nodes_of_the_union_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_requests, k, depth = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    expands = [_random_lattice(seed * 10 + r, k) for r in range(n_requests)]
    union = [(score, r, path) for r in range(n_requests) for score, path in _all_nodes(expands[r], depth)]
    budget = int(rng.integers(0, len(union) + 2))
    caps = [int(c) for c in rng.integers(0, len(union) + 1, n_requests)] if seed % 2 else None
    trees = best_first_shared(expands, budget, depth, caps)
    got = {(r, tuple(tree.path_tokens(i))) for r, tree in enumerate(trees) for i in range(len(tree))}
    want, taken = set(), [0] * n_requests      # the union's nodes best first, a full request skipped
    for _, r, path in sorted(union, reverse=True):
        if len(want) < budget and (caps is None or taken[r] < caps[r]):
            want.add((r, path))
            taken[r] += 1
    assert got == want
    for r, tree in enumerate(trees):       # each request's share, as its own best-first tree
        alone = best_first(expands[r], len(tree), depth) if len(tree) else None
        assert len(tree) == 0 or (alone.tokens, alone.parents) == (tree.tokens, tree.parents)
        assert all(tree.parents[i] < i for i in range(len(tree)))      # parents first


@pytest.mark.parametrize("seed", range(12))
def test_every_prefix_of_the_order_taken_is_the_best_first_trees_of_its_budget(seed):
    """`tree.prefix` of the order `best_first_shared` took its nodes in, at each length n: the trees
    a budget of n builds (so a pass verifying fewer nodes still verifies the best first)."""
    rng = np.random.default_rng(seed)
    n_requests, k, depth = int(rng.integers(1, 5)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    expands = [_random_lattice(seed * 10 + r, k) for r in range(n_requests)]
    caps = [int(c) for c in rng.integers(0, 12, n_requests)] if seed % 2 else None
    depth = [int(d) for d in rng.integers(1, depth + 1, n_requests)] if seed % 3 else depth
    floor = float(rng.uniform(-6.0, -1.0)) if seed % 4 == 1 else float("-inf")
    budget, order = int(rng.integers(0, 30)), []
    trees = best_first_shared(expands, budget, depth, caps, floor, order=order)
    assert len(order) == sum(len(t) for t in trees)
    assert [(r, s) for r, s, _ in order] == sorted(((r, s) for r, s, _ in order), key=lambda e: -e[1])
    for n in range(len(order) + 1):
        cut, want = prefix(trees, order, n), best_first_shared(expands, n, depth, caps, floor)
        assert [(t.tokens, t.parents, t.depths, t.scores) for t in cut] == \
            [(t.tokens, t.parents, t.depths, t.scores) for t in want]


@pytest.mark.parametrize("seed", range(300))
def test_shared_prefetch_fetches_every_node_the_shared_budget_expands(seed):
    """Level-wise prefetch for a shared budget (one batched drafter pass a level for all requests):
    the same trees as node-by-node expansion, and no node expanded outside the levels -- caps that
    bind (a request past its cap leaves its budget to others) and a score floor included."""
    rng = np.random.default_rng(100 + seed)
    n_requests, k = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    depths = [int(d) for d in rng.integers(1, 7, n_requests)]
    caps = [int(c) for c in rng.integers(0, 12, n_requests)]
    budget = int(rng.integers(1, 40))
    floor = float(rng.choice([float("-inf"), -4.0, -8.0]))
    expands = [_random_lattice(seed * 10 + r, k) for r in range(n_requests)]
    singles = []

    def counted(r):
        return lambda path: (singles.append((r, tuple(path))), expands[r](path))[1]

    def fetch(requests):
        return [[expands[r](p) for p in paths] for r, paths in enumerate(requests)]
    lookups = prefetch_shared([counted(r) for r in range(n_requests)], budget, depths, caps, fetch, floor)
    assert sorted(singles) == [(r, ()) for r in range(n_requests)]     # the roots, nothing else
    want = best_first_shared(expands, budget, depths, caps, floor)
    got = best_first_shared(lookups, budget, depths, caps, floor)
    assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
    assert sorted(singles) == [(r, ()) for r in range(n_requests)]


def test_a_levels_passes_are_ranked_together_as_each_would_be_alone():
    """`rank_passes`: the rows of many requests' drafter passes ranked in one go (grouped by top k
    and temperature) equal each row ranked on its own -- odd sizes, a pass with no rows, ties."""
    from specpilot.runtime.drafters import TreePass, log_probs, rank_passes, ranked

    gen = torch.Generator().manual_seed(11)
    lengths, rankings = [5, 1, 3, 7, 2], [(4, 1.0), (4, 1.0), (3, 0.7), (4, 1.0), (3, 0.7)]
    logits = [torch.randn(n, 97, generator=gen) for n in lengths]
    logits[3][2, :10] = logits[3][2, 10]                      # planted ties
    picks = [[4, 0, 2], [], [1], [6, 2, 3, 0], [1, 0]]
    plans = [TreePass(None, None, (), rows, ranking, None) for rows, ranking in zip(picks, rankings)]
    got = rank_passes(plans, logits)
    # the same rows as items of one batched pass: (B, T, V) padded to the longest, each a view of it
    padded = torch.randn(len(lengths), max(lengths), 97, generator=gen)
    for b, x in enumerate(logits):
        padded[b, :len(x)] = x
    views = [padded[b, :n] for b, n in enumerate(lengths)]
    for answer in (got, rank_passes(plans, views)):
        for plan, rows, tops in zip(plans, logits, answer):
            k, temperature = plan.ranking
            assert len(tops) == len(plan.rows)
            for row, top in zip(plan.rows, tops):
                indices, values = ranked(log_probs(rows[row], temperature), k)
                assert [t for t, _ in top] == indices.tolist()
                np.testing.assert_allclose([v for _, v in top], values.tolist(), rtol=1e-6, atol=1e-6)


def _best_first_eager(expands, budget, depths, caps, min_score):
    """`best_first_shared` with every child pushed when its parent is taken (the reference)."""
    import heapq
    trees, heap = [Tree() for _ in expands], []

    def push(request, parent, depth, score, path):
        if depth > depths[request] or len(trees[request]) >= caps[request]:
            return
        for rank, (token, logprob) in enumerate(expands[request](path)):
            if logprob != float("-inf") and score + logprob >= min_score:
                heapq.heappush(heap, (-(score + logprob), request, depth, parent, rank, token))
    for request in range(len(expands)):
        push(request, -1, 1, 0.0, [])
    taken = 0
    while heap and taken < budget:
        neg, request, depth, parent, _, token = heapq.heappop(heap)
        tree = trees[request]
        if len(tree) >= caps[request]:
            continue
        tree.tokens.append(token), tree.parents.append(parent), tree.depths.append(depth), tree.scores.append(-neg)
        taken += 1
        if taken < budget:
            push(request, len(tree) - 1, depth + 1, -neg, tree.path_tokens(len(tree) - 1))
    return trees


@pytest.mark.parametrize("seed", range(200))
def test_siblings_pushed_one_at_a_time_build_the_trees_of_pushing_them_all(seed):
    """Children listed best first enter the heap one at a time (each when its elder is taken); the
    trees equal those of pushing every child -- exact ties (ranked by index), -inf and a score
    floor, caps, several requests; an expansion not listed best first is pushed whole."""
    import random
    rng = random.Random(seed)
    n_requests, k = rng.randint(1, 4), rng.randint(1, 6)
    values = [0.0, -0.5, -1.0, -1.0, -2.0, float("-inf")]       # few distinct values: many ties

    def lattice(r):
        def expand(path):
            g = random.Random(f"{seed}:{r}:{path}")
            children = [(t, g.choice(values) if seed % 3 else -g.uniform(0.0, 3.0)) for t in g.sample(range(500), k)]
            if g.random() < 0.8:
                children.sort(key=lambda c: -c[1])                  # best first (stable: ties keep their order)
            return children
        return expand
    expands = [lattice(r) for r in range(n_requests)]
    depths = [rng.randint(1, 6) for _ in range(n_requests)]
    caps = [rng.randint(0, 15) for _ in range(n_requests)]
    budget, floor = rng.randint(0, 40), rng.choice([float("-inf"), -1.5, -3.0])
    got = best_first_shared(expands, budget, depths, caps, floor)
    want = _best_first_eager(expands, budget, depths, caps, floor)
    assert [(t.tokens, t.parents, t.depths, t.scores) for t in got] == \
        [(t.tokens, t.parents, t.depths, t.scores) for t in want]


@pytest.mark.parametrize("seed", range(40))
def test_a_request_s_share_grown_under_a_larger_cap_starts_with_the_nodes_it_was_given(seed):
    """A batched pass grows each request's tree into the rows its longest item pads it to
    (`batching`, ``fill``): best first again with larger caps and no floor.  Each grown tree's first
    nodes are the tree the shared budget gave it -- same tokens, parents and scores, in order -- so
    the rows already drafted keep their places, and the growth is that request's best-first tree."""
    rng = np.random.default_rng(500 + seed)
    n_requests, k = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    depths = [int(d) for d in rng.integers(1, 6, n_requests)]
    caps = [int(c) for c in rng.integers(0, 10, n_requests)]
    floor = float(rng.choice([float("-inf"), -3.0, -6.0]))
    expands = [_random_lattice(seed * 10 + r, k) for r in range(n_requests)]
    trees = best_first_shared(expands, int(rng.integers(0, 30)), depths, caps, floor)
    more = [len(t) + int(rng.integers(0, 6)) for t in trees]
    grown = best_first_shared(expands, sum(more), depths, more)
    for r, (tree, big) in enumerate(zip(trees, grown)):
        n = len(tree)
        assert (big.tokens[:n], big.parents[:n], big.depths[:n], big.scores[:n]) == \
            (tree.tokens, tree.parents, tree.depths, tree.scores)
        alone = best_first(expands[r], len(big), depths[r]) if len(big) else None
        assert len(big) == 0 or (alone.tokens, alone.parents) == (big.tokens, big.parents)
        assert len(big) <= more[r]
