"""Drafters: given the accepted context, propose the next few tokens as a `Lattice`.

- `ModelDrafter`: a small causal LM (a separate checkpoint, or the target's first layers)
  drafting greedily; keeps its own state in step with the accepted context and rolls it
  back (KV truncation, recorded recurrent states) when drafts are rejected.
- `NGramDrafter`: training-free prompt lookup: continue the longest suffix of the context
  that occurred before, ranking continuations by how often they followed it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.lattice import Lattice
from specpilot.runtime.reference.model import ReferenceModel


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.  Every drafter asks this of its whole context
    every cycle: list slices compare in C, halving the window where they differ (3-5x a Python loop
    at a 1000-token context)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n           # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def ranked(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k (indices, values) along the last axis, best first, equal values in index order and
    the lowest indices among those equal to the k-th -- the rule of every token choice here (topk's
    own pick among equal values is the device's), so the chain a drafter proposes is the same on
    every engine, the C++ runtime's included.  Rows (any leading axes) are ranked in one go."""
    if k == 0:
        top = logp.topk(0, dim=-1)
        return top.indices, top.values
    if k == 1:                        # argmax takes the first of equal maxima
        indices = logp.argmax(dim=-1, keepdim=True)
        return indices, logp.gather(-1, indices)
    kth = logp.topk(k, dim=-1).values[..., -1:]
    above, tied = logp > kth, logp == kth
    room = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= room))
    V = logp.shape[-1]
    # exactly k chosen a row: the k largest of (V - index) over them are their indices, ascending
    indices = V - torch.where(chosen, torch.arange(V, 0, -1, device=logp.device), 0).topk(k, dim=-1).values
    values, rank = logp.gather(-1, indices).sort(dim=-1, descending=True, stable=True)
    return indices.gather(-1, rank), values


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """A drafter's offered log-probabilities: log_softmax(logits / temperature)."""
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def ranked_rows(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """`ranked` of every row of ``logp`` (rows, vocab) as (token, value) lists, with one copy to the
    host for all of them (a tree level's expansions)."""
    indices, values = ranked(logp, k)
    return [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


class ModelDrafter:
    def __init__(self, model: ReferenceModel, top_k: int, capacity: int, name: str = "model",
                 temperature: float = 1.0):
        """``temperature``: the log-probabilities offered are log_softmax(logits / temperature)
        (tree shape only: which tokens the chain drafts does not change, and verification alone
        decides what is accepted)."""
        if not temperature > 0:
            raise SpecPilotError(f"drafter temperature must be positive, got {temperature}")
        self.model, self.top_k, self.capacity, self.name = model, top_k, capacity, name
        self.temperature = float(temperature)
        self.reset()

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        return log_probs(logits, self.temperature)

    @property
    def network(self) -> "ModelDrafter":
        return self

    def reset(self) -> None:
        self.state = None   # a compiled model's old state gives its cache row back first
        self.state = self.model.new_state(self.capacity)
        self.consumed: list[int] = []   # the tokens whose KV / recurrent state is in self.state
        self.root: tuple | None = None  # (context, logits after it, their ranked top-k) left by `sync_across`

    def _pending(self, context: list[int]) -> list[int] | None:
        """Cut the state back to what it shares with ``context`` and return the tokens still to feed
        (the last one at least), or None on a first call (its prefill is its own pass)."""
        keep = common_prefix(self.consumed, context)
        if keep == len(context):
            keep -= 1
        if keep <= 0:
            return None
        if keep < self.state.length:
            self.state.truncate(keep)
        self.state.drop_history()
        self.consumed = list(context[:keep])
        return list(context[keep:])

    def _sync(self, context: list[int], keep_history: bool = False) -> torch.Tensor:
        """Bring the state to ``context`` and return the logits after its last token.
        ``keep_history``: keep the recorded recurrent states of earlier passes, so a later call
        can roll back to any prefix of the contexts synced since (tree expansion)."""
        if self.root is not None and not keep_history:
            (synced, logits, _), self.root = self.root, None
            if synced == tuple(context) and self.consumed == list(context):
                return logits
        keep = common_prefix(self.consumed, context)
        if keep == len(context):        # nothing new: recompute the last position
            keep -= 1
        if keep < self.state.length:
            self.state.truncate(keep)
        if not keep_history:
            self.state.drop_history()
        self.consumed = list(context[:keep])
        new = context[keep:]
        if keep == 0 and len(new) > 1:  # first call: prefill without per-token states
            self.model.forward(new[:-1], self.state)
            new = new[-1:]
        logits = self.model.forward(new, self.state, record=True)[-1]
        self.consumed = list(context)
        return logits

    def expander(self, context: list[int]):
        """For tree drafting: path below the context -> the drafter's top-k next tokens with
        their log-probabilities, conditioned on context + path."""
        synced = self.root is not None and self.root[0] == tuple(context) and self.consumed == list(context)
        ranked_root = self.root[2] if synced else None        # ranked by `sync_across` with the batch's roots
        logits = self._sync(context)
        if ranked_root is None:
            ranked_root = self._top(self._logp(logits))
        # a network without recurrent layers keeps the tree's scored nodes in its cache until the next
        # sync (path -> cache slot), so a level's pass scores only its new nodes
        cached: dict[tuple, int] | None = None if self.model.cfg.is_hybrid else {}

        def expand(path: list[int]) -> list[tuple[int, float]]:
            if len(context) + len(path) >= self.capacity:
                return []
            if not path:
                return ranked_root
            if cached:
                cached.clear()          # the sync below cuts the cache back to the context
            return self._top(self._logp(self._sync(context + path, keep_history=True)))

        if self._tree_capable():
            expand.batch = lambda paths: self._expand_batch(context, paths, expand, cached)
            expand.plan = lambda paths: self._tree_plan(context, paths, cached)
        return expand

    def _top(self, logp: torch.Tensor) -> list[tuple[int, float]]:
        indices, values = ranked(logp, self.top_k)
        return list(zip(indices.tolist(), values.tolist()))

    def _tree_capable(self) -> bool:
        """One drafter pass can score a whole tree (ancestor mask, depth positions); a compiled
        hybrid drafter needs gdn-path-recompute for that."""
        return not getattr(self.model, "has_gdn", False) or getattr(self.model, "path_recompute", True)

    def _expand_batch(self, context: list[int], paths: list[list[int]], expand,
                      cached: dict | None) -> list[list[tuple[int, float]]]:
        """The expansions of many paths below ``context`` from one tree-shaped drafter pass over
        their nodes (`_tree_plan`)."""
        plan = self._tree_plan(context, paths, cached)
        if plan is None:
            return [expand(path) for path in paths]  # no room for the whole pass: node by node
        return expand_across([SimpleNamespace(plan=lambda _: plan)], [paths])[0]

    def _tree_plan(self, context: list[int], paths: list[list[int]], cached: dict | None = None) -> TreePass | None:
        """One tree-shaped pass over the paths' nodes below ``context`` (None when it does not fit:
        cache room, a compiled hybrid's tree-kernel limit, a state not where the tree left it).
        ``cached``: nodes an earlier pass of this tree left in the cache (path -> slot), which this
        pass attends to instead of scoring them again, and to which it adds its own; None: the pass
        takes the union of the paths' nodes and the state is put back after it."""
        known = cached if cached is not None else {}
        nodes: dict[tuple, int] = {}                 # path prefix -> index in the pass
        tokens, depths = [], []
        for path in paths:               # a path asked for gets a row of its own, even if cached
            for d in range(1, len(path) + 1):
                key = tuple(path[:d])
                if key not in nodes and (key not in known or d == len(path)):
                    nodes[key] = len(tokens)
                    tokens.append(path[d - 1])
                    depths.append(d)
        base, start = len(context), self.state.length
        limit = getattr(self.model, "max_verify_tokens", None)   # a compiled hybrid's GDN tree kernel holds so many
        cache_end = max(known.values(), default=base - 1) + 1      # the tree's cached slots run base..
        if not tokens or self.consumed != list(context) or start != cache_end \
                or start + len(tokens) > self.capacity or (limit and len(tokens) > limit):
            return None
        slot = known | {key: start + i for key, i in nodes.items()}
        mask = np.zeros((len(tokens), start + len(tokens)), dtype=bool)
        mask[:, :base] = True
        for key, i in nodes.items():
            mask[i, [slot[key[:d]] for d in range(1, len(key) + 1)]] = True
        parents = [nodes.get(key[:-1], -1) for key in nodes]     # within the pass (recurrent layers' paths)
        room = [base + len(path) < self.capacity for path in paths]

        def finish(tops: list[list[tuple[int, float]]]) -> list[list[tuple[int, float]]]:
            if cached is not None:
                cached.update(slot)
            ranked_paths = iter(tops)
            return [next(ranked_paths) if fits else [] for fits in room]
        item = (tokens, self.state, [base + d - 1 for d in depths], mask, parents)
        rows = [nodes[tuple(path)] for path, fits in zip(paths, room) if fits]
        return TreePass(self.model, self.state, item, rows, (self.top_k, self.temperature), finish,
                        keep=cached is not None)

    def chain_from(self, context: list[int], n: int, ran: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """The chain of ``n`` first-ranked tokens below ``context``, given what `chain_levels` ran."""
        return ran[:n]

    def propose(self, context: list[int], n: int) -> Lattice:
        n = min(n, self.capacity - len(context))
        if n <= 0:
            return Lattice.empty(self.top_k)
        logits = self._sync(context)
        tokens, logprobs = [], []
        for i in range(n):      # each chosen token is fed back where it was chosen: no wait for the device
            indices, values = ranked(self._logp(logits), self.top_k)
            tokens.append(indices)
            logprobs.append(values)
            if i + 1 < n:
                logits = self.model.forward(indices[:1], self.state, record=True)[-1]
        lattice = Lattice(torch.stack(tokens), torch.stack(logprobs))
        self.consumed.extend(lattice.chain()[:n - 1])          # the chain's one copy to the host
        return lattice


@dataclass
class TreePass:
    """A drafter pass scoring a tree's nodes: ``item`` for the network's ``forward_batch`` on ``state``
    (put back afterwards); ``finish(tops)`` the expansions it answers from the ranked (token,
    log-probability) lists of its ``rows``, under ``ranking`` (top k, temperature).  ``keep``: the
    pass's nodes stay in the state's cache (put back only if the pass fails)."""
    model: object
    state: object
    item: tuple
    rows: list[int]
    ranking: tuple[int, float]
    finish: Callable[[list], list]
    keep: bool = False


def rank_passes(plans: list[TreePass], logits: list[torch.Tensor]) -> list[list]:
    """Each pass's ``rows`` ranked, the passes sharing a ranking all at once: one top-k over the
    rows of every request and one copy to the host (a tree level of a whole batch)."""
    picked = pick_rows(logits, [plan.rows for plan in plans])
    return rank_together([(x, plan.ranking) for plan, x in zip(plans, picked)])


def pick_rows(logits: list[torch.Tensor], rows: list[list[int]]) -> list[torch.Tensor]:
    """``logits[i][rows[i]]`` for every i.  Where the tensors are rows of one (B, T, V) tensor (a
    batched pass's items), one index and one gather for all of them instead of one apiece."""
    base = logits[0]._base if logits else None
    width = logits[0].shape[-1] if logits else 0
    if base is None or not base.is_contiguous() or base.shape[-1] != width or any(
            x._base is not base or x.dim() != 2 or x.stride() != (width, 1)
            or (x.storage_offset() - base.storage_offset()) % width for x in logits):
        return [x.index_select(0, _device_index(r, x.device)) for x, r in zip(logits, rows)]
    first = [(x.storage_offset() - base.storage_offset()) // width for x in logits]
    flat = [f + r for f, picks in zip(first, rows) for r in picks]
    gathered = base.reshape(-1, width).index_select(0, _device_index(flat, base.device))
    return list(torch.split(gathered, [len(r) for r in rows]))


def rank_together(blocks: list[tuple[torch.Tensor, tuple[int, float]]]) -> list[list]:
    """`ranked_rows` of many (rows, (top k, temperature)) blocks, those sharing a ranking in one go."""
    tops: list = [None] * len(blocks)
    groups: dict[tuple, list[int]] = {}
    for i, (_, ranking) in enumerate(blocks):
        groups.setdefault(ranking, []).append(i)
    for (k, temperature), members in groups.items():
        picked = [blocks[i][0] for i in members]
        stacked = torch.cat(picked) if len(picked) > 1 else picked[0]
        ranked_all = iter(ranked_rows(log_probs(stacked, temperature), k) if len(stacked) else [])
        for i in members:
            tops[i] = [next(ranked_all) for _ in range(len(blocks[i][0]))]
    return tops


def _device_index(rows: list[int], device) -> torch.Tensor:
    """``rows`` as an index where the logits are, copied from pinned memory without waiting for the device."""
    index = torch.tensor(rows, dtype=torch.long)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


def bind(drafter, state) -> None:
    """Let a drafter that reads the target's hidden states (`runtime.feature_drafters`) see the
    generation's target ``state``; other drafters ignore it."""
    if hasattr(drafter, "bind"):
        drafter.bind(state)


def sync_across(drafters: list, contexts: list[list[int]]) -> None:
    """Bring many requests' drafter networks to their contexts with one batched pass per network
    (the tokens each accepted since its last draft); each keeps the logits after its context for
    its next `expander`.  Drafters without a network, and first calls (a prefill), sync alone later."""
    groups: dict[int, list] = {}
    for drafter, context in zip(drafters, contexts):
        network = getattr(drafter, "network", None)
        new = network._pending(list(context)) if network is not None else None
        if new is not None:
            groups.setdefault(id(network.model), []).append((network, list(context), new))
    for members in groups.values():
        rows = members[0][0].model.forward_batch([(new, n.state) for n, _, new in members], record=True)
        roots = rank_together([(logits[-1:], (n.top_k, n.temperature)) for (n, _, _), logits in zip(members, rows)])
        for (network, context, _), logits, top in zip(members, rows, roots):
            network.consumed, network.root = context, (tuple(context), logits[-1], top[0])


def chain_network(drafter) -> "ModelDrafter | None":
    """The network whose chains `catch_up_chains` / `chain_levels` run for ``drafter`` (a model
    drafter's own, a replay drafter's cost network), or None: it drafts position by position."""
    network = getattr(drafter, "network", None)
    return network if isinstance(network, ModelDrafter) and hasattr(drafter, "chain_from") else None


@dataclass
class ChainGroup:
    """Requests whose chains run on one drafter network: (request index, network, context, chain
    length) each, and the logits after each context, where the network ran."""
    members: list[tuple[int, "ModelDrafter", list[int], int]]
    roots: torch.Tensor


def catch_up_chains(networks: list, contexts: list[list[int]], lengths: list[int]) -> list[ChainGroup]:
    """Bring each request's drafter network to its context for a chain of ``lengths[r]`` tokens:
    one batched pass per network over the tokens each accepted since its last draft (a first call
    prefills alone), its logits left where the network ran."""
    groups: dict[tuple, list] = {}
    for r, (network, context, n) in enumerate(zip(networks, contexts, lengths)):
        n = min(n, network.capacity - len(context))
        if n > 0:
            groups.setdefault((id(network.model), network.temperature), []).append((r, network, list(context), n))
    out = []
    for members in groups.values():
        pending = [network._pending(context) for _, network, context, _ in members]
        batched = [(m, new) for m, new in zip(members, pending) if new is not None]
        roots: dict[int, torch.Tensor] = {}
        if batched:
            rows = members[0][1].model.forward_batch([(new, m[1].state) for m, new in batched], record=True)
            roots.update({m[0]: logits[-1] for (m, _), logits in zip(batched, rows)})
        for (r, network, context, _), new in zip(members, pending):
            if new is None:
                roots[r] = network._sync(context)          # a first call: its prefill, alone
            network.consumed, network.root = list(context), None
        out.append(ChainGroup(members, torch.stack([roots[m[0]] for m in members])))
    return out


def chain_levels(groups: list[ChainGroup], count: int) -> tuple[list[list[tuple[int, float]]], int]:
    """The groups' chains: at each position every request's first-ranked token (the highest
    log-probability, the lowest index among equals: `ranked`'s first) is fed back to its network
    where it was chosen, one batched pass a position, and all chosen tokens come to the host in one
    copy at the end.  Returns each of ``count`` requests' chain as (token, log-probability) pairs
    (empty for requests in no group) and the number of passes run."""
    out: list[list[tuple[int, float]]] = [[] for _ in range(count)]
    passes = 0
    for group in groups:
        members, network = group.members, group.members[0][1]
        active, logits, chosen = list(range(len(members))), group.roots, []
        while True:
            values, tokens = log_probs(logits, network.temperature).max(dim=-1)
            chosen.append((active, tokens, values))
            depth = len(chosen)
            going = [j for j, i in enumerate(active) if members[i][3] > depth]
            if not going:
                break
            rows = network.model.forward_batch([(tokens[j:j + 1], members[active[j]][1].state) for j in going],
                                               record=True)
            passes += 1
            active, logits = [active[j] for j in going], torch.stack([row[-1] for row in rows])
        picked = torch.cat([t for _, t, _ in chosen]).tolist()
        scores = torch.cat([v for _, _, v in chosen]).float().tolist()
        at = 0
        for rows_active, _, _ in chosen:
            for i in rows_active:
                out[members[i][0]].append((picked[at], scores[at]))
                at += 1
        for r, net, context, n in members:
            net.consumed = context + [t for t, _ in out[r][:n - 1]]
    return out, passes


def expand_across(expands: list, requests: list[list[list[int]]]) -> list[list[list[tuple[int, float]]]]:
    """The expansions of many requests' paths (``requests[r]``: paths below request r's context),
    the tree-shaped passes of expanders on one drafter network run as one batched pass; the rest
    expand as they can (their own batch, or node by node)."""
    out: list = [None] * len(expands)
    groups: dict[int, list] = {}
    for r, (expand, paths) in enumerate(zip(expands, requests)):
        plan = expand.plan(paths) if paths and getattr(expand, "plan", None) is not None else None
        if plan is not None:
            groups.setdefault(id(plan.model), []).append((r, plan))
        elif getattr(expand, "batch", None) is not None and paths:
            out[r] = expand.batch(paths)
        else:
            out[r] = [expand(path) for path in paths]
    for members in groups.values():
        members[0][1].model.settle([plan.state for _, plan in members])    # one commit call, not one a snapshot
        snaps = [plan.state.snapshot() for _, plan in members]
        done = False
        try:
            rows = members[0][1].model.forward_batch([plan.item for _, plan in members], record=True)
            done = True
        finally:
            for (_, plan), snap in zip(members, snaps):
                if not (done and plan.keep):
                    plan.state.restore(snap, keep_history=True)
        plans = [plan for _, plan in members]
        for (r, plan), tops in zip(members, rank_passes(plans, rows)):
            out[r] = plan.finish(tops)
    return out


class NGramDrafter:
    """Prompt lookup over an incrementally built n-gram index of the context."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, top_k: int = 4):
        self.max_n, self.min_n, self.top_k = max_n, min_n, top_k
        self.reset()

    def reset(self) -> None:
        self.indexed: list[int] = []
        # (n-gram) -> Counter(next token), and next token -> last position seen (recency tie-break)
        self.follow: dict[tuple, Counter] = defaultdict(Counter)
        self.last_seen: dict[tuple, dict[int, int]] = defaultdict(dict)

    def _index(self, context: list[int]) -> None:
        if context[:len(self.indexed)] != self.indexed:
            self.reset()
        for end in range(max(len(self.indexed), 1), len(context)):
            nxt = context[end]
            for n in range(self.min_n, self.max_n + 1):
                if end - n < 0:
                    break
                gram = tuple(context[end - n:end])
                self.follow[gram][nxt] += 1
                self.last_seen[gram][nxt] = end
        self.indexed = list(context)

    def _candidates(self, seq: list[int]) -> list[tuple[int, float]]:
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            gram = tuple(seq[-n:])
            counts = self.follow.get(gram)
            if counts:
                total = sum(counts.values())
                seen = self.last_seen[gram]
                ranked = sorted(counts, key=lambda t: (-counts[t], -seen[t], t))
                return [(t, counts[t] / total) for t in ranked[:self.top_k]]
        return []

    def expander(self, context: list[int]):
        """For tree drafting: the continuations of the longest matching suffix of context + path."""
        self._index(context)

        def expand(path: list[int]) -> list[tuple[int, float]]:
            return [(t, math.log(p)) for t, p in self._candidates(list(context) + list(path))]
        return expand

    def propose(self, context: list[int], n: int) -> Lattice:
        self._index(context)
        seq, tokens, logprobs = list(context), [], []
        for _ in range(n):
            cands = self._candidates(seq)
            if not cands:
                break
            pad = self.top_k - len(cands)   # fewer continuations than top_k: pad with impossible ones
            tokens.append([t for t, _ in cands] + [cands[0][0]] * pad)
            logprobs.append([float(torch.tensor(p).log()) for _, p in cands] + [float("-inf")] * pad)
            seq.append(cands[0][0])
        if not tokens:
            return Lattice.empty(self.top_k)
        return Lattice(torch.tensor(tokens, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32))
