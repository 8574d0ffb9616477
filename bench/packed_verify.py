"""A batched verification padded against packed (`tree-verify{packed=true}`), side by side on one build.

    python bench/packed_verify.py BUILD_DIR [--batches 16,32] [--sizes 16,12,8,6,4,2,1,0] [--context 512]
                                  [--reps 20] [--seed 0] [--kernels TOP] [--out DIR]

B requests are prefilled with --context random token ids each; each gets a random draft tree whose node
count cycles through --sizes (the uneven trees a shared node budget gives: the batch engines pad every
request's to the longest).  The same pass (`CompiledModel.step_call`: calls do not move the states) is
timed through ``target_verify`` (padded: B x (1 + the largest tree) rows through every layer) and
``target_verify_packed`` (the linear layers and head over the real rows only), round-robin after a
second of calls of each, synchronised, medians and quartiles, beside the AR step of the same B requests
(a token each: what each verification is priced against).  Their logits at the real rows are
compared: equal bit for bit on the CPU (float32 builds); on a GPU the two row counts may take different
GEMM configurations, so the largest difference and the rows whose argmax differs are recorded.
--kernels TOP: then one call of each per kernel (`bench._common.kernel_times`: device time on a GPU), the
TOP kernels of each -- which kernels the padded rows still pay for.  JSON to --out.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import kernel_times, timed_calls, write  # noqa: E402
from specpilot.runtime.decoding import close_state, tree_inputs  # noqa: E402
from specpilot.runtime.engine import CompiledModule  # noqa: E402
from specpilot.runtime.tree import Tree  # noqa: E402


def random_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    """A tree of ``n`` nodes, each below a random earlier node (or the root)."""
    tree = Tree()
    for i in range(n):
        parent = rng.randint(-1, i - 1)
        tree.tokens.append(rng.randrange(vocab))
        tree.parents.append(parent)
        tree.depths.append(1 if parent < 0 else tree.depths[parent] + 1)
        tree.scores.append(0.0)
    return tree


def logits_of(result) -> torch.Tensor:
    """A step's logits as a float32 host copy: (B, T, vocab), a packed pass's (N, vocab)."""
    out = result[0] if not hasattr(result, "shape") else result
    return torch.from_dlpack(out).float().cpu().clone()


def one_batch(model, B: int, sizes: list[int], context: int, reps: int, rng: random.Random, top: int = 0) -> dict:
    vocab = model.vocab_size
    states = [model.new_state(model.capacity) for _ in range(B)]
    for st in states:     # one prefill a request: a batch's logits of every prompt token would not fit a 27B card
        model.forward([rng.randrange(vocab) for _ in range(context)], st)
    items = []
    for b, st in enumerate(states):
        tree = random_tree(rng, sizes[b % len(sizes)], vocab)
        tokens, positions, mask, parents = tree_inputs(rng.randrange(vocab), tree, st.length)
        items.append((tokens, st, positions, mask, parents))
    calls = {"packed": model.step_call(items, record=True)[:2]}
    model.pack_verify = False
    calls["padded"] = model.step_call(items, record=True)[:2]
    model.pack_verify = True
    ar_step = {"ar_step": model.step_call([([item[0][0]], st) for item, st in zip(items, states)])[:2]}   # the roots
    lengths = [len(it[0]) for it in items]
    T = max(lengths)
    results = {name: logits_of(fn(*args)) for name, (fn, args) in calls.items()}
    real = [(b, t) for b, n in enumerate(lengths) for t in range(n)]
    a = results["packed"]                     # the real tokens' rows (N, vocab), in the same order, then rounding's
    # (a build whose packed pass returned the padded layout: its real positions)
    a = torch.stack([a[b, t] for b, t in real]) if a.dim() == 3 else a[:len(real)]
    p = torch.stack([results["padded"][b, t] for b, t in real])
    times = timed_calls({**calls, **ar_step}, reps)
    per_kernel = {name: kernel_times(fn, args, top, model.module) for name, (fn, args) in {**calls, **ar_step}.items()} \
        if top else None
    for st in states:
        close_state(st)
    return {"batch": B, "real_rows": len(real), "padded_rows": B * T, "context": context, "tree_sizes": [n - 1 for n in lengths],
            "identical": bool(torch.equal(a, p)), "max_abs_diff": float((a - p).abs().max()),
            "argmax_differs": int((a.argmax(-1) != p.argmax(-1)).sum()), **times,
            "speedup": times["padded"]["median_ms"] / times["packed"]["median_ms"],
            **({"kernels": per_kernel} if per_kernel else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build", type=Path)
    ap.add_argument("--batches", default="16,32")
    ap.add_argument("--sizes", default="16,12,8,6,4,2,1,0", help="tree nodes a request, cycled over the batch")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", type=int, default=0, metavar="TOP", help="also the TOP kernels of each call")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model = CompiledModule(args.build).model("target")
    if not model.packs_verification:
        sys.exit(f"{args.build}: no target_verify_packed (build it with tree-verify{{packed=true}})")
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(args.seed)
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        row = one_batch(model, B, sizes, args.context, args.reps, rng, args.kernels)
        rows.append(row)
        print(f"batch {B}: {row['real_rows']} real of {row['padded_rows']} rows: padded "
              f"{row['padded']['median_ms']:.2f} ms, packed {row['packed']['median_ms']:.2f} ms "
              f"({row['speedup']:.2f}x); logits identical {row['identical']}, max diff {row['max_abs_diff']:.3g}, "
              f"argmax differs at {row['argmax_differs']}; AR step {row['ar_step']['median_ms']:.2f} ms", flush=True)
        for name, ranked in (row.get("kernels") or {}).items():
            print(f"  {name}: " + "; ".join(f"{k['kernel'][:48]} {k['us'] / 1e3:.2f} ms" for k in ranked[:8]), flush=True)
    path = write("packed-verify-" + args.build.name, {"build": str(args.build), "sizes": sizes, "seed": args.seed,
                                                      "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
