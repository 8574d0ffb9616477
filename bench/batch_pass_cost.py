"""Where a batched pass's time goes: a target step of B requests as the batch engines run it, per kernel.

    python bench/batch_pass_cost.py BUILD_DIR [--batches 8,16,32] [--nodes 16,...] [--context 512] [--reps 10]
                                   [--top 12] [--accepted 4] [--prefill 1,8] [--out DIR]

B requests are prefilled with --context random token ids each.  At each batch size B, timed on the device
(synchronised, medians of --reps after a second of calls): the AR step (one new token a request: the build's
batched decode), a
verification pass of --nodes drafted tokens a request plus its last token (the build's verify, recording
as the speculative engines do; a chain's mask: a tree's costs the same rows), and, where the build has a
drafter model (an early-exit or replay cost drafter), its pass over one node a request (a tree level).
Then one run of each per kernel: on a GPU under torch's profiler (CUPTI sees TVM's kernels too), device
time per kernel name; on the CPU by TVM's VM instrument hook, a kernel's per-layer copies under one name;
the top --top kernels of each with their share.  Calls of the step functions do not move the states
(`CompiledModel.step_call`), so every repetition computes the same pass.  Last, the commit after a
verification, request by request (`commit_cost`: the emitted positions' choices and `accept_path` of
--accepted drafted tokens), which moves the states on; after each node count they go back to --context
(a model with recurrent layers cannot: its later rows' context is larger, recorded as each row's
``context``).  --prefill P,...: a prefill pass of P prompts of --context tokens from empty
states (the batch engines' join), timed and per kernel the same way.  JSON to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import kernel_times, sync, timed_calls, write  # noqa: E402
from specpilot.runtime.engine import CompiledModule  # noqa: E402


def timed(fn, args, reps: int) -> dict:
    """Milliseconds per call, synchronised, after ``WARMUP_S`` seconds of calls; median and quartiles."""
    return timed_calls({"call": (fn, args)}, reps)["call"]


def passes(model, states, nodes: int, gen) -> dict:
    """The step calls of B requests: AR (a token each) and verification (nodes + 1 tokens each)."""
    vocab = model.vocab_size
    one = [(torch.randint(0, vocab, (1,), generator=gen).tolist(), st) for st in states]
    many = [(torch.randint(0, vocab, (nodes + 1,), generator=gen).tolist(), st) for st in states]
    return {"ar_step": model.step_call(one)[:2], "verify": model.step_call(many, record=True)[:2]}


def commit_cost(model, states, nodes: int, accepted: int, reps: int, gen) -> dict:
    """A verification's commit as the batch engines run it, request by request, after a real recorded
    pass of ``nodes`` + 1 tokens each: the choice at each of ``accepted`` + 1 emitted positions
    (`Emitter.target_token`: `decoding.top2` of its logits row, then to the host) and `accept_path` of
    ``accepted`` nodes (every other one, as a tree's path; a chain build's prefix, which moves nothing).
    Milliseconds for all B requests, medians of ``reps`` (one more
    first, untimed); this moves the states on by ``accepted`` + 1 tokens a repetition."""
    from specpilot.runtime.decoding import top2
    choose, commit = [], []
    for rep in range(reps + 1):
        items = [(torch.randint(0, model.vocab_size, (nodes + 1,), generator=gen).tolist(), st) for st in states]
        bases = [st.length for st in states]
        rows = model.forward_batch(items, record=True)
        sync()
        t0 = time.perf_counter()
        for logits in rows:
            for r in range(accepted + 1):
                best, at, second, runner = top2(logits[r])
                torch.stack([best, second]).float().tolist()
                torch.stack([at, runner]).tolist()
        sync()
        t1 = time.perf_counter()
        step = 2 if model.keeps_tree_paths else 1   # a tree's path: every other node, so keys and values move
        for st, base in zip(states, bases):
            model.accept_path(st, base, [step * i for i in range(accepted + 1)])
        model.settle(states)      # the kept paths' states and keys / values, one call each for the batch
        sync()
        if rep:
            choose.append((t1 - t0) * 1e3)
            commit.append((time.perf_counter() - t1) * 1e3)
    return {"accepted": accepted, "choices_ms": statistics.median(choose), "accept_path_ms": statistics.median(commit)}


def prefill_row(model, prompts: int, args) -> dict:
    """A prefill pass of ``prompts`` random prompts of --context tokens from empty states."""
    gen = torch.Generator().manual_seed(1)
    states = [model.new_state(args.context + 1) for _ in range(prompts)]
    ids = [torch.randint(0, model.vocab_size, (args.context,), generator=gen).tolist() for _ in range(prompts)]
    fn, fargs = model.step_call(list(zip(ids, states)))[:2]
    row = {"prompts": prompts, "tokens": prompts * args.context, **timed(fn, fargs, args.reps),
           "kernels": kernel_times(fn, fargs, args.top, model.module)}
    print(f"prefill of {prompts} x {args.context} tokens: {row['median_ms']:.2f} ms "
          f"({row['tokens'] / row['median_ms'] * 1e3:.0f} tokens/s)")
    for k in row["kernels"][:12]:
        print(f"    prefill {k['share'] * 100:5.1f} %  {k['us'] / 1e3:7.2f} ms  x{k['calls']:<4} {k['kernel'][:80]}")
    for st in states:
        st.close()
    return row


def batch_row(module, target, drafter, states, d_states, nodes: int, args, gen) -> dict:
    """The passes of ``len(states)`` requests at ``nodes`` drafted tokens each: timed, per kernel, the commit."""
    b = len(states)
    calls = passes(target, states, nodes, gen)
    if drafter:
        calls["drafter_level"] = drafter.step_call(
            [(torch.randint(0, drafter.vocab_size, (1,), generator=gen).tolist(), st) for st in d_states])[:2]
    row = {"batch": b, "nodes": nodes, "context": max(st.length for st in states)}
    for name, (fn, fargs) in calls.items():
        row[name] = {**timed(fn, fargs, args.reps), "kernels": kernel_times(fn, fargs, args.top, module)}
    row["verify_over_ar"] = row["verify"]["median_ms"] / row["ar_step"]["median_ms"]
    accepted = min(args.accepted, nodes // 2 if target.keeps_tree_paths else nodes)
    row["commit"] = commit_cost(target, states, nodes, accepted, args.reps, gen)
    line = f"B={b}, context {row['context']}: AR step {row['ar_step']['median_ms']:.2f} ms, " \
           f"verify ({b} x {nodes + 1} rows) {row['verify']['median_ms']:.2f} ms ({row['verify_over_ar']:.2f}x)"
    if drafter:
        line += f", drafter level {row['drafter_level']['median_ms']:.2f} ms"
    line += f"; commit of {accepted} + 1 tokens a request: choices {row['commit']['choices_ms']:.2f} ms, " \
            f"accept_path {row['commit']['accept_path_ms']:.2f} ms"
    print(line)
    for k in row["verify"]["kernels"][:8]:
        print(f"    verify {k['share'] * 100:5.1f} %  {k['us'] / 1e3:7.2f} ms  x{k['calls']:<4} {k['kernel'][:80]}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", type=Path)
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--nodes", default="16", help="drafted tokens a request a verification, comma-separated")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--accepted", type=int, default=4, help="drafted tokens a request a commit keeps (at most nodes / 2 "
                    "on a tree build, nodes on a chain build)")
    ap.add_argument("--prefill", default="", help="prompts a prefill pass, comma-separated (none by default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    module = CompiledModule(args.build)
    if module.torch_device.type == "cpu":
        torch.set_num_threads(1)    # the host work on one thread, as compiled engines run it (`runtime.threads`)
    target = module.model("target")
    drafter = module.model("drafter") if "drafter" in module.manifest.models else None
    gen = torch.Generator().manual_seed(0)
    top = max(batches)
    states = [target.new_state(module.manifest.capacity) for _ in range(top)]
    d_states = [drafter.new_state(module.manifest.capacity) for _ in range(top)] if drafter else []
    for group in range(0, top, 8):          # prefilled 8 at a time: a pass's logits grow with its tokens
        ids = [torch.randint(0, target.vocab_size, (args.context,), generator=gen).tolist() for _ in range(8)]
        target.forward_batch(list(zip(ids, states[group:group + 8])))
        if drafter:
            drafter.forward_batch(list(zip(ids, d_states[group:group + 8])))
    rows = []
    for b in batches:
        for nodes in [int(n) for n in str(args.nodes).split(",")]:
            rows.append(batch_row(module, target, drafter, states[:b], d_states[:b], nodes, args, gen))
            if not target.has_gdn:      # back to the prefilled context (a recurrent state cannot go back)
                for st in states[:b]:
                    target.truncate(st, args.context)
    for st in states + d_states:          # their rows free for the prefill passes
        st.close()
    prefills = [prefill_row(target, int(p), args) for p in args.prefill.split(",") if p]
    path = write(f"batch-pass-cost-{args.build.name}", {"build": str(args.build), "context": args.context,
                                                         "rows": rows, "prefill": prefills}, args.out)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
