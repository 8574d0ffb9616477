"""The Gated DeltaNet recurrence kernels of a batched pass (`kernels.gdn.gated_delta_rule`, GPU form) on
the GPU: the decode step's (one token a sequence, final states out) and verification's sequential tree
form (records out), over B sequences, the shipped form and the alternatives of ``VARIANTS`` (where a
branching token's parent state and a token's operands wait, the registers a thread may take, barriers a
step, the split of d_k) side by side in one run, checked against the PyTorch recurrence along every root
path and against each other bit for bit.

    python bench/gdn_recurrence.py build LIB.so     # on the CPU machine, with the stub driver
    python bench/gdn_recurrence.py run LIB.so [--out DIR]

Heads: the 27B-class hybrid's (48 value heads of 128 x 128) at batch 1, 16 and 32, timed; and two narrow
ones checked at batch 3 -- 4 heads of 128 x 12 (48 threads a block, fewer than d_k: three rounds of k / q
loads) and of 16 x 12 (more threads than d_k) -- with the last two tokens of every chain padding (slot -1:
state kept, output 0).  Layers stacked as a batch build stacks them (this kernel's layer 0 of 2).  Chains of
5, 9 and 17 tokens and a branching tree of 9 nodes a sequence (verification), one token (decode: its final
states checked too), and ragged batches: a chain and a tree of 17 tokens whose sequences keep 17, 12, 9, 5,
3, 2, 1, 1 of them (cycled), the rest padding -- where ``padding="skip"`` (a block's loop ends at its
sequence's last real token) against ``walk`` (every block through all 17) shows.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tree_verify import DK, DV, HEADS  # noqa: E402  (Qwen3.5-27B's Gated DeltaNet heads)

# name -> ((heads, dk, dv), batch sizes, padded tokens at the end of every chain)
HEAD_SHAPES = {"27B-class": ((HEADS, DK, DV), (1, 16, 32), 0),
               "4 x 128 x 12": ((4, 128, 12), (3,), 2),
               "4 x 16 x 12": ((4, 16, 12), (3,), 2)}

# name -> gated_delta_rule keyword arguments; the first (the shipped form) is the yardstick every other must
# equal bit for bit (a variant with another ``split`` sums d_k in other pieces: checked against the reference)
VARIANTS = {
    "shipped": {},
    "prefetched parent, no bound": {"parent": "prefetch", "min_blocks": 0},
    "no bound": {"min_blocks": 0},
    "5 blocks an SM": {"min_blocks": 5},
    "walk the padding": {"padding": "walk"},
    "8 x 16 split": {"split": (8, 16)},
    "registers": {"operands": "registers", "min_blocks": 0},
}
TREE = [-1, 0, 0, 1, 1, 2, 3, 3, 5]          # a branching tree of 9 nodes (parents before children)
# a ragged chain of 17: sequence b's real tokens RAGGED[b % 8], the rest padding (a shared node budget's
# uneven drafts, padded to the longest), and a best-first-like tree of 17 cut the same way
RAGGED = [17, 12, 9, 5, 3, 2, 1, 1]
TREE17 = [-1, 0, 1, 1, 2, 3, 0, 4, 5, 6, 2, 8, 9, 10, 11, 12, 14]
SHAPES = {"decode": None, "chain 5": 5, "chain 9": 9, "chain 17": 17, "tree 9": TREE,
          "ragged 17": 17, "ragged tree 17": TREE17}
STACK = (2, 0)


def applies(name: str, dims: tuple) -> bool:
    """Whether variant ``name`` builds for heads ``dims``: its ``split`` (parts, cols) must divide (d_k, d_v)."""
    split = VARIANTS[name].get("split")
    return split is None or (dims[1] % split[0] == 0 and dims[2] % split[1] == 0)


def same_sums(name: str) -> bool:
    """A variant with the yardstick's split sums in its order, so must equal it bit for bit; another split
    sums d_k in other pieces (checked against the reference only)."""
    return VARIANTS[name].get("split") is None


def symbol(form: str, heads: str, name: str) -> str:
    return "_".join(["gdn", form, *("".join(ch if ch.isalnum() else "_" for ch in x) for x in (heads, name))])


def build(out: Path) -> None:
    import tvm

    from bench._common import export_kernels
    from specpilot.compiler.build import load_cuda_runtime
    from specpilot.kernels.gdn import gated_delta_rule
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    funcs = {}
    for heads, (shape, _, _) in HEAD_SHAPES.items():
        for name, kwargs in VARIANTS.items():
            if not applies(name, shape):
                continue
            funcs[symbol("verify", heads, name)] = gated_delta_rule(*shape, True, True, tree=True, stack=STACK, **kwargs)
            funcs[symbol("decode", heads, name)] = gated_delta_rule(*shape, False, True, stack=STACK, **kwargs)
    export_kernels(funcs, tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"}), out)
    (out.parent / (out.name + ".json")).write_text(json.dumps(VARIANTS))


def inputs(shape: tuple, batch: int, parents: list[int], padded: int | list[int], dev, seed: int = 3):
    """Seeded float32 operands for ``batch`` sequences of len(parents) tokens (unit q, k rows, q
    scaled by dk^-1/2, g < 0), the stacked initial states (B, G, H, dk, dv) and slots (the last
    ``padded`` tokens -1; a list: sequence b's last padded[b]), parents."""
    import torch
    heads, dk, dv = shape
    n = len(parents)
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, n, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(batch, n, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, n, heads, dv, generator=gen)
    g = -torch.rand(batch, n, heads, generator=gen) * 0.5
    beta = torch.rand(batch, n, heads, generator=gen)
    s0 = torch.randn(batch, STACK[0], heads, dk, dv, generator=gen) * 0.1
    slots = torch.arange(n, dtype=torch.int32).repeat(batch, 1)
    for b, pad in enumerate(padded if isinstance(padded, list) else [padded] * batch):
        if pad:
            slots[b, n - pad:] = -1
    par = torch.tensor([parents] * batch, dtype=torch.int32)
    return [t.to(dev).contiguous() for t in (q, k, v, g, beta, s0, slots, par)]


def reference(q, k, v, g, beta, s0, parents, padded: int | list[int]):
    """(o (B, T, H, dv), the state after the last real token (B, H, dk, dv)): each token's output
    after the recurrence along its root path from the layer's s0; padding tokens (the last
    ``padded``, or sequence b's last padded[b], at the end) output 0."""
    import torch

    from specpilot.runtime.reference.gdn import recurrent_gated_delta_rule
    out = torch.zeros_like(v)
    final = torch.empty_like(s0[:, STACK[1]])
    pads = padded if isinstance(padded, list) else [padded] * q.shape[0]
    for b in range(q.shape[0]):
        final[b] = s0[b, STACK[1]]
        for t in range(q.shape[1] - pads[b]):
            path = [t]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            idx = torch.tensor(path[::-1], device=q.device)
            o, state, _ = recurrent_gated_delta_rule(q[b, idx], k[b, idx], v[b, idx], g[b, idx], beta[b, idx],
                                                     s0[b, STACK[1]])
            out[b, t] = o[-1]
            final[b] = state
    return out, final


def case(lib, to_tvm, heads: str, shape: str, batch: int, dev) -> list[dict]:
    """Every variant on one (heads, shape, batch): outputs (and decode's final states) checked against
    the reference and each other, then timed round-robin."""
    import torch

    from bench._common import timed_interleaved
    dims, _, pad = HEAD_SHAPES[heads]
    decode = SHAPES[shape] is None
    chain = not decode and not isinstance(SHAPES[shape], list)
    parents = [-1] if decode else (SHAPES[shape] if not chain else [t - 1 for t in range(SHAPES[shape])])
    padded = pad if chain else 0
    if shape.startswith("ragged"):
        padded = [len(parents) - RAGGED[b % len(RAGGED)] for b in range(batch)]
    q, k, v, g, beta, s0, slots, par = inputs(dims, batch, parents, padded, dev)
    n = len(parents)
    ref, ref_final = reference(q, k, v, g, beta, s0, parents, padded)
    calls, outs = {}, {}
    names = [name for name in VARIANTS if applies(name, dims)]
    for name in names:
        o = torch.full((batch, n, dims[0], dims[2]), float("nan"), device=dev)
        if decode:
            st = torch.full_like(s0, float("nan"))
            extra = [o, st]
        else:
            rec = torch.full((batch, n, STACK[0], dims[0], dims[1] + dims[2] + 2), float("nan"), device=dev)
            st = torch.empty(batch, n, *dims, device=dev)
            extra = [o, rec, st]
        args = [to_tvm(x) for x in (q, k, v, g, beta, s0, slots, par, *extra)]
        fn = lib[symbol("decode" if decode else "verify", heads, name)]
        fn(*args)
        torch.cuda.synchronize()
        outs[name] = (o.clone(), (st[:, STACK[1]].clone() if decode else extra[1][:, :, STACK[1]].clone()))
        calls[name] = (lambda r, fn=fn, args=args: fn(*args))
    samples = timed_interleaved(calls, 1, rounds=7, iters=20)
    base = names[0]
    rows = []
    for name in names:
        o, kept = outs[name]
        err = float((o - ref).abs().max() / ref.abs().max())
        if decode:
            err = max(err, float((kept - ref_final).abs().max() / ref_final.abs().max()))
        rows.append({"heads": heads, "shape": shape, "batch": batch, "tokens": n, "padded": padded, "variant": name,
                     "median_us": statistics.median(samples[name]), "samples_us": samples[name],
                     "vs_reference": err, "nan_free": bool(torch.isfinite(o).all() and torch.isfinite(kept).all()),
                     "same_sums": same_sums(name),
                     "equal_to_first": bool(torch.equal(o, outs[base][0]) and torch.equal(kept, outs[base][1]))})
    for r in rows:
        r["vs_first"] = r["median_us"] / rows[0]["median_us"]
    return rows


def run(lib_path: Path, out_dir: Path | None) -> None:
    import torch

    from bench._common import load_kernels, write
    lib, to_tvm = load_kernels(lib_path)
    dev = torch.device("cuda")
    rows = []
    for heads, (_, batches, _) in HEAD_SHAPES.items():
        for shape in SHAPES:
            for batch in batches:
                for r in case(lib, to_tvm, heads, shape, batch, dev):
                    rows.append(r)
                    print(f"  {heads:12s} {shape:9s} B={batch:3d} {r['variant']:12s} {r['median_us']:8.1f} us  "
                          f"x{r['vs_first']:.2f}  err {r['vs_reference']:.1e}  equal {r['equal_to_first']}", flush=True)
    ok = all((r["equal_to_first"] or not r["same_sums"]) and r["nan_free"] and r["vs_reference"] < 1e-4 for r in rows)
    path = write("gdn-recurrence", {"heads": {h: list(d) for h, (d, _, _) in HEAD_SHAPES.items()},
                                    "stack": list(STACK), "checked": ok, "results": rows}, out_dir)
    print(f"\n{'heads':12s} {'shape':9s} {'B':>3s} " + " ".join(f"{n[:14]:>14s}" for n in VARIANTS))
    for heads, (_, batches, _) in HEAD_SHAPES.items():
        for shape in SHAPES:
            for batch in batches:
                us = {r["variant"]: r["median_us"] for r in rows if (r["heads"], r["shape"], r["batch"]) == (heads, shape, batch)}
                print(f"{heads:12s} {shape:9s} {batch:3d} " + " ".join(f"{us[n]:14.1f}" if n in us else f"{'-':>14s}"
                                                                      for n in VARIANTS))
    print(f"checked: {ok}; wrote {path}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    from bench._common import build_or_run
    build_or_run(build, run)
