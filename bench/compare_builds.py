"""Two builds of one seeded spec, compared output for output, bit for bit, on the GPU.

    python bench/compare_builds.py BUILD_A BUILD_B [--context 1024] [--out DIR]

A schedule change that only moves arithmetic (fused epilogues, a different kernel for the same
expression) must leave every output unchanged: prefill logits, an AR step's logits (and the next
step's, which reads the keys and values the first one wrote), and a
64-node tree verification's logits, GDN conv states and recurrence records at a ``context``-token
cache.  Both builds draw the same seeded weights (``--params seeded``), so any differing bit is
a schedule bug.  Exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench._common import write  # noqa: E402


def outputs(build: Path, context: int) -> dict:
    import numpy as np
    import torch

    from specpilot.runtime.engine import CompiledModule
    from tree_verify import make_tree
    model = CompiledModule(build).model("target")
    gen = torch.Generator().manual_seed(1)
    state = model.new_state(model.capacity)
    prompt = torch.randint(0, model.vocab_size, (context,), generator=gen).tolist()
    out = {}

    def run(name, items, record=False):
        fn, args, _, _ = model.step_call(items, record)
        res = fn(*args)
        res = [res] if hasattr(res, "shape") else list(res)    # a model without recurrent layers: logits alone
        out[name] = [torch.from_dlpack(o).clone() for o in (res if record else res[:1])]
    run("prefill (300 tokens)", [(prompt[:300], state)])
    model.forward(prompt, state)
    run("AR step", [([7], state)])
    model.forward([7], state)      # the step's own keys / values in the pool (decode writes them itself)
    run("AR step after it", [([8], state)])
    base, tree = state.length, make_tree()
    mask = np.zeros((len(tree) + 1, base + len(tree) + 1), dtype=bool)
    mask[:, :base] = True
    mask[:, base:] = tree.ancestor_mask()
    tokens = [7] + [t % model.vocab_size for t in tree.tokens]
    run(f"tree verify ({len(tree)} nodes + root)",
        [(tokens, state, [base] + [base + d for d in tree.depths], mask, [-1] + [p + 1 for p in tree.parents])], True)
    torch.cuda.synchronize()
    state.close()
    return out


def main() -> None:
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    a, b = outputs(args.a, args.context), outputs(args.b, args.context)
    rows = []
    for name in a:
        for i, (x, y) in enumerate(zip(a[name], b[name])):
            same_shape = x.shape == y.shape and x.dtype == y.dtype
            bits = same_shape and torch.equal(x.contiguous().view(torch.int8), y.contiguous().view(torch.int8))
            diff = float((x.float() - y.float()).abs().max()) if same_shape else float("nan")
            rows.append({"step": name, "output": i, "shape": list(x.shape), "dtype": str(x.dtype),
                         "bit_identical": bool(bits), "max_abs_diff": diff})
            print(f"{name:32s} output {i} {tuple(x.shape)} {x.dtype}: bit-identical {bits}, max |diff| {diff:.3g}",
                  flush=True)
    ok = all(r["bit_identical"] for r in rows)
    path = write("compare-builds", {"a": str(args.a), "b": str(args.b), "context": args.context,
                                    "all_bit_identical": ok, "results": rows}, args.out)
    print(("all outputs bit-identical" if ok else "OUTPUTS DIFFER") + f"; wrote {path}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
