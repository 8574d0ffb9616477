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
