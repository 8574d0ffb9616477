"""fuse-projections: matmuls reading one activation become one GEMM over stacked weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from specpilot.core.weights import fuse_params
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.legality import check
from specpilot.passes.pipeline import parse
from specpilot.passes.runner import run_pipeline

from tests.build_helpers import assert_forces_exactly

ROOT = Path(__file__).resolve().parents[2]


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), h: R.Tensor(("n", 8), "float32"),
             ids: R.Tensor(("n",), "int32"),
             packed_params: R.Tuple(R.Tensor((6, 8), "float32"), R.Tensor((4, 8), "float32"),
                                    R.Tensor((4, 8), "float32"), R.Tensor((5, 8), "float32"),
                                    R.Tensor((3, 8), "float32"))):
        R.func_attr({"num_input": 3})
        with R.dataflow():
            wq = packed_params[0]
            wk = packed_params[1]
            wv = packed_params[2]
            we = packed_params[3]
            wo = packed_params[4]
            tq = R.permute_dims(wq)
            q = R.matmul(x, tq, out_dtype="float32")
            tk = R.permute_dims(wk)
            k = R.matmul(x, tk, out_dtype="float32")
            tv = R.permute_dims(wv)
            v = R.matmul(x, tv, out_dtype="float32")
            te = R.permute_dims(we)           # read with x too, but also by take(): stays its own matmul
            e = R.matmul(x, te, out_dtype="float32")
            emb = R.take(we, ids, axis=0)
            to = R.permute_dims(wo)           # alone on h: nothing to fuse
            o = R.matmul(h, to, out_dtype="float32")
            s = (q, k, v, e, emb, o)
            R.output(s)
        return s


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), h: R.Tensor(("n", 8), "float32"),
             ids: R.Tensor(("n",), "int32"),
             packed_params: R.Tuple(R.Tensor((14, 8), "float32"), R.Tensor((5, 8), "float32"),
                                    R.Tensor((3, 8), "float32"))):
        R.func_attr({"num_input": 3})
        with R.dataflow():
            we = packed_params[1]
            wo = packed_params[2]
            w = packed_params[0]
            t = R.permute_dims(w)
            y = R.matmul(x, t, out_dtype="float32")
            q = R.strided_slice(y, axes=[1], begin=[0], end=[6], assume_inbound=True)
            k = R.strided_slice(y, axes=[1], begin=[6], end=[10], assume_inbound=True)
            v = R.strided_slice(y, axes=[1], begin=[10], end=[14], assume_inbound=True)
            te = R.permute_dims(we)
            e = R.matmul(x, te, out_dtype="float32")
            emb = R.take(we, ids, axis=0)
            to = R.permute_dims(wo)
            o = R.matmul(h, to, out_dtype="float32")
            s = (q, k, v, e, emb, o)
            R.output(s)
        return s


def _params():
    g = torch.Generator().manual_seed(1)
    return {name: torch.randn(rows, 8, generator=g) for name, rows in
            (("target.q", 6), ("target.k", 4), ("target.v", 4), ("target.embed", 5), ("target.o", 3))}


def test_before_expected_and_the_parameters_follow():
    params = _params()
    context = PassContext(target_kind="llvm", params=dict(params))
    after, records = run_pipeline(parse("fuse-projections"), Before, context)
    tvm.ir.assert_structural_equal(after, Expected)
    assert records[0].statistics == {"groups": 1, "matmuls_fused": 3, "parameters_before": 5, "parameters_after": 3}
    assert list(context.params) == ["target.q+target.k+target.v", "target.embed", "target.o"]
    assert torch.equal(context.params["target.q+target.k+target.v"],
                       torch.cat([params["target.q"], params["target.k"], params["target.v"]]))


def test_seeded_parameters_keep_names_and_shared_groups_stack_once():
    names = dict.fromkeys(["target.a", "target.b", "target.c"])
    assert list(fuse_params(names, {"target.a+target.b": ["target.a", "target.b"]})) == ["target.a+target.b", "target.c"]
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    out = fuse_params({"target.a": a, "target.b": b, "drafter.a": a, "drafter.b": b},
                      {"target.a+target.b": ["target.a", "target.b"], "drafter.a+drafter.b": ["drafter.a", "drafter.b"]})
    assert out["target.a+target.b"] is out["drafter.a+drafter.b"]     # dedupe stores it once
    with pytest.raises(SpecPilotError, match="not among the parameters: target.z"):
        fuse_params({"target.a": a}, {"target.a+target.z": ["target.a", "target.z"]})


@I.ir_module
class TwoFunctions:
    """A block drafter's two functions: its block reads q, k, v with one activation, its context
    only k and v with another."""
    @R.function
    def block(x: R.Tensor(("n", 8), "float32"),
              packed_params: R.Tuple(R.Tensor((6, 8), "float32"), R.Tensor((4, 8), "float32"),
                                     R.Tensor((4, 8), "float32"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            q = R.matmul(x, R.permute_dims(packed_params[0]), out_dtype="float32")
            k = R.matmul(x, R.permute_dims(packed_params[1]), out_dtype="float32")
            v = R.matmul(x, R.permute_dims(packed_params[2]), out_dtype="float32")
            s = (q, k, v)
            R.output(s)
        return s

    @R.function
    def context(y: R.Tensor(("m", 8), "float32"),
                packed_params: R.Tuple(R.Tensor((6, 8), "float32"), R.Tensor((4, 8), "float32"),
                                       R.Tensor((4, 8), "float32"))):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            k = R.matmul(y, R.permute_dims(packed_params[1]), out_dtype="float32")
            v = R.matmul(y, R.permute_dims(packed_params[2]), out_dtype="float32")
            s = (k, v)
            R.output(s)
        return s


def test_slots_read_together_in_every_function_fuse_and_the_rest_stays_apart():
    """k and v go together wherever either is read, q only in one function: k + v is one GEMM in
    both functions, q its own; every output equal to the unfused module's on fresh inputs."""
    from specpilot.passes.fuse_projections import plan_groups
    assert plan_groups(TwoFunctions) == [(1, 2)]
    g = torch.Generator().manual_seed(3)
    params = {name: torch.randn(rows, 8, generator=g) for name, rows in (("d.q", 6), ("d.k", 4), ("d.v", 4))}
    context = PassContext(target_kind="llvm", params=dict(params))
    after, records = run_pipeline(parse("fuse-projections"), TwoFunctions, context)
    assert records[0].statistics == {"groups": 1, "matmuls_fused": 4, "parameters_before": 3, "parameters_after": 2}
    assert list(context.params) == ["d.q", "d.k+d.v"]
    x, y = torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)

    def run(mod, packed):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        tup = [tvm.runtime.from_dlpack(t.contiguous()) for t in packed]
        return ([torch.from_dlpack(o).clone() for o in vm["block"](tvm.runtime.from_dlpack(x), tup)],
                [torch.from_dlpack(o).clone() for o in vm["context"](tvm.runtime.from_dlpack(y), tup)])
    want = run(TwoFunctions, list(params.values()))
    got = run(after, list(context.params.values()))
    for w, o in zip(want[0] + want[1], got[0] + got[1]):
        assert torch.equal(w, o)


def test_w12_layout_must_come_after_it():
    context = PassContext(target_kind="llvm")
    assert check(parse("w12-layout,fuse-projections"), context) == ["w12-layout must come after fuse-projections"]
    assert check(parse("fuse-projections,w12-layout"), context) == []


@pytest.mark.parametrize("example,passes,params", [
    ("tiny-hybrid.yaml", "fuse-projections", "seeded"),          # the engine redoes the stacking
    ("tiny-llama.yaml", "fuse-projections,w12-layout", "file"),  # W12 converts the stacked weights
])
@pytest.mark.slow
def test_compiled_fused_builds_pass_token_forcing_exactly(example, passes, params, tmp_path):
    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target

    manifest = build(BuildRequest(load_spec(ROOT / "examples" / example), parse_target("llvm"), tmp_path / "b", passes=passes,
                     params=params))
    stats = manifest.passes[0]["statistics"]
    assert stats["groups"] > 0 and stats["parameters_after"] < stats["parameters_before"]
    assert manifest.fused and all("+" in name for name in manifest.fused)
    if "w12-layout" in passes:
        assert any("+" in name for name in manifest.w12["weights"])
    assert_forces_exactly(tmp_path / "b", 96)


@pytest.mark.slow
@pytest.mark.parametrize("passes", ["fuse-projections,w12-layout", "fuse-projections"])
def test_the_engines_rewrite_of_seeded_weights_equals_what_a_build_stores(tmp_path, passes):
    """`rewritten_parameters` (stacking, and W12 conversion, one weight at a time, each model weight
    dropped once used, as a GPU engine does for a seeded build) against the parameters a build with
    the weights stored."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from specpilot.compiler.build import BuildRequest, build
    from specpilot.core.loader import load_models
    from specpilot.core.spec import load_spec
    from specpilot.core.target import parse_target
    from specpilot.core.weights import rewritten_parameters

    spec = load_spec(ROOT / "examples" / "tiny-llama.yaml")
    manifest = build(BuildRequest(spec, parse_target("llvm"), tmp_path / "b", passes=passes))
    stored = load_file(str(tmp_path / "b" / "params" / "params.safetensors"))
    target, drafter = load_models(spec)
    kept = dict(target.weights)
    values = rewritten_parameters(manifest, SimpleNamespace(cfg=target.cfg, weights=target.weights),
                                  SimpleNamespace(cfg=drafter.cfg, weights=drafter.weights), consume=True)
    assert list(values) == manifest.params and any(".w12_lo" in n for n in values) == ("w12" in passes)
    used = manifest.w12["weights"] if manifest.w12 else manifest.params
    converted = {m.partition(".")[2] for n in used if n.startswith("target.")
                 for m in (manifest.fused or {}).get(n, [n])}
    assert converted and not converted & set(target.weights) and set(kept) - converted <= set(target.weights)
    for name, value in values.items():
        assert torch.equal(value, stored[manifest.aliases.get(name, name)]), name
