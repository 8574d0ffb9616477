"""The replay drafter, for projections: it proposes the target's own greedy continuation, so that
acceptance follows a recorded profile or a per-token acceptance rate exactly, while a real drafter
network (``cost``) runs every draft step, so that drafting time is real.  Verification is untouched:
tokens are still the target's, and token forcing still holds.

Acceptance is a function of position: a plan marks the generated positions at which a draft is
wrong (the *rejection points*).  A recorded profile (tokens per verification t_1, t_2, ...) puts
them at the running sums t_1, t_1 + t_2, ... -- a chain or tree verification starting right after a
rejection point then commits exactly t_i tokens, as in the recorded run; a rate alpha makes each
position a rejection point with probability 1 - alpha (seeded per request and position), so accepted
runs are geometric.  Drafts past the last planned segment are all wrong.

Scores: by default the replay is certain of its own plan -- its first-ranked token scores ON_PLAN
where the plan accepts it and OFF_PLAN where it does not, the other ranks OFF_PLAN - r and never
right -- so whatever ranks by the drafter's confidence (best-first trees, a batch's shared budget,
dynamic draft lengths) knows the future.  A plan with ``confidence`` pools (a real drafter's ranked
rows, `core.acceptance_profile`) scores each position with a row drawn (seeded per request and
position) from the pool of what the target made of it: accepted, the first rejected of its chain, or
past that; at a rejection point of a rate plan the continuation's token then sits at the rank where
that drafter offered the target's token (a tree that holds it goes on, as a real drafter's does; a
chain, on the first ranks, accepts as planned).  A recorded profile's counts stay exact: its rejection
points offer no right token.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace

import numpy as np
import torch

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.lattice import Lattice

ON_PLAN = -1e-3     # log-probability offered for the continuation's token: best-first keeps the path first
OFF_PLAN = -8.0     # and for the wrong tokens beside it (rank r: OFF_PLAN - r)
LEAST = -7.0        # a drawn confidence's floor (log): the first rank stays above the others
DRAWN = 1024        # rows drawn a pool and run, used cyclically by position


class Oracle:
    """The target's own greedy continuation of each prompt (registered before a replay run)."""

    def __init__(self):
        self.runs: dict[tuple[int, ...], list[int]] = {}

    def register(self, prompt: list[int], tokens: list[int]) -> None:
        self.runs.setdefault(tuple(prompt), list(tokens))

    def has(self, prompt: list[int]) -> bool:
        return tuple(prompt) in self.runs

    def find(self, context: list[int]) -> tuple[int, tuple[int, ...], list[int]]:
        """(request index, prompt, continuation) of the registered run ``context`` follows.  A context
        that left its run (a bf16 engine taking the other side of a near-tie) gets the continuation
        cut where it left: every draft past that point is wrong."""
        left = None
        for index, (prompt, tokens) in enumerate(self.runs.items()):
            n = len(prompt)
            if tuple(context[:n]) != prompt:
                continue
            generated = context[n:]
            agree = next((i for i, (a, b) in enumerate(zip(generated, tokens)) if a != b),
                         min(len(generated), len(tokens)))
            if agree == len(generated) or agree == len(tokens):
                return index, prompt, tokens
            left = left or (index, prompt, tokens[:agree])
        if left is not None:
            return left
        raise SpecPilotError("the replay drafter has no greedy continuation of this prompt; run the target "
                             "autoregressively on it first (`specpilot bench` does)")


def rejection_points(plan: dict, request: int, prompt: tuple[int, ...], length: int) -> set[int]:
    """Generated positions (0-based) where a draft is wrong, for positions < ``length``."""
    if "accepted" in plan:
        counts = plan["accepted"][request % len(plan["accepted"])]
        return set(itertools.accumulate(counts))
    digest = hashlib.sha256(np.asarray(prompt, dtype=np.int64).tobytes()).digest()
    rng = np.random.default_rng([int(plan.get("seed", 0)), int.from_bytes(digest[:8], "little")])
    wrong = rng.random(length) >= float(plan["alpha"])
    return {i for i in range(1, length) if wrong[i]}


def score_rows(confidence: dict | None, top_k: int) -> dict | None:
    """A plan's confidence pools (`core.acceptance_profile`) as rows of ``top_k`` float32 log-probabilities
    (what a lattice holds; the first rank floored at LEAST, rows narrower than ``top_k`` padded below
    OFF_PLAN), with the wrong rows' ranks of the target's token (None beyond ``top_k``); None without."""
    if not confidence:
        return None

    def row(probabilities: list[float]) -> list[float]:
        logs = np.log(np.asarray(probabilities[:top_k], dtype=np.float64))
        logs[0] = max(logs[0], LEAST)
        pad = min(float(logs[-1]), OFF_PLAN) - np.arange(1, top_k - len(logs) + 1)
        return np.concatenate([logs, pad]).astype(np.float32).tolist()

    rows = {pool: [row(r) for r in confidence[pool] or confidence["wrong"]] for pool in ("right", "wrong", "beyond")}
    return {**rows, "ranks": [r if r is not None and 1 <= r < top_k else None for r in confidence["ranks"]]}


_SCORED: dict[tuple[int, int], tuple[dict, dict]] = {}     # (id(confidence), top_k) -> (confidence, rows)


def scored_pools(confidence: dict | None, top_k: int) -> dict | None:
    """`score_rows`, computed once a plan's pools and width (a batch makes a drafter a request, on its clock)."""
    if not confidence:
        return None
    key = (id(confidence), top_k)
    hit = _SCORED.get(key)
    if hit is None or hit[0] is not confidence:      # the pools are held, so their id is not reused while cached
        if len(_SCORED) >= 16:
            _SCORED.clear()
        hit = _SCORED[key] = (confidence, score_rows(confidence, top_k))
    return hit[1]


def picks(plan: dict, prompt: tuple[int, ...], pools: dict) -> dict[str, list[int]]:
    """Per pool, the row each position draws (position p: entry p % DRAWN), seeded per request."""
    digest = hashlib.sha256(np.asarray(prompt, dtype=np.int64).tobytes()).digest()
    drawn = {}
    for i, pool in enumerate(("right", "wrong", "beyond")):
        rng = np.random.default_rng([int(plan.get("seed", 0)), int.from_bytes(digest[:8], "little"), 1 + i])
        drawn[pool] = rng.integers(len(pools[pool]), size=DRAWN).tolist()
    return drawn


class ReplayDrafter:
    """Proposes the oracle's continuation up to the next rejection point; runs ``cost`` alongside."""

    name = "replay"

    def __init__(self, cost, oracle: Oracle, plan: dict, top_k: int, vocab_size: int):
        self.cost, self.oracle, self.plan = cost, oracle, plan
        self.top_k, self.vocab_size = top_k, vocab_size
        self.off_scores = [OFF_PLAN - r for r in range(top_k)]     # the wrong tokens', by rank
        # a chain's scores as a lattice holds them (float32), so its nodes score as `propose`'s
        self.float32 = {s: float(np.float32(s)) for s in (ON_PLAN, *self.off_scores)}
        self.pools = scored_pools(plan.get("confidence"), top_k)     # a real drafter's rows, or None
        self.reset()

    @property
    def network(self):
        """The drafter network whose time a replay spends."""
        return self.cost.network

    @property
    def block_drafter(self):
        """A block drafter spending the time (`feature_drafters.draft_blocks` batches its cycles), or None."""
        return getattr(self.cost, "block_drafter", None)

    def bind(self, state) -> None:
        """A cost network that reads the target's hidden states reads ``state``'s (`drafters.bind`)."""
        if hasattr(self.cost, "bind"):
            self.cost.bind(state)

    def close(self) -> None:
        if hasattr(self.cost, "close"):
            self.cost.close()

    def reset(self) -> None:
        self.cost.reset()
        self.run, self.drawn = None, None

    def _locate(self, context: list[int]):
        """(generated index of the next position, continuation, rejection points) for ``context``."""
        if self.run is None or tuple(context[:len(self.run[0])]) != self.run[0] \
                or list(context[len(self.run[0]):]) != self.run[1][:len(context) - len(self.run[0])]:
            index, prompt, tokens = self.oracle.find(context)
            self.run = (prompt, tokens, rejection_points(self.plan, index, prompt, len(tokens) + 1))
            self.drawn = picks(self.plan, prompt, self.pools) if self.pools is not None else None
        prompt, tokens, wrong = self.run
        return len(context) - len(prompt), tokens, wrong

    @staticmethod
    def _accepts(position: int, tokens: list[int], wrong: set[int], on_path: bool) -> bool:
        """Whether the plan accepts the first-ranked draft at ``position`` (on the continuation so far)."""
        return on_path and position < len(tokens) and position not in wrong

    def _children(self, position: int, tokens: list[int], wrong: set[int], on_path: bool,
                  k: int | None = None) -> list[tuple[int, float]]:
        """The top-k (``k``: the first k of them) at generated ``position``: the continuation's token
        first where the plan accepts it."""
        k = self.top_k if k is None else k
        right = tokens[position] if position < len(tokens) else None
        accepted = self._accepts(position, tokens, wrong, on_path)
        if self.pools is not None:
            return self._drawn_children(position, right, accepted, on_path, k)
        if accepted:
            return [(right, ON_PLAN)] + list(zip(self._wrong_tokens(right, k - 1), self.off_scores))
        return list(zip(self._wrong_tokens(right, k), self.off_scores))

    def _drawn_children(self, position: int, right: int | None, accepted: bool, on_path: bool,
                        k: int) -> list[tuple[int, float]]:
        """The top-k scored by a recorded drafter's row for this outcome; at a rejection point of a
        rate plan the continuation's token sits where that drafter offered the target's (if it did)."""
        pool = "right" if accepted else "wrong" if on_path else "beyond"
        index = self.drawn[pool][position % DRAWN]
        scores = self.pools[pool][index]
        if accepted:
            return list(zip([right] + self._wrong_tokens(right, k - 1), scores))
        others = self._wrong_tokens(right, k)
        rate = "accepted" not in self.plan            # a recorded profile's counts stay exact
        rank = self.pools["ranks"][index] if pool == "wrong" and right is not None and rate else None
        if rank is not None and rank < k:
            others = others[:rank] + [right] + others[rank:k - 1]
        return list(zip(others, scores))

    def _wrong_tokens(self, right: int | None, k: int) -> list[int]:
        start = 0 if right is None else right + 1
        if start + k <= self.vocab_size:
            return list(range(start, start + k))
        return [(start + j) % self.vocab_size for j in range(k)]

    def _rows(self, context: list[int], n: int, k: int | None = None) -> list[list[tuple[int, float]]]:
        """The top-k (``k``: the first k) at each of the ``n`` positions after ``context`` along the
        first-ranked path."""
        position, tokens, wrong = self._locate(context)
        rows, on_path = [], True
        for i in range(n):
            rows.append(self._children(position + i, tokens, wrong, on_path, k))
            on_path = self._accepts(position + i, tokens, wrong, on_path)
        return rows

    def chain_from(self, context: list[int], n: int, ran) -> list[tuple[int, float]]:
        """The replayed chain of ``n`` tokens below ``context``; ``ran``, the cost network's own chain
        of the same length (`drafters.chain_levels`), was its drafting work."""
        return [row[0] for row in self._rows(context, n, 1)]

    def scored_chain(self, context: list[int], n: int) -> list[tuple[int, float]]:
        """``propose(context, n).scored_chain()`` without the lattice: the first-ranked (token,
        log-probability) of each position, for a cost network that drafted its block already
        (`feature_drafters.draft_blocks`)."""
        self.cost.scored_chain(context, n)                     # the drafting work, its tokens unused
        return self._replayed_chain(context, n)

    def chain_ahead(self, context: list[int], n: int):
        """`scored_chain(context, n)` the way the cost drafter's own `chain_ahead` goes: its
        verification tokens placed, its block read when ``finish()`` is called (the drafting work, its
        tokens unused); the verification's tokens are [last] + the replayed chain.  None where the
        cost drafter has no chain ahead."""
        ahead = getattr(self.cost, "chain_ahead", None)
        spent = ahead(context, n) if ahead is not None else None
        if spent is None:
            return None
        chain = self._replayed_chain(context, n)

        def finish() -> list[tuple[int, float]]:
            spent[1]()
            return chain
        return [context[-1]] + [token for token, _ in chain], finish

    def _replayed_chain(self, context: list[int], n: int) -> list[tuple[int, float]]:
        if self.pools is None:
            return self._first_ranked(context, n)
        return [(token, self.float32.get(score, score)) for (token, score), in self._rows(context, n, 1)]

    def _first_ranked(self, context: list[int], n: int) -> list[tuple[int, float]]:
        """`_rows`' first-ranked (token, float32 score) at each of ``n`` positions for a rate plan (no
        recorded pools): the continuation's token while the plan accepts, then the first wrong token."""
        position, tokens, wrong = self._locate(context)
        on, off = self.float32[ON_PLAN], self.float32[self.off_scores[0]]
        out, on_path = [], True
        for at in range(position, position + n):
            right = tokens[at] if at < len(tokens) else None
            on_path = self._accepts(at, tokens, wrong, on_path)
            out.append((right, on) if on_path else (self._wrong_tokens(right, 1)[0], off))
        return out

    def propose(self, context: list[int], n: int) -> Lattice:
        self.cost.propose(context, n)                          # the real drafting work, its tokens unused
        rows = self._rows(context, n)
        if not rows:
            return Lattice.empty(self.top_k)
        return Lattice(torch.tensor([[t for t, _ in row] for row in rows]),
                       torch.tensor([[p for _, p in row] for row in rows], dtype=torch.float32))

    def expander(self, context: list[int]):
        """A tree drafter's expansion; each node also expands the cost drafter's node of the same
        shape (the same ranks down the same depth), so the cost network does a real tree's work."""
        position, tokens, wrong = self._locate(context)
        expansion = ReplayExpansion(self.cost.expander(context),
                                    lambda at, on_path: self._children(at, tokens, wrong, on_path),
                                    lambda path: list(path) == tokens[position:position + len(path)], position)
        return expansion.callable()


class ReplayExpansion:
    """The replay's expansion of one context beside its cost drafter's: ``children_at(position,
    on_path)`` gives the replayed children, ``on_path(path)`` whether a path is the continuation's.
    A node's children depend only on those two, so they are built once for each and shared by every
    node with them (the tree asks again, and `tree.best_first_shared` reads a shared list's order once)."""

    def __init__(self, cost_expand, children_at, on_path, position: int):
        self.cost_expand, self.children_at, self.on_path, self.position = cost_expand, children_at, on_path, position
        self.built: dict[tuple[int, bool], list] = {}
        self.cost_paths: dict[tuple, list[int] | None] = {(): []}
        self.cost_children: dict[tuple, list] = {}

    def callable(self):
        """``expand(path)``, with ``batch`` / ``plan`` where the cost drafter batches its nodes; over a
        block drafter (``by_depth``), a lookup of its drafted block's row at the node's depth -- the host
        work that drafter does for the node."""
        by_depth = getattr(self.cost_expand, "by_depth", False)
        inner = self.by_depth if by_depth else self.expand

        def expand(path: list[int]) -> list[tuple[int, float]]:     # a function: callers may set attributes on it
            return inner(path)
        if not by_depth and getattr(self.cost_expand, "batch", None) is not None:
            expand.batch, expand.plan = self.batch, self.plan
        return expand

    def children(self, path: list[int]) -> list[tuple[int, float]]:
        at = (self.position + len(path), self.on_path(path))
        if at not in self.built:
            self.built[at] = self.children_at(*at)
        return self.built[at]

    def by_depth(self, path: list[int]) -> list[tuple[int, float]]:
        self.cost_expand(path)
        return self.children(path)

    def cost_path(self, path: tuple) -> list[int] | None:
        """The cost drafter's node of the same ranks down the same depth (None past its tree)."""
        if path in self.cost_paths:
            return self.cost_paths[path]
        parent = self.cost_path(path[:-1])
        if parent is None or path[:-1] not in self.cost_children:
            return None
        rank = [t for t, _ in self.children(list(path[:-1]))].index(path[-1])
        below = self.cost_children[path[:-1]]
        self.cost_paths[path] = parent + [below[rank][0]] if rank < len(below) else None
        return self.cost_paths[path]

    def expand(self, path: list[int]) -> list[tuple[int, float]]:
        mapped = self.cost_path(tuple(path))
        if mapped is not None:
            self.cost_children[tuple(path)] = self.cost_expand(mapped)
        return self.children(path)

    def known(self, paths: list[list[int]]) -> list[tuple[tuple, list[int]]]:
        mapped = [(tuple(p), self.cost_path(tuple(p))) for p in paths]
        return [(key, m) for key, m in mapped if m is not None]

    def batch(self, paths: list[list[int]]) -> list[list[tuple[int, float]]]:
        found = self.known(paths)
        for (key, _), below in zip(found, self.cost_expand.batch([m for _, m in found]) if found else []):
            self.cost_children[key] = below
        return [self.children(p) for p in paths]

    def plan(self, paths: list[list[int]]):
        """The cost network's tree pass for these paths, answering with the replayed expansions
        (`drafters.expand_across` runs many requests' in one batched pass)."""
        found = self.known(paths)
        inner = self.cost_expand.plan([m for _, m in found]) if found else None
        if inner is None:
            return None

        def finish(tops):
            for (key, _), below in zip(found, inner.finish(tops)):
                self.cost_children[key] = below
            return [self.children(p) for p in paths]
        return replace(inner, finish=finish)
