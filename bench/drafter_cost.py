"""What drafting costs beside an AR step of the target, for a build with a block / feature drafter
lowered into it (issue goals: <= 15 % on SmolLM2, <= 5 % at 27B-class shapes), in one run.

    python bench/drafter_cost.py BUILD_DIR [--context 4096] [--accepted 3] [--draft-len N] [--reps 40] [--out DIR]

The target is prefilled with --context random token ids.  AR step: the build's decode, a token fed back
on the device (`CompiledModel.step_on_device`, as the AR engine runs), per step over --reps steps.
Drafting cycle: what the drafter does between two verifications -- cache the target features of the
--accepted tokens the last verification committed, then propose a chain of --draft-len tokens (a
block drafter: one block pass; a feature drafter: its steps), its log-probabilities read back ranked
(`drafters.ranked`) -- timed to the host having the proposal.  Features are random rows of the right
width: the cost does not depend on their values.  Medians and quartiles; JSON to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import write  # noqa: E402
from specpilot.runtime.engine import CompiledModule  # noqa: E402
from specpilot.runtime.feature_drafters import BlockDrafter, FeatureDrafter  # noqa: E402
from specpilot.runtime.features import FeatureStore  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quartiles(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4)
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "samples": len(ms)}


def ar_steps(module: CompiledModule, context: int, reps: int) -> list[float]:
    """Milliseconds per decode step after a prefill of ``context`` random ids."""
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
    return out


def drafting_cycles(module: CompiledModule, context: int, accepted: int, draft_len: int, reps: int) -> list[float]:
    """Milliseconds per drafting cycle (see the module docstring)."""
    net = module.draft_net()
    cfg = net.cfg
    capacity = module.manifest.capacity
    need = context + reps * accepted + 1
    if need + draft_len >= capacity:
        raise SystemExit(f"--context {context} with {reps} cycles of {accepted} needs {need + draft_len} slots; "
                         f"the build holds {capacity}")
    gen = torch.Generator().manual_seed(1)
    store = FeatureStore(capacity, len(cfg.target_layers) * cfg.target_hidden, net.dtype, net.device)
    store.write(0, torch.randn(need, store.width, generator=gen).to(net.device))
    tokens = torch.randint(0, cfg.vocab_size, (need + 1,), generator=gen).tolist()
    kind = BlockDrafter if cfg.kind == "block" else FeatureDrafter
    drafter = kind(net, top_k=8, capacity=capacity)
    drafter.source = store          # the drafter reads these rows as the committed context's features
    drafter.propose(tokens[:context + 1], draft_len)      # the context cached once
    out = []
    for r in range(reps):
        length = context + (r + 1) * accepted + 1
        _sync(net.device)
        t0 = time.perf_counter()
        lattice = drafter.propose(tokens[:length], draft_len)
        out.append((time.perf_counter() - t0) * 1e3)
        assert lattice.tokens.shape[0] == draft_len
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", type=Path)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--accepted", type=int, default=3, help="tokens a verification commits (features to cache)")
    ap.add_argument("--draft-len", type=int, default=None, help="drafts a cycle (default: a block's, or the build's)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    module = CompiledModule(args.build)
    cfg = module.feature_drafter()[0]
    draft_len = args.draft_len or (cfg.drafts_per_pass if cfg.kind == "block" else module.manifest.serving.draft_len)
    ar = ar_steps(module, args.context, args.warmup + args.reps)[args.warmup:]
    cycles = drafting_cycles(module, args.context, args.accepted, draft_len, args.warmup + args.reps)[args.warmup:]
    result = {"build": str(args.build), "context": args.context, "accepted": args.accepted, "draft_len": draft_len,
              "drafter": {**cfg.to_dict(), "parameters": sum(t.numel() for k, t in module.feature_drafter()[1].items()
                                                             if k != "d2t")},
              "ar_step": quartiles(ar), "drafting_cycle": quartiles(cycles)}
    result["share_of_ar_step"] = result["drafting_cycle"]["median_ms"] / result["ar_step"]["median_ms"]
    path = write(f"drafter-cost-{args.build.name}", result, args.out)
    print(f"{args.build.name}: AR step {result['ar_step']['median_ms']:.3f} ms, drafting cycle "
          f"{result['drafting_cycle']['median_ms']:.3f} ms ({cfg.kind}, {cfg.num_layers} layer(s), {draft_len} drafts): "
          f"{100 * result['share_of_ar_step']:.1f} % of an AR step -> {path}")


if __name__ == "__main__":
    main()
