"""The W12 GEMM on the CPU: weights decoded in registers from their W12 planes."""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.kernels.base import memo


@memo
def w12_gemm(n_out: int, k_in: int, n_escapes: int, x_dtype: str, hi_only: bool = False):
    """y[m, n] = sum_k x[m, k] * W[n, k] (float32), W decoded in registers from its W12 planes.

    Row n's escapes are merged in column order as k advances, so every weight enters the sum
    with its exact bf16 value and in the same order as a plain GEMM over the decoded matrix.
    CPU form: rows in parallel.  (The CUDA schedule is issue 4's kernel work.)

    ``hi_only``: the nested 8-bit view -- the lo plane is not read, the low mantissa bits are
    taken at their midpoint (0b1000); escapes stay exact.
    """
    lo_len = (n_out * k_in + 1) // 2
    e = max(n_escapes, 1)
    x_dtype = str(x_dtype)   # a Relax DataType or a string: the attribute records the string

    @T.prim_func(private=True, s_tir=True)
    def kernel(x_h: T.handle, hi_h: T.handle, lo_h: T.handle, base_h: T.handle, ptr_h: T.handle,
               col_h: T.handle, bits_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": False,
                     "w12.n": n_out, "w12.k": k_in, "w12.escapes": n_escapes, "w12.x_dtype": x_dtype})
        m = T.int64()
        x = T.match_buffer(x_h, (m, k_in), x_dtype)
        hi = T.match_buffer(hi_h, (n_out, k_in), "uint8")
        lo = T.match_buffer(lo_h, (lo_len,), "uint8")
        base = T.match_buffer(base_h, (n_out,), "uint8")
        ptr = T.match_buffer(ptr_h, (n_out + 1,), "int32")
        col = T.match_buffer(col_h, (e,), "int32")
        bits = T.match_buffer(bits_h, (e,), "int32")
        y = T.match_buffer(y_h, (m, n_out), "float32")
        with T.sblock("root"):
            for i in range(m):
                for n in T.parallel(n_out):
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    w = T.alloc_buffer((1,), "float32", scope="local")
                    p = T.alloc_buffer((1,), "int32", scope="local")
                    acc[0] = T.float32(0)
                    p[0] = ptr[n]
                    for k in range(k_in):
                        if p[0] < ptr[n + 1] and col[T.min(p[0], e - 1)] == T.Cast("int32", k):
                            w[0] = T.reinterpret("float32", T.shift_left(T.Cast("uint32", bits[p[0]]), T.uint32(16)))
                            p[0] = p[0] + 1
                        else:
                            w[0] = T.reinterpret("float32", T.shift_left(
                                T.bitwise_or(T.bitwise_or(
                                    T.shift_left(T.shift_right(T.Cast("uint32", hi[n, k]), T.uint32(7)), T.uint32(15)),
                                    T.shift_left(T.Cast("uint32", base[n]) + T.bitwise_and(
                                        T.shift_right(T.Cast("uint32", hi[n, k]), T.uint32(3)), T.uint32(15)), T.uint32(7))),
                                    T.bitwise_or(T.shift_left(T.bitwise_and(T.Cast("uint32", hi[n, k]), T.uint32(7)), T.uint32(4)),
                                                 T.uint32(8) if hi_only else
                                                 T.bitwise_and(T.shift_right(T.Cast("uint32", lo[(n * k_in + k) // 2]),
                                                                             T.Cast("uint32", ((n * k_in + k) % 2) * 4)),
                                                               T.uint32(15)))),
                                T.uint32(16)))
                        acc[0] = acc[0] + T.Cast("float32", x[i, k]) * w[0]
                    y[i, n] = acc[0]
    return kernel
