"""The step functions' dimension bounds (`compiler.memory_bounds`): which functions take them, and
that TVM then plans a bounded function's intermediates at fixed sizes while an unbounded one keeps
sizing them a call."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specpilot.compiler.memory_bounds import bound_functions, step_bounds, verify_rows


def test_a_packed_rows_bound_is_the_longest_row_a_pass_verifies():
    assert verify_rows(16, 16, 16) == 17 and verify_rows(8, 5, None) == 9 and verify_rows(4, 3, 12) == 13
    assert verify_rows(None, 16, 16) is None and verify_rows(0, 16, None) is None
    bounds = step_bounds(32, 1024, 17)
    assert bounds["target_verify_packed"] == {"batch": 32, "kv_len": 1024, "n": 17, "real": 32 * 17}
    assert bounds["target_decode_batch"] == bounds["target_decode"] == {"batch": 32, "kv_len": 1024}
    assert "target_verify_packed" not in step_bounds(4, 64, None) and "target_prefill" not in bounds


def _module():
    """Two functions of x (n, k): exp then a sum over k and a broadcast back, one of them bounded on both."""
    from tvm import relax, tirx
    bb = relax.BlockBuilder()
    for name in ("bounded", "free"):
        n, k = tirx.Var("n", "int64"), tirx.Var("k", "int64")
        x = relax.Var("x", relax.TensorType([n, k], "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                e = bb.emit(relax.op.exp(x))
                s = bb.emit(relax.op.sum(e, axis=[1], keepdims=True))
                out = bb.emit_output(relax.op.add(e, s))
            bb.emit_func_output(out)
    return bb.get()


def _planned(mod, name: str) -> list[str]:
    import tvm
    from tvm import relax
    with tvm.target.Target("llvm"):
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.ToNonDataflow(),
                                        relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
                                        relax.transform.StaticPlanBlockMemory()])(mod)
    return re.findall(r"alloc_storage\(R\.shape\(\[([^\]]*)\]\)", mod[name].script(show_meta=False))


def test_only_a_function_whose_every_dimension_is_bounded_is_planned_at_its_bounds():
    mod = bound_functions(_module(), {"bounded": {"n": 24, "k": 7, "unused": 3}, "free": {"n": 24}})
    assert dict(mod["bounded"].attrs["tir_var_upper_bound"]) == {"n": 24, "k": 7}
    assert "tir_var_upper_bound" not in (mod["free"].attrs or {})     # k has no bound: left as it was
    bounded, free = _planned(mod, "bounded"), _planned(mod, "free")
    # exp's (n, k) and the sum's (n, 1) intermediates at fixed sizes: 24 * 7 and 24 floats
    assert sorted(int(size) for size in bounded) == [24 * 4, 24 * 7 * 4]
    assert free and not any(size.strip().isdigit() for size in free)


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (24, 7), (17, 2)])
def test_a_bounded_function_computes_what_the_unbounded_one_does(shape):
    import tvm
    from tvm import relax
    mod = bound_functions(_module(), {"bounded": {"n": 24, "k": 7}})
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype("float32")
    a, b = (vm[name](tvm.runtime.tensor(x)).numpy() for name in ("bounded", "free"))
    e = np.exp(x)
    assert np.array_equal(a, b) and np.allclose(a, e + e.sum(1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("cap", [1, 5, 16, 17, 32])
def test_a_dimension_rounds_up_to_a_power_of_two_at_most_its_cap(cap):
    for dim in range(1, 2 * cap + 3):
        want = dim if dim > cap else min(cap, 1 << (dim - 1).bit_length())
        assert _rounded(dim, cap) == want, (dim, cap)


def _rounded(dim: int, cap: int) -> int:
    from tvm import tirx
    from tvm.sym import Analyzer
    from specpilot.compiler.memory_bounds import power_of_two_at_most
    return int(Analyzer().simplify(power_of_two_at_most(tirx.IntImm("int64", dim), cap)))


def _batched():
    """f(x (batch, n, 3)) -> (x * 2 (batch, n, 3), its sum over n (batch, 3)), and g(y (m,)) -> y + 1."""
    from tvm import relax, tirx
    bb = relax.BlockBuilder()
    batch, n, m = (tirx.Var(name, "int64") for name in ("batch", "n", "m"))
    x = relax.Var("x", relax.TensorType([batch, n, 3], "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            doubled = bb.emit(relax.op.multiply(x, relax.const(2.0, "float32")))
            out = bb.emit_output(relax.Tuple([doubled, relax.op.sum(doubled, axis=[1])]))
        bb.emit_func_output(out)
    y = relax.Var("y", relax.TensorType([m], "float32"))
    with bb.function("g", [y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(y, relax.const(1.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _storage_bytes(func, **dims: int) -> list[int]:
    """The sizes of ``func``'s ``alloc_storage`` calls at the given values of its shape variables."""
    import tvm
    from tvm import relax, tirx
    from tvm.sym import Analyzer
    analyzer = Analyzer()
    for var in func.params[0].ty.shape.values:
        if isinstance(var, tirx.Var) and var.name in dims:
            analyzer.bind(var, tirx.IntImm("int64", dims[var.name]))
    op = tvm.ir.Op.get("relax.memory.alloc_storage")
    return [int(analyzer.simplify(b.value.args[0].values[0])) for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op == op]


def test_the_batch_is_rounded_wherever_a_function_takes_one():
    from specpilot.compiler.memory_bounds import ROUND_ROWS, round_rows
    mod = round_rows(_batched(), 16)
    assert {k: int(v) for k, v in mod["f"].attrs[ROUND_ROWS].items()} == {"batch": 16}
    assert ROUND_ROWS not in (mod["g"].attrs or {})          # no batch: left as it was


def test_outputs_get_storage_of_the_rounded_size_and_the_same_values():
    """After planning, each output of a function with a rounded batch has storage of its own sized for it
    (a (batch, n, 3) float32 output: 4 * 3 * rounded batch * n bytes); the compiled function computes what
    the plain one does below, at and past the cap."""
    import tvm
    from tvm import relax
    from specpilot.compiler.memory_bounds import round_output_storage, round_rows
    from specpilot.schedules.relax_pipeline import pipeline
    mod = round_rows(_batched(), 16)
    target = tvm.target.Target("llvm")
    with target:
        planned = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.ToNonDataflow(),
                                            relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
                                            relax.transform.StaticPlanBlockMemory(), round_output_storage()])(mod)
    assert "alloc_storage" not in planned["g"].script(show_meta=False)     # g's output left to TVM as before
    for batch, n, rounded in ((3, 5, 4), (16, 9, 16), (17, 12, 17), (1, 1, 1), (9, 2, 16)):
        # the doubled (batch, n, 3) and the summed (batch, 3), float32
        assert sorted(_storage_bytes(planned["f"], batch=batch, n=n)) == sorted([4 * 3 * rounded * n, 4 * 3 * rounded])
    exe = tvm.compile(pipeline(target, "tvm-default", after_planning=[round_output_storage()])(mod), target=target,
                      relax_pipeline=None)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    for batch, n in ((3, 5), (16, 9), (17, 12), (1, 1)):
        x = np.random.default_rng(batch * n).standard_normal((batch, n, 3)).astype("float32")
        doubled, summed = vm["f"](tvm.runtime.tensor(x))
        assert np.array_equal(doubled.numpy(), x * 2) and np.allclose(summed.numpy(), (x * 2).sum(1), rtol=1e-6)
    assert np.array_equal(vm["g"](tvm.runtime.tensor(np.arange(5, dtype="float32"))).numpy(), np.arange(1, 6))
