"""Skinny tensor-core GEMMs (`schedules.skinny_mma`): which shapes a configuration tiles, which
PrimFuncs count as a plain bf16 NT matmul, the Relax substitution (before/expected, must not
fire), and the kernel compiling to sm_90 mma.sync code without a GPU.  Its numbers are checked
on the H200 against the float32 product (bench/skinny_gemm.py) and by bf16 token forcing of
skinny-mma builds (bench/gpu_forcing.py)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import tvm
from tvm import relax

from specpilot.schedules.skinny_config import Config, WIDE, applicable, pick
from specpilot.schedules.skinny_kernels import skinny_nt_matmul
from specpilot.schedules.skinny_mma import nt_matmul_shape, substitute
from specpilot.schedules.tensor_core import nt_matmul
from tests.kernel_helpers import sm90_source


def test_configurations_tile_only_what_they_divide():
    assert Config(1, 1, 1, 8).fits(5120, 5120) and not Config(1, 1, 1, 8).fits(5120, 96)
    assert Config(9, 2, 2, 2).block_n() == 64 and Config(9, 2, 2, 2).block_m() == 72
    chosen = pick(17408, 5120)
    assert [limit for limit, _ in chosen] == [8, 16, 32, None] and all(cfg.stages for _, cfg in chosen)
    assert all(cfg.fits(17408, 5120) for _, cfg in chosen) and chosen[2][1].block_n() == 128   # N >= 64 x SMs
    assert pick(5120, 17408)[2][1].block_n() == 64      # fewer channels: narrower blocks, more of them
    # K = 96: only one warp along K divides it; N = 48: one 16-row tile per warp -- the register kernel
    assert pick(48, 96) == [(8, Config(2, 1, 1, 1, 4)), (16, Config(2, 1, 1, 1, 4)), (32, Config(4, 1, 1, 1, 2)),
                            (None, Config(9, 1, 1, 1, 2))]
    # a ring too large for a block's shared memory does not fit
    big = Config(9, 2, 8, 1, 4, stages=8)
    assert big.shared_bytes(4096) > 227 * 1024 and not big.fits(4096, 4096)
    # ... and so does a K that is one chunk (the register kernel takes it)
    one = Config(9, 1, 2, 2, 2, stages=3)
    assert one.chunk(64) == 64 and not one.fits(128, 64) and not one.fits(128, 128) and one.fits(128, 256)
    assert pick(128, 64)[-1][1].stages == 0 and pick(128, 5120)[-1][1].stages == 3
    assert not applicable(203, 96) and not applicable(96, 203) and not applicable(8, 64)


def test_plain_bf16_nt_matmuls_are_recognised():
    assert nt_matmul_shape(nt_matmul(384, 256)) == (384, 256)


def test_one_static_row_stays_with_the_gemv_and_more_take_the_tensor_core_kernel():
    """A decode step's one row is `decode_gemv`'s; a fixed-size verification's 33 static rows are ours."""
    assert nt_matmul_shape(nt_matmul(384, 256, rows=1)) is None
    assert nt_matmul_shape(nt_matmul(384, 256, rows=33)) == (384, 256)


def _fused_matmul_cast():
    """An NT matmul with a cast fused after it: two blocks, not a plain matmul."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def f(x_h: T.handle, w: T.Buffer((T.int64(64), T.int64(32)), "bfloat16"), y_h: T.handle):
        m = T.int64()
        x = T.match_buffer(x_h, (m, T.int64(32)), "bfloat16")
        y = T.match_buffer(y_h, (m, T.int64(64)), "bfloat16")
        acc = T.sblock_alloc_buffer((m, T.int64(64)), "float32")
        for i, j, k in T.grid(m, T.int64(64), T.int64(32)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    acc[vi, vj] = T.float32(0)
                acc[vi, vj] = acc[vi, vj] + T.Cast("float32", x[vi, vk]) * T.Cast("float32", w[vj, vk])
        for i, j in T.grid(m, T.int64(64)):
            with T.sblock("cast"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast("bfloat16", acc[vi, vj])
    return f


def _transposed_x():
    """x read as x[k, i]: same shapes and dtypes, a different product."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def f(x: T.Buffer((T.int64(32), T.int64(32)), "bfloat16"), w: T.Buffer((T.int64(64), T.int64(32)), "bfloat16"),
          y: T.Buffer((T.int64(32), T.int64(64)), "float32")):
        for i, j, k in T.grid(T.int64(32), T.int64(64), T.int64(32)):
            with T.sblock("NT_matmul"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    y[vi, vj] = T.float32(0)
                y[vi, vj] = y[vi, vj] + T.Cast("float32", x[vk, vi]) * T.Cast("float32", w[vj, vk])
    return f


@pytest.mark.parametrize("case", ["fp32", "fp16", "fused epilogue", "transposed x"])
def test_other_functions_are_not_plain_bf16_nt_matmuls(case):
    func = {"fp32": lambda: nt_matmul(64, 32, "float32"), "fp16": lambda: nt_matmul(64, 32, "float16"),
            "fused epilogue": _fused_matmul_cast, "transposed x": _transposed_x}[case]()
    assert nt_matmul_shape(func) is None


def _module(n_out: int, k_in: int):
    """x[m, k] . W^T as Relax legalizes it, with a symbolic row count."""
    bb = relax.BlockBuilder()
    m = tvm.tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType([m, k_in], "bfloat16"))
    w = relax.Var("w", relax.TensorType([n_out, k_in], "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32"))
            out = bb.emit_output(relax.op.astype(y, "bfloat16"))
        bb.emit_func_output(out)
    seq = tvm.transform.Sequential([relax.transform.FuseTransposeMatmul(), relax.transform.LegalizeOps()])
    return seq(bb.get())


def _callees(mod) -> list[str]:
    call_tir = tvm.ir.Op.get("relax.call_tir")
    names = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            v = binding.value
            if isinstance(v, relax.Call) and v.op.same_as(call_tir):
                names.append(v.args[0].name_hint)
    return names


def test_substitution_points_the_matmul_at_the_kernel():
    mod = _module(96, 64)
    assert any("NT_matmul" in n for n in _callees(mod))
    out, swapped = substitute(mod)
    assert swapped == 1
    callees = _callees(out)
    assert callees[0] == "skinny_mma_96_64" and not any("NT_matmul" in n for n in callees)
    kernel = out[out.get_global_var("skinny_mma_96_64")]
    assert kernel.attrs["tirx.is_scheduled"] and int(kernel.attrs["op_pattern"]) == 8
    # the call passes x and W only; the result keeps its type
    call = out["main"].body.blocks[0].bindings[0].value
    assert len(call.args[1].fields) == 2 and str(call.ty) == str(mod["main"].body.blocks[0].bindings[0].value.ty)
    assert not [gv for gv in out.get_global_vars() if gv.name_hint.startswith("NT_matmul")]


def test_substitution_leaves_shapes_no_configuration_tiles():
    mod = _module(203, 64)
    out, swapped = substitute(mod)
    assert swapped == 0
    tvm.ir.assert_structural_equal(out, mod)


def test_kernel_compiles_to_sm90_mma_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot.schedules.skinny_kernels import skinny_nt_matmul",
                       "{'mm': skinny_nt_matmul(48, 96)}")
    assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 3   # one per M configuration
    # the operands are addressed in bf16 elements: their local arrays must be bf16, not vector-typed
    assert "nv_bfloat16 bf_ptr[" in text and "nv_bfloat16 af_ptr[" in text and "uint4 bf_ptr" not in text


def test_pipelined_configurations_compile_to_cp_async_mma_without_a_gpu(tmp_path):
    """The pipelined kernel (Config.stages): cp.async copies into dynamic shared memory, a
    wait per chunk, and tensor-core mma; with split-K inside the block (partial sums meet in
    shared memory) and without (accumulators stored directly)."""
    text = sm90_source(
        tmp_path, "from specpilot.schedules.skinny_config import Config; from specpilot.schedules.skinny_kernels import skinny_nt_matmul",
        "{'split': skinny_nt_matmul(128, 384, ((None, Config(3, 1, 2, 2, 2, stages=3)),)),"
        " 'direct': skinny_nt_matmul(128, 384, ((None, Config(3, 2, 4, 1, 2, stages=4)),))}")
    bodies = {name: body for name, body in re.findall(r"void __launch_bounds__\(\d+\) (\w+)_kernel\([^)]*\) \{(.*?)\n\}",
                                                      text, re.S)}
    split, direct = bodies["split"], bodies["direct"]
    for body, stages in ((split, 3), (direct, 4)):
        assert "extern __shared__" in body and "cp_async_cg_async_cg_shared_global_16" in body
        assert f"cp_async_wait_group_async_wait_group_{stages - 2}()" in body
        assert "cp_async_cg_src_size_async_cg_shared_global_16(" in body    # x rows past m: zero-filled
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "__syncthreads()" in split and split.count("__syncthreads()") > direct.count("__syncthreads()")


def test_pipelined_configurations_need_two_stages():
    with pytest.raises(ValueError, match="stages"):
        skinny_nt_matmul(128, 384, ((None, Config(3, 1, 2, 2, 2, stages=1)),))


def test_pipelined_x_rows_never_share_bytes_with_the_weight_rows(tmp_path):
    """W and x chunks live in one ring buffer, x rows past the block's weight rows.  (With two
    buffers, TVM's shared-memory planner -- which does not count cp.async writes as uses --
    puts x on the weights' bytes when K is one chunk: error ~1.0 on the H200.)  Here 32 weight
    rows x 128 k per chunk precede x."""
    text = sm90_source(tmp_path, "from specpilot.schedules.skinny_config import Config; from specpilot.schedules.skinny_kernels import skinny_nt_matmul",
                       "{'ring': skinny_nt_matmul(128, 256, ((None, Config(9, 1, 2, 2, 2, stages=3)),))}")
    assert text.count("extern __shared__") == 1
    x_reads = [line for line in text.splitlines() if "*(uint4*)(xb_ptr + " in line]
    assert x_reads and all(line.rstrip().endswith("+ 4096));") for line in x_reads), x_reads


def test_k_splits_over_blocks_only_where_channel_blocks_leave_sms_idle():
    """`with_splits`: N = 5120 (80 blocks of 64 channels on 132 SMs) splits K into the most pieces
    of >= 2048 that the configuration tiles; N = 17408 and the lm_head (more blocks than SMs) and
    short K keep one; the register kernel never splits; `pick` splits only beyond 16 rows (decode
    batches lost more to the second launch than they gained)."""
    from specpilot.schedules.skinny_config import with_splits
    down = dict(pick(5120, 17408))
    assert down[None].splits == 8 and down[32].splits == 8 and down[8].splits == down[16].splits == 1
    assert with_splits(down[8], 5120, 17408).splits == 8
    assert dict(pick(5120, 6144))[None].splits == 3                  # 6144 / 4 < 2048; 3 divides it
    assert all(cfg.splits == 1 for _, cfg in pick(17408, 5120) + pick(248320, 5120) + pick(5120, 2048))
    assert with_splits(Config(9, 2, 2, 2, 2), 5120, 17408).splits == 1
    # a split must leave every block whole k steps for its warps and at least two chunks
    assert Config(9, 2, 2, 2, 2, stages=3, splits=8).fits(5120, 17408)
    assert not Config(9, 2, 2, 2, 2, stages=3, splits=3).fits(5120, 17408)      # 17408 / 3 / 64: not whole
    assert not Config(9, 2, 2, 2, 2, stages=3, splits=64).fits(5120, 17408)     # one chunk per block
    assert not Config(9, 2, 2, 2, 2, splits=2).fits(5120, 17408)                # the register kernel


def test_k_split_over_blocks_sums_partials_in_a_second_kernel(tmp_path):
    """Config.splits > 1: the GEMM kernel runs over a z grid of K pieces and writes partial sums
    to a float32 workspace; a second kernel adds the pieces in a fixed order into y."""
    text = sm90_source(tmp_path, "from specpilot.schedules.skinny_config import Config; from specpilot.schedules.skinny_kernels import skinny_nt_matmul",
                       "{'spl': skinny_nt_matmul(128, 4096, ((None, Config(3, 1, 2, 2, 2, stages=3, splits=4)),))}")
    bodies = dict(re.findall(r"void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{", text))
    assert set(bodies) == {"spl_kernel", "spl_kernel_1"}
    assert "part_ptr" in bodies["spl_kernel"] and "y_ptr" not in bodies["spl_kernel"]
    assert "part_ptr" in bodies["spl_kernel_1"] and "y_ptr" in bodies["spl_kernel_1"]
    gemm = re.search(r"spl_kernel\([^)]*\) \{(.*?)\n\}", text, re.S).group(1)
    assert "blockIdx.z" in gemm and "mma.sync" in gemm


def test_hopper_picks_the_wgmma_kernel_where_it_tiles():
    """sm_90a (`pick(wgmma=True)`): the warpgroup kernel in every M range of a 64-channel-multiple
    shape, R = 8 / 16 / 32 / 72 rows of x as wgmma's N; K split over blocks where the channel blocks
    leave SMs idle, at any row count; at 9-16 rows such shapes keep mma's in-block K split (it led
    there on the H200); N = 16480 (not a multiple of 64: the 27B hybrid's GDN in-projections) takes
    it with a partial last block; other archs never get it."""
    wide = dict(pick(17408, 5120, wgmma=True))
    assert all(cfg.wgmma for cfg in wide.values())
    assert [wide[k].block_m() for k in (8, 16, 32, 72)] == [8, 16, 32, 72]
    assert wide[72].block_n() == 128 and wide[8].block_n() == 64 and wide[8].stages == 6
    assert all(cfg.splits == 1 for cfg in wide.values())          # 272 blocks of 64 channels: no split
    down = dict(pick(5120, 17408, wgmma=True))
    assert down[8].wgmma and down[8].splits == 8 and down[8].stages == 4     # split even at 1-8 rows
    assert not down[16].wgmma and down[16] == Config(2, 1, 1, 8, 1, stages=4)
    assert down[32].wgmma and down[32].splits == 8 and down[128].splits == 8
    assert down[72] == replace(WIDE, splits=2)        # `wide_split`: 128 channels a block, K in two
    assert all(cfg.wgmma for _, cfg in pick(16480, 5120, wgmma=True))
    assert not Config(9, 4, 1, 1, stages=4, wgmma=True).fits(100, 128)      # N a multiple of 8
    assert not any(cfg.wgmma for _, cfg in pick(17408, 5120))
    # of a range's two candidates, the one whose blocks fill the block slots best: 34816 channels
    # at <= 8 rows are 544 blocks -- 6 stages fit 4 a SM (528 slots: a last wave of 16), 4 stages 6
    wider = dict(pick(34816, 5120, wgmma=True))
    # (at 72 rows 6 stages, 2 a SM: 264 slots, two waves and 16 blocks -- those 16 in eighths of K, `with_tail`)
    assert wider[8].stages == 4 and wider[72] == Config(9, 4, 1, 1, stages=6, wgmma=True, overlap=1, tail=8)
    assert wide[72] == Config(9, 4, 2, 1, stages=4, wgmma=True)        # 272 one-warpgroup blocks: 264 slots
    # a wgmma configuration: 64 channels a warpgroup, one warp along K, N = R <= 256, 64-k chunks
    assert Config(9, 4, 2, 1, stages=4, wgmma=True).fits(128, 128)
    assert not Config(9, 2, 2, 1, stages=4, wgmma=True).fits(128, 128)      # a_tiles must be 4
    assert not Config(33, 4, 1, 1, stages=4, wgmma=True).fits(64, 128)      # 264 rows > wgmma's N
    assert not Config(9, 4, 1, 1, stages=4, wgmma=True).fits(64, 96)        # K not whole 64-k chunks
    assert not Config(9, 4, 1, 1, stages=1, wgmma=True).fits(64, 128)


def test_hopper_sizes_row_blocks_beyond_128_rows_to_the_batch_and_the_waves():
    """Beyond 128 rows, `many_rows`: row blocks sized to the batch's rows by how many 64-channel blocks N
    makes -- two 80-row blocks up to 160 rows where they are many or few (a long K with few: one 160-row
    block, K in two; a head of thousands: one 144-row block first), one 160-row block where they are
    between; few blocks take three row blocks where those fit one wave; the blocks past the last whole
    wave take K in pieces; 144, 192 and 256-row blocks beyond 336 rows; a 48-channel shape splits K 16
    ways in every range; neighbouring ranges of one configuration merge."""
    def wg(rows, wn, stages, **kw):
        return Config(rows // 8, 4, wn, 1, stages=stages, wgmma=True, overlap=1, **kw)
    limits = {"head": [144, 160, 256, 320, 336], "many": [160, 208, 320, 336], "mid": [160, 256, 320, 336],
              "few": [160, 216, 288, 320, 336]}
    for n, k in ((34816, 5120), (17408, 5120), (248320, 5120), (16480, 5120), (10240, 5120), (5120, 17408),
                 (5120, 6144), (6144, 5120), (48, 5120)):
        ranges = pick(n, k, wgmma=True)
        blocks = n // 64
        kind = "head" if blocks >= 8 * 132 else "many" if blocks >= 2 * 132 else "mid" if blocks >= 132 else "few"
        merged = [160, 216, 320, 336] if n == 6144 else limits[kind]      # 6144: two 160-row blocks at 217-320
        assert [limit for limit, _ in ranges] == [8, 16, 32, 72, 128] + merged + [432, 576, None]
        chosen = dict(ranges)
        splits = 16 if n == 48 else 1
        assert chosen[432] == wg(144, 1, 4, splits=splits)
        assert chosen[576] == wg(192, 2, 4, splits=splits)
        assert chosen[None] == wg(256, 2, 4, splits=splits)
        assert all(cfg.fits(n, k) for cfg in chosen.values())
        if kind == "head":
            assert chosen[144] == wg(144, 1, 4) and chosen[160] == wg(80, 1, 6) and chosen[256] == wg(256, 2, 4)
        elif kind == "many":
            # tail pieces where a wave is left partial: 17408 -> 272 blocks of 64 in 264 slots
            tail = 8 if n in (34816, 17408) else 1
            assert chosen[160] == wg(80, 1, 6, tail=tail) and chosen[208] == wg(208, 2, 4, tail=tail)
            assert chosen[320] == wg(160, 2, 4, tail=tail)
        elif kind == "mid":
            assert chosen[160] == wg(160, 2, 4) and chosen[320] == wg(160, 2, 3) and chosen[336] == wg(112, 1, 4)
        elif k >= 16384:
            assert chosen[160] == wg(160, 2, 4, splits=2) and chosen[216] == wg(80, 1, 6, splits=2)
            assert chosen[288] == wg(128, 2, 4)
        else:
            assert chosen[160] == wg(80, 1, 6, splits=splits)
            # three 72-row blocks of 5120 channels (240) fit 264 slots; of 6144 (288) they do not
            assert chosen[216] == (wg(208, 1, 5) if n == 6144 else wg(72, 1, 6, splits=splits))
            assert chosen[336] == (wg(168, 2, 4) if n == 6144 else wg(112, 1, 4, splits=splits))
            assert chosen[320] == wg(160, 2, 4, splits=splits)
    # other archs keep their four ranges (the last one open)
    assert [limit for limit, _ in pick(34816, 5120)] == [8, 16, 32, None]


def test_tail_split_takes_k_in_pieces_only_past_the_last_whole_wave():
    """`tail_split` on any unsplit warpgroup configuration: the channel blocks past its last whole wave
    of block slots take K in the most pieces (<= 8) that stay within the SMs; none where the blocks fit
    whole waves or one partial wave, where K does not divide or the configuration is split."""
    from specpilot.schedules.skinny_config import tail_blocks, tail_split
    r80 = Config(10, 4, 1, 1, stages=6, wgmma=True, overlap=1)      # two an SM: 264 slots
    assert tail_blocks(r80, 17408, 5120) == (264, 8) and tail_split(r80, 17408, 5120) == replace(r80, tail=8)
    assert tail_split(r80, 64 * 264, 5120) == r80 and tail_split(r80, 64 * 200, 5120) == r80
    assert tail_split(r80, 64 * (264 + 40), 5120) == replace(r80, tail=2)       # 40 x 4 > 132 SMs
    assert tail_split(r80, 64 * (264 + 100), 5120) == r80                        # 100 x 2 > 132
    assert tail_split(r80, 17408, 64 * 12) == replace(r80, tail=4)               # 12 chunks: quarters
    assert tail_split(replace(r80, splits=2), 17408, 5120).tail == 1
    r160 = Config(20, 4, 2, 1, stages=4, wgmma=True, overlap=1)     # one an SM: 132 slots
    assert tail_blocks(r160, 17408, 5120) == (132, 4) and tail_split(r160, 17408, 5120).tail == 8


def test_wgmma_kernel_compiles_for_sm90a_without_a_gpu(tmp_path):
    """The warpgroup kernel through nvcc for sm_90a (ptxas checks the wgmma operands): one
    m64nRk16 wgmma per 16 k of a 64-k chunk from descriptors (128-byte swizzle, 1024-byte groups),
    cp.async copies, the proxy fence before the barrier, a wgmma wait per chunk; K split over blocks
    adds the fixed-order sum kernel.  No launch argument is 64-bit unsigned (TVM's runtime cannot
    pass one: a hoisted descriptor constant fails on the H200).  Its numbers are checked on the
    H200 (bench/skinny_gemm.py, bench/README "Skinny GEMMs": <= 2.5e-5 of the float32 product at
    1-65 rows)."""
    text = sm90_source(
        tmp_path, "from specpilot.schedules.skinny_config import Config; from specpilot.schedules.skinny_kernels import skinny_nt_matmul",
        "{'wg': skinny_nt_matmul(256, 512, ((8, Config(1, 4, 1, 1, stages=6, wgmma=True)),"
        " (None, Config(9, 4, 2, 1, stages=4, wgmma=True)))),"
        " 'wgk': skinny_nt_matmul(200, 1024, ((None, Config(4, 4, 1, 1, stages=4, wgmma=True, splits=2)),))}",
        arch="sm_90a")
    heads = {name: (int(threads), params) for threads, name, params in
             re.findall(r"void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\) \{", text)}
    assert set(heads) == {"wg_kernel", "wg_kernel_1", "wgk_kernel", "wgk_kernel_1"}
    assert heads["wg_kernel"][0] == 128 and heads["wg_kernel_1"][0] == 256     # one / two warpgroups
    assert not any("uint64" in params for _, params in heads.values())
    for shape in ("m64n8k16", "m64n72k16", "m64n32k16"):
        assert f"wgmma.mma_async.sync.aligned.{shape}.f32.bf16.bf16" in text
    body = re.search(r"wg_kernel_1\([^)]*\) \{(.*?)\n\}", text, re.S).group(1)
    assert body.count("wgmma_bf16_ss_mma_async") == 4            # 64 k = four k16 steps
    fence, barrier = body.index("fence_proxy_proxy_async_shared__cta()"), body.index("__syncthreads()")
    assert body.index("cp_async_wait_group") < fence < barrier < body.index("wgmma_fence")
    assert "wgmma_wait_group_wait_group_sync_aligned_0()" in body and "cvta_generic_to_shared" in body
    # x's copies carry a source size (rows past m zero-filled, not read); W's are whole 16-byte copies
    assert "cp_async_cg_src_size_async_cg_shared_global_16(" in body
    assert "cp_async_cg_async_cg_shared_global_16(" in body
    # N = 200: four blocks of 64 channels, the last clamping its weight rows to row 199 and storing
    # channels < 200 only
    ragged = re.search(r"wgk_kernel\([^)]*\) \{(.*?)\n\}", text, re.S).group(1)
    assert "blockIdx.z" in ragged and ", 199)" in ragged
    assert ragged.count(") < m) && (") == 16          # each of the 16 accumulators: row and channel checked



def test_wide_blocks_at_33_to_72_rows_only_where_they_fill_the_gpu():
    """33-72 rows: two 64-channel weight tiles a warpgroup (`WIDE`: 128 channels, 8 stages, one
    block an SM, unsplit) where those blocks fill one wave to >= 80 % of the SMs or make >= 8
    waves; elsewhere (a nearly empty last wave, or K split over blocks) the 64-channel kernels stay,
    and nothing changes at other row counts."""
    from specpilot.schedules.skinny_config import TUNED, WIDE, wide_fills
    SMS = TUNED.sms
    assert WIDE.block_n() == 128 and WIDE.block_m() == 72 and WIDE.splits == 1
    assert WIDE.shared_bytes(5120) <= 227 * 1024 < 2 * (WIDE.shared_bytes(5120) + 1024)   # one block an SM
    for n_out, wide in ((16480, True), (14336, True), (248320, True), (151936, True),
                        (34816, False), (5120, False), (6144, False), (28672, False)):
        chosen = dict(pick(n_out, 5120, wgmma=True))
        assert (chosen[72] == WIDE) == wide, n_out
        assert all(cfg != WIDE for limit, cfg in chosen.items() if limit != 72)
        assert not any(cfg == WIDE for _, cfg in pick(n_out, 5120))          # never before Hopper
    blocks = [b for b in range(1, 1200) if wide_fills(128 * b)]
    assert min(blocks) == 106 and 132 in blocks and 133 not in blocks and 1055 not in blocks and 1056 in blocks
    assert SMS == 132
    # a_tiles: 4, 8 or 12 (one to three 64-channel tiles a warpgroup), at most 128 accumulators a thread
    assert Config(9, 12, 1, 1, stages=4, wgmma=True).fits(384, 128)
    assert not Config(9, 16, 1, 1, stages=2, wgmma=True).fits(512, 128)
    assert not Config(16, 12, 1, 1, stages=2, wgmma=True).fits(384, 128)     # 3 x 64 accumulators
    assert not Config(9, 6, 1, 1, stages=4, wgmma=True).fits(384, 128)


def test_wide_blocks_split_k_in_two_where_few_channel_blocks_meet_a_long_k():
    """`wide_split`: at 33-72 rows a shape with fewer 64-channel blocks than SMs (K split over
    blocks anyway) and K >= 16384 takes `WIDE` with K over two blocks where the doubled 128-channel
    blocks still fit one wave (17408 -> 5120: 40 x 2 = 80 blocks) -- not where K is shorter (6144,
    12288 -> 5120 / 4096) or where the 64-channel blocks fill the SMs (8448: 132 of them; below that
    the doubled 128-channel blocks fit one wave); other row ranges keep their kernels."""
    from specpilot.schedules.skinny_config import TUNED, wide_split
    SMS = TUNED.sms
    assert wide_split(5120, 17408) == replace(WIDE, splits=2) and wide_split(5120, 16384) is not None
    assert wide_split(4096, 28672) is not None                      # 32 x 2 blocks
    for n, k in ((5120, 16320), (5120, 6144), (4096, 12288), (64 * SMS, 17408), (34816, 17408)):
        assert wide_split(n, k) is None, (n, k)
    assert wide_split(64 * SMS - 8, 17408) is not None and wide_split(64 * SMS, 17408) is None   # 66 x 2 blocks
    chosen, before = dict(pick(5120, 17408, wgmma=True)), dict(pick(5120, 6144, wgmma=True))
    assert chosen[72] == replace(WIDE, splits=2) and chosen[128] == Config(9, 4, 1, 1, stages=6, wgmma=True,
                                                                        overlap=1, splits=8)
    assert all(cfg.a_tiles == 4 for limit, cfg in chosen.items() if limit != 72 and cfg.wgmma)
    assert before[72].a_tiles == 4 and before[72].splits == 3
    assert not any(cfg.wgmma for _, cfg in pick(5120, 17408))          # never before Hopper


def test_wide_wgmma_kernel_multiplies_each_x_tile_by_two_weight_tiles(tmp_path):
    """`WIDE` through nvcc for sm_90a, plain and paired: eight wgmmas a 64-k chunk (two weight
    tiles per k16 step, the second's descriptor 8 KB further), 72 accumulators a thread, every one
    stored once (plain: to its channel; paired: silu(gate) * up of its pair, 36 stores); 128 threads
    a block.  Its numbers (plain) are the 64-channel kernel's bit for bit on the H200 -- only the
    tiling across channels changes (bench/README "Build comparison": the 27B-style hybrid's
    prefill, AR steps and tree verification); the paired form is held to bf16 forcing
    (bench/specs/tiny-llama-wide-mlp-bf16.yaml)."""
    setup = (
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "from tests.schedules.test_skinny_mma import _swiglu_module\n"
        "from specpilot.schedules.relax_pipeline import pipeline\n"
        "from specpilot.schedules.skinny_config import WIDE\n"
        "from specpilot.schedules.skinny_kernels import skinny_nt_matmul\n"
        "t0 = tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90a'})\n"
        "with t0:\n"
        "    mod = pipeline(t0, 'skinny-mma')(_swiglu_module(8448, 512))\n"
        "fused = [f for gv, f in mod.functions.items() if gv.name_hint.startswith('skinny_mma')]\n")
    text = sm90_source(tmp_path, setup,
                       "{'wide': skinny_nt_matmul(16400, 512, ((None, WIDE),)), 'swiglu': fused[0]}", arch="sm_90a")
    heads = {name: (int(threads), params) for threads, name, params in
             re.findall(r"void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\) \{", text)}
    assert heads["wide_kernel"][0] == 128
    body = re.search(r"wide_kernel\([^)]*\) \{(.*?)\n\}", text, re.S).group(1)
    assert body.count("wgmma_bf16_ss_mma_async_sync_aligned_m64n72k16") == 8
    assert re.search(r"float acc_ptr\[72\];", body)
    assert body.count(") < m) && (") == 72 and ", 16399)" in body     # ragged N: rows clamped, channels checked
    # the paired kernel of an 8448-wide SwiGLU: 33-72 rows take WIDE (132 blocks of 128 channels)
    paired = [n for n, (_, params) in heads.items() if n.startswith("swiglu_kernel")]
    wide = [n for n in paired if "m64n72k16" in re.search(rf"{n}\([^)]*\) \{{(.*?)\n\}}", text, re.S).group(1)]
    assert len(wide) == 1, paired
    body = re.search(rf"{wide[0]}\([^)]*\) \{{(.*?)\n\}}", text, re.S).group(1)
    assert body.count("wgmma_bf16_ss_mma_async_sync_aligned_m64n72k16") == 8 and re.search(r"float acc_ptr\[72\];", body)
    out, = [n for t, n in re.findall(r"(\w+)\* __restrict__ (\w+)", heads[wide[0]][1]) if n not in ("w_ptr", "x_ptr")]
    stores = [line for line in body.splitlines() if line.strip().startswith(f"{out}[")]
    assert len(stores) == 36 and all("expf" in line for line in stores)

def test_a_nearly_empty_last_wave_takes_k_in_pieces():
    """`with_tail`: the unsplit 72-row warpgroup kernel of 5120 -> 34816 (544 blocks of 64 channels,
    2 a SM: 264 slots) runs 528 blocks over all of K and the last 16 as 8 blocks of 10 chunks each
    (16 x 8 = 128 <= 132 SMs), and so do its two 80-row blocks at 73-128 rows; nowhere else of the 27B /
    8B shapes up to 128 rows, never with K split already or a last wave fuller than a quarter of the
    slots; pieces of whole chunks."""
    from specpilot.schedules.skinny_config import TUNED, block_slots, tail_blocks, with_tail
    SMS = TUNED.sms
    six = Config(9, 4, 1, 1, stages=6, wgmma=True, overlap=1)
    assert block_slots(six, 5120) == 2 * SMS and tail_blocks(six, 34816, 5120) == (528, 16)
    assert tail_blocks(six, 64 * 2 * SMS, 5120) == (2 * SMS, 0)          # whole waves: no tail
    assert tail_blocks(six, 64 * 100, 5120) == (100, 0)                   # one partial wave: no tail
    assert with_tail(six, 34816, 5120) == replace(six, tail=8)
    assert with_tail(six, 34816, 256) == replace(six, tail=4)             # 4 chunks: quarters
    assert with_tail(six, 64 * (2 * SMS + 40), 5120) == replace(six, tail=2)   # 40 x 4 > 132 SMs
    assert with_tail(six, 64 * (2 * SMS + 67), 5120) == six               # 67 > 264 / 4
    assert with_tail(six, 64 * (2 * SMS + 66), 5120) == replace(six, tail=2)
    assert with_tail(replace(six, splits=2), 34816, 5120).tail == 1
    assert with_tail(Config(4, 4, 1, 1, stages=6, wgmma=True, overlap=1), 34816, 5120).tail == 1   # 32 rows
    assert with_tail(Config(9, 2, 2, 2, 2, stages=3), 34816, 5120).tail == 1                     # mma
    for n, k in ((17408, 5120), (5120, 17408), (16480, 5120), (14336, 5120), (248320, 5120), (5120, 6144),
                 (24576, 4096), (4096, 12288), (6144, 4096), (151936, 4096)):
        assert all(cfg.tail == 1 for limit, cfg in pick(n, k, wgmma=True) if limit is not None and limit <= 128), (n, k)
    tailed = [(limit, cfg.block_m()) for limit, cfg in pick(34816, 5120, wgmma=True) if cfg.tail > 1]
    # beyond 128 rows `many_rows` takes the tail wherever its blocks leave a wave partial (`tail_split`)
    assert tailed == [(72, 72), (128, 80), (160, 80), (208, 208), (320, 160), (336, 168)]
    assert [limit for limit, cfg in pick(17408, 5120, wgmma=True) if cfg.tail > 1] == [160, 208, 320, 336]
    assert not replace(six, tail=3).fits(34816, 5120) and not replace(six, tail=8, splits=2).fits(34816, 5120)


def test_the_tail_form_sums_its_pieces_in_a_second_kernel(tmp_path):
    """Config.tail: blocks 528.. of the GEMM kernel store to the float32 workspace (rows piece * m..,
    columns channel - 528 * 64) and run an eighth of the chunks; the second kernel adds
    the eight pieces in order into channels 33792.. of y (a ragged N: below N only)."""
    text = sm90_source(tmp_path, "from specpilot.schedules.skinny_config import Config; from specpilot.schedules.skinny_kernels import skinny_nt_matmul",
                       "{'t': skinny_nt_matmul(34816 - 40, 5120, ((None, Config(9, 4, 1, 1, stages=6, wgmma=True,"
                       " overlap=1, tail=8)),))}", arch="sm_90a")
    heads = dict(re.findall(r"void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{", text))
    assert set(heads) == {"t_kernel", "t_kernel_1"} and "w_ptr" in heads["t_kernel"] and "w_ptr" not in heads["t_kernel_1"]
    gemm = re.search(r"t_kernel\([^)]*\) \{(.*?)\n\}", text, re.S).group(1)
    # channel blocks are blockIdx.y (`Config.rows_first`): the row blocks sharing a weight tile launch together
    assert "((int)blockIdx.y) < 528)" in gemm and "part_ptr[" in gemm and "y_ptr[" in gemm
    assert "((((int)blockIdx.y) >> 3) + 462)" in gemm          # tail block b: channel block 528 + (b - 528) / 8
    total = re.search(r"t_kernel_1\([^)]*\) \{(.*?)\n\}", text, re.S).group(1)
    sums = re.findall(r"part_ptr\[(.*?)\]\)?;", total)
    assert len(sums) == 8 and "m * (int64_t)" not in sums[0] and all(f"m * (int64_t){z * 1024}" in sums[z] for z in (2, 3, 7))
    assert total.count("y_ptr[") == 1 and "+ (int64_t)33792)] = total_ptr[0]" in total


def test_wave_efficiency_counts_blocks_against_slots():
    from specpilot.schedules.skinny_config import TUNED, wave_efficiency
    SMS = TUNED.sms
    one = Config(9, 4, 1, 1, stages=6, wgmma=True, overlap=1)          # ~105 KB: 2 blocks a SM
    assert one.shared_bytes(5120) == 6 * (64 + 72) * 128 + 1024
    assert wave_efficiency(one, 64 * 2 * SMS, 5120) == 1.0                  # exactly one wave
    assert wave_efficiency(one, 64 * 2 * SMS + 64, 5120) == (2 * SMS + 1) / (2 * SMS) / 2
    assert wave_efficiency(one, 64 * 10, 5120) == 1.0                       # a partial single wave
    assert wave_efficiency(replace(one, splits=3), 64 * 2 * SMS, 5120) == 1.0    # 3 whole waves


def _swiglu_module(n_half: int, k_in: int):
    """main(x[m, K], W[2 H, K]) = silu(bf16(x W^T)[:, :H]) * bf16(x W^T)[:, H:] (m symbolic)."""
    from tvm import tirx
    bb = relax.BlockBuilder()
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType([m, k_in], "bfloat16"))
    w = relax.Var("w", relax.TensorType([2 * n_half, k_in], "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            gu = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w), out_dtype="float32"))
            gate = bb.emit(relax.op.astype(bb.emit(relax.op.strided_slice(gu, axes=[1], begin=[0], end=[n_half])),
                                           "bfloat16"))
            up = bb.emit(relax.op.astype(bb.emit(relax.op.strided_slice(gu, axes=[1], begin=[n_half],
                                                                        end=[2 * n_half])), "bfloat16"))
            out = bb.emit_output(relax.op.multiply(bb.emit(relax.op.nn.silu(gate)), up))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("n_half,k_in,fused", [
    (17408, 5120, True),     # the 27B-style MLP: unsplit warpgroup kernels at every row count
    (17408, 512, True),
    (2176, 512, False),      # few channel blocks: K split over blocks at some row count, no pair form
])
@pytest.mark.slow
def test_swiglu_over_a_fused_gate_up_projection_joins_the_skinny_kernel(n_half, k_in, fused):
    """Verification / prefill rows (symbolic): SwiGLU over a fused gate / up projection becomes the
    skinny kernel's paired store where every configuration is an unsplit wgmma kernel; else the
    float32 output and the activation's kernel stay."""
    from tvm import tirx

    from specpilot.schedules.relax_pipeline import pipeline
    from specpilot.schedules.skinny_kernels import pairable
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target:
        mod = pipeline(target, "skinny-mma")(_swiglu_module(n_half, k_in))
    names = sorted(gv.name_hint for gv, f in mod.functions.items()
                   if isinstance(f, tirx.PrimFunc) and not gv.name_hint.startswith("shape_func"))
    assert pairable(2 * n_half, k_in, True) == fused
    if fused:
        assert len(names) == 1 and names[0].startswith(f"skinny_mma_{2 * n_half}_{k_in}_fused_"), names
    else:
        assert len(names) == 2, names
    with pytest.raises(ValueError, match="no paired form"):
        skinny_nt_matmul(2 * 2176, 512, wgmma=True, paired=True)
    with pytest.raises(ValueError, match="no paired form"):
        skinny_nt_matmul(2 * 17408, 512, wgmma=False, paired=True)


@pytest.mark.slow
def test_the_paired_wgmma_store_is_one_store_of_the_activation(tmp_path):
    """The fused kernel's CUDA for sm_90a: every row range's kernel stores silu(gate) * up once, in
    bf16 (no float32 output parameter); a block's 64 weight rows are 32 of the gate half and the
    same 32 of the up half (rows c and c + H).  H = 17400 pairs are 544 blocks of 32: at 33-128
    rows (and in `many_rows`' tailed ranges) the tail form, whose last 16 blocks' float32 partial sums (the one float32
    buffer, ``part``) the second kernel adds and stores as silu(gate) * up, for pairs 16896.. only."""
    setup = (
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "from tests.schedules.test_skinny_mma import _swiglu_module\n"
        "from specpilot.schedules.relax_pipeline import pipeline\n"
        "t0 = tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90a'})\n"
        "with t0:\n"
        "    mod = pipeline(t0, 'skinny-mma')(_swiglu_module(17400, 512))\n"
        "fused = [f for gv, f in mod.functions.items() if gv.name_hint.startswith('skinny_mma')]\n"
        "assert len(fused) == 1 and '_fused_' in [gv.name_hint for gv in mod.functions if\n"
        "                                        gv.name_hint.startswith('skinny_mma')][0]\n")
    text = sm90_source(tmp_path, setup, "{'swiglu': fused[0]}", arch="sm_90a")
    heads = re.findall(r"void __launch_bounds__\((\d+)\) (swiglu_kernel\w*)\(([^)]*)\) \{", text)
    floats = {name: re.findall(r"float\* __restrict__ (\w+)", params) for _, name, params in heads}
    assert heads and all(f in ([], ["part_ptr"]) for f in floats.values()), floats
    # the tails' GEMM kernels and sums: at 33-72 and 73-128 rows and in the four tailed ranges beyond 128
    # (each of whose blocks also leaves 528 x 32 pairs whole)
    assert sum(f == ["part_ptr"] for f in floats.values()) == 12
    for _, name, params in heads:
        body = re.search(rf"{name}\([^)]*\) \{{(.*?)\n\}}", text, re.S).group(1)
        out, = [n for t, n in re.findall(r"(\w+)\* __restrict__ (\w+)", params) if n not in ("w_ptr", "x_ptr", "part_ptr")]
        stores = [line for line in body.splitlines() if line.strip().startswith(f"{out}[")]
        assert stores and all("expf" in line for line in stores), (name, stores[:2])
        if "w_ptr" in params:
            assert ", 17399)" in body and "+ 17400)" in body     # a ragged H: gate rows clamped to H - 1, up rows c + H
        else:       # the sum: pairs 528 * 32.. below H, gate + up of each from the eight pieces in order
            assert "+ (int64_t)16896)] = " in body and body.count("part_ptr[") == 16, body


@pytest.mark.parametrize("rows_first", [True, False])
def test_row_blocks_sharing_a_weight_tile_launch_together(rows_first):
    """`Config.rows_first`: the row blocks are blockIdx.x and the channel blocks blockIdx.y, so the
    blocks reading one weight tile are launched one after another (the rest read it from the L2);
    without it the other way round.  Every launch form: unsplit, K split over blocks, the tail form."""
    forms = {"plain": Config(18, 4, 1, 1, stages=4, wgmma=True, overlap=1),
             "split": Config(18, 4, 1, 1, stages=4, wgmma=True, overlap=1, splits=2),
             "tail": Config(9, 4, 1, 1, stages=6, wgmma=True, overlap=1, tail=8)}
    for name, cfg in forms.items():
        n_out = 34816 - 40 if name == "tail" else 5120
        func = skinny_nt_matmul(n_out, 5120, ((None, replace(cfg, rows_first=rows_first)),), wgmma=True)
        bound: dict[str, str] = {}          # the GEMM kernel's launch (a sum kernel may follow)
        for extent, tag in re.findall(r'thread_binding\((.*?), thread="(blockIdx\.\w)"\)', func.script()):
            bound.setdefault(tag, extent)
        rows, channels = ("blockIdx.x", "blockIdx.y") if rows_first else ("blockIdx.y", "blockIdx.x")
        assert "m" in bound[rows] and bound[channels].isdigit(), (name, bound)   # row blocks: (m + BM - 1) // BM
