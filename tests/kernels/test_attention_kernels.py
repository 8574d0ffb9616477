"""Attention read straight from the KV pool, split over the keys: `kernels.attention_rows_partial`
(any number of query rows: decode on the CPU, prefill and verification) and `attention_combine`.
The CPU form against softmax(q k^T / sqrt(d)) v computed in numpy from the same pool rows, on odd
sizes (head_dim 24 / 10, groups of 3, key counts that do not fill the last split, splits of odd
length), ancestor-style masks that differ per token, sequences on other pool rows than their
batch index, and outputs poisoned with NaN beforehand.  The GPU forms (decode's, and the rows
kernel's flash attention on tensor cores) compile to sm_90 without a GPU; their numbers are checked
on the H200 by bench/attention_rows.py (against PyTorch) and by bf16 token forcing
(bench/gpu_forcing.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specpilot import kernels
from tests.kernel_helpers import run_cpu as _run, sm90_source


def _reference(q, kv, layer, row, mask, group):
    B, T, nh, d = q.shape
    out = np.zeros((B, T, nh, d))
    for b in range(B):
        for t in range(T):
            for h in range(nh):
                keys = kv[layer, 0, row[b], h // group, :mask.shape[2]].astype("float64")
                values = kv[layer, 1, row[b], h // group, :mask.shape[2]].astype("float64")
                scores = keys @ q[b, t, h].astype("float64") / np.sqrt(d)
                scores[~mask[b, t]] = -np.inf
                p = np.exp(scores - scores.max())
                out[b, t, h] = (p / p.sum()) @ values
    return out


@pytest.mark.parametrize("seed,T,L,d,group,masked,split,splits", [
    (0, 1, 70, 24, 3, 0.0, kernels.ATTN_CHUNK, 0),   # decode on the CPU: one token, decode's splits
    (1, 1, 129, 16, 1, 0.3, kernels.ATTN_CHUNK, 0),
    (2, 5, 5, 32, 4, 0.5, kernels.ATTN_CHUNK, 0),
    (3, 7, 64, 24, 2, 0.0, 16, 0),
    (4, 17, 83, 10, 3, 0.6, 7, 0),                    # a tree: each token its own set of keys
    (5, 3, 40, 12, 2, 0.2, 0, 1),                     # prefill: one split of all the keys
    (6, 9, 83, 24, 3, 0.4, 0, 16),                    # 16 splits of 6 keys, the last empty
    (7, 5, 7, 16, 2, 0.3, 0, 16),                     # fewer keys than splits: most splits empty
    (8, 9, 83, 24, 3, 0.4, 8, 4),                     # splits of >= 8 keys, at most 4: 4 of 21
    (9, 9, 29, 24, 3, 0.4, 8, 16),                    # ... at most 16: 4 of 8
    (10, 3, 150, 64, 3, 0.3, 0, 1),                   # the CPU form's chunks of keys: 64 + 64 + 22
    (11, 4, 157, 40, 2, 0.5, 100, 0),                 # chunks that do not align with the splits
    (12, 2, 90, 5, 2, 0.2, 0, 1),                     # a head dimension below one vector
    (13, 3, 150, 16, 2, "gap", 0, 1),                 # a row that sees a chunk, none of the next, then one key
])
def test_attention_from_the_pool_matches_softmax_attention(seed, T, L, d, group, masked, split, splits):
    rng = np.random.default_rng(seed)
    n_layers, layer, rows, n_kv, cap, B = 3, 1, 4, 2, 160, 3
    kv = rng.standard_normal((n_layers, 2, rows, n_kv, cap, d)).astype("float32")
    q = rng.standard_normal((B, T, n_kv * group, d)).astype("float32") * 2
    row = np.array([2, 0, 3], "int32")              # sequence b lives in pool row row[b]
    if masked == "gap":     # keys 0..63 and 140 visible, nothing in 64..127: the larger max comes late
        mask = np.zeros((B, T, L), bool)
        mask[:, :, :64] = True
        mask[:, :, 140] = True
        kv[layer, 0, :, :, 140] *= 6.0
    else:
        mask = rng.uniform(size=(B, T, L)) >= masked
    mask[:, :, 0] = True                            # every query sees at least one key
    S = min(splits or L, (L + split - 1) // split) if split else splits
    acc, ml = _run(kernels.attention_rows_partial(n_layers, layer, rows, n_kv, cap, d, group, "float32", False,
                                                  split=split, splits=splits), [q, kv, row, mask],
                   [((B, n_kv, S, T * group, d), "float32"), ((B, n_kv, S, T * group, 2), "float32")])
    assert not np.isnan(acc).any() and not np.isnan(ml).any()
    (out,) = _run(kernels.attention_combine(n_kv, d, group, "float32", False), [acc, ml],
                  [((B, T, n_kv * group, d), "float32")])
    np.testing.assert_allclose(out, _reference(q, kv, layer, row, mask, group), rtol=2e-5, atol=2e-6)


def test_rows_kernel_refuses_heads_its_gpu_form_cannot_tile():
    assert kernels.rows_kernel_fits(256, "bfloat16") and kernels.rows_kernel_fits(32, "float16")
    assert not kernels.rows_kernel_fits(24, "bfloat16") and not kernels.rows_kernel_fits(128, "float32")
    with pytest.raises(ValueError, match="head_dim % 32"):
        kernels.attention_rows_partial(1, 0, 1, 2, 64, 24, 2, "bfloat16", True, splits=16)
    with pytest.raises(ValueError, match="split"):
        kernels.attention_rows_partial(1, 0, 1, 2, 64, 32, 2, "float32", False)


@pytest.mark.slow
def test_attention_gpu_forms_compile_to_sm90_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot import kernels",
                       "{'partial': kernels.attention_decode(2, 1, 3, 8, 256, 128, 4, 'bfloat16'), "
                       "'rows': kernels.attention_rows_partial(1, 0, 1, 4, 4352, 256, 6, 'bfloat16', True, split=256, splits=16), "

                       "'combine': kernels.attention_combine(8, 128, 4, 'bfloat16', True)}")
    assert "__shfl_xor_sync" in text and "partial_kernel" in text and "combine_kernel" in text
    decode = text[text.index("void __launch_bounds__(128) partial_kernel("):]
    decode = decode[:decode.index("\n}\n")]
    # d = 128: a key row is 16 lanes' 16-byte loads; the block's 8 key groups take 8 keys each, the
    # 8 key rows and the 8 value rows all loaded before the first product (one DRAM round trip)
    assert decode.count("*(uint4*)(kv_ptr") == 16 and decode.count("__syncthreads()") >= 3
    assert decode.rindex("*(uint4*)(kv_ptr") < decode.index("__shfl_xor_sync")
    assert decode.rindex("mask_ptr[") < decode.index("__syncthreads()")
    # 16 query heads per KV head (Qwen3-235B-style): the P V partial sums meet a few heads a round,
    # so the block's static shared memory stays under 48 KB
    wide = sm90_source(tmp_path, "from specpilot import kernels",
                       "{'partial': kernels.attention_decode(1, 0, 1, 4, 512, 128, 16, 'bfloat16')}")
    shared = [int(n) for n in re.findall(r"__shared__ alignas\(64\) float \w+\[(\d+)\]", wide)]
    assert shared and 4 * sum(shared) <= 48 * 1024
    # the builds' form: q holds the new token's keys and values too, and the kernel writes them into
    # the pool (kv_write's work); the key rows it reads are still all loaded before the first product
    writing = sm90_source(tmp_path, "from specpilot import kernels",
                          "{'partial': kernels.attention_decode(2, 1, 3, 8, 256, 128, 4, 'bfloat16', "
                          "q_heads=48, write_at=(32, 40))}")
    writing = writing[writing.index("partial_kernel("):]
    writing = writing[:writing.index("\n}\n")]
    stores = [line for line in writing.splitlines() if line.strip().startswith("kv_ptr[") and "] = q_ptr[" in line]
    assert writing.count("*(uint4*)(kv_ptr") == 16 and len(stores) == 2
    # and merges the splits in the last block to finish: a fence, the counter, the merge's exps, the reset
    tail = writing[writing.index("tvm_builtin_cuda_atomic_add("):]
    assert "tvm_builtin_cuda_thread_fence()" in writing[:writing.index("tvm_builtin_cuda_atomic_add(")]
    assert "__expf" in tail or "expf(" in tail
    assert re.search(r"counters_ptr\[[^;]*\] = 0;", tail) and "o_ptr[" in tail
    # without the merge (wide query groups: attention_combine's own kernel) no counter, no fence
    split = sm90_source(tmp_path, "from specpilot import kernels",
                        "{'partial': kernels.attention_decode(1, 0, 1, 4, 512, 256, 6, 'bfloat16', q_heads=32, "
                        "write_at=(24, 28), merges=False)}")
    split = split[split.index("partial_kernel("):]
    assert "atomic_add(" not in split[:split.index("\n}\n")] and "kv_ptr[" in split
    rows = text[text.index("void __launch_bounds__(128) rows_kernel("):]
    # d = 256, 32 keys per chunk: 2 x 8 x 4 mma for S, 2 x 16 x 2 for O; V through ldmatrix.trans
    assert rows.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 128
    assert rows.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 32
    assert "ptx_cp_async_cg" in rows and "cp.async.cg.shared.global" in text
    # the float16 form (a module of its own: CUDA wants one type per extern shared array name)
    half = sm90_source(tmp_path, "from specpilot import kernels",
                       "{'rows': kernels.attention_rows_partial(1, 0, 1, 2, 512, 64, 2, 'float16', True, splits=1)}")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in half and "ldmatrix" in half


@pytest.mark.parametrize("head_dim,dtype,rows_kernel", [(32, "bfloat16", True), (24, "bfloat16", False),
                                                        (32, "float32", False)])
@pytest.mark.slow
def test_gpu_lowering_reads_the_pool_in_place_where_the_rows_kernel_serves(head_dim, dtype, rows_kernel):
    """GPU lowering: prefill and verify attention through `attention_rows_partial` (verify with capped
    key splits, prefill with one) when its GPU form serves the heads (bf16 / fp16, head_dim % 32 == 0),
    else through gathered keys and matmuls; decode through the decode kernel either way; the CPU
    lowering verifies through decode's own kernels in float32 (its splits, the same functions) and keeps
    the gathered form in 16 bits."""
    import tvm
    from tvm import relax

    from specpilot.compiler.lower import lower_deployment
    from tests.conftest import DENSE, tiny_config
    cfg = tiny_config(DENSE, head_dim=head_dim)

    def called(mod, fn):
        """The kernels (call_tir) and Relax operators a function calls."""
        names = set()

        def visit(e):
            if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
                names.add(e.args[0].name_hint if e.op.name.startswith("relax.call_tir") else e.op.name)
        relax.analysis.post_order_visit(mod[fn].body, visit)
        return names

    gpu, _ = lower_deployment(cfg, None, dtype, 256, gpu=True)
    for fn in ("target_prefill", "target_verify"):
        names = called(gpu, fn)
        assert any(n.startswith("attention_rows") for n in names) == rows_kernel, (fn, names)
        assert ("relax.nn.softmax" in names) != rows_kernel, (fn, names)    # the gathered form's softmax
    assert any(n.startswith("attention_decode") for n in called(gpu, "target_decode"))
    cpu, _ = lower_deployment(cfg, None, dtype, 256, gpu=False)
    decode = {n for n in called(cpu, "target_decode") if n.startswith("attention_decode")}   # the rows kernel's loop
    verify = {n for n in called(cpu, "target_verify") if n.startswith(("attention_rows", "attention_decode"))}
    assert decode and (verify == decode) == (dtype == "float32")     # float32 verification: decode's kernels
    assert ("relax.nn.softmax" in called(cpu, "target_verify")) == (dtype != "float32")


def test_cpu_verification_rows_are_decode_rows_bit_for_bit():
    """On the CPU verification takes decode's splits, so row t of a causal T-row pass over base + T keys is
    exactly what decode computes for that query over its base + t + 1 keys (keys it may not see add
    nothing, splits it sees none of merge with weight 0): equal bit for bit, across split boundaries."""
    rng = np.random.default_rng(21)
    n_layers, layer, rows, n_kv, cap, d, group, base, T = 2, 1, 2, 2, 256, 24, 3, 100, 40
    kv = rng.standard_normal((n_layers, 2, rows, n_kv, cap, d)).astype("float32")
    q = rng.standard_normal((1, T, n_kv * group, d)).astype("float32")
    row = np.array([1], "int32")

    def attend(qs, L, mask):
        S = (L + kernels.ATTN_CHUNK - 1) // kernels.ATTN_CHUNK
        t = qs.shape[1]
        acc, ml = _run(kernels.attention_rows_partial(n_layers, layer, rows, n_kv, cap, d, group, "float32", False,
                                                      split=kernels.ATTN_CHUNK), [qs, kv, row, mask],
                       [((1, n_kv, S, t * group, d), "float32"), ((1, n_kv, S, t * group, 2), "float32")])
        return _run(kernels.attention_combine(n_kv, d, group, "float32", False), [acc, ml],
                    [((1, t, n_kv * group, d), "float32")])[0]

    L = base + T
    causal = np.arange(L)[None, :] <= (base + np.arange(T))[:, None]
    verified = attend(q, L, causal[None])
    for t in range(T):
        decoded = attend(q[:, t:t + 1], base + t + 1, np.ones((1, 1, base + t + 1), bool))
        assert np.array_equal(verified[:, t], decoded[:, 0]), t


def test_the_cpu_form_reads_bf16_pools():
    """bf16 CPU builds decode through the same loop: q and the pool in bfloat16, sums in float32, the merged
    output rounded once to bfloat16 -- against softmax attention over the same bf16 values in float64."""
    import ml_dtypes
    rng = np.random.default_rng(31)
    n_layers, layer, rows, n_kv, cap, d, group, T, L = 2, 0, 2, 2, 160, 40, 2, 3, 150
    kv = rng.standard_normal((n_layers, 2, rows, n_kv, cap, d)).astype(ml_dtypes.bfloat16)
    q = (rng.standard_normal((1, T, n_kv * group, d)) * 2).astype(ml_dtypes.bfloat16)
    row = np.array([1], "int32")
    mask = rng.uniform(size=(1, T, L)) >= 0.3
    mask[:, :, 0] = True
    S = (L + kernels.ATTN_CHUNK - 1) // kernels.ATTN_CHUNK
    acc, ml = _run(kernels.attention_rows_partial(n_layers, layer, rows, n_kv, cap, d, group, "bfloat16", False,
                                                  split=kernels.ATTN_CHUNK), [q, kv, row, mask],
                   [((1, n_kv, S, T * group, d), "float32"), ((1, n_kv, S, T * group, 2), "float32")])
    (out,) = _run(kernels.attention_combine(n_kv, d, group, "bfloat16", False), [acc, ml],
                  [((1, T, n_kv * group, d), ml_dtypes.bfloat16)])
    want = _reference(q.astype("float32"), kv.astype("float32"), layer, row, mask, group)
    np.testing.assert_allclose(out.astype("float32"), want, rtol=1e-2, atol=1e-2)    # one bf16 rounding
