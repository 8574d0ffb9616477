"""The batch-1 decode GEMV with the RMSNorm as its prologue (`schedules.decode_gemv`).

On the CPU: the substitution through the real GPU pipeline (`relax_pipeline.pipeline(sm_90,
"skinny-mma")`) on small Relax modules -- a norm read only by one-row projections disappears into
them (with their cast / residual epilogues), a norm with another reader stays, symbolic rows and
rows of partial 16-byte pieces are not the kernel's -- and the kernel's CUDA for sm_90 (weights
loaded before the staging barrier, the norm's sum before it, ragged rows and columns guarded).
Its numbers are checked on the GPU against torch (bench/decode_gemv.py) and by bf16 token forcing
of builds that use it (bench/gpu_forcing.py); the CPU builds do not run it.
"""

from __future__ import annotations

import json
import re

import pytest
import tvm
from tvm import relax, tirx

from specpilot.kernels.norms import NORM_ATTR, rms_norm_te
from specpilot.schedules.decode_gemv import THREADS, resident_blocks, rows_per_warp
from specpilot.schedules.relax_pipeline import pipeline
from tests.kernel_helpers import sm90_source

NORM = {"eps": 1e-6, "zero_centered": False, "spelled": False}


def _kernels(tail, hidden: int = 128, rows=1):
    """main(x[rows, hidden], g, W_q[256, hidden], W_k[64, hidden], r) through the skinny-mma GPU pipeline:
    n = RMSNorm(x; g) (with `lower.NORM_ATTR`), then ``tail(bb, n, x, ws, r)``; the kernel names."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([rows, hidden], "bfloat16"))
    g = relax.Var("g", relax.TensorType([hidden], "bfloat16"))
    ws = [relax.Var("wq", relax.TensorType([256, hidden], "bfloat16")),
          relax.Var("wk", relax.TensorType([64, hidden], "bfloat16"))]
    r = relax.Var("r", relax.TensorType([rows, 256], "bfloat16"))
    with bb.function("main", [x, g, *ws, r]):
        with bb.dataflow():
            n = bb.emit_te(rms_norm_te(NORM["eps"], False, "bfloat16", False), x, g, primfunc_name_hint="rms_norm",
                           primfunc_attrs={NORM_ATTR: json.dumps(NORM)})
            out = bb.emit_output(tail(bb, n, x, ws, r))
        bb.emit_func_output(out)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with target:
        mod = pipeline(target, "skinny-mma")(bb.get())
    return sorted(gv.name_hint for gv, f in mod.functions.items()
                  if isinstance(f, tirx.PrimFunc) and not gv.name_hint.startswith("shape_func"))


def _proj(bb, n, w):
    return bb.emit(relax.op.astype(bb.emit(relax.op.matmul(n, relax.op.permute_dims(w), out_dtype="float32")),
                                   "bfloat16"))


def test_the_norm_becomes_the_projections_prologue_with_its_epilogue():
    """Norm -> projection -> cast -> residual add: one kernel, the norm's own gone."""
    kernels = _kernels(lambda bb, n, x, ws, r: relax.op.add(_proj(bb, n, ws[0]), r))
    assert kernels == ["decode_gemv_norm_256_128_fused_cast_add"], kernels


def test_a_norm_read_by_several_projections_is_computed_in_each():
    """Unfused q / k projections of one norm: each GEMV normalizes x itself; no norm kernel is left."""
    kernels = _kernels(lambda bb, n, x, ws, r: relax.Tuple([_proj(bb, n, ws[0]), _proj(bb, n, ws[1])]))
    assert not [k for k in kernels if "rms_norm" in k], kernels
    assert len([k for k in kernels if k.startswith("decode_gemv_norm_256_128")]) == 1, kernels
    assert len([k for k in kernels if k.startswith("decode_gemv_norm_64_128")]) == 1, kernels


def test_a_norm_with_another_reader_stays_a_kernel():
    """The norm's output also read by an add: it stays, and the projection reads it (plain GEMV)."""
    kernels = _kernels(lambda bb, n, x, ws, r: relax.Tuple([
        _proj(bb, n, ws[0]), bb.emit(relax.op.add(n, x))]))
    assert any("rms_norm" in k for k in kernels), kernels
    assert any(k.startswith("decode_gemv_256_128") for k in kernels), kernels
    assert not any(k.startswith("decode_gemv_norm") for k in kernels), kernels


def test_symbolic_rows_and_partial_pieces_are_not_the_kernels():
    """Decode batches / verification (symbolic rows) keep the skinny tensor-core kernel and the norm;
    a row that is not whole 16-byte pieces (hidden 100) keeps dlight's GEMV and the norm."""
    batch = _kernels(lambda bb, n, x, ws, r: relax.op.add(_proj(bb, n, ws[0]), r), rows=tirx.Var("m", "int64"))
    assert not any(k.startswith("decode_gemv") for k in batch) and any("rms_norm" in k for k in batch), batch
    odd = _kernels(lambda bb, n, x, ws, r: relax.op.add(_proj(bb, n, ws[0]), r), hidden=100)
    assert not any(k.startswith("decode_gemv") for k in odd) and any("rms_norm" in k for k in odd), odd


@pytest.mark.parametrize("n_out", [200, 4096, 6144, 24576, 151936])
def test_rows_per_warp_keep_the_grid_within_one_wave(n_out):
    """Every warp the same rows, the grid at most one wave of resident blocks (no tail wave), with
    the fewest rows a warp that allow it (one fewer would need a second wave)."""
    def blocks(rpw):
        return -(-n_out // (THREADS // 32 * rpw))
    rpw = rows_per_warp(n_out)
    assert blocks(rpw) <= resident_blocks()
    assert rpw == 1 or blocks(rpw - 1) > resident_blocks()


def test_kernel_compiles_to_sm90_without_a_gpu(tmp_path):
    """Qwen3-8B's fused qkv with the norm, the down projection plain, and a ragged tiny shape (K = 96:
    12 pieces a row, N = 200: the last block's rows past N clamp their loads and store nothing)."""
    norm = json.dumps(NORM)
    text = sm90_source(tmp_path, "from specpilot.schedules.decode_gemv import decode_gemv",
                       f"{{'qkv': decode_gemv(6144, 4096, {norm!r}), 'down': decode_gemv(4096, 12288), "
                       f"'tiny': decode_gemv(200, 96, {norm!r})}}")

    def body(name):
        start = re.search(rf"void __launch_bounds__\({THREADS}\) {name}_kernel\([^)]*\) {{", text).end()
        return text[start:text.index("\n}\n", start)]
    qkv = body("qkv")
    barrier = qkv.index("__syncthreads()")
    # the first chunk's four 16-byte weight loads issued before the row of x is staged and normed
    assert qkv[:barrier].count("*(uint4*)(w_ptr") == 4 and qkv.index("*(uint4*)(w_ptr") < qkv.index("x_ptr")
    # the sum of squares: a warp butterfly before the barrier, then every warp's partial
    assert qkv[:barrier].count("__shfl_xor_sync") == 5 and "sqrtf" in qkv[barrier:] and "g_ptr" in qkv
    assert qkv.count("__syncthreads()") == 2
    down = body("down")
    # the plain form: the row copied to shared memory as it is (16-byte pieces: TVM types it uint4)
    assert "sqrtf" not in down and re.search(r"__shared__ alignas\(64\) (nv_bfloat16 xs_ptr\[12288\]|uint4 xs_ptr\[1536\])", down)
    tiny = body("tiny")
    assert "min(lane_ptr[0], 11)" in tiny and re.search(r"< 200\)|< 25\)", tiny), tiny[-600:]


def test_swiglu_over_a_fused_gate_up_projection_joins_its_gemv():
    """norm -> fused gate / up (2 x 128 rows) -> silu(gate) * up: one paired kernel, the norm, the
    activation and the float32 gate / up output gone."""
    def swiglu(bb, n, x, ws, r):
        gu = bb.emit(relax.op.matmul(n, relax.op.permute_dims(ws[0]), out_dtype="float32"))   # (1, 256)
        gate = bb.emit(relax.op.astype(bb.emit(relax.op.strided_slice(gu, axes=[1], begin=[0], end=[128])), "bfloat16"))
        up = bb.emit(relax.op.astype(bb.emit(relax.op.strided_slice(gu, axes=[1], begin=[128], end=[256])), "bfloat16"))
        return relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up)
    kernels = _kernels(swiglu)
    assert len(kernels) == 1 and kernels[0].startswith("decode_gemv_norm_256_128_fused_"), kernels


def test_the_paired_store_becomes_one_store_of_the_activation(tmp_path):
    """The fused kernel's CUDA: one bf16 store of silu(gate) * up per pair, no float32 output."""
    setup = (
        "import json\n"
        "from tvm import relax\n"
        "from specpilot.kernels.norms import NORM_ATTR, rms_norm_te\n"
        "from specpilot.schedules.relax_pipeline import pipeline\n"
        "norm = {'eps': 1e-6, 'zero_centered': False, 'spelled': False}\n"
        "bb = relax.BlockBuilder()\n"
        "x = relax.Var('x', relax.TensorType([1, 4096], 'bfloat16'))\n"
        "g = relax.Var('g', relax.TensorType([4096], 'bfloat16'))\n"
        "w = relax.Var('w', relax.TensorType([24576, 4096], 'bfloat16'))\n"
        "with bb.function('main', [x, g, w]):\n"
        "    with bb.dataflow():\n"
        "        n = bb.emit_te(rms_norm_te(1e-6, False, 'bfloat16', False), x, g, primfunc_name_hint='rms_norm',\n"
        "                       primfunc_attrs={NORM_ATTR: json.dumps(norm)})\n"
        "        gu = bb.emit(relax.op.matmul(n, relax.op.permute_dims(w), out_dtype='float32'))\n"
        "        gate = bb.emit(relax.op.astype(bb.emit(relax.op.strided_slice(gu, axes=[1], begin=[0], end=[12288])), 'bfloat16'))\n"
        "        up = bb.emit(relax.op.astype(bb.emit(relax.op.strided_slice(gu, axes=[1], begin=[12288], end=[24576])), 'bfloat16'))\n"
        "        out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))\n"
        "    bb.emit_func_output(out)\n"
        "t0 = tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90'})\n"
        "with t0:\n"
        "    mod = pipeline(t0, 'skinny-mma')(bb.get())\n"
        "fused = {gv.name_hint: f for gv, f in mod.functions.items() if gv.name_hint.startswith('decode_gemv')}\n"
        "assert len(fused) == 1, list(fused)\n")
    text = sm90_source(tmp_path, setup, "{'swiglu': list(fused.values())[0]}")
    start = re.search(rf"void __launch_bounds__\({THREADS}\) swiglu_kernel\(([^)]*)\) {{", text)
    assert start and "float*" not in start.group(1), start and start.group(1)
    body = text[start.end():text.index("\n}\n", start.end())]
    params = re.findall(r"(\w+)\* __restrict__ (\w+)", start.group(1))
    stores = [line for line in body.splitlines() for _, name in params if line.strip().startswith(f"{name}[")]
    assert len(stores) == 1 and "expf" in stores[0] and [t for t, n in params if stores[0].strip().startswith(n)] == \
        ["nv_bfloat16"], stores
