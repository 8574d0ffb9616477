"""What drafting costs beside an AR step of the target, for a build with a block / feature drafter
lowered into it (issue goals: <= 15 % on SmolLM2, <= 5 % at 27B-class shapes), in one run.

    python bench/drafter_cost.py BUILD_DIR [--context 4096] [--accepted 3] [--draft-len N] [--reps 40]
                                 [--batches 2,4,8,16,32] [--out DIR]

The target is prefilled with --context random token ids.  AR step: the build's decode, a token fed back
on the device (`CompiledModel.step_on_device`, as the AR engine runs), per step over --reps steps.
Drafting cycle: what the drafter does between two verifications -- cache the target features of the
--accepted tokens the last verification committed, then propose a chain of --draft-len tokens (a
block drafter: the build's one `drafter_cycle` call, ranked where it ran, and beside it the context and
block calls with the logits ranked by torch (`drafters.ranked`); a feature drafter: its steps, ranked by
torch) -- timed to the host having the proposal.  Features are random rows of the right
width: the cost does not depend on their values.  Medians and quartiles; JSON to --out.

--batches (a block drafter in a build for batches): B drafters, each on its own row of the pool with a
context of --context tokens, their cycles as one ``drafter_cycle_batch`` call against one
``drafter_cycle`` call each, interleaved, beside the target's batched AR pass over the same B sequences,
and how alike the two ways rank (their kernels differ: with bf16, near-ties may swap).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench._common import quartiles, write  # noqa: E402
from specpilot.core import feature_drafter as fd  # noqa: E402
from specpilot.runtime.drafters import ranked  # noqa: E402
from specpilot.runtime.engine import CompiledModule  # noqa: E402
from specpilot.runtime.feature_drafters import BlockDrafter, FeatureDrafter  # noqa: E402
from specpilot.runtime.features import FeatureStore  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ar_steps(module: CompiledModule, context: int, reps: int, profiled: int = 0) -> tuple[list[float], list[dict]]:
    """Milliseconds per decode step after a prefill of ``context`` random ids; ``profiled``: that many
    more steps' kernels (`kernel_table`)."""
    target = module.model("target")
    gen = torch.Generator().manual_seed(0)
    state = target.new_state(module.manifest.capacity)
    logits = target.forward(torch.randint(0, target.vocab_size, (context,), generator=gen).tolist(), state)
    token = logits[-1].argmax().reshape(1).to(torch.int32)
    device = token.device
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        token = target.step_on_device(token, state).argmax().reshape(1).to(torch.int32)
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)

    def more() -> None:
        nonlocal token
        for _ in range(profiled):
            token = target.step_on_device(token, state).argmax().reshape(1).to(torch.int32)
    return out, kernel_table(more, profiled) if profiled else []


def drafting_cycles(module: CompiledModule, context: int, accepted: int, draft_len: int, reps: int,
                    one_call: bool = True, profiled: int = 0) -> tuple[list[float], list[dict]]:
    """Milliseconds per drafting cycle (see the module docstring); ``one_call``: a block drafter's
    cycle as the build's ``drafter_cycle`` (else its context and block calls, ranked by torch).  ``profiled``: that
    many more cycles under the profiler, their kernels (`kernel_table`)."""
    net = module.draft_net()
    if hasattr(net, "one_call"):
        net.one_call = one_call
    cfg = net.cfg
    capacity = module.manifest.capacity
    need = context + (reps + profiled) * accepted + 1
    if need + draft_len >= capacity:
        raise SystemExit(f"--context {context} with {reps + profiled} cycles of {accepted} needs "
                         f"{need + draft_len} slots; the build holds {capacity}")
    gen = torch.Generator().manual_seed(1)
    store = FeatureStore(capacity, len(cfg.target_layers) * cfg.target_hidden, net.dtype, net.device)
    store.write(0, torch.randn(need, store.width, generator=gen).to(net.device))
    tokens = torch.randint(0, cfg.vocab_size, (need + 1,), generator=gen).tolist()
    kind = BlockDrafter if cfg.kind == "block" else FeatureDrafter
    drafter = kind(net, top_k=getattr(net, "ranks", 8), capacity=capacity)     # a block drafter: what its build ranks
    drafter.source = store          # the drafter reads these rows as the committed context's features
    drafter.propose(tokens[:context + 1], draft_len)      # the context cached once

    def cycle(r: int) -> None:
        lattice = drafter.propose(tokens[:context + (r + 1) * accepted + 1], draft_len)
        assert lattice.tokens.shape[0] == draft_len
    out = []
    for r in range(reps):
        _sync(net.device)
        t0 = time.perf_counter()
        cycle(r)
        out.append((time.perf_counter() - t0) * 1e3)
    return out, (kernel_table(lambda: [cycle(r) for r in range(reps, reps + profiled)], profiled)
                 if profiled else [])


def batched_cycles(module: CompiledModule, context: int, accepted: int, batch: int, reps: int, warmup: int,
                   profiled: int = 0) -> dict:
    """A batch's drafting cycles (see the module docstring): milliseconds a cycle of all ``batch`` drafters
    as one call and as a call each, the share of drafters ranking alike both ways, and the target's
    batched AR pass over ``batch`` sequences of ``context`` tokens; ``profiled``: that many more one-call
    cycles under the profiler, their kernels (`kernel_table`)."""
    net = module.draft_net()
    cfg, capacity = net.cfg, module.manifest.capacity
    n = warmup + reps + profiled
    need = context + n * accepted
    if need + cfg.block_size > capacity:
        raise SystemExit(f"--context {context} with {n} cycles of {accepted} needs {need + cfg.block_size} slots; "
                         f"the build holds {capacity}")
    gen = torch.Generator().manual_seed(3)
    width = len(cfg.target_layers) * cfg.target_hidden
    features = torch.randn(batch, need, width, generator=gen).to(device=net.device, dtype=net.dtype)
    tokens = torch.randint(0, cfg.vocab_size, (n, batch, cfg.block_size), generator=gen)
    caches = [net.new_cache(fd.cache_slots(cfg, capacity)) for _ in range(batch)]
    for b, cache in enumerate(caches):
        net.context(cache, features[b, :context], 0)
    one, each, alike, worst = [], [], 0, 0.0

    def entries(r: int) -> list:
        start = context + (r + 1) * accepted      # both ways cache the same rows: the same state after either
        return [(c, features[b, start - accepted:start], start, tokens[r, b]) for b, c in enumerate(caches)]
    for r in range(warmup + reps):
        entries_r = entries(r)
        _sync(net.device)
        t0 = time.perf_counter()
        together = net.cycle_batch(entries_r, net.ranks).read()
        t1 = time.perf_counter()
        alone = [net.ranked_cycle(*entry, net.ranks) for entry in entries_r]
        t2 = time.perf_counter()
        if r >= warmup:
            one.append((t1 - t0) * 1e3)
            each.append((t2 - t1) * 1e3)
        alike += sum(bool(np.array_equal(a[0], b[0])) for a, b in zip(together, alone))
        worst = max([worst] + [float(np.abs(a[1][:, 0] - b[1][:, 0]).max()) for a, b in zip(together, alone)])
    kernels = kernel_table(lambda: [net.cycle_batch(entries(r), net.ranks).read() for r in range(warmup + reps, n)],
                           profiled) if profiled else []
    return {"batch": batch, "one_call": quartiles(one), "a_call_each": quartiles(each),
            "identical_rankings": alike / ((warmup + reps) * batch), "max_top1_logprob_difference": worst,
            "ar_pass": quartiles(ar_passes(module, context, batch, warmup + reps)[warmup:]), "kernels": kernels}


def ar_passes(module: CompiledModule, context: int, batch: int, reps: int) -> list[float]:
    """Milliseconds per batched AR pass (`forward_batch` of one token a sequence, as the batch scheduler
    runs AR) over ``batch`` sequences prefilled with ``context`` random ids."""
    target = module.model("target")
    gen = torch.Generator().manual_seed(4)
    states = [target.new_state(module.manifest.capacity) for _ in range(batch)]
    for state in states:
        target.forward(torch.randint(0, target.vocab_size, (context,), generator=gen).tolist(), state)
    out = []
    for r in range(reps):
        t0 = time.perf_counter()
        rows = target.forward_batch([([r % target.vocab_size], state) for state in states])
        rows[-1][-1].argmax().item()          # the host has the pass's result
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def ranking_check(module: CompiledModule, context: int, cycles: int = 8) -> dict:
    """The build's ranking (`kernels.rank_rows` in ``drafter_cycle``) against `drafters.ranked` over the
    same block's logits (``drafter_block`` again on the same cache): the share of identical ranked
    indices and the largest difference from torch's log_softmax at them."""
    net = module.draft_net()
    cfg = net.cfg
    gen = torch.Generator().manual_seed(2)
    width = len(cfg.target_layers) * cfg.target_hidden
    cache = net.new_cache(fd.cache_slots(cfg, module.manifest.capacity))
    net.context(cache, torch.randn(context, width, generator=gen), 0)
    same = total = 0
    worst = 0.0
    for r in range(cycles):
        start = context + 3 * (r + 1)
        tokens = torch.randint(0, cfg.vocab_size, (cfg.block_size,), generator=gen)
        got = [torch.from_numpy(a) for a in net.ranked_cycle(cache, torch.randn(3, width, generator=gen), start,
                                                            tokens, net.ranks)]
        logits = net.block(cache, tokens, start)
        indices = ranked(logits, net.ranks)[0]
        values = torch.log_softmax(logits, dim=-1).gather(-1, indices)
        same += int((got[0] == indices.cpu()).sum())
        total += got[0].numel()
        worst = max(worst, float((got[1] - values.float().cpu()).abs().max()))
    return {"identical_indices": same / total, "max_logprob_difference": worst}


def kernel_table(run, calls: int, top: int = 12) -> list[dict]:
    """The device's kernels over ``run()`` (``calls`` cycles or steps) under torch's profiler, per call:
    microseconds and launches by kernel name, the busiest first, then their sum ("(all)") -- beside the
    wall time, what a cycle spends on the device at all.  Empty off a GPU."""
    if not torch.cuda.is_available():
        return []
    from torch.profiler import ProfilerActivity, profile
    _sync(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        _sync(torch.device("cuda"))
    totals: dict[str, list] = {}
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            t = totals.setdefault(e.name[:100], [0.0, 0])
            t[0] += e.time_range.elapsed_us() / calls
            t[1] += 1 / calls
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return [{"kernel": k, "us": us, "launches": n} for k, (us, n) in ranked[:top]] + [
        {"kernel": "(all)", "us": sum(t[0] for t in totals.values()), "launches": sum(t[1] for t in totals.values())}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", type=Path)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--accepted", type=int, default=3, help="tokens a verification commits (features to cache)")
    ap.add_argument("--draft-len", type=int, default=None, help="drafts a cycle (default: a block's, or the build's)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile", type=int, default=10, help="steps / cycles whose kernels are listed (GPU)")
    ap.add_argument("--batches", default="", help="B,...: a batch's cycles in one call against a call each")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.accepted < 1:     # a cycle caches what the last verification committed: at least its last token
        raise SystemExit("--accepted: at least 1")
    module = CompiledModule(args.build)
    cfg = module.feature_drafter()[0]
    draft_len = args.draft_len or (cfg.drafts_per_pass if cfg.kind == "block" else module.manifest.serving.draft_len)
    n = args.warmup + args.reps
    ar, ar_kernels = ar_steps(module, args.context, n, args.profile)
    cycles, kernels = drafting_cycles(module, args.context, args.accepted, draft_len, n, profiled=args.profile)
    two_calls, agreement = None, None
    if cfg.kind == "block":
        two_calls = drafting_cycles(module, args.context, args.accepted, draft_len, n, one_call=False)[0]
        agreement = ranking_check(module, args.context)
    ar, cycles, two_calls = ar[args.warmup:], cycles[args.warmup:], two_calls and two_calls[args.warmup:]
    result = {"build": str(args.build), "context": args.context, "accepted": args.accepted, "draft_len": draft_len,
              "drafter": {**cfg.to_dict(), "parameters": sum(t.numel() for k, t in module.feature_drafter()[1].items()
                                                             if k != "d2t")},
              "ar_step": quartiles(ar), "drafting_cycle": quartiles(cycles)}
    result["share_of_ar_step"] = result["drafting_cycle"]["median_ms"] / result["ar_step"]["median_ms"]
    if two_calls:     # the same cycle as two calls (context, then block) ranked by torch, for the side-by-side
        result["drafting_cycle_two_calls"] = quartiles(two_calls)
        result["ranking_check"] = agreement
    batches = [int(v) for v in args.batches.split(",") if v]
    if batches:
        result["batched"] = [batched_cycles(module, args.context, args.accepted, b, args.reps, args.warmup,
                                            args.profile) for b in batches]
        for row in result["batched"]:
            print(f"batch {row['batch']}: one call {row['one_call']['median_ms']:.3f} ms, a call each "
                  f"{row['a_call_each']['median_ms']:.3f} ms, AR pass {row['ar_pass']['median_ms']:.3f} ms; "
                  f"ranked alike {100 * row['identical_rankings']:.1f} %")
            if row["kernels"]:
                print(f"  one call: {row['kernels'][-1]['us']:.0f} us on the device in "
                      f"{row['kernels'][-1]['launches']:.0f} launches; "
                      + ", ".join(f"{k['kernel'][:40]} {k['us']:.0f}" for k in row["kernels"][:8]))
    if kernels:       # per step / cycle: what the device ran, against the wall time above
        result["kernels"] = {"ar_step": ar_kernels, "drafting_cycle": kernels}
        for what, table in result["kernels"].items():
            print(f"{what}: {table[-1]['us']:.0f} us on the device in {table[-1]['launches']:.0f} launches; "
                  + ", ".join(f"{k['kernel'][:40]} {k['us']:.0f}" for k in table[:6]))
    path = write(f"drafter-cost-{args.build.name}", result, args.out)
    print(f"{args.build.name}: AR step {result['ar_step']['median_ms']:.3f} ms, drafting cycle "
          f"{result['drafting_cycle']['median_ms']:.3f} ms ({cfg.kind}, {cfg.num_layers} layer(s), {draft_len} drafts): "
          f"{100 * result['share_of_ar_step']:.1f} % of an AR step"
          + (f"; as two calls ranked by torch {result['drafting_cycle_two_calls']['median_ms']:.3f} ms "
             f"(the build's ranks {100 * agreement['identical_indices']:.1f} % torch's)" if two_calls else "")
          + f" -> {path}")
    if agreement and agreement["identical_indices"] < 1.0:     # the kernel is wrong somewhere: fail the run
        raise SystemExit(f"the build's ranking differs from torch's on the same logits: {agreement}")



if __name__ == "__main__":
    main()
