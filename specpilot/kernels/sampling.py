"""Sampling scores inside the compiled module: logits / T plus keyed Gumbel noise (`core.sampling`).

scores[r, v] = logits[r, v] * controls[r, 0] + g(keys[r], v)   where logits[r, v] >= controls[r, 1]
             = MASKED                                             elsewhere (left out by top-k / top-p)

controls[r] = (1 / temperature, the lowest kept logit); keys[r] = (seed low, seed high, position)
as int32 words.  The argmax of a row is the sampled token; the noise is made here, on the
device, from the key alone.
"""

from __future__ import annotations

from tvm.script import tirx as T

from specpilot.core.sampling import GOLDEN, KEY_WORDS, MASKED, MIX, WORD
from specpilot.kernels.base import memo

THREADS = 256


@memo
def sample_scores(vocab: int, gpu: bool):
    blocks = (vocab + THREADS - 1) // THREADS

    # the hash in uint64 with explicit masks: every value stays below 2**64, so no wrapping
    # arithmetic reaches TVM's simplifier (it miscompiles chains of wrapping uint32 multiplies)
    @T.macro
    def mix(h):
        h[0] = h[0] ^ (h[0] >> T.uint64(16))
        h[0] = (h[0] * T.uint64(MIX[0])) & T.uint64(WORD)
        h[0] = h[0] ^ (h[0] >> T.uint64(15))
        h[0] = (h[0] * T.uint64(MIX[1])) & T.uint64(WORD)
        h[0] = h[0] ^ (h[0] >> T.uint64(16))

    @T.macro
    def score(logits, keys, controls, out, r, v):
        h = T.alloc_buffer((1,), "uint64", scope="local")
        h[0] = (T.Cast("uint64", T.Cast("uint32", keys[r, 0])) + T.uint64(GOLDEN)) & T.uint64(WORD)
        mix(h)
        for w in range(1, KEY_WORDS):
            h[0] = h[0] ^ ((T.Cast("uint64", T.Cast("uint32", keys[r, w])) + T.uint64(GOLDEN)) & T.uint64(WORD))
            mix(h)
        h[0] = h[0] ^ ((T.Cast("uint64", v) + T.uint64(GOLDEN)) & T.uint64(WORD))
        mix(h)
        u = (T.Cast("float32", h[0] >> T.uint64(8)) + T.float32(0.5)) * T.float32(2.0 ** -24)
        out[r, v] = T.if_then_else(logits[r, v] >= controls[r, 1],
                                   logits[r, v] * controls[r, 0] - T.log(-T.log(u)), T.float32(MASKED))

    @T.prim_func(private=True, s_tir=True)
    def kernel(l_h: T.handle, k_h: T.handle, c_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "op_pattern": 8, "tirx.is_scheduled": gpu})
        rows = T.int64()
        logits = T.match_buffer(l_h, (rows, vocab), "float32")
        keys = T.match_buffer(k_h, (rows, KEY_WORDS), "int32")
        controls = T.match_buffer(c_h, (rows, 2), "float32")
        out = T.match_buffer(out_h, (rows, vocab), "float32")
        with T.sblock("root"):
            if gpu:
                for bx in T.thread_binding(rows * blocks, thread="blockIdx.x"):
                    for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                        if bx % blocks * THREADS + tx < vocab:
                            score(logits, keys, controls, out, bx // blocks, bx % blocks * THREADS + tx)
            else:
                for r in T.parallel(rows):
                    for v in range(vocab):
                        score(logits, keys, controls, out, r, v)
    return kernel
