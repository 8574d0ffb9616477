"""Greedy decoding, plain and speculative, on any model with ``new_state`` / ``forward``.

Both loops can be *forced*: given stock's tokens, they emit those instead of their own
choices (so the run follows stock's path) and record their own greedy choice at every
position.  That is token forcing: the system under test is exact iff its choices equal
stock's tokens everywhere.  ``logits_hook(position, logits)`` lets a test inject faults.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specpilot.runtime.draft_schedule import DraftSchedule
from specpilot.runtime.drafters import bind

from specpilot.runtime.tree import Tree, accept, best_first


@dataclass
class Generation:
    tokens: list[int]                 # emitted tokens (stock's when forced)
    choices: list[int]                # the system's own greedy choice at each position
    margins: list[float]              # top-1 minus top-2 logit of the system's logits there
    runner_up: list[int] = field(default_factory=list)  # the system's second-ranked token there
    accepted: list[int] = field(default_factory=list)  # tokens committed per verification pass
    off_first_rank: int = 0           # tree verifications whose accepted path left the first-ranked child
    seconds: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens per target verification pass (accepted drafts + the target's own token)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def top2(row: torch.Tensor):
    """(best value, its index, runner-up value, its index) of a logits row as 0-d tensors where the
    row is (no host copy): ties go to the lowest index, as argmax's do -- the same choice on every
    device and in every loop, where topk's order among equal values is its own (exact ties are
    common in bf16-rounded logits over a large vocabulary) -- and the runner-up is the best of the
    rest.  H200, 152k float32 logits, back to back: 73 us a call against topk(2)'s 132 (argmax
    alone 15); the 8B-shape engine step with tokens on the device 1.35 ms with topk(2), 1.32 with
    this (bench/README "Token choice"; docs/bench-log.md)."""
    best, at = row.max(0)
    second, runner = row.index_fill(0, at.reshape(1), float("-inf")).max(0)
    return best, at, second, runner


@dataclass(frozen=True)
class Choice:
    """A logits row's top two on the host (`top2`'s values): what `Emitter.target_token` records."""
    first: float
    token: int
    second: float
    runner_up: int


def top2_rows(logits: list[torch.Tensor]) -> list[list[Choice]]:
    """`top2` of every row of each (rows, vocab) logits tensor, in one pass over them all (a batch's
    requests together: four kernels, not four a request) and one copy to the host: a batched pass's
    commits then wait for the device once, not once per emitted token.  The same values and ties as
    `top2` row by row (``max`` over a dimension takes the first maximum)."""
    if not logits:
        return []
    rows = joined_rows(list(logits))
    best, at = rows.max(1)
    second, runner = rows.scatter(1, at[:, None], float("-inf")).max(1)
    values = torch.stack([best, second]).float().cpu().tolist()
    index = torch.stack([at, runner]).cpu().tolist()
    out, start = [], 0
    for rows in logits:
        end = start + rows.shape[0]
        out.append([Choice(*c) for c in zip(values[0][start:end], index[0][start:end], values[1][start:end],
                                             index[1][start:end])])
        start = end
    return out


def joined_rows(blocks: list[torch.Tensor]) -> torch.Tensor:
    """(rows, vocab) blocks as one: a view where they lie one after the other in one tensor's memory (a
    packed pass's logits, split by request), else a copy."""
    first = blocks[0]
    width = first.shape[1]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for b in blocks:
        if not b.is_contiguous() or b.dtype != first.dtype or b.shape[1] != width \
                or b.untyped_storage().data_ptr() != storage or b.storage_offset() != offset:
            return torch.cat(blocks)
        offset += b.numel()
    return first.as_strided((sum(b.shape[0] for b in blocks), width), (width, 1), first.storage_offset())


STREAM_WINDOW = 4     # tokens a streamed on-device decode hands over at once (a host round trip each)


class Emitter:
    """Turns logits rows into emitted tokens, choices and margins, honouring forcing.  ``on_token``
    hears each emitted token as it is decided (streaming); returning False stops the generation
    there (a cancelled request)."""

    def __init__(self, max_new: int, force, logits_hook, stop_ids, on_token=None):
        self.max_new, self.force, self.hook, self.stop_ids = max_new, force, logits_hook, set(stop_ids)
        self.on_token = on_token
        self.gen = Generation([], [], [])
        self.stopped = False

    def target_token(self, logits_row: "torch.Tensor | Choice") -> int:
        """Record the system's choice at the next position and return the token to emit; the row's
        `Choice` where it was taken already (`top2_rows`; not with a logits hook, which sees rows)."""
        pos = len(self.gen.tokens)
        if isinstance(logits_row, Choice):
            if self.hook is not None:
                raise ValueError("a logits hook needs the logits rows, not their choices")
            first, choice, second, runner_up = (logits_row.first, logits_row.token, logits_row.second,
                                                logits_row.runner_up)
        else:
            if self.hook is not None:
                logits_row = self.hook(pos, logits_row)
            best, at, second_best, runner = top2(logits_row)
            (first, second) = torch.stack([best, second_best]).float().tolist()    # two copies
            choice, runner_up = torch.stack([at, runner]).tolist()
        self.gen.choices.append(choice)
        self.gen.margins.append(first - second)
        self.gen.runner_up.append(runner_up)
        token = self.force[pos] if self.force is not None else choice
        self.gen.tokens.append(token)
        if token in self.stop_ids or len(self.gen.tokens) >= self.max_new:
            self.stopped = True
        if self.on_token is not None and self.on_token(token) is False:
            self.stopped = True
        return token


def autoregressive(model, prompt: list[int], max_new: int, capacity: int, force=None,
                   logits_hook=None, stop_ids=(), window: int = 16, on_token=None) -> Generation:
    """Stock decoding: one target pass per token.  Unforced and unhooked on a model that takes
    its token on the device (`CompiledModel.step_on_device`), each step's top-2 is taken where
    the logits are and its argmax fed to the next step there: the host never waits on a step
    and enqueues the next while the device runs; every ``window`` steps (and at the end) the
    choices come back, to stop at a stop token.  Same tokens, choices, margins and runner-ups
    as the host loop (the same `top2` on the same logits).  Streaming (``on_token``) hears the
    tokens every ``STREAM_WINDOW`` steps there (the host loop: each as soon as it is chosen)."""
    if force is None and logits_hook is None and hasattr(model, "step_on_device"):
        return _autoregressive_on_device(model, prompt, max_new, capacity, stop_ids,
                                         window if on_token is None else STREAM_WINDOW, on_token)
    start = time.perf_counter()
    state = model.new_state(capacity)
    out = Emitter(max_new, force, logits_hook, stop_ids, on_token)
    logits = model.forward(prompt, state)[-1]
    while True:
        token = out.target_token(logits)
        out.gen.accepted.append(1)
        if out.stopped:
            break
        logits = model.forward([token], state)[-1]
    close_state(state)
    out.gen.seconds = time.perf_counter() - start
    return out.gen


def teacher_forced(model, prompt: list[int], tokens: list[int], capacity: int, chunk: int = 64):
    """The logits row at each of ``tokens``' positions, with the tokens before it fed (a forced
    autoregressive run's rows), from passes of at most ``chunk`` tokens: a few calls instead of one a
    token, the same rows up to the arithmetic's rounding (float32 on the tiny hybrids: ~5e-4, the prompt's
    Gated DeltaNet run chunked rather than token by token)."""
    if not prompt or not tokens:
        raise ValueError("teacher forcing needs a prompt and at least one token")
    state = model.new_state(capacity)
    sequence, first = list(prompt) + list(tokens[:-1]), len(prompt) - 1   # sequence[first] predicts tokens[0]
    try:
        for start in range(0, len(sequence), chunk):
            rows = model.forward(sequence[start:start + chunk], state)
            yield from rows[max(first - start, 0):]
    finally:
        close_state(state)


def close_state(state) -> None:
    """Give a finished sequence's cache row back now (compiled states hold a pool row)."""
    if hasattr(state, "close"):
        state.close()


def tops_on_device(model, state, first, n: int, stop_ids=(), window: int = 16, on_token=None) -> list:
    """``first`` (the `top2` of the prefill's last logits row) and the `top2` of each decode step
    after it, up to ``n`` in all: each step is fed its predecessor's choice where the build runs
    (`CompiledModel.step_on_device`), so nothing waits on the device except, every ``window``
    steps, the choices coming back -- to stop after a stop token (the steps past it are wasted, not
    wrong: the caller cuts there) and to hand them to ``on_token`` (streaming in bursts of a window;
    False from it ends the generation at that token)."""
    stops = set(stop_ids)
    tops, heard = [first], 0

    def hear(upto: int) -> bool:
        nonlocal heard
        for token in torch.stack([t[1] for t in tops[heard:upto]]).tolist():
            heard += 1
            if (on_token is not None and on_token(token) is False) or token in stops:
                return False
        return True

    while len(tops) < n:
        if (stops or on_token is not None) and len(tops) - heard >= window and not hear(len(tops)):
            return tops[:heard]
        tops.append(top2(model.step_on_device(tops[-1][1], state)))
    if on_token is not None:
        hear(len(tops))
        return tops[:heard]
    return tops


def _autoregressive_on_device(model, prompt, max_new: int, capacity: int, stop_ids, window: int,
                              on_token=None) -> Generation:
    start = time.perf_counter()
    state = model.new_state(capacity)
    stops = set(stop_ids)
    tops = tops_on_device(model, state, top2(model.forward(prompt, state)[-1]), max_new, stops, window, on_token)
    values = torch.stack([torch.stack([t[0], t[2]]) for t in tops]).float().cpu().tolist()
    indices = torch.stack([torch.stack([t[1], t[3]]) for t in tops]).cpu().tolist()
    tokens = [i for i, _ in indices]
    end = next((n + 1 for n, t in enumerate(tokens) if t in stops), len(tokens))
    gen = Generation(tokens[:end], tokens[:end], [a - b for a, b in values[:end]], [r for _, r in indices[:end]],
                     accepted=[1] * end)
    state.close()
    gen.seconds = time.perf_counter() - start
    return gen


def speculative(model, drafter, prompt: list[int], max_new: int, draft_len, capacity: int,
                force=None, logits_hook=None, stop_ids=(), on_token=None) -> Generation:
    """Stock speculative decoding: draft a chain, verify it in one target pass, keep the
    longest prefix the target agrees with plus the target's own next token.  ``draft_len``:
    an int (fixed) or a `runtime.draft_schedule.DraftSchedule` (its length per step)."""
    schedule = draft_len if isinstance(draft_len, DraftSchedule) else DraftSchedule(draft_len)
    start = time.perf_counter()
    state = model.new_state(capacity)
    out = Emitter(max_new, force, logits_hook, stop_ids, on_token)
    if hasattr(drafter, "reset"):
        drafter.reset()
    bind(drafter, state)
    logits = model.forward(prompt, state)[-1]
    last = out.target_token(logits)            # emitted, not yet fed to the target
    out.gen.accepted.append(1)
    while not out.stopped:
        room = min(schedule.next(), out.max_new - len(out.gen.tokens), capacity - state.length - 1)
        draft = drafter.propose(prompt + out.gen.tokens, room).chain()[:room]
        base = state.length
        rows = model.forward([last] + draft, state, record=True)   # row i: target after draft[:i]
        last = commit_chain(state, out, draft, rows, base)
        model.settle([state])        # the kept token's states now, not inside the next verification
        schedule.update(out.gen.accepted[-1] - 1)
    close_state(state)
    out.gen.seconds = time.perf_counter() - start
    return out.gen


def row_choices(out: "Emitter", rows):
    """What `Emitter.target_token` takes for a verification's rows: on a GPU every row's `Choice` in
    one read-back (a row at a time waits for the device twice a row), else the rows themselves (a
    logits hook sees rows; on the CPU there is nothing to wait for, and unread rows cost nothing)."""
    if out.hook is None and isinstance(rows, torch.Tensor) and rows.is_cuda:
        return top2_rows([rows])[0]
    return rows


def commit_chain(state, out: "Emitter", draft: list[int], rows, base: int) -> int:
    """After a verification of ``[last] + draft`` (logits ``rows``, the pass starting at ``base``):
    emit the longest agreeing prefix and the target's own next token, cut the rest from ``state``;
    returns the new last token."""
    committed = 0
    rows = row_choices(out, rows)
    for i in range(len(draft) + 1):
        last = out.target_token(rows[i])
        committed += 1
        if out.stopped or i == len(draft) or draft[i] != last:
            break
    state.truncate(base + committed)       # keep [last fed] + accepted drafts; drop the rest
    state.drop_history()
    out.gen.accepted.append(committed)
    return last


def tree_inputs(last: int, tree: Tree, base: int):
    """[root] + nodes for one verification pass: tokens, rotary positions, mask, parents."""
    n = len(tree)
    mask = np.zeros((n + 1, base + n + 1), dtype=bool)
    mask[:, :base] = True
    mask[:, base:] = tree.ancestor_mask()
    return ([last] + tree.tokens, [base] + [base + d for d in tree.depths], mask,
            [-1] + [p + 1 for p in tree.parents])


def _verify_tree(model, state, out: "Emitter", last: int, tree: Tree) -> int:
    """One exact verification of ``tree`` below ``last``: emit the accepted path and the bonus
    token, keep the path in ``state``; returns the new last token."""
    base = state.length
    tokens, positions, mask, parents = tree_inputs(last, tree, base)
    rows = model.forward(tokens, state, positions=positions, attn_mask=mask, record=True, parents=parents)
    last = commit_tree(model, state, out, tree, rows, base)
    model.settle([state])
    return last


def commit_tree(model, state, out: "Emitter", tree: Tree, rows, base: int) -> int:
    """After a verification of ``tree`` (logits ``rows``, the pass starting at ``base``): emit the
    accepted path and the bonus token, keep the path in ``state``; returns the new last token."""
    rows = row_choices(out, rows)

    def choose(row: int) -> int:
        if out.stopped:
            raise StopIteration
        return out.target_token(rows[row])

    nodes, emitted = accept(tree, choose)
    if any(tree.children(tree.parents[i])[0] != i for i in nodes):
        out.gen.off_first_rank += 1
    model.accept_path(state, base, [0] + [i + 1 for i in nodes])
    out.gen.accepted.append(len(emitted))
    return emitted[-1]


def _start(model, drafter, prompt, max_new, capacity, force, logits_hook, stop_ids, on_token):
    state = model.new_state(capacity)
    out = Emitter(max_new, force, logits_hook, stop_ids, on_token)
    if hasattr(drafter, "reset"):
        drafter.reset()
    bind(drafter, state)
    last = out.target_token(model.forward(prompt, state)[-1])   # emitted, not yet fed to the target
    out.gen.accepted.append(1)
    return state, out, last


def speculative_tree(model, drafter, prompt: list[int], max_new: int, budget: int, capacity: int,
                     force=None, logits_hook=None, stop_ids=(), on_token=None) -> Generation:
    """Tree speculative decoding: the drafter's best-first tree of up to ``budget`` nodes is
    verified in one target pass (ancestor-only attention, depth positions); the longest root
    path the target agrees with is kept, plus the target's own next token."""
    start = time.perf_counter()
    state, out, last = _start(model, drafter, prompt, max_new, capacity, force, logits_hook, stop_ids, on_token)
    while not out.stopped:
        room = min(budget, capacity - state.length - 1)
        depth = out.max_new - len(out.gen.tokens)
        tree = best_first(drafter.expander(prompt + out.gen.tokens), room, depth) if room > 0 else Tree()
        last = _verify_tree(model, state, out, last, tree)
    close_state(state)
    out.gen.seconds = time.perf_counter() - start
    return out.gen


def speculative_two_level(model, drafter, prompt: list[int], max_new: int, budget: int, capacity: int,
                          force=None, logits_hook=None, stop_ids=(), on_token=None) -> Generation:
    """Two-level verification: the drafter's tree is verified first through the nested 8-bit
    view (``model.forward_view``: no tokens accepted, no state moved); the path it agrees
    with plus its own next token is a proposed chain, the drafter continues from the chain's
    end, and one exact verification of chain + new drafts (at most ``budget`` nodes) accepts."""
    start = time.perf_counter()
    state, out, last = _start(model, drafter, prompt, max_new, capacity, force, logits_hook, stop_ids, on_token)
    while not out.stopped:
        room = min(budget, capacity - state.length - 1)
        depth = out.max_new - len(out.gen.tokens)
        context = prompt + out.gen.tokens
        first = best_first(drafter.expander(context), room, depth) if room > 0 else Tree()
        chain: list[int] = []
        if len(first):
            tokens, positions, mask, parents = tree_inputs(last, first, state.length)
            view = model.forward_view(tokens, state, positions, mask, parents)
            nodes, emitted = accept(first, lambda row: int(view[row].argmax()))
            chain = ([first.tokens[i] for i in nodes] + emitted[-1:])[:min(room, depth)]
        k = len(chain)
        second = best_first(drafter.expander(context + chain), room - k, depth - k) \
            if room > k and depth > k else Tree()
        combined = Tree(chain + second.tokens,
                        list(range(-1, k - 1)) + [k - 1 if p < 0 else k + p for p in second.parents],
                        list(range(1, k + 1)) + [k + d for d in second.depths],
                        [0.0] * k + second.scores)
        last = _verify_tree(model, state, out, last, combined)
    close_state(state)
    out.gen.seconds = time.perf_counter() - start
    return out.gen
