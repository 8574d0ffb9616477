"""Tree verification cost on the GPU, side by side in one run.

    python bench/tree_verify.py build LIB.so            # on the CPU machine, with the stub driver
    python bench/tree_verify.py run --lib LIB.so --build BUILD_DIR [--context 4096] [--out DIR]

0. bf16 matmuls x[m, k] . W^T at verification/prefill row counts: the tensor-core schedule
   (`schedules.tensor_core`) vs dlight's CUDA-core Matmul schedule vs torch (cuBLAS).
1. Step functions of a build with ``tree-verify{budget=64},gdn-path-recompute`` (a
   Qwen3.5-27B-style hybrid cut to a few layers, seeded bf16 weights) after a context of
   ``--context`` tokens: one autoregressive step (`decode`, 1 token) vs one verification of a
   64-node best-first tree (65 rows: the root and the nodes; ancestor mask, depth positions,
   parents), and a 65-token chain for reference; and a 1024-token prefill chunk (empty cache).
   The step function is called with prepared device arguments, so the times are the module's
   own (no logits copied to the host).
2. The Gated DeltaNet recurrence alone, at the same head shapes: the path-recompute kernel
   (every node from its parent's state, all 65 rows in one launch) vs per-node sequential
   recurrence -- (a) node by node, one launch per node from its parent's saved state, and
   (b) each node's root path walked again from the root -- and commit rebuilding the deepest
   node's state from the kernel's records.  Outputs, and every node's state as commit
   rebuilds it, are compared with the PyTorch recurrence and with (a) and (b).

The tree shape comes from `runtime.tree.best_first` on a synthetic drafter (top-4 per node,
log-probabilities from a seeded softmax): a realistic bushy-near-the-root, chain-below shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, DK, DV = 48, 128, 128       # Qwen3.5-27B's Gated DeltaNet value heads and head dims


def make_tree(budget: int = 64, max_depth: int = 16, seed: int = 0):
    import torch

    from specpilot.runtime.tree import best_first

    def expand(path):
        g = torch.Generator().manual_seed(hash((seed, *path)) % (2 ** 31))
        logp = torch.log_softmax(torch.randn(1000, generator=g) * 3, dim=0)
        top = logp.topk(4)
        return list(zip(top.indices.tolist(), top.values.tolist()))
    return best_first(expand, budget, max_depth)


MATMULS = [(5120, 17408), (17408, 5120), (5120, 248320)]
MS = [7, 65, 256]


def bench_matmuls(lib_path: Path) -> list[dict]:
    """bf16 x[m, k] . W^T on tensor cores (ours) vs dlight's CUDA-core schedule vs torch (cuBLAS),
    checked against the float32 product."""
    import torch
    import tvm
    lib = tvm.runtime.load_module(str(lib_path))
    to_tvm = tvm.runtime.from_dlpack
    rows = []
    for k, n in MATMULS:
        gen = torch.Generator().manual_seed(k + n)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
        for m in MS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            want = x.float() @ w.float().T
            y = torch.empty(m, n, device="cuda")
            row = {"case": f"matmul {m}x{k} . {n}x{k}^T", "m": m, "k": k, "n": n}
            for label in ("tc", "cc"):
                fn = lib[f"mm_{label}_{k}_{n}"]
                args = (to_tvm(x), to_tvm(w), to_tvm(y))
                y.zero_()
                fn(*args)
                torch.cuda.synchronize()
                row[f"{label}_rel_err"] = float((y - want).abs().max() / want.abs().max())
                row[f"{label}_us"] = statistics.median(timed(lambda fn=fn, args=args: fn(*args), iters=5, rounds=5))
            row["cublas_us"] = statistics.median(timed(lambda: torch.nn.functional.linear(x, w), iters=5, rounds=5))
            row["median_us"] = row["tc_us"]
            row["tc_vs_cublas"] = row["cublas_us"] / row["tc_us"]
            row["tc_vs_cuda_cores"] = row["cc_us"] / row["tc_us"]
            rows.append(row)
            print(f"  {row['case']:34s} tc {row['tc_us']:8.1f} us (err {row['tc_rel_err']:.1e})  "
                  f"cuda-core {row['cc_us']:9.1f} us  cublas {row['cublas_us']:8.1f} us", flush=True)
    return rows


def build(out: Path) -> None:
    import tvm

    from specpilot.compiler.build import load_cuda_runtime
    from specpilot.kernels.gdn_tree import form_for, gated_delta_rule_tree
    from specpilot.kernels import gated_delta_rule, gdn_commit
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    funcs = {"gdn_tree": gated_delta_rule(HEADS, DK, DV, keep_states=True, gpu=True, tree=True),
             "gdn_tree_chunked": gated_delta_rule_tree(HEADS, DK, DV, gpu=True, **form_for(65)),   # what ships
             "gdn_step": gated_delta_rule(HEADS, DK, DV, keep_states=False, gpu=True),
             "gdn_commit": gdn_commit(1, HEADS, DK, DV, gpu=True)}
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    from tvm.s_tir import dlight as dl

    from specpilot.schedules.tensor_core import BF16Matmul, nt_matmul
    with target:
        for k, n in MATMULS:    # x[m, k] . W[n, k]^T, bf16 -> float32: tensor cores vs dlight's CUDA-core tiling
            for label, rule in (("tc", BF16Matmul()), ("cc", dl.gpu.Matmul())):
                sch = rule.apply(nt_matmul(n, k), target, False)
                funcs[f"mm_{label}_{k}_{n}"] = sch.mod["main"]
    funcs = {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}
    with target:
        lib = tvm.compile(tvm.IRModule(funcs), target=target)
    lib.export_library(str(out))
    print(f"wrote {out}")


def timed(fn, iters: int = 20, rounds: int = 7) -> list[float]:
    """Microseconds per call of ``fn`` (CUDA events around ``iters`` calls), ``rounds`` samples."""
    import torch
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(rounds):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / iters)
    return out


def result_row(name: str, samples: list[float], **extra) -> dict:
    return {"case": name, "median_us": statistics.median(samples), "min_us": min(samples),
            "max_us": max(samples), **extra}


def bench_steps(build_dir: Path, context: int, tree) -> list[dict]:
    """AR step vs 64-node tree verification vs a 65-token chain, after ``context`` tokens."""
    import numpy as np
    import torch

    from specpilot.runtime.engine import CompiledModule
    module = CompiledModule(build_dir)
    model = module.model("target")
    gen = torch.Generator().manual_seed(1)
    state = model.new_state(model.capacity)
    prompt = torch.randint(0, model.vocab_size, (max(context, 1024),), generator=gen).tolist()
    rows = []
    fn, args, _, _ = model.step_call([(prompt[:1024], state)], False)   # a 1024-token prefill chunk
    rows.append(result_row("prefill (1024 tokens)", timed(lambda: fn(*args), iters=5), context=0, tokens=1024))
    print(f"  {'prefill (1024 tokens)':34s} {rows[-1]['median_us'] / 1e3:8.3f} ms", flush=True)
    for i in range(0, context, 1024):                 # prefill in chunks
        model.forward(prompt[i:i + 1024], state)
    base = state.length
    n = len(tree)
    mask = np.zeros((n + 1, base + n + 1), dtype=bool)
    mask[:, :base] = True
    mask[:, base:] = tree.ancestor_mask()
    tokens = [7] + [t % model.vocab_size for t in tree.tokens]
    items = {
        "AR step (1 token)": ([[7], state], False),
        f"tree verify ({n} nodes + root)": ([tokens, state, [base] + [base + d for d in tree.depths], mask,
                                             [-1] + [p + 1 for p in tree.parents]], True),
        f"chain verify ({n + 1} tokens)": ([tokens, state], True),
        "chain verify (7 tokens)": ([tokens[:7], state], True),
    }
    for name, (item, record) in items.items():
        fn, args, _, _ = model.step_call([item], record)
        samples = timed(lambda fn=fn, args=args: fn(*args))
        rows.append(result_row(name, samples, context=context, tokens=len(item[0])))
        print(f"  {name:34s} {rows[-1]['median_us'] / 1e3:8.3f} ms", flush=True)
    from specpilot.runtime.profile import AnyKernel, profiling
    for name in ("AR step (1 token)", f"tree verify ({n} nodes + root)"):
        item, record = items[name]
        fn, args, _, _ = model.step_call([item], record)
        with profiling(module, AnyKernel()) as prof:
            fn(*args)
        kernels = sorted(((k, sum(c.seconds for c in calls), len(calls)) for k, calls in prof.by_kernel().items()),
                         key=lambda x: -x[1])
        row = next(r for r in rows if r["case"] == name)
        row["kernels"] = [{"kernel": k, "us": s * 1e6, "calls": c} for k, s, c in kernels]
        print(f"  {name}: per kernel (instrumented, {prof.kernel_seconds * 1e3:.2f} ms)")
        for k, s, c in kernels[:12]:
            print(f"    {k[:56]:56s} x{c:<3d} {s * 1e6:9.1f} us")
    ar = next(r for r in rows if r["case"] == "AR step (1 token)")["median_us"]
    for r in rows:
        r["vs_ar_step"] = r["median_us"] / ar
    state.close()
    return rows


def root_path(parents: list[int], t: int) -> list[int]:
    """Rows from the root down to row t."""
    path = []
    while t >= 0:
        path.append(t)
        t = parents[t]
    return path[::-1]


def gdn_inputs(parents: list[int], dev, seed: int = 2):
    """Seeded float32 inputs of the GDN tree kernels on ``dev`` for rows with these parents (row 0
    the root, parent -1): q, k (unit rows, q scaled by dk^-1/2), v, g (< 0), beta, S_0, slots, parents."""
    import torch
    n = len(parents)
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, n, HEADS, DK, generator=gen), dim=-1) * DK ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, n, HEADS, DK, generator=gen), dim=-1)
    v = torch.randn(1, n, HEADS, DV, generator=gen)
    g = -torch.rand(1, n, HEADS, generator=gen) * 0.5
    beta = torch.rand(1, n, HEADS, generator=gen)
    s0 = torch.randn(1, HEADS, DK, DV, generator=gen) * 0.1
    q, k, v, g, beta, s0 = (t.float().to(dev).contiguous() for t in (q, k, v, g, beta, s0))
    slots = torch.arange(n, dtype=torch.int32, device=dev)[None]
    par = torch.tensor([parents], dtype=torch.int32, device=dev)
    return q, k, v, g, beta, s0, slots, par


def bench_gdn(lib_path: Path, tree) -> list[dict]:
    import torch
    import tvm

    lib = tvm.runtime.load_module(str(lib_path))
    tree_fn, step_fn, commit_fn = lib["gdn_tree"], lib["gdn_step"], lib["gdn_commit"]
    chunked_fn = lib["gdn_tree_chunked"]
    dev = torch.device("cuda")
    to_tvm = tvm.runtime.from_dlpack
    parents = [-1] + [p + 1 for p in tree.parents]        # row 0: the root (the last accepted token)
    n = len(parents)
    q, k, v, g, beta, s0, slots, par = gdn_inputs(parents, dev)
    o_tree = torch.zeros(1, n, HEADS, DV, device=dev)
    rec = torch.zeros(1, n, 1, HEADS, DK + DV + 2, device=dev)   # kernels.record_width (no compiler here)
    scratch = torch.full((1, n, HEADS, DK, DV), float("nan"), device=dev)   # a state read back unstored: NaN
    args_tree = [to_tvm(t) for t in (q, k, v, g, beta, s0, slots, par, o_tree, rec[:, :, 0], scratch)]
    # the chunked form (compiler/gdn_tree.py): same inputs, its own outputs and records
    o_chunk, rec_chunk = torch.full_like(o_tree, float("nan")), torch.full_like(rec, float("nan"))
    args_chunk = [to_tvm(t) for t in (q, k, v, g, beta, s0, slots, par, o_chunk, rec_chunk[:, :, 0], scratch)]
    # every node's state as commit rebuilds it from the tree kernel's records (root path, root first)
    st_tree = torch.zeros(1, n, HEADS, DK, DV, device=dev)
    commit_args = [[to_tvm(rec), to_tvm(s0[:, None]),
                    to_tvm(torch.tensor([root_path(parents, t)], dtype=torch.int32, device=dev)),
                    to_tvm(st_tree[:, t:t + 1])] for t in range(n)]
    deepest = max(range(n), key=lambda t: len(root_path(parents, t)))

    # (a) node by node: one launch per row, from its parent's saved state
    o_node = torch.zeros(1, n, HEADS, DV, device=dev)
    st_node = torch.zeros(n, 1, HEADS, DK, DV, device=dev)
    one_slot = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    node_args = []
    for t, p in enumerate(parents):
        sl = lambda x, t=t: to_tvm(x[:, t:t + 1])                          # noqa: E731
        node_args.append([sl(q), sl(k), sl(v), sl(g), sl(beta), to_tvm(s0 if p < 0 else st_node[p]),
                          to_tvm(one_slot), to_tvm(one_slot), sl(o_node), to_tvm(st_node[t])])

    # (b) each row's root path walked from the root (its last token's output and final state)
    path_args, o_path, st_path = [], torch.zeros(1, n, HEADS, DV, device=dev), torch.zeros(n, 1, HEADS, DK, DV, device=dev)
    for t in range(n):
        idx = torch.tensor(root_path(parents, t), device=dev)
        gathered = [x[:, idx].contiguous() for x in (q, k, v, g, beta)]
        o_buf = torch.zeros(1, len(idx), HEADS, DV, device=dev)
        path_args.append(([to_tvm(x) for x in gathered] + [to_tvm(s0), to_tvm(slots[:, :len(idx)].contiguous()),
                          to_tvm(slots[:, :len(idx)].contiguous()), to_tvm(o_buf), to_tvm(st_path[t])], o_buf))

    def run_tree():
        tree_fn(*args_tree)

    def run_chunked():
        chunked_fn(*args_chunk)

    def run_nodes():
        for a in node_args:
            step_fn(*a)

    def run_paths():
        for a, _ in path_args:
            step_fn(*a)

    def run_commit():   # the deepest node's state, as commit keeps an accepted path
        commit_fn(*commit_args[deepest])

    for f in (run_tree, run_chunked, run_nodes, run_paths):
        f()
    for a in commit_args:
        commit_fn(*a)
    torch.cuda.synchronize()
    for t, (_, o_buf) in enumerate(path_args):
        o_path[:, t] = o_buf[:, -1]
    scale = float(st_tree.abs().max())
    # the reference: every row's root path walked by the PyTorch recurrence, float32 on the GPU
    from specpilot.runtime.reference.gdn import recurrent_gated_delta_rule
    ref_o, ref_st = torch.zeros_like(o_tree), torch.zeros_like(st_tree)
    for t in range(n):
        idx = torch.tensor(root_path(parents, t), device=dev)
        out, after, _ = recurrent_gated_delta_rule(q[0, idx], k[0, idx], v[0, idx], g[0, idx], beta[0, idx], s0[0])
        ref_o[0, t], ref_st[0, t] = out[-1], after
    errors = {"vs_reference_out": float((o_tree - ref_o).abs().max() / ref_o.abs().max()),
              "vs_reference_state": float((st_tree - ref_st).abs().max() / ref_st.abs().max()),
              "node_by_node_state": float((st_node[:, 0] - st_tree[0]).abs().max()) / scale,
              "node_by_node_out": float((o_node - o_tree).abs().max() / o_tree.abs().max()),
              "path_walk_state": float((st_path[:, 0] - st_tree[0]).abs().max()) / scale,
              "path_walk_out": float((o_path - o_tree).abs().max() / o_tree.abs().max()),
              "chunked_vs_sequential_out": float((o_chunk - o_tree).abs().max() / o_tree.abs().max()),
              "chunked_records_equal": bool(torch.equal(rec_chunk, rec)),
              "chunked_vs_reference_out": float((o_chunk - ref_o).abs().max() / ref_o.abs().max())}
    print(f"  GDN agreement (max relative): {errors}", flush=True)
    rows = [result_row(f"GDN path recompute, one launch ({n} rows)", timed(run_tree)),
            result_row(f"GDN path recompute, chunked ({n} rows)", timed(run_chunked)),
            result_row(f"GDN node by node ({n} launches)", timed(run_nodes, iters=5)),
            result_row(f"GDN root paths walked ({n} launches, {sum(o.shape[1] for _, o in path_args)} token steps)",
                       timed(run_paths, iters=5)),
            result_row(f"GDN commit: the state at depth {len(root_path(parents, deepest))} rebuilt (1 launch)",
                       timed(run_commit))]
    fast = rows[0]["median_us"]
    for r in rows:
        r["vs_path_recompute"] = r["median_us"] / fast
        r["errors"] = errors
        print(f"  {r['case']:50s} {r['median_us']:9.1f} us  x{r['vs_path_recompute']:.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("lib", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--lib", type=Path, required=True)
    r.add_argument("--build", type=Path, required=True)
    r.add_argument("--context", type=int, default=4096)
    r.add_argument("--out", type=Path, default=None)
    r.add_argument("--parts", default="matmul,gdn,steps", help="which of matmul,gdn,steps to run")
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.lib)
        return
    from bench._common import write
    from specpilot.runtime.engine import import_tvm_runtime
    import_tvm_runtime(gpu=True)
    tree = make_tree()
    print(f"tree: {len(tree)} nodes, depth {max(tree.depths)}, root children {len(tree.children(-1))}", flush=True)
    parts = set(args.parts.split(","))
    rows = bench_matmuls(args.lib) if "matmul" in parts else []
    rows += bench_gdn(args.lib, tree) if "gdn" in parts else []
    rows += bench_steps(args.build, args.context, tree) if "steps" in parts else []
    path = write("tree-verify", {"build": str(args.build), "tree": {"nodes": len(tree), "depth": max(tree.depths), "parents": tree.parents},
                                 "results": rows}, args.out)
    print(f"\n{'case':52s} {'median':>10s} {'ratio':>7s}")
    for row in rows:
        ratio = row.get("vs_ar_step", row.get("vs_path_recompute", row.get("tc_vs_cublas")))
        print(f"{row['case']:52s} {row['median_us']:8.1f}us {ratio:7.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
