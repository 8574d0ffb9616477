"""Best-first draft trees under a node budget, and their verification bookkeeping.

A tree hangs below the root -- the last accepted token, already emitted and not yet fed to
the target.  Node i has a token, a parent (-1: the root), a depth (1 for the root's
children) and a score: its parent's score plus its own log-probability conditioned on its
parent's path.  ``best_first`` keeps the ``budget`` nodes of highest score: it pops the best
candidate, adds it, then asks the drafter for that node's top-k children.  Ties break
deterministically on (depth, parent index, the drafter's rank), and nodes come out parents
first, so index order is a topological order.

For verification the target reads ``[root] + nodes`` in one pass: rotary positions
``start + depth``, attention over the cache plus each node's ancestors (``ancestor_mask``).
Acceptance walks down from the root: at each step the target's greedy token either matches
a child (accept it, go on) or ends the walk (the target's token is the bonus).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

Expand = Callable[[list[int]], list[tuple[int, float]]]   # path below the root -> [(token, logprob)], best first
# An Expand may carry ``expand.batch(paths) -> [expansion per path]``: one drafter call for many
# nodes (a tree-shaped drafter pass).  `best_first` then fetches the expansions level by level.


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def path_tokens(self, i: int) -> list[int]:
        return [self.tokens[j] for j in self.path(i)]

    def children(self, i: int) -> list[int]:
        """Children of node i (-1: the root), in index order."""
        return [j for j, p in enumerate(self.parents) if p == i]

    def ancestor_mask(self) -> np.ndarray:
        """(N+1, N+1) bool over [root] + nodes: entry (a, b) is True iff b is a or an ancestor of a."""
        n = len(self)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for i in range(n):
            mask[i + 1, 1:] = mask[self.parents[i] + 1, 1:]
            mask[i + 1, i + 1] = True
        return mask

    @staticmethod
    def chain(tokens: list[int]) -> "Tree":
        return Tree(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)),
                    [0.0] * len(tokens))


def best_first(expand: Expand, budget: int, max_depth: int) -> Tree:
    """The ``budget`` highest-scoring nodes (cumulative log-probability), at most ``max_depth`` deep.
    With ``expand.batch``, the expansions it needs are fetched first, one batched call per tree
    level (`prefetch_levels`); the tree is the same node for node."""
    if getattr(expand, "batch", None) is not None and budget > 1:
        expand = prefetch_levels(expand, budget, max_depth)
    return best_first_shared([expand], budget, max_depth)[0]


def best_first_shared(expands: list[Expand], budget: int, max_depth: int | list[int],
                      caps: list[int] | None = None, min_score: float = float("-inf"),
                      order: list[tuple[int, float, int]] | None = None) -> list[Tree]:
    """One node budget shared by several requests' trees (a batched verification pass): the
    ``budget`` highest-scoring nodes over the union of the requests' candidates, best first, so a
    request may get none.  ``max_depth`` (one, or one per request) and ``caps`` (nodes a request may
    take at most: its cache room) bound each tree; candidates scoring below ``min_score`` (a path
    log-probability) are not taken.  Ties break on (request, depth, parent index, the
    drafter's rank).  With one request it is `best_first`'s tree; each request's tree is
    `best_first` of its share.  ``order``, where given, receives (request, score, depth) of every node taken,
    in the order taken: any prefix of it is the best-first allocation of a smaller budget (`prefix`)."""
    depths = max_depth if isinstance(max_depth, list) else [max_depth] * len(expands)
    caps = caps if caps is not None else [budget] * len(expands)
    trees = [Tree() for _ in expands]
    paths: list[list[tuple]] = [[] for _ in expands]     # each node's root path (tokens), by tree and index
    heap: list[tuple] = []
    ordered: dict[int, tuple[list, bool]] = {}            # id -> (children list, listed best first); the
                                                          # list is held so that its id is not reused

    def offer(request: int, parent: int, depth: int, score: float, children: list, rank: int, lazy: bool) -> None:
        """Push children[rank] (the first of them a score can take, from rank on) and, unless ``lazy``,
        every later one.  Children listed best first need only one entry at a time: a younger
        sibling's key is never below its elder's, so it is pushed when the elder is popped."""
        for r in range(rank, len(children)):
            token, logprob = children[r]
            if logprob == float("-inf") or score + logprob < min_score:
                if lazy:
                    return            # best first: the siblings after it score no higher
                continue
            heapq.heappush(heap, (-(score + logprob), request, depth, parent, r, token, children if lazy else None, score))
            if lazy:
                return

    def push_children(request: int, parent: int, depth: int, score: float, path: tuple) -> None:
        if depth > depths[request] or len(trees[request]) >= caps[request]:
            return
        children = expands[request](list(path))
        known = ordered.get(id(children))
        if known is None or known[0] is not children:
            known = ordered[id(children)] = (children, all(a[1] >= b[1] for a, b in zip(children, children[1:])))
        offer(request, parent, depth, score, children, 0, known[1])

    for request in range(len(expands)):
        push_children(request, -1, 1, 0.0, ())
    taken = 0
    while heap and taken < budget:
        neg, request, depth, parent, rank, token, siblings, parent_score = heapq.heappop(heap)
        tree = trees[request]
        if len(tree) >= caps[request]:
            continue
        if siblings is not None:
            offer(request, parent, depth, parent_score, siblings, rank + 1, True)
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg)
        if order is not None:
            order.append((request, -neg, depth))
        taken += 1
        path = (paths[request][parent] if parent >= 0 else ()) + (token,)
        paths[request].append(path)
        if taken < budget:
            push_children(request, len(tree) - 1, depth + 1, -neg, path)
    return trees


def prefix(trees: list[Tree], order: list[tuple[int, float, int]], n: int) -> list[Tree]:
    """The trees of the first ``n`` nodes of ``order`` (`best_first_shared`'s): each tree's first
    nodes, in the order taken (parents before children, so every kept node's parent is kept)."""
    sizes = [0] * len(trees)
    for request, *_ in order[:n]:
        sizes[request] += 1
    return [Tree(t.tokens[:k], t.parents[:k], t.depths[:k], t.scores[:k]) for t, k in zip(trees, sizes)]


def prefetch_levels(expand: Expand, budget: int, max_depth: int) -> Expand:
    """Expansions for `best_first`, fetched one tree level per ``expand.batch`` call instead of
    one node per call.  Scores only fall along a path (log-probabilities <= 0), so a node of the
    best ``budget`` scores at least the ``budget``-th best score among the nodes known so far;
    each level expands exactly the known nodes above that bound (ties kept).  Every node
    best_first pops is one of them; a node it asks for that was not fetched (it cannot happen,
    but the answer must not depend on it) is expanded on its own.  Returns a lookup Expand."""
    cache: dict[tuple, list[tuple[int, float]]] = {(): expand([])}
    known: list[float] = []                      # scores of every enumerated node, for the bound
    frontier: list[tuple[tuple, float]] = [((), 0.0)]
    for depth in range(1, max_depth):            # nodes at max_depth are never expanded
        level = [(path + (token,), score + logprob) for path, score in frontier
                 for token, logprob in cache[path] if logprob != float("-inf")]
        known.extend(score for _, score in level)
        bound = heapq.nlargest(budget, known)[-1] if len(known) >= budget else float("-inf")
        frontier = [(path, score) for path, score in level if score >= bound]
        if not frontier:
            break
        for (path, _), children in zip(frontier, expand.batch([list(p) for p, _ in frontier])):
            cache[path] = children

    def lookup(path: list[int]) -> list[tuple[int, float]]:
        key = tuple(path)
        if key not in cache:
            cache[key] = expand(path)
        return cache[key]
    return lookup


def prefetch_shared(expands: list[Expand], budget: int, max_depths: list[int], caps: list[int], fetch,
                    min_score: float = float("-inf")) -> list[Expand]:
    """`prefetch_levels` for `best_first_shared`: each tree level of every request fetched in one
    ``fetch(paths per request) -> expansions per request`` call (one batched drafter pass for the whole
    batch).  A node is fetched when it could still be taken: its score reaches the ``budget``-th best
    over the union of every request's ``caps`` best known nodes (a request past its cap is skipped,
    so its other nodes leave room for others'), its request's ``caps``-th best and ``min_score``.
    Returns lookups; a node not fetched is expanded on its own when asked for, so the trees do not
    depend on this."""
    n = len(expands)
    caches: list[dict] = [{(): expand([])} for expand in expands]
    mine: list[list[float]] = [[] for _ in range(n)]
    frontiers = [[((), 0.0)] for _ in range(n)]
    for depth in range(1, max(max_depths, default=0)):     # nodes at a request's max depth are never expanded
        levels = [[(path + (token,), score + logprob) for path, score in frontiers[r]
                   for token, logprob in caches[r][path] if logprob != float("-inf")] for r in range(n)]
        for r, level in enumerate(levels):
            mine[r] = heapq.nlargest(caps[r], mine[r] + [s for _, s in level])   # the rest can never be taken
        takeable = [s for scores in mine for s in scores]
        bound = max(heapq.nlargest(budget, takeable)[-1] if len(takeable) >= budget else float("-inf"), min_score)
        for r, level in enumerate(levels):
            own = mine[r][-1] if caps[r] and len(mine[r]) >= caps[r] else float("-inf")
            keep = caps[r] > 0 and depth < max_depths[r]
            frontiers[r] = [(p, s) for p, s in level if keep and s >= max(bound, own)]
        if not any(frontiers):
            break
        for r, found in enumerate(fetch([[list(p) for p, _ in frontier] for frontier in frontiers])):
            for (path, _), children in zip(frontiers[r], found):
                caches[r][path] = children

    def lookup_for(r: int) -> Expand:
        def lookup(path: list[int]) -> list[tuple[int, float]]:
            key = tuple(path)
            if key not in caches[r]:
                caches[r][key] = expands[r](path)
            return caches[r][key]
        return lookup
    return [lookup_for(r) for r in range(n)]


def accept(tree: Tree, choose: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Walk down from the root.  ``choose(row)`` returns the token emitted after row ``row`` of
    the verification (0: the root, i+1: node i) -- the target's greedy choice, or stock's
    token when forced -- and may stop the walk by raising StopIteration.  Returns (accepted
    node indices, emitted tokens): every accepted node's token plus the bonus token."""
    nodes, emitted, row = [], [], 0
    while True:
        try:
            token = choose(row)
        except StopIteration:
            return nodes, emitted
        emitted.append(token)
        match = next((c for c in tree.children(row - 1) if tree.tokens[c] == token), None)
        if match is None:
            return nodes, emitted
        nodes.append(match)
        row = match + 1


def replay_acceptance(expand_at: Callable[[int], Expand], reference: list[int], budget: int, max_depth: int) -> list[int]:
    """Accepted tokens per verification when decoding ``reference`` (stock's greedy tokens: a
    lossless system emits exactly these) with best-first trees, without running the target:
    ``expand_at(p)`` is the drafter's expansion for the context ending at reference[p - 1]."""
    out, p = [], 1     # reference[0] is the first token, emitted by prefill
    while p < len(reference):
        tree = best_first(expand_at(p), budget, min(max_depth, len(reference) - p))
        _, emitted = accept(tree, lambda row, p=p, tree=tree: _reference_choice(tree, reference, p, row))
        out.append(len(emitted))
        p += len(emitted)
    return out


def _reference_choice(tree: Tree, reference: list[int], p: int, row: int) -> int:
    depth = 0 if row == 0 else tree.depths[row - 1]
    if p + depth >= len(reference):
        raise StopIteration
    return reference[p + depth]
