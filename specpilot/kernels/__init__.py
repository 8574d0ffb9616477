"""TIR kernels the lowering calls where Relax has no operator, one file per family (mlc-llm's
``op/``): the KV-cache pool, decode attention, many-row attention and the merge of key splits,
Gated DeltaNet (chain, tree, commit, conv windows, q / k / v heads), the W12 GEMM, the norms and sampling's
keyed Gumbel scores; a packed verification's row gathers (`rows`, a tensor expression).

Each kernel comes in a CPU form (plain loops, the outer ones parallel) and a GPU form (the same
loops bound to blocks and threads); both compute the same thing in the same order, so the
reference comparisons in the tests hold for either.  ``gpu`` picks the form.  The exceptions: the
gated delta rule's GPU form splits d_k over threads and sums partial dot products (float32
rounding apart, the same arithmetic), and the GPU forms of attention are flash attention (decode:
CUDA cores, one row; many rows: tensor cores, P rounded to the value dtype before P V) -- checked
against PyTorch on the H200 (bench/tree_verify.py, bench/attention_rows.py) and by bf16 token
forcing (bench/gpu_forcing.py).
"""

from specpilot.kernels.attention_decode import ATTN_CHUNK, DECODE_MERGE_MAX, attention_decode
from specpilot.kernels.attention_merge import ATTN_FLOOR, attention_combine
from specpilot.kernels.attention_rows import (ROWS_KEYS, ROWS_SPLIT, ROWS_SPLITS, ROWS_WARPS, attention_rows_partial,
                                              key_splits, rows_kernel_fits)
from specpilot.kernels.base import memo
from specpilot.kernels.choice import PARTS as ARGMAX_PARTS
from specpilot.kernels.choice import argmax_merge, argmax_parts, argmax_rows, rank_rows
from specpilot.kernels.gdn import (gated_delta_rule, gdn_commit, gdn_conv_prefill, gdn_conv_verify, record_width,
                                   select_token)
from specpilot.kernels.gdn_heads import gdn_heads
from specpilot.kernels.kv_cache import compact_kv, kv_write
from specpilot.kernels.sampling import sample_scores
from specpilot.kernels.w12_gemm import w12_gemm

__all__ = ["ATTN_CHUNK", "ATTN_FLOOR", "DECODE_MERGE_MAX", "ROWS_KEYS", "ROWS_SPLIT", "ROWS_SPLITS", "ROWS_WARPS",
           "ARGMAX_PARTS", "argmax_merge", "argmax_parts", "argmax_rows", "rank_rows", "attention_combine", "attention_decode", "attention_rows_partial", "compact_kv",
           "gated_delta_rule", "gdn_commit", "gdn_conv_prefill", "gdn_conv_verify", "gdn_heads", "key_splits", "kv_write", "memo", "record_width",
           "rows_kernel_fits", "sample_scores", "select_token", "w12_gemm"]
