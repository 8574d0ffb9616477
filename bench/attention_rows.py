"""Attention of many query rows straight from the KV pool on the GPU, side by side in one run.

    python bench/attention_rows.py build LIB.so     # on the CPU machine, with the stub driver
    python bench/attention_rows.py run LIB.so [--out DIR]

`kernels.attention_rows_partial` + `attention_combine` (what GPU builds run for prefill and
verification) against what the builds ran before -- keys and values gathered out of the pool,
bf16 matmuls, the mask applied to the (T x L) scores, a float32 softmax rounded to bf16 (here in
PyTorch: cuBLAS matmuls, so a lower bound on the old TVM path) -- and PyTorch's
scaled_dot_product_attention with the same boolean mask.  Heads of the 27B-style hybrid (4 KV
heads x 6, d = 256), of Qwen3-8B (8 x 4, d = 128) and of the tiny test models (2 x 2, d = 32);
query rows of a chain (7), a 64-node tree + root (65) and a prefill (causal, one split); every
output checked against float32 attention over the same bf16 values.  Then decode's kernel
(`kernels.attention_decode`, one query row, 64-key splits, the splits merged by the last block) against
the same float32 attention and PyTorch's SDPA, at 77 / 512 / 4096 keys with a random quarter of
the keys masked, for the same heads, an odd head_dim (24, the tiny models') and 16 query heads
per KV head (their P V sums meet in shared memory a few heads a round).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS = [(4, 6, 256), (8, 4, 128), (2, 2, 32)]     # (KV heads, query heads per KV head, head_dim)
CAPACITY = 4352
# (query tokens, keys incl. the new tokens, verification?) -- verification: tree masks, key splits
CASES = [(7, 4096, True), (65, 4096, True), (65, 1000, True), (33, 77, True), (1, 4096, True), (512, 512, False)]
DECODE_HEADS = HEADS + [(2, 3, 24), (4, 16, 128)]     # + the tiny models' odd head_dim, 16 heads a KV head
DECODE_KEYS = (77, 512, 4096)


def _name(kind: str, nkv: int, group: int, d: int, split: int = 0) -> str:
    return f"{kind}_{nkv}_{group}_{d}" + (f"_{split}" if split else "")


def build(out: Path) -> None:
    import tvm

    from specpilot import kernels
    from specpilot.compiler.build import load_cuda_runtime
    if not load_cuda_runtime():
        sys.exit("TVM's CUDA runtime does not load; run with the stub driver (specpilot.compiler.build.cuda_stub_env)")
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    funcs = {}
    for nkv, group, d in HEADS:
        for split, splits in ((kernels.ROWS_SPLIT, kernels.ROWS_SPLITS), (0, 1)):     # verification, prefill
            funcs[_name("rows", nkv, group, d, splits)] = kernels.attention_rows_partial(
                1, 0, 2, nkv, CAPACITY, d, group, "bfloat16", True, split=split, splits=splits)
        funcs[_name("combine", nkv, group, d)] = kernels.attention_combine(nkv, d, group, "bfloat16", True)
    for nkv, group, d in DECODE_HEADS:
        nh = nkv * group        # the builds' form: queries, keys, values in one tensor, the new token written
        for merges in (True, False):     # the splits merged by the last block, or by attention_combine
            funcs[_name("decode" if merges else "decode_split", nkv, group, d)] = kernels.attention_decode(
                1, 0, 2, nkv, CAPACITY, d, group, "bfloat16", q_heads=nh + 2 * nkv, write_at=(nh, nh + nkv),
                merges=merges)
        funcs[_name("combine", nkv, group, d)] = kernels.attention_combine(nkv, d, group, "bfloat16", True)
    with target:
        lib = tvm.compile(tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()}), target=target)
    lib.export_library(str(out))
    # the run side has the TVM runtime alone (no TVMScript to import kernels with): the split travels here
    out.with_suffix(".json").write_text(json.dumps({"split": kernels.ROWS_SPLIT, "splits": kernels.ROWS_SPLITS,
                                                       "chunk": kernels.ATTN_CHUNK}))
    print(f"wrote {out} ({len(funcs)} kernels)")


def _mask(T: int, L: int, tree: bool, gen):
    """(T, L) bool: every token sees the L - T cached keys; among the new ones a random tree's
    ancestors (verification) or the causal triangle (prefill)."""
    import torch
    mask = torch.zeros(T, L, dtype=torch.bool)
    mask[:, :L - T] = True
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)] if tree else \
        list(range(-1, T - 1))
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, L - T + j] = True
            j = parents[j]
    return mask


def run(lib_path: Path, out_dir: Path | None) -> None:
    import torch
    import tvm

    from bench._common import timed_rotating, write
    from specpilot.runtime.engine import import_tvm_runtime
    import_tvm_runtime(gpu=True)
    lib = tvm.runtime.load_module(str(lib_path))
    to_tvm = tvm.runtime.from_dlpack
    sidecar = json.loads(lib_path.with_suffix(".json").read_text())
    verify_split, verify_splits, chunk = sidecar["split"], sidecar["splits"], sidecar["chunk"]
    rows = []

    for nkv, group, d in HEADS:
        gen = torch.Generator().manual_seed(nkv * 1000 + d)
        nh = nkv * group
        pool = (torch.randn(1, 2, 2, nkv, CAPACITY, d, generator=gen)).to(torch.bfloat16).cuda()
        row = torch.tensor([1], dtype=torch.int32).cuda()
        for T, L, tree in CASES:
            S = min(verify_splits, (L + verify_split - 1) // verify_split) if tree else 1
            q = torch.randn(1, T, nh, d, generator=gen).to(torch.bfloat16).cuda()
            mask = _mask(T, L, tree, gen).cuda()
            keys, values = pool[0, 0, 1, :, :L], pool[0, 1, 1, :, :L]                  # (nkv, L, d)
            qh = q[0].transpose(0, 1).reshape(nkv, group * T, d)                           # rows g * T + t
            scores = (qh.float() @ keys.float().transpose(1, 2)).view(nkv, group, T, L) * d ** -0.5
            want = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).view(nkv, group * T, L) @ values.float()
            want = want.view(nh, T, d).transpose(0, 1)                                      # (T, nh, d)
            acc = torch.full((1, nkv, S, T * group, d), float("nan"), device="cuda")
            ml = torch.full((1, nkv, S, T * group, 2), float("nan"), device="cuda")
            out = torch.full((1, T, nh, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            partial = lib[_name("rows", nkv, group, d, verify_splits if tree else 1)]
            combine = lib[_name("combine", nkv, group, d)]
            args = [to_tvm(x) for x in (q, pool, row, mask.view(1, T, L), acc, ml)]
            outs = [to_tvm(acc), to_tvm(ml), to_tvm(out)]

            def ours():
                partial(*args)
                combine(*outs)

            def gathered():      # what builds ran before, in PyTorch
                k, v = pool[0, 0, row.long()][0, :, :L], pool[0, 1, row.long()][0, :, :L]
                s = (qh @ k.transpose(1, 2)).view(nkv, group, T, L) * d ** -0.5
                s = torch.where(mask, s, torch.tensor(float("-inf"), dtype=s.dtype, device="cuda"))
                p = torch.softmax(s.float(), -1).to(torch.bfloat16).view(nkv, group * T, L)
                return p @ v

            def sdpa():
                k, v = pool[0, 0, row.long()][0, :, :L], pool[0, 1, row.long()][0, :, :L]
                return torch.nn.functional.scaled_dot_product_attention(
                    q[0, :, :nh].transpose(0, 1), k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                    attn_mask=mask)

            ours()
            torch.cuda.synchronize()
            err = float(((out[0].float() - want).abs().max() / want.abs().max()).nan_to_num(float("inf")))
            err_gathered = float((gathered().view(nh, T, d).transpose(0, 1).float() - want).abs().max()
                                 / want.abs().max())
            found = {name: timed_rotating(lambda r, fn=fn: fn(), 1)        # the pool stays in the L2 for all three
                     for name, fn in (("rows_kernel", ours), ("gathered_torch", gathered), ("sdpa_torch", sdpa))}
            base = statistics.median(found["rows_kernel"])
            for name, samples in found.items():
                med = statistics.median(samples)
                rows.append({"kv_heads": nkv, "group": group, "head_dim": d, "tokens": T, "keys": L,
                             "mask": "tree" if tree else "causal", "splits": S, "kernel": name, "median_us": med,
                             "min_us": min(samples), "max_us": max(samples), "vs_rows_kernel": med / base,
                             "max_rel_error": err if name == "rows_kernel" else
                             err_gathered if name == "gathered_torch" else None})
            print(f"  heads {nkv}x{group} d={d:3d} T={T:3d} L={L:4d} {'tree ' if tree else 'causal'}: rows kernel "
                  f"{base:7.1f} us (err {err:.1e}; gathered err {err_gathered:.1e})  gathered "
                  f"{statistics.median(found['gathered_torch']):7.1f}  sdpa {statistics.median(found['sdpa_torch']):7.1f}",
                  flush=True)
    decode = _decode(lib, to_tvm, chunk)
    path = write("attention-rows", {"heads": HEADS, "cases": CASES, "capacity": CAPACITY,
                                    "split": verify_split, "splits": verify_splits, "results": rows,
                                    "decode_heads": DECODE_HEADS, "decode_keys": DECODE_KEYS, "chunk": chunk,
                                    "decode": decode}, out_dir)
    print(f"wrote {path}")


def _decode(lib, to_tvm, chunk: int) -> list[dict]:
    """Decode's kernel: one query row per sequence, the keys split in ``chunk``s, a random quarter
    masked (the first and the new key always visible), the sequence in pool row 1 of 2; the new
    token's key and value (heads of q, as the builds pass them) written at slot L - 1 by the
    kernel -- checked bit for bit in the pool after the call."""
    import torch

    from bench._common import timed_rotating
    rows = []
    for nkv, group, d in DECODE_HEADS:
        gen = torch.Generator().manual_seed(nkv * 7 + d)
        nh = nkv * group
        pool = torch.randn(1, 2, 2, nkv, CAPACITY, d, generator=gen).to(torch.bfloat16).cuda()
        row = torch.tensor([1], dtype=torch.int32).cuda()
        for L in DECODE_KEYS:
            S = (L + chunk - 1) // chunk
            q = (torch.randn(1, 1, nh + 2 * nkv, d, generator=gen) * 2).to(torch.bfloat16).cuda()
            new_k, new_v = q[0, 0, nh:nh + nkv], q[0, 0, nh + nkv:]
            mask = torch.rand(L, generator=gen) >= 0.25
            mask[0] = mask[L - 1] = True
            mask = mask.cuda()
            keys, values = pool[0, 0, 1, :, :L].float(), pool[0, 1, 1, :, :L].float()        # (nkv, L, d)
            keys[:, L - 1], values[:, L - 1] = new_k.float(), new_v.float()
            qh = q[0, 0, :nh].view(nkv, group, d).float()
            scores = (qh @ keys.transpose(1, 2)) * d ** -0.5                                  # (nkv, group, L)
            want = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ values).view(nh, d)
            acc = torch.full((1, nkv, S, group, d), float("nan"), device="cuda")
            ml = torch.full((1, nkv, S, group, 2), float("nan"), device="cuda")
            out = torch.full((1, 1, nh, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            decode = lib[_name("decode", nkv, group, d)]
            split, combine = lib[_name("decode_split", nkv, group, d)], lib[_name("combine", nkv, group, d)]
            slot = torch.tensor([[L - 1]], dtype=torch.int32).cuda()
            counters = torch.zeros(nkv, dtype=torch.int32, device="cuda")
            args = [to_tvm(x) for x in (q, pool, row, mask.view(1, 1, L), slot, counters, acc, ml, out)]
            out_split = torch.full_like(out, float("nan"))
            split_args = args[:-1] + [to_tvm(out_split)]
            merged = [to_tvm(x) for x in (acc, ml, out_split)]

            def ours():
                decode(*args)

            def then_combine():     # the builds' form where the merge is large (DECODE_MERGE_MAX)
                split(*split_args)
                combine(*merged)

            def sdpa():
                k, v = pool[0, 0, row.long()][0, :, :L], pool[0, 1, row.long()][0, :, :L]
                return torch.nn.functional.scaled_dot_product_attention(
                    q[0, :, :nh].transpose(0, 1), k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                    attn_mask=mask.view(1, L))

            ours()
            torch.cuda.synchronize()
            then_combine()
            torch.cuda.synchronize()
            same = bool(torch.equal(out.view(torch.int16), out_split.view(torch.int16)))
            err = float(((out[0, 0].float() - want).abs().max() / want.abs().max()).nan_to_num(float("inf")))
            written = bool(torch.equal(pool[0, 0, 1, :, L - 1], new_k) and torch.equal(pool[0, 1, 1, :, L - 1], new_v)
                           and not counters.any())
            found = {name: timed_rotating(lambda r, fn=fn: fn(), 1) for name, fn in (
                ("decode_kernel", ours), ("decode_kernel_then_combine", then_combine), ("sdpa_torch", sdpa))}
            base = statistics.median(found["decode_kernel"])
            for name, samples in found.items():
                med = statistics.median(samples)
                rows.append({"kv_heads": nkv, "group": group, "head_dim": d, "keys": L, "splits": S, "kernel": name,
                             "median_us": med, "min_us": min(samples), "max_us": max(samples),
                             "vs_decode_kernel": med / base,
                             "max_rel_error": err if name == "decode_kernel" else None,
                             "new_key_value_written": written if name == "decode_kernel" else None,
                             "same_bits_as_decode_kernel": same if name == "decode_kernel_then_combine" else None})
            print(f"  decode heads {nkv}x{group} d={d:3d} L={L:4d}: decode kernel {base:6.1f} us (err {err:.1e}, "
                  f"new k/v {'written' if written else 'NOT WRITTEN (or counters left set)'})  "
                  f"+combine {statistics.median(found['decode_kernel_then_combine']):6.1f} "
                  f"({'same bits' if same else 'BITS DIFFER'})  sdpa {statistics.median(found['sdpa_torch']):6.1f}",
                  flush=True)
    return rows


if __name__ == "__main__":
    from bench._common import build_or_run
    build_or_run(build, run)
