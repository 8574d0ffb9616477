"""Drafters conditioned on the target's hidden states (`runtime.features`).

A generation's loop binds the drafter to the target's state (`bind`); the drafter then reads
the features of the committed context -- every token the target has consumed, i.e. all but the
last emitted one -- and keeps what it derived from them until the context changes under it.

- `BlockDrafter` (DFlash): one pass over [last token, mask * (block - 1)] proposes the whole
  block; its per-position top-k feed the best-first tree (a node's candidates depend on its depth
  only).
- `FeatureDrafter` (EAGLE-3): autoregressive over the draft; a tree node's pair is (its parent's
  output hidden state, its token), attending to the context's pairs and its ancestors'.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from specpilot.core.errors import SpecPilotError
from specpilot.core.feature_drafter import cache_slots
from specpilot.runtime.compiled_draft_nets import RankedBlocks
from specpilot.runtime.drafters import common_prefix, log_probs, ranked, ranked_rows
from specpilot.runtime.engine import PlacedTokens
from specpilot.runtime.lattice import Lattice


class _Conditioned:
    def __init__(self, net, top_k: int, capacity: int, temperature: float = 1.0):
        if not temperature > 0:
            raise SpecPilotError(f"drafter temperature must be positive, got {temperature}")
        self.net, self.top_k, self.capacity, self.temperature = net, top_k, capacity, float(temperature)
        self.source = self.target_state = None
        self.reset()

    def bind(self, state) -> None:
        """Read the target features kept by ``state`` (the generation's target state)."""
        features = getattr(state, "features", None)
        if features is None:
            raise SpecPilotError(f"a {self.name} drafter reads the target's hidden states; this target keeps none "
                                 "(load or build it with the drafter's feature layers)")
        if features.width != len(self.net.cfg.target_layers) * self.net.cfg.target_hidden:
            raise SpecPilotError(f"the target keeps features of width {features.width}; the drafter reads "
                                 f"{len(self.net.cfg.target_layers)} layers of {self.net.cfg.target_hidden}")
        self.source, self.target_state = features, state

    def expander(self, context: list[int]):
        """For tree drafting below ``context``.  A context longer than what the target has consumed
        (two-level verification's proposed chain) has no features past it: the extra tokens are a
        path below the consumed context."""
        committed = self.target_state.length + 1 if self.target_state is not None else len(context)
        if len(context) <= committed:
            return self._expander(context)
        inner, extra = self._expander(context[:committed]), list(context[committed:])

        def expand(path: list[int]) -> list[tuple[int, float]]:
            return inner(extra + list(path))
        if getattr(inner, "batch", None) is not None:
            expand.batch = lambda paths: inner.batch([extra + list(p) for p in paths])
        return expand

    def _features(self, start: int, end: int) -> torch.Tensor:
        if self.source is None:
            raise SpecPilotError(f"the {self.name} drafter is not bound to a target state (call bind(state))")
        return self.source.read(start, end)

    def _logp(self, logits: torch.Tensor) -> torch.Tensor:
        return log_probs(logits, self.temperature)

    @staticmethod
    def _lattice(logps: torch.Tensor, k: int) -> Lattice:
        """The lattice of ``logps`` (positions, vocab): all rows ranked at once, one copy each to the host."""
        indices, values = ranked(logps, k)
        return Lattice(indices.cpu(), values.float().cpu())


class BlockDrafter(_Conditioned):
    name = "block"

    @property
    def block_drafter(self) -> "BlockDrafter":
        """The block drafter whose cycles `draft_blocks` batches (a replay drafter's: its cost's)."""
        return self

    def reset(self) -> None:
        self.cache = None       # a pooled row goes back before the next is taken
        self.cache = self.net.new_cache(cache_slots(self.net.cfg, self.capacity))
        self.consumed: list[int] = []      # the context tokens whose keys/values are cached
        self.last = None                   # (context, ranked) of the last block drafted

    def bind(self, state) -> None:
        super().bind(state)
        self.last = None

    def close(self) -> None:
        """Give the cache back (a pooled row returns to its network's pool)."""
        self.cache = self.last = None

    def block_ranked(self, context: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The top_k (indices, log-probabilities) on the host of each draft after ``context``, (block - 1,
        top_k) numpy arrays (int64, float32), best first, equal logits in index order (`drafters.ranked`
        over the logits).  The committed context's keys/values (all but its last token) are cached
        first: with the block and its ranking in one call where the network has one
        (`CompiledBlockNet.ranked_cycle`) and the new tokens, top_k and temperature 1 let it; else
        context and block calls, ranked here.  The same context twice (or one `draft_blocks` drafted)
        is not drafted again."""
        if self.last is not None and self.last[0] == tuple(context):
            return self._last_ranked()
        self.catch_up(context)
        n = len(context) - 1
        keep = common_prefix(self.consumed, context[:n])
        tokens = self._block_tokens(context)
        cycle = getattr(self.net, "ranked_cycle", None) if keep < n and self.temperature == 1.0 else None
        out = cycle(self.cache, self._features(keep, n), n, tokens, self.top_k) if cycle else None
        if out is None:
            if keep < n:
                self.net.context(self.cache, self._features(keep, n), keep)
            logits = self.net.block(self.cache, tokens, n)[1:]
            indices, _ = ranked(logits, self.top_k)
            out = indices.cpu().numpy(), self._logp(logits).gather(-1, indices).float().cpu().numpy()
        else:
            out = out[0][1:], out[1][1:]
        self._drafted(context, out)
        return out

    def _block_tokens(self, context: list[int]) -> torch.Tensor:
        return torch.tensor([context[-1]] + [self.net.cfg.mask_token_id] * self.net.cfg.drafts_per_pass)

    def _drafted(self, context: list[int], out) -> None:
        """``out``: the block's (indices, values) on the host, or (`RankedBlocks`, entry) not read yet."""
        self.consumed, self.last = list(context[:len(context) - 1]), (tuple(context), out)

    def _last_ranked(self) -> tuple[np.ndarray, np.ndarray]:
        context, out = self.last
        if isinstance(out[0], RankedBlocks):       # a batched cycle's entry: its block after the last token
            indices, values = out[0][out[1]]
            out = indices[1:], values[1:]
            self.last = context, out
        return out

    def chain_ahead(self, context: list[int], n: int) -> tuple[PlacedTokens, Callable] | None:
        """`scored_chain(context, n)` before its block is read: the verification's tokens ([last] + the
        chain) where the batched cycle computed them, and ``finish()``, the scored chain (reading the
        block then).  None unless ``context``'s block is a `draft_blocks` cycle's entry not read yet."""
        if self.last is None or self.last[0] != tuple(context) or not isinstance(self.last[1][0], RankedBlocks):
            return None
        blocks, entry = self.last[1]
        n = max(0, min(n, self.net.cfg.drafts_per_pass, self.capacity - len(context)))
        return PlacedTokens(blocks.first_ranked(), entry, 1 + n), lambda: self.scored_chain(context, n)

    def catch_up(self, context: list[int]) -> None:
        """Cache the committed context's keys/values up to its last block of new tokens (one context
        call) where it has more than a cycle call takes (a joining request's prompt, a verification that
        accepted a whole block), so that its block still drafts in one call (`ranked_cycle`) or with the
        batch's (`draft_blocks`).  Nothing where no cycle call serves this drafter."""
        serves = getattr(self.net, "serves", None)
        n = len(context) - 1
        if serves is None or self.temperature != 1.0 or not serves(1, self.top_k) \
                or self.target_state is not None and n > self.target_state.length:
            return
        keep, cut = common_prefix(self.consumed, context[:n]), n - self.net.cfg.block_size
        if cut > keep:
            self.net.context(self.cache, self._features(keep, cut), keep)
            self.consumed = list(context[:cut])

    def cycle_entry(self, context: list[int]):
        """This drafter's part of a batched cycle below ``context`` (cache row, new features, start,
        block tokens), or None where one cannot take it: nothing new to cache, more new tokens than a
        block, a context past what the target consumed (its features are not there), sampling
        temperature, more ranks than the build keeps, or a network that drafts alone."""
        if not getattr(self.net, "batched", False) or self.temperature != 1.0:     # the cheap tests first: every step
            return None
        n = len(context) - 1
        past = self.target_state is not None and n > self.target_state.length
        keep = common_prefix(self.consumed, context[:n])
        if past or not keep < n or not self.net.serves(n - keep, self.top_k) \
                or self.last is not None and self.last[0] == tuple(context):
            return None
        return self.cache, self._features(keep, n), n, self._block_tokens(context)

    def propose(self, context: list[int], n: int) -> Lattice:
        n = min(n, self.net.cfg.drafts_per_pass, self.capacity - len(context))
        if n <= 0:
            return Lattice.empty(self.top_k)
        indices, values = self.block_ranked(context)
        return Lattice(torch.from_numpy(indices[:n]), torch.from_numpy(values[:n]))

    def scored_chain(self, context: list[int], n: int) -> list[tuple[int, float]]:
        """``propose(context, n).scored_chain()`` without the lattice."""
        n = min(n, self.net.cfg.drafts_per_pass, self.capacity - len(context))
        if n <= 0:
            return []
        indices, values = self.block_ranked(context)
        return list(zip(indices[:n, 0].tolist(), values[:n, 0].tolist()))

    def _expander(self, context: list[int]):
        indices, values = self.block_ranked(context)
        tops: dict[int, list[tuple[int, float]]] = {}       # a depth's row, made when a tree first asks for it

        def expand(path: list[int]) -> list[tuple[int, float]]:
            d = len(path)
            if d >= len(indices) or len(context) + d >= self.capacity:
                return []
            if d not in tops:
                tops[d] = list(zip(indices[d].tolist(), values[d].tolist()))
            return tops[d]
        expand.by_depth = True      # a node's expansion depends on its depth alone (`replay` reads this)
        return expand


def draft_blocks(drafters: list, contexts: list[list[int]]) -> None:
    """The block drafters among ``drafters`` (a replay drafter's cost too) that share a network draft
    their blocks below ``contexts`` in one batched call (`CompiledBlockNet.cycle_batch`), each caught up
    to its last block of new tokens first (`BlockDrafter.catch_up`); each keeps its ranked block for the
    `block_ranked` of that context.  The others draft alone when asked."""
    groups: dict[tuple[int, int], list] = {}
    for drafter, context in zip(drafters, contexts):
        block = getattr(drafter, "block_drafter", None)
        if block is not None:
            block.catch_up(context)
        entry = block.cycle_entry(context) if block is not None else None
        if entry is not None:
            groups.setdefault((id(block.net), block.top_k), []).append((block, context, entry))
    for members in groups.values():
        if len(members) < 2:
            continue
        blocks = members[0][0].net.cycle_batch([entry for _, _, entry in members], members[0][0].top_k)
        for i, (block, context, _) in enumerate(members):
            block._drafted(context, (blocks, i))


class FeatureDrafter(_Conditioned):
    name = "feature"

    def reset(self) -> None:
        self.slots = cache_slots(self.net.cfg, self.capacity)   # the context's pairs by position, then nodes
        self.cache = self.net.new_cache(self.slots)
        self.tokens: list[int] = []        # pair j = (feature j, token j + 1) is cached for j < len(tokens) - 1

    def _sync(self, context: list[int]):
        """Cache the context's pairs; returns (their count, output hidden and logits of the last)."""
        m = len(context) - 1
        if m < 1:
            raise SpecPilotError("a feature drafter needs a context of two tokens at least")
        keep = min(max(common_prefix(self.tokens, context) - 1, 0), m - 1)   # the last pair is always rerun
        hidden = self.net.fuse(self._features(keep, m))
        tokens = torch.tensor(context[keep + 1:m + 1])
        positions = torch.arange(keep, m)
        mask = torch.ones(m - keep, m, dtype=torch.bool).tril(keep)
        h, logits = self.net.step(self.cache, hidden, tokens, positions, positions, mask)
        self.tokens = list(context)
        return m, h[-1:], logits[-1]

    def propose(self, context: list[int], n: int) -> Lattice:
        n = min(n, self.capacity - len(context))
        if n <= 0:
            return Lattice.empty(self.top_k)
        m, h, logits = self._sync(context)
        rows = []
        for i in range(n):
            logp = self._logp(logits)
            rows.append(logp)
            if i + 1 < n:
                token = ranked(logp, 1)[0][:1]
                pos = torch.tensor([m + i])
                h, out = self.net.step(self.cache, h, token, pos, pos, torch.ones(1, m + i + 1, dtype=torch.bool))
                logits = out[0]
        return self._lattice(torch.stack(rows), self.top_k)

    def _expander(self, context: list[int]):
        m, h, logits = self._sync(context)
        nodes: dict[tuple, tuple] = {(): (h, ranked_rows(self._logp(logits)[None], self.top_k)[0], None)}
        # path -> (output hidden, its top-k (token, log-probability), the slot of its key and value)
        free = [m]      # the next free slot: a node's pair goes after the context's and earlier nodes'

        def run(paths: list[list[int]]) -> None:
            """Score the nodes of ``paths`` (their parents scored) in one pass; nodes past the cache's
            slots get no children."""
            new = list(dict.fromkeys(tuple(p) for p in paths if tuple(p) not in nodes))
            placed = [p for p in new if nodes[p[:-1]][0] is not None][:max(self.slots - free[0], 0)]
            for p in set(new) - set(placed):
                nodes[p] = (None, [], None)
            new = placed
            if not new:
                return
            slots = list(range(free[0], free[0] + len(new)))
            free[0] += len(new)
            mask = torch.zeros(len(new), slots[-1] + 1, dtype=torch.bool)
            mask[:, :m] = True
            for i, p in enumerate(new):
                for d in range(1, len(p)):
                    mask[i, nodes[p[:d]][2]] = True
                mask[i, slots[i]] = True
            hidden = torch.cat([nodes[p[:-1]][0] for p in new])
            positions = torch.tensor([m - 1 + len(p) for p in new])
            out, logits = self.net.step(self.cache, hidden, torch.tensor([p[-1] for p in new]), positions,
                                        torch.tensor(slots), mask)
            tops = ranked_rows(self._logp(logits), self.top_k)
            for i, p in enumerate(new):
                nodes[p] = (out[i:i + 1], tops[i], slots[i])

        def expand(path: list[int]) -> list[tuple[int, float]]:
            if len(context) + len(path) >= self.capacity:
                return []
            for d in range(1, len(path) + 1):      # ancestors first (a two-level chain's are new)
                run([path[:d]])
            return nodes[tuple(path)][1]

        def batch(paths: list[list[int]]) -> list[list[tuple[int, float]]]:
            fit = [p for p in paths if len(context) + len(p) < self.capacity]
            for d in range(1, max((len(p) for p in fit), default=0) + 1):   # a level per pass
                run([p[:d] for p in fit if len(p) >= d])
            return [expand(p) for p in paths]
        expand.batch = batch
        return expand
