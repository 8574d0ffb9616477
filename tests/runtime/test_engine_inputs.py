"""`engine.pack_inputs`: a step's small inputs as one buffer (one host-to-device copy on GPUs),
each a view at a 64-byte aligned offset -- checked on the CPU: every view is its array again
(values, dtype, shape), aligned as TVM requires of DLPack tensors, no two views overlap, and TVM
takes each view as is.  `CompiledModule.keep_headroom`: TVM's unused blocks go back to the driver
exactly when a GPU's free memory is under the headroom, torch's cached ones only where it stays under."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpilot.runtime import engine
from specpilot.runtime.engine import pack_inputs


def test_packed_inputs_are_the_arrays_again_aligned_and_disjoint():
    import tvm
    rng = np.random.default_rng(5)
    arrays = [rng.integers(-5, 1 << 20, (1, 1)).astype("int32"),          # tokens
              rng.integers(0, 4096, (3, 7)).astype("int32"),              # positions of a batch
              rng.uniform(size=(3, 7, 77)) < 0.5,                         # mask (bool, odd length)
              np.array([2], "int32"),                                     # rows
              rng.integers(-1, 64, (1, 65)).astype("int32"),              # parents of a tree
              rng.integers(0, 9, (2, 3)).astype("int64")]
    host, views = pack_inputs(arrays)
    buf = torch.from_numpy(host).clone()    # a fresh allocation, as the device copy is (torch aligns it)
    assert buf.data_ptr() % 64 == 0
    spans = []
    for a, view in zip(arrays, views):
        t = view(buf)
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
        offset = t.data_ptr() - buf.data_ptr()
        assert offset % 64 == 0
        spans.append((offset, offset + a.nbytes))
        assert np.array_equal(tvm.runtime.from_dlpack(t).numpy(), a)
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert len(host) == sum((a.nbytes + 63) // 64 * 64 for a in arrays)


def _gpu_module():
    from types import SimpleNamespace
    gpu = SimpleNamespace(device=SimpleNamespace(dlpack_device_type=lambda: 2, index=0), releases=0)
    gpu._low_on_memory = lambda: engine.CompiledModule._low_on_memory(gpu)
    return gpu


def test_headroom_releases_pooled_memory_only_when_the_card_runs_low(monkeypatch):
    from types import SimpleNamespace
    engine.release_device_memory()      # TVM's memory manager is reachable in this runtime
    released = []
    monkeypatch.setattr(engine, "release_pooled_memory", lambda: released.append("tvm"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append("torch"))
    cpu = SimpleNamespace(device=SimpleNamespace(dlpack_device_type=lambda: 1, index=0))
    assert not engine.CompiledModule.keep_headroom(cpu) and not released
    gpu = _gpu_module()
    total = 1000
    for free, low in ((total, False), (int(engine.HEADROOM * total), False), (int(engine.HEADROOM * total) - 1, True),
                      (0, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index, free=free: (free, total))
        assert engine.CompiledModule.keep_headroom(gpu) == low
    # nothing came free either time: torch's cache went back too
    assert released == ["tvm", "torch"] * 2 and gpu.releases == 2     # counted for the benchmarks' rows


def test_torch_keeps_its_cache_where_tvms_pool_alone_frees_enough(monkeypatch):
    """A hand-back empties torch's cache only where TVM's pool going back leaves the card still low."""
    total, state = 1000, {"free": 50}
    released = []

    def tvm_back(amount):
        released.append("tvm")
        state["free"] += amount
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (state["free"], total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append("torch"))
    gpu = _gpu_module()
    monkeypatch.setattr(engine, "release_pooled_memory", lambda: tvm_back(400))
    assert engine.CompiledModule.keep_headroom(gpu) and released == ["tvm"]
    state["free"], released[:] = 50, []
    monkeypatch.setattr(engine, "release_pooled_memory", lambda: tvm_back(10))
    assert engine.CompiledModule.keep_headroom(gpu) and released == ["tvm", "torch"] and gpu.releases == 2


class _Seq:
    def __init__(self, length: int, capacity: int = 4096):
        self.length, self.capacity = length, capacity

    def check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise ValueError("no room")


def _rows_one_by_one(toks, items, T):
    """The step's rows a sequence at a time: the reference `engine.step_rows` is checked against."""
    B = len(items)
    L = max(st.length + len(t) for t, (_, st, *_) in zip(toks, items))
    tokens, positions = np.zeros((B, T), "int32"), np.zeros((B, T), "int32")
    slots, mask = np.full((B, T), -1, "int32"), np.zeros((B, T, L), bool)
    mask[:, :, 0] = True
    parents = np.tile(np.arange(-1, T - 1, dtype="int32"), (B, 1))
    for b, (t, (_, st, pos, attn, par)) in enumerate(zip(toks, items)):
        n, start = len(t), st.length
        tokens[b, :n] = t
        slots[b, :n] = np.arange(start, start + n)
        positions[b, :n] = slots[b, :n] if pos is None else pos
        for i in range(n):
            for j in range(start + n):
                mask[b, i, j] = (j <= start + i) if attn is None else attn[i][j]
        if par is not None:
            parents[b, :n] = par
    return tokens, positions, slots, mask, parents


def test_step_rows_equal_a_sequence_at_a_time_on_random_batches():
    """`engine.step_rows` (a batched pass's rows built for the batch at once) against the same rows
    built a sequence at a time: random batches of chains, trees (positions, masks, parents of their
    own) and empty items, odd lengths and padding included; a sequence without room is refused."""
    rng = np.random.default_rng(5)
    for _ in range(60):
        B = int(rng.integers(1, 7))
        toks, items = [], []
        for _ in range(B):
            n, start = int(rng.integers(0, 6)), int(rng.integers(1, 20))
            t = rng.integers(0, 1000, n).astype("int32")
            pos = attn = par = None
            if n and rng.random() < 0.5:     # a tree: its own positions, mask and parents
                par = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], "int32")
                pos = (start + rng.integers(0, n, n)).astype("int32")
                attn = rng.random((n, start + n)) < 0.7
            toks.append(t)
            items.append((t, _Seq(start), pos, attn, par))
        T = max(1, max(len(t) for t in toks)) + int(rng.integers(0, 3))
        got, want = engine.step_rows(toks, items, T), _rows_one_by_one(toks, items, T)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
    full = (np.zeros(3, "int32"), _Seq(10, capacity=12), None, None, None)
    with pytest.raises(ValueError, match="no room"):
        engine.step_rows([full[0]], [full], 3)
