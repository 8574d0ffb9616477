"""Continuous batching for every engine: requests arrive (an arrival trace), wait in a bounded
queue, run together -- one batched target pass a step over every running request -- and leave,
their cache rows given back at once.  The batch schedule (`BatchPolicy`) decides how much each
step drafts and admits, never what is computed: every request's tokens equal its own
single-request greedy (or seeded sampled) tokens, whatever shares its batch.

A step: autoregressive requests feed their last token; chain requests their drafted chain; tree
requests a tree drawn from the pass's node budget (`tree.best_first_shared`: best first over the
union of the running requests' candidates, each request capped by its draft length and cache
room).  Drafting runs the drafter network for all running requests at once: one batched pass to
catch up on accepted tokens, then one a chain position or tree level.  Waiting prompts join either
by a prefill pass of their own before the step (stock continuous batching) or, with admission, in
chunks riding in the rows the step's drafts leave under the budget (whole, when nothing is
running or the backlog is a burst of more than ``passes`` chunks).  Time comes from a clock:
`WallClock` (the bench), or `StepClock` (a fixed time a pass), under which a trace replays to the
same schedule every time (tests).
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from specpilot.core.errors import SpecPilotError
from specpilot.core.files import atomic_write_text
from specpilot.runtime import heap
from specpilot.runtime.decoding import (Emitter, Generation, close_state, commit_chain, commit_tree, top2_rows,
                                        tree_inputs)
from specpilot.runtime.draft_schedule import DraftSchedule
from specpilot.runtime.pass_cost import EXPLORE, PassCost, chain_length, tree_nodes, verified_rows
from specpilot.runtime.drafters import (bind, catch_up_chains, chain_levels, chain_network, expand_across,
                                        sync_across)
from specpilot.runtime.feature_drafters import draft_blocks
from specpilot.runtime.tree import Tree, best_first_shared, prefetch_shared, prefix


@dataclass(frozen=True)
class Arrival:
    at: float              # seconds after the trace starts
    prompt: tuple[int, ...]
    max_new: int


def read_trace(path: Path | str, encode=None) -> list[Arrival]:
    """A JSONL arrival trace: one request a line, {"at": seconds, "prompt_ids": [...] | "prompt": text,
    "max_new_tokens": n}, in any order (returned by arrival time, ties in file order).  ``encode``
    turns a text prompt into ids."""
    arrivals = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecPilotError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(entry, dict):
            raise SpecPilotError(f"{where}: expected an object with at, prompt_ids or prompt, max_new_tokens")
        arrivals.append(_arrival(entry, where, encode))
    if not arrivals:
        raise SpecPilotError(f"{path}: no requests in the trace")
    return sorted(arrivals, key=lambda a: a.at)


def _arrival(entry: dict, where: str, encode) -> Arrival:
    at, n = entry.get("at", 0.0), entry.get("max_new_tokens")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
        raise SpecPilotError(f"{where}: 'at' must be a non-negative number of seconds, got {at!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SpecPilotError(f"{where}: 'max_new_tokens' must be a positive integer, got {n!r}")
    if "prompt_ids" in entry:
        ids = entry["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise SpecPilotError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        return Arrival(float(at), tuple(ids), n)
    if isinstance(entry.get("prompt"), str) and entry["prompt"]:
        if encode is None:
            raise SpecPilotError(f"{where}: a text prompt needs a tokenizer; give prompt_ids")
        return Arrival(float(at), tuple(encode(entry["prompt"])), n)
    raise SpecPilotError(f"{where}: needs 'prompt_ids' (token ids) or 'prompt' (text)")


def write_trace(path: Path | str, arrivals: list[Arrival]) -> None:
    atomic_write_text(Path(path), "".join(json.dumps({"at": round(a.at, 6), "prompt_ids": list(a.prompt),
                                                      "max_new_tokens": a.max_new}) + "\n" for a in arrivals))


def poisson_trace(prompts: list[list[int]], max_new: int, rate: float, seed: int = 0) -> list[Arrival]:
    """The prompts arriving as a Poisson process of ``rate`` requests a second (0: all at once)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(prompts)) if rate > 0 else np.zeros(len(prompts))
    times = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if len(prompts) else []
    return [Arrival(float(t), tuple(p), max_new) for t, p in zip(times, prompts)]


@dataclass(frozen=True)
class BatchPolicy:
    """How a batched run schedules its work.  ``mode``: "ar", "chain" or "tree"; ``nodes``: a request's
    drafted tokens a step (chain length, tree nodes); ``budget``: a pass's drafted nodes in all -- a
    tree pass's best first over every request's, a chain pass's split evenly (`split_budget`); None:
    ``nodes`` for each request; ``lengths``: the dynamic draft lengths (None: ``nodes``
    fixed); ``chunk``: prompt admission's chunk (None: joins by their own prefill pass).  A batched
    pass computes every request's rows up to its longest item's; with ``fill`` the drafts shorter than
    that take their next-best nodes into those rows where that needs no drafter pass, so the budget and
    lengths choose the pass's rows and the rows carry as many candidates as they hold.  Off by default
    (`bench --fill`): growing trees runs best first over the union again, host time that cost more than
    the tokens it added (docs/bench-log.md)."""
    mode: str = "ar"
    max_batch: int = 1
    nodes: int = 0
    budget: int | None = None
    min_prob: float = 0.0
    lengths: tuple[int, ...] | None = None
    chunk: int | None = None
    queue: int | None = None        # waiting requests at most; later arrivals are refused
    prefill: int = 2048             # prompt tokens one join's prefill pass takes (whole prompts, one at least):
                                    # a pass's activations and logits grow with its tokens (as PREFILL_CHUNK)
    passes: int = 4
    adaptive: bool = False          # the pass's longest chain, or its tree nodes (a prefix of the best-first
                                    # order), chosen by its measured cost (`pass_cost`)
    fill: bool = False              # drafts grown into the rows the padded pass computes anyway (`_Drafts`)

    def __post_init__(self):
        if self.mode not in ("ar", "chain", "tree"):
            raise SpecPilotError(f"batch mode must be ar, chain or tree, got {self.mode!r}")
        if self.max_batch < 1 or (self.mode != "ar" and self.nodes < 1):
            raise SpecPilotError("a batch needs max_batch >= 1 and a speculative one nodes >= 1")
        if self.budget is not None and self.mode == "ar":
            raise SpecPilotError("a shared node budget needs drafts (chain or tree verification)")
        if self.min_prob and self.mode != "tree":
            raise SpecPilotError("a node budget's probability floor needs tree verification")
        if self.chunk is not None and (self.chunk < 1 or (self.mode == "tree" and self.budget is None)):
            raise SpecPilotError("prompt admission needs a chunk >= 1 and, with trees, a node budget")
        if self.budget is not None and self.budget < 1:
            raise SpecPilotError(f"a node budget must be >= 1, got {self.budget}")
        if not 0.0 <= self.min_prob < 1.0:
            raise SpecPilotError(f"min_prob must be in [0, 1), got {self.min_prob}")
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise SpecPilotError(f"draft lengths must be >= 1, got {self.lengths}")
        if self.queue is not None and self.queue < 0:
            raise SpecPilotError(f"the waiting queue's bound must be >= 0, got {self.queue}")
        if self.passes < 1:
            raise SpecPilotError(f"admission rides a backlog of >= 1 chunks, got {self.passes}")
        if self.prefill < 1:
            raise SpecPilotError(f"a prefill pass takes >= 1 prompt tokens, got {self.prefill}")
        if self.adaptive and self.mode == "ar":
            raise SpecPilotError("a pass's drafts chosen by its cost need drafts (chain or tree verification)")

    def schedule(self) -> DraftSchedule:
        if self.lengths:
            return DraftSchedule(max(self.lengths), min(self.lengths), dynamic=len(self.lengths) > 1,
                                 step=_step(self.lengths))
        return DraftSchedule(max(self.nodes, 1))


def split_budget(budget: int, caps: list[int], turn: int = 0) -> list[int]:
    """A chain pass's ``budget`` of drafted tokens over requests that would draft ``caps``: as evenly as
    the caps allow (water-filling, smallest caps first; what one cannot use goes to the others).  Among
    equal caps the request ``turn`` places first gets the spare tokens last, so a budget smaller than
    the requests shorts each in turn, not always the same ones."""
    out, left, n = [0] * len(caps), budget, len(caps)
    order = sorted(range(n), key=lambda i: (caps[i], (i - turn) % n))
    for k, i in enumerate(order):
        out[i] = min(caps[i], left // (n - k))
        left -= out[i]
    return out


def _step(choices: tuple[int, ...]) -> int:
    ordered = sorted(choices)
    return min((b - a for a, b in zip(ordered, ordered[1:])), default=1)


class WallClock:
    def __init__(self):
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def tick(self) -> None:
        pass


class StepClock:
    """Each pass takes ``seconds``: a trace replays to the same schedule on any machine."""

    def __init__(self, seconds: float = 0.01):
        self.seconds, self.t = seconds, 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def tick(self) -> None:
        self.t += self.seconds


@dataclass
class Timing:
    arrival: float
    started: float | None = None      # its prompt's first pass
    first: float | None = None        # its first token
    done: float | None = None


@dataclass
class Step:
    """One target pass: its requests and rows."""
    running: int                      # requests decoding in it (a prefill pass: the requests it delays)
    drafted: int                      # drafted nodes (chain tokens, tree nodes)
    admitted: int                     # prompt tokens riding in it (admission chunks or joins' prefill)
    rows: int                         # the pass's padded rows (batch x longest)
    prefill: bool = False             # a join's own prefill pass (no decoding)
    levels: int = 0                   # batched drafter passes (chain positions, tree levels) before it


@dataclass
class BatchRun:
    generations: list[Generation | None]     # by request; None: refused (queue full)
    timings: list[Timing]
    steps: list[Step] = field(default_factory=list)
    seconds: float = 0.0
    prices: tuple | None = None   # an adaptive policy's pass cost at the end, seconds (`PassCost.model`)

    @property
    def refused(self) -> list[int]:
        return [i for i, g in enumerate(self.generations) if g is None]


@dataclass
class _Request:
    index: int
    prompt: list[int]
    state: object
    out: Emitter
    schedule: DraftSchedule
    drafter: object = None
    fed: int = 0                     # prompt tokens in the cache
    last: int = -1


def run_batch(model, make_drafter, arrivals: list[Arrival], policy: BatchPolicy, capacity: int, clock=None,
              forces=None, logits_hook=None, stop_ids=(), parts=None) -> BatchRun:
    """Serve ``arrivals`` as one continuous batch under ``policy`` (``make_drafter()``: a fresh drafter
    for each request as it joins; None for "ar").  ``model`` needs ``forward_batch``.  ``parts``: a
    `cycle_timing.Clock` that times each pass's parts to their end on the device -- prefill (joins'
    own passes), draft (drafts and trees), verify (the batched pass), commit (choices and commits);
    within draft also draft_sync (the drafter's catch-up pass), draft_blocks (the block drafters'
    batched cycle) and draft_levels (its passes a chain position or tree level, with their inputs and
    ranking)."""
    if forces is not None and len(forces) != len(arrivals):
        raise SpecPilotError(f"{len(forces)} forced token lists for {len(arrivals)} requests")
    with heap.frozen():      # the loop's small objects collected without walking the loaded system's
        return _Scheduler(model, make_drafter, arrivals, policy, capacity, clock or StepClock(), forces or
                          [None] * len(arrivals), logits_hook, stop_ids, parts).run()


class _Scheduler:
    def __init__(self, model, make_drafter, arrivals, policy, capacity, clock, forces, logits_hook, stop_ids, parts):
        self.model, self.make_drafter, self.policy, self.capacity = model, make_drafter, policy, capacity
        self.parts, self.levels, self.riding = parts, 0, False
        self.cost, self.chosen = PassCost(), 0
        # a packed verification (`tree-verify{packed=true}`) prices its real and its padded rows apart
        self.packed = bool(getattr(model, "packs_verification", False))
        self.clock, self.forces, self.hook, self.stop_ids = clock, forces, logits_hook, stop_ids
        self.arrivals = arrivals
        self.pending = deque(sorted(range(len(arrivals)), key=lambda i: arrivals[i].at))
        self.waiting: deque[int] = deque()
        self.prefilling: list[_Request] = []
        self.running: list[_Request] = []
        self.result = BatchRun([None] * len(arrivals), [Timing(a.at) for a in arrivals])
        limit = getattr(model, "max_verify_tokens", None)
        self.chunk = min(policy.chunk, limit) if policy.chunk and limit else policy.chunk

    def run(self) -> BatchRun:
        start = time.perf_counter()
        while self.pending or self.waiting or self.prefilling or self.running:
            self._arrive()
            if not (self.waiting or self.prefilling or self.running):
                self.clock.wait_until(self.arrivals[self.pending[0]].at)
                continue
            if not self._rides() and (self.prefilling or (self.waiting and self._free_rows())):
                self._join_by_prefill()
            if self.running:
                self._step()
        self.result.seconds = time.perf_counter() - start
        if self.policy.adaptive:
            self.result.prices = self.cost.model()
        return self.result

    def _timed(self, part: str, fn, *args, **kwargs):
        return fn(*args, **kwargs) if self.parts is None else self.parts.timed(part, fn, *args, **kwargs)

    def _arrive(self) -> None:
        now = self.clock.now()
        while self.pending and self.arrivals[self.pending[0]].at <= now:
            i = self.pending.popleft()
            if self.policy.queue is not None and len(self.waiting) >= self.policy.queue:
                self.result.timings[i].done = now      # refused: its generation stays None
                continue
            self.waiting.append(i)

    def _rides(self) -> bool:
        """Whether waiting prompts ride in this step's verification pass: with admission, requests
        running, and a backlog the free rows could take of at most ``passes`` chunks.  A larger one
        (a burst) joins by a prefill pass: riding a chunk or two a pass, it would leave rows idle
        for many passes."""
        if self.policy.chunk is None or not self.running:
            return False
        joinable = list(self.waiting)[:max(0, self._free_rows())]
        backlog = sum(len(r.prompt) - r.fed for r in self.prefilling) + \
            sum(len(self.arrivals[i].prompt) for i in joinable)
        return backlog <= self.policy.passes * self.chunk

    def _free_rows(self) -> int:
        return self.policy.max_batch - len(self.running) - len(self.prefilling)

    def _start(self, i: int) -> _Request:
        a = self.arrivals[i]
        self.result.timings[i].started = self.clock.now()
        return _Request(i, list(a.prompt), self.model.new_state(self.capacity),
                        Emitter(a.max_new, self.forces[i], self.hook, self.stop_ids), self.policy.schedule())

    def _join_by_prefill(self) -> None:
        """Prompts (partly admitted ones first) prefilled in a pass of their own, at most ``prefill``
        tokens (one prompt at least); the running requests wait for it (``Step.running``)."""
        joining, tokens = [], 0
        for r in list(self.prefilling):
            if joining and tokens + len(r.prompt) - r.fed > self.policy.prefill:
                break
            self.prefilling.remove(r)
            joining.append(r)
            tokens += len(r.prompt) - r.fed
        while self.waiting and self._free_rows() > len(joining):
            n = len(self.arrivals[self.waiting[0]].prompt)
            longest = max([n] + [len(r.prompt) - r.fed for r in joining])
            if joining and longest * (len(joining) + 1) > self.policy.prefill:    # the pass's padded tokens
                break
            joining.append(self._start(self.waiting.popleft()))
            tokens += n
        delayed = len(self.running)
        if len(joining) == 1:    # one prompt: `forward` (a GPU build cuts a long one into passes of its own)
            r = joining[0]
            rows = [self._timed("prefill", self.model.forward, r.prompt[r.fed:], r.state)]
        else:
            rows = self._timed("prefill", self.model.forward_batch, [(r.prompt[r.fed:], r.state) for r in joining])
        longest = max(len(r.prompt) - r.fed for r in joining)
        for r, logits in zip(joining, rows):
            r.fed = len(r.prompt)
            self._first_token(r, logits[-1])
        self._tick(Step(delayed, 0, tokens, len(joining) * longest, prefill=True))

    def _first_token(self, r: _Request, logits_row) -> None:
        r.last = r.out.target_token(logits_row)
        r.out.gen.accepted.append(1)
        self.result.timings[r.index].first = self.clock.now()
        if self.policy.mode != "ar":
            r.drafter = self.make_drafter()
            bind(r.drafter, r.state)
        self.running.append(r)

    def _tick(self, step: Step) -> None:
        self.clock.tick()
        self.result.steps.append(step)
        self._retire()

    def _step(self) -> None:
        """One target pass: every running request's draft (or last token), plus admitted chunks."""
        self.levels, self.riding = 0, self._rides()
        started = self.clock.now()
        items, plans, chunks = self._timed("draft", self._drafts)
        drafted = sum(len(p[0]) for p in plans)
        speculative = self.policy.mode != "ar"
        drafting = self.clock.now()
        rows = self._timed("verify", self.model.forward_batch, items, record=speculative)
        self._timed("commit", self._commit_all, plans, rows)
        # both parts end reading the device's results on the host, so their wall times are theirs; a pass
        # carrying prompt chunks has rows no chain length explains
        if self.policy.adaptive and not chunks:
            sizes = [len(it[0]) - 1 for it in items]
            self.cost.observe(verified_rows(sizes, self.packed), self.clock.now() - drafting, self.levels,
                              drafting - started, verified_rows(sizes, False) if self.packed else None, len(plans))
        for (r, n), logits in zip(chunks, rows[len(plans):]):
            r.fed += n
            if speculative and hasattr(r.state, "drop_history"):
                r.state.drop_history()
            if r.fed == len(r.prompt):
                self.prefilling.remove(r)
                self._first_token(r, logits[-1])
        self._tick(Step(len(plans), drafted, sum(n for _, n in chunks),
                        len(items) * max(len(it[0]) for it in items), levels=self.levels))

    def _drafts(self) -> tuple[list, list, list]:
        """The pass's items -- every running request's draft (or last token), grown into the rows the
        pass pads it to anyway (`_grown`), then the admitted prompt chunks -- with what each request
        drafted, (tree or chain, base), and the chunks, (request, tokens)."""
        rooms = [max(0, min(self.capacity - r.state.length - 1, r.out.max_new - len(r.out.gen.tokens)))
                 for r in self.running]
        drafts = _Drafts([Tree() for _ in self.running]) if self.policy.mode == "ar" else self._planned(rooms)
        chunks = self._chunks(sum(len(t) for t in drafts.trees)) if self.riding else []
        items, plans = [], []
        for r, tree in zip(self.running, self._grown(drafts, rooms, chunks)):
            base = r.state.length
            if isinstance(tree, _Ahead):
                items.append((tree.tokens, r.state))
            elif self.policy.mode != "tree":     # causal rows; rejected drafts are cut off, no KV moves
                items.append(([r.last] + tree.tokens, r.state))
            else:
                tokens, positions, mask, parents = tree_inputs(r.last, tree, base)
                items.append((tokens, r.state, positions, mask, parents))
            plans.append((tree, base))
        items += [(r.prompt[r.fed:r.fed + n], r.state) for r, n in chunks]
        return items, plans, chunks

    def _planned(self, rooms: list[int]) -> "_Drafts":
        """The running requests' chains or trees under the pass's caps and budget."""
        # priced trees choose their nodes by cost: the dynamic lengths would only learn the cuts back
        priced_trees = self.policy.adaptive and self.policy.mode == "tree"
        caps = [min(room, self.policy.nodes if priced_trees else r.schedule.next())
                for r, room in zip(self.running, rooms)]
        if self.policy.adaptive and self.policy.mode == "chain":
            caps = self._priced(caps)
        if self.policy.mode == "chain" and self.policy.budget is not None:
            caps = split_budget(self.policy.budget, caps, len(self.result.steps))
        return self._chains(caps) if self.policy.mode == "chain" else self._trees(caps, self._reserve())

    def _grown(self, drafts: "_Drafts", rooms: list[int], chunks: list) -> list[Tree]:
        """The drafts, each grown (where growing needs no drafter pass) to the pass's longest item: its
        rows are computed for every request whatever it holds, so the shorter drafts fill them with their
        next-best nodes instead of padding.  Cache room still bounds each."""
        if drafts.grow is None or not self.policy.fill:
            return drafts.trees
        longest = max([len(t) for t in drafts.trees] + [n - 1 for _, n in chunks])     # nodes; a chunk's rows
        caps = [min(longest, room) for room in rooms]
        if all(len(t) >= cap for t, cap in zip(drafts.trees, caps)):
            return drafts.trees
        return drafts.grow(caps)

    def _priced(self, caps: list[int]) -> list[int]:
        """``caps`` cut to the chain length with the most expected tokens a second of pass; while the
        passes seen cannot price a row yet, every other pass at half the caps, and then every
        ``EXPLORE``-th pass a neighbouring length, so the rows the cost is fitted over vary."""
        model = self.cost.model()
        self.chosen += 1
        if model is None:
            return caps if self.chosen % 2 else [c // 2 for c in caps]
        k = chain_length([r.schedule.rate() for r in self.running], caps, model, self.packed)
        if self.chosen % EXPLORE == 0:
            k = k + 1 if (self.chosen // EXPLORE) % 2 else max(0, k - 1)
        return [min(c, k) for c in caps]

    def _reserve(self) -> int:
        """Nodes of a tree pass's budget set aside for prompt chunks while prompts wait for admission:
        without it drafts that fill the budget would leave a free row idle until the batch drains."""
        if not self.riding or self.policy.mode != "tree" or not (
                self.prefilling or (self.waiting and self._free_rows() > 0)):
            return 0
        return min(self.chunk, max(1, self.policy.budget // 2))

    def _trees(self, caps: list[int], reserve: int = 0) -> "_Drafts":
        """The running requests' trees from the pass's budget; the drafter network runs once for all
        of them to catch up on accepted tokens, then once a tree level (`drafters.expand_across`)."""
        own = self._expanders()
        budget = sum(caps) if self.policy.budget is None else self.policy.budget - reserve
        floor = math.log(self.policy.min_prob) if self.policy.min_prob > 0 else float("-inf")
        depths = [r.out.max_new - len(r.out.gen.tokens) for r in self.running]
        # levels fetched ahead only where a drafter pass answers many nodes at once (a block drafter's
        # expansions are lookups in its drafted block: walking levels ahead would be host time for nothing)
        passes = any(getattr(e, "plan", None) is not None or getattr(e, "batch", None) is not None for e in own)
        expands = prefetch_shared(own, budget, depths, caps, lambda paths: self._level(own, paths), floor) \
            if budget > 1 and passes else own
        order = [] if self.policy.adaptive else None
        trees = best_first_shared(expands, budget, depths, caps, floor, order)
        trees = trees if order is None else prefix(trees, order, self._priced_nodes(order))
        # grown best first without the floor: a request's first nodes are the ones it was given
        return _Drafts(trees, None if passes else lambda more: best_first_shared(expands, sum(more), depths, more))

    def _priced_nodes(self, order: list[tuple[int, float, int]]) -> int:
        """How many nodes of the pass's best-first ``order`` to verify: the most expected tokens a second
        of pass (`pass_cost.tree_nodes`); while the passes seen cannot price a row yet, every other pass
        half of them, and then every ``EXPLORE``-th pass a request's node more or fewer a tree."""
        model = self.cost.model()
        self.chosen += 1
        if model is None:
            return len(order) if self.chosen % 2 else len(order) // 2
        n = tree_nodes(order, len(self.running), model, model[2] * self.levels, self.packed)
        if self.chosen % EXPLORE == 0:
            step = len(self.running)
            n = min(len(order), n + step) if (self.chosen // EXPLORE) % 2 else max(0, n - step)
        return n

    def _expanders(self) -> list:
        """Every running request's drafter brought to its context in one batched pass, and its expander."""
        contexts = [r.prompt + r.out.gen.tokens for r in self.running]
        drafters = [r.drafter for r in self.running]
        self._timed("draft_sync", sync_across, drafters, contexts)
        self._timed("draft_blocks", draft_blocks, drafters, contexts)
        return [d.expander(c) for d, c in zip(drafters, contexts)]

    def _chains(self, caps: list[int]) -> "_Drafts":
        """The running requests' chains, each its drafter's first-ranked path (up to its cap), one
        batched drafter pass a chain position for all of them; nodes scored by the path's cumulative
        log-probability.  Drafter networks that can (`drafters.chain_network`) feed their chosen
        tokens back where they run and read the chains once; others are read a position at a time."""
        drafters = [r.drafter for r in self.running]
        networks = [chain_network(d) for d in drafters]
        if all(n is not None for n in networks):
            contexts = [r.prompt + r.out.gen.tokens for r in self.running]
            groups = self._timed("draft_sync", catch_up_chains, networks, contexts, caps)
            ran, passes = self._timed("draft_levels", chain_levels, groups, len(drafters))
            self.levels += passes
            return _Drafts([_chain_tree(d.chain_from(c, cap, own)) for d, c, cap, own in zip(drafters, contexts, caps, ran)])
        if all(getattr(d, "block_drafter", None) is not None for d in drafters):
            # a block drafter ranks every position in its one pass: the chain is each position's first
            contexts = [r.prompt + r.out.gen.tokens for r in self.running]
            self._timed("draft_blocks", draft_blocks, drafters, contexts)

            def chains(caps: list[int]) -> list:
                ahead = _chains_ahead(drafters, contexts, caps)
                return ahead if ahead is not None else \
                    [_chain_tree(d.scored_chain(c, cap)) if cap else Tree() for d, c, cap in zip(drafters, contexts, caps)]
            return _Drafts(chains(caps), chains)
        own = self._expanders()
        trees = [Tree() for _ in own]
        children = [expand([]) if cap else [] for expand, cap in zip(own, caps)]
        while True:
            grown = set()
            for r, (tree, below) in enumerate(zip(trees, children)):
                if len(tree) < caps[r] and below and below[0][1] != float("-inf"):
                    token, logprob = below[0]
                    tree.tokens.append(token)
                    tree.parents.append(len(tree.tokens) - 2)
                    tree.depths.append(len(tree.tokens))
                    tree.scores.append((tree.scores[-1] if tree.scores else 0.0) + logprob)
                    grown.add(r)
            paths = [[list(trees[r].tokens)] if r in grown and len(trees[r]) < caps[r] else [] for r in range(len(own))]
            if not any(paths):
                return _Drafts(trees)
            children = [found[0] if found else [] for found in self._level(own, paths)]

    def _level(self, expands, paths):
        self.levels += 1
        return self._timed("draft_levels", expand_across, expands, paths)

    def _chunks(self, drafted: int) -> list[tuple[_Request, int]]:
        """Prompt chunks for this pass: in the room the running requests' drafts leave under the
        budget, a chunk each, oldest prompts first (with nothing running, prompts are prefilled whole)."""
        # trees: what the drafts leave of the budget (`_reserve` keeps some); ar / chain: a chunk a pass
        room = self.policy.budget - drafted if self.policy.mode == "tree" else self.chunk
        while self.waiting and self._free_rows() > 0 and room > 0:
            self.prefilling.append(self._start(self.waiting.popleft()))
        chunks = []
        for r in self.prefilling:
            n = min(self.chunk, room, len(r.prompt) - r.fed)
            if n <= 0:
                break
            chunks.append((r, n))
            room -= n
        return chunks

    def _commit_all(self, plans, rows) -> None:
        # chains verified before they were read are read now, behind the verification
        plans = [(tree.read() if isinstance(tree, _Ahead) else tree, base) for tree, base in plans]
        # the running requests' choices, all rows at once (a hook needs the rows themselves)
        chosen = top2_rows(rows[:len(plans)]) if self.hook is None else rows
        for r, plan, logits in zip(list(self.running), plans, chosen):
            self._commit(r, plan, logits)
        self.model.settle([r.state for r in self.running])    # the kept paths' states, one call for the batch

    def _commit(self, r: _Request, plan, logits) -> None:
        tree, base = plan
        if self.policy.mode == "ar":
            r.last = r.out.target_token(logits[-1])
            r.out.gen.accepted.append(1)
            return
        if self.policy.mode == "chain":
            r.last = commit_chain(r.state, r.out, tree.tokens, logits, base)
        else:
            r.last = commit_tree(self.model, r.state, r.out, tree, logits, base)
        if len(tree):      # a request given no nodes this pass learns nothing about its drafts
            # a chain that ended at the request's last token says nothing of the next draft
            r.schedule.update(r.out.gen.accepted[-1] - 1, _confidence(tree),
                              len(tree) if self.policy.mode == "chain" and not r.out.stopped else None)

    def _retire(self) -> None:
        """Finished requests leave the batch; their cache rows (target and drafter) go back at once."""
        now = self.clock.now()
        for r in [r for r in self.running if r.out.stopped]:
            self.running.remove(r)
            close_state(r.state)
            network = getattr(r.drafter, "network", None) or r.drafter    # a replay drafter's: its cost network
            if getattr(network, "state", None) is not None:
                close_state(network.state)
                network.state = None
            if hasattr(r.drafter, "close"):      # a block drafter's pooled cache row
                r.drafter.close()
            r.out.gen.seconds = now - self.result.timings[r.index].arrival
            self.result.timings[r.index].done = now
            self.result.generations[r.index] = r.out.gen


@dataclass
class _Drafts:
    """A pass's drafts: each running request's tree (a chain is one) and, where drafting more is a
    lookup in what the drafter computed already (a block drafter's ranked block; not a drafter pass a
    level), ``grow(caps)``: the drafts again with at most caps[r] nodes each, their first nodes
    the ones these have."""
    trees: list[Tree]
    grow: Callable[[list[int]], list[Tree]] | None = None


class _Ahead:
    """A chain verified before the host read it (`BlockDrafter.chain_ahead`): the verification's
    tokens, [last] + the chain (placed where the drafter computed them, or a host list), and
    ``read()``, its tree once the drafter's block is read.  Its length is the chain's."""

    def __init__(self, tokens, finish: Callable[[], list[tuple[int, float]]]):
        self.tokens, self.finish = tokens, finish

    def __len__(self) -> int:
        return len(self.tokens) - 1

    def read(self) -> Tree:
        return _chain_tree(self.finish())


def _chains_ahead(drafters: list, contexts: list[list[int]], caps: list[int]) -> list[_Ahead] | None:
    """Every request's chain as `_Ahead`, where every drafter's block came from the pass's batched
    cycle and is not read yet: the verification then launches behind the drafter without a host
    round trip.  None otherwise (the chains are read first)."""
    if not all(hasattr(d, "chain_ahead") for d in drafters):
        return None
    ahead = [d.chain_ahead(c, cap) for d, c, cap in zip(drafters, contexts, caps)]
    return None if any(a is None for a in ahead) else [_Ahead(*a) for a in ahead]


def _chain_tree(chain: list[tuple[int, float]]) -> Tree:
    """A chain as a tree, each node scored by its path's cumulative log-probability; it ends before
    a token the drafter rules out (-inf)."""
    tree, score = Tree(), 0.0
    for token, logprob in chain:
        if logprob == float("-inf"):
            break
        score += logprob
        tree.tokens.append(token)
        tree.parents.append(len(tree.tokens) - 2)
        tree.depths.append(len(tree.tokens))
        tree.scores.append(score)
    return tree


def _confidence(tree: Tree) -> float | None:
    """The drafter's expected accepted length for ``tree``: the sum of its first-ranked path's
    probabilities (None without scores)."""
    if not len(tree) or len(tree.scores) != len(tree):
        return None
    total, node = 0.0, -1
    while True:
        children = tree.children(node)
        if not children:
            return total
        node = children[0]
        total += math.exp(tree.scores[node])
