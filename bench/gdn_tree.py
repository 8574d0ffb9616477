"""The chunked Gated DeltaNet tree kernel (compiler/gdn_tree.py) alone on the GPU: its forms and
column blocks side by side in one run, checked against the PyTorch recurrence along every root
path, with a per-phase breakdown from the probe form (clock64 at each phase boundary).

    python bench/gdn_tree.py build LIB.so [--variants ...]     # on the CPU machine, stub driver
    python bench/gdn_tree.py run --lib LIB.so [--out DIR]      # on the GPU

Shapes: Qwen3.5-27B's Gated DeltaNet (48 value heads of 128 x 128).  Trees: the 64-node
best-first tree of bench/tree_verify.py, a 65-token chain (the form's worst case: every pair
an ancestor pair) and a 7-token chain.  Outputs start NaN-poisoned; every record must equal the
substitution form's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tree_verify import DK, DV, HEADS  # noqa: E402  (Qwen3.5-27B's Gated DeltaNet heads)

# name -> gated_delta_rule_tree keyword arguments ("levels cb32 n72": what gdn-path-recompute runs for
# budgets up to 71; "substitution": the form it runs up to 104 tokens, the yardstick)
VARIANTS = {
    "substitution": {},
    "levels cb32 n72": {"levels": True, "columns": 32, "nmax": 72},
    "levels cb16 n72": {"levels": True, "columns": 16, "nmax": 72},
    "levels cb64 n72": {"levels": True, "columns": 64, "nmax": 72},
}
PROBES = {"probe levels cb32 n72": {"levels": True, "columns": 32, "nmax": 72, "probe": True}}
PHASES = ("loads", "records + G", "L and P + S0 k", "r + q issue", "level solve", "outputs")


def symbol(name: str) -> str:
    return "gdn_" + "".join(ch if ch.isalnum() else "_" for ch in name)


def build(out: Path, names: list[str]) -> None:
    from specpilot.compiler.build import load_cuda_runtime
    from specpilot.kernels.gdn_tree import gated_delta_rule_tree
    import tvm

    from bench._common import export_kernels
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    todo = {**VARIANTS, **PROBES}
    funcs = {symbol(n): gated_delta_rule_tree(HEADS, DK, DV, gpu=True, **todo[n]) for n in names or todo}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    export_kernels(funcs, target, out)
    (out.parent / (out.name + ".json")).write_text(json.dumps({n: todo[n] for n in (names or todo)}))


def chain(n: int):
    from specpilot.runtime.tree import Tree
    return Tree.chain(list(range(n)))


def run(lib_path: Path, out_dir: Path | None) -> None:
    import torch

    from bench._common import load_kernels, write
    from bench.tree_verify import root_path, result_row, timed, gdn_inputs, make_tree
    from specpilot.runtime.reference.gdn import recurrent_gated_delta_rule
    lib, to_tvm = load_kernels(lib_path)
    built = json.loads((lib_path.parent / (lib_path.name + ".json")).read_text())
    dev = torch.device("cuda")
    rows = []
    trees = {"best-first tree (64 nodes + root)": make_tree(), "chain (65 tokens)": chain(64),
             "chain (7 tokens)": chain(6)}
    for tname, tree in trees.items():
        parents = [-1] + [p + 1 for p in tree.parents]
        n = len(parents)
        q, k, v, g, beta, s0, slots, par = gdn_inputs(parents, dev)
        scratch = torch.empty(1, n, HEADS, DK, DV, device=dev)   # the sequential form's; the chunked forms' signature
        ref = torch.zeros(1, n, HEADS, DV, device=dev)
        for t in range(n):
            idx = torch.tensor(root_path(parents, t), device=dev)
            out, _, _ = recurrent_gated_delta_rule(q[0, idx], k[0, idx], v[0, idx], g[0, idx], beta[0, idx], s0[0])
            ref[0, t] = out[-1]
        base_rec = None
        for name, kwargs in built.items():
            fn = lib[symbol(name)]
            o = torch.full((1, n, HEADS, DV), float("nan"), device=dev)
            rec = torch.full((1, n, HEADS, DK + DV + 2), float("nan"), device=dev)
            args = [to_tvm(x) for x in (q, k, v, g, beta, s0, slots, par, o, rec, scratch)]
            marks = None
            if kwargs.get("probe"):
                blocks = HEADS * (DV // next(c for c in range(min(kwargs["columns"], DV), 0, -1) if DV % c == 0))
                marks = torch.zeros(blocks, 8, dtype=torch.int64, device=dev)
                args.append(to_tvm(marks))
            fn(*args)
            torch.cuda.synchronize()
            err = float((o - ref).abs().max() / ref.abs().max())
            if name == "substitution":
                base_rec = rec.clone()
            row = result_row(f"{tname}: {name}", timed(lambda fn=fn, args=args: fn(*args)), tree=tname, variant=name,
                             tokens=n, vs_reference_out=err, nan_free=bool(torch.isfinite(o).all()),
                             records_equal_substitution=(bool(torch.equal(rec, base_rec))
                                                         if base_rec is not None else None))
            if marks is not None:
                fn(*args)
                torch.cuda.synchronize()
                m = marks.cpu()
                deltas = (m[:, 1:7] - m[:, 0:6]).double()
                row["phase_cycles_median"] = dict(zip(PHASES, deltas.median(dim=0).values.tolist()))
                row["block_cycles_median"] = float((m[:, 6] - m[:, 0]).double().median())
                row["block_cycles_max"] = float((m[:, 6] - m[:, 0]).double().max())
            rows.append(row)
            print(f"  {tname:34s} {name:24s} {row['median_us']:8.1f} us  err {err:.1e}  "
                  f"records {row['records_equal_substitution']}", flush=True)
            if "phase_cycles_median" in row:
                print("      phases (median cycles over blocks): " +
                      ", ".join(f"{p} {c:.0f}" for p, c in row["phase_cycles_median"].items()) +
                      f"; block {row['block_cycles_median']:.0f} (max {row['block_cycles_max']:.0f})", flush=True)
    base = {r["tree"]: r["median_us"] for r in rows if r["variant"] == "substitution"}
    for r in rows:
        r["vs_substitution"] = r["median_us"] / base[r["tree"]]
    path = write("gdn-tree", {"heads": [HEADS, DK, DV], "results": rows}, out_dir)
    print(f"\n{'tree':34s} {'variant':24s} {'us':>8s} {'vs subst.':>10s} {'error':>8s}")
    for r in rows:
        print(f"{r['tree']:34s} {r['variant']:24s} {r['median_us']:8.1f} {r['vs_substitution']:10.2f} "
              f"{r['vs_reference_out']:8.1e}")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("lib", type=Path)
    b.add_argument("--variants", default="", help="comma-separated names of VARIANTS / PROBES (default: all)")
    r = sub.add_parser("run")
    r.add_argument("--lib", type=Path, required=True)
    r.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.lib, [v for v in args.variants.split(",") if v])
    else:
        run(args.lib, args.out)


if __name__ == "__main__":
    main()
