"""Sampling on a GPU build, checked two ways (bench/README "Sampling"):

1. the build's ``sample_scores`` against the PyTorch reference on random rows where the build runs;
2. at every sampled position where the compiled engine and stock choose differently, why: the top-p /
   top-k cut each side computed (their lowest kept logit), the two tokens' logits on both sides.

    python bench/sampling_check.py BUILD --temperature 0.8 --top-p 0.95 --seed 1 -o out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from specpilot.core.files import atomic_write_text
from specpilot.core.sampling import SamplingParams
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.environment import environment
from specpilot.runtime.sampling import controls, reference_scores
from specpilot.runtime.systems import from_build

PROMPTS = ("def fibonacci(n):\n    ", "The quick brown fox", "import numpy as np\n\ndef softmax(x):",
           "User: What is speculative decoding?\nAssistant:")


def kernel_check(module, vocab: int, device) -> dict:
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((33, vocab)).astype(np.float32) * 4).to(device)
    keys = rng.integers(-2 ** 31, 2 ** 31, size=(33, 3)).astype(np.int32)
    ctl = controls(logits, SamplingParams(temperature=0.8, top_p=0.9))
    got, want = module.sample_scores(logits, keys, ctl), reference_scores(logits, keys, ctl)
    kept = want > -1e30
    return {"rows": 33, "max_abs_diff": float((got[kept] - want[kept]).abs().max()),
            "same_mask": bool(torch.equal(got > -1e30, kept)),
            "same_argmax": bool(torch.equal(got.argmax(-1), want.argmax(-1)))}


def logits_along(model, prompt, tokens, capacity):
    rows = []
    autoregressive(model, prompt, len(tokens), capacity, force=tokens,
                   logits_hook=lambda pos, row: rows.append(row.float().clone()) or row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    system = from_build(Path(args.build))
    stock, compiled = system.engines["stock"].model, system.engines["compiled"].model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"environment": environment(), "sampling": params.model_dump(),
              "kernel": kernel_check(compiled.module, compiled.vocab_size, device), "divergences": []}
    print("kernel vs reference:", report["kernel"])
    for r, text in enumerate(PROMPTS):
        prompt = system.tokenizer.encode(text)
        s = system.generate("stock", prompt, args.max_new_tokens, sampling=params)
        c = system.generate("compiled", prompt, args.max_new_tokens, force=s.tokens, sampling=params)
        where = [p for p, (a, b) in enumerate(zip(s.tokens, c.choices)) if a != b]
        if not where:
            continue
        ls, lc = logits_along(stock, prompt, s.tokens, system.capacity), logits_along(compiled, prompt, s.tokens,
                                                                                      system.capacity)
        for p in where:
            a, b = s.tokens[p], c.choices[p]
            cut_s, cut_c = (float(controls(x[p][None], params)[0, 1]) for x in (ls, lc))
            row = {"request": r, "position": p, "stock_token": a, "system_token": b, "stock_margin": s.margins[p],
                   "stock_cut": cut_s, "compiled_cut": cut_c,
                   "stock_logits": [float(ls[p][a]), float(ls[p][b])],
                   "compiled_logits": [float(lc[p][a]), float(lc[p][b])]}
            report["divergences"].append(row)
            print(row)
    if args.output:
        atomic_write_text(args.output, json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
