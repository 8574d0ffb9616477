"""Choosing a decode step's token on the GPU, side by side in one run: torch's topk(2), argmax, and
`decoding.top2` (max, index_fill, max: ties to the lowest index) over one float32 logits row.

    python bench/top2.py [--vocab 151936] [--out DIR]

CUDA events around 200 back-to-back calls a sample, 7 samples; the three choices checked equal
on the row (random bf16-rounded values, ties planted at the top).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from bench._common import write
    from specpilot.runtime.decoding import top2
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    row = (torch.randn(args.vocab, generator=gen) * 2).to(torch.bfloat16).float().cuda()
    row[[17, 4000, 90000 % args.vocab]] = row.max() + 1      # an exact tie at the top
    ways = {"topk(2)": lambda: row.topk(2), "argmax": lambda: row.argmax(), "top2": lambda: top2(row)}
    assert int(ways["argmax"]()) == int(top2(row)[1]) == 17 and int(top2(row)[3]) == 4000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for name, fn in ways.items():
        for _ in range(20):
            fn()
        samples = []
        for _ in range(7):
            torch.cuda.synchronize()
            start.record()
            for _ in range(200):
                fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / 200)
        rows.append({"way": name, "median_us": statistics.median(samples), "min_us": min(samples),
                     "max_us": max(samples)})
        print(f"  {name:8s} {statistics.median(samples):7.1f} us", flush=True)
    path = write("top2", {"vocab": args.vocab, "results": rows,
                          "topk_first_index_at_the_tie": int(row.topk(2).indices[0])}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
