"""`engine.pack_inputs`: a step's small inputs as one buffer (one host-to-device copy on GPUs),
each a view at a 64-byte aligned offset -- checked on the CPU: every view is its array again
(values, dtype, shape), aligned as TVM requires of DLPack tensors, no two views overlap, and TVM
takes each view as is.  `CompiledModule.keep_headroom`: TVM's and torch's unused blocks go back to the
driver exactly when a GPU's free memory is under the headroom."""

from __future__ import annotations

import numpy as np
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


def test_headroom_releases_pooled_memory_only_when_the_card_runs_low(monkeypatch):
    from types import SimpleNamespace
    engine.release_device_memory()      # TVM's memory manager is reachable in this runtime
    released = []
    monkeypatch.setattr(engine, "release_device_memory", lambda: released.append(1))
    cpu = SimpleNamespace(device=SimpleNamespace(dlpack_device_type=lambda: 1, index=0))
    assert not engine.CompiledModule.keep_headroom(cpu) and not released
    gpu = SimpleNamespace(device=SimpleNamespace(dlpack_device_type=lambda: 2, index=0))
    total = 1000
    for free, low in ((total, False), (int(engine.HEADROOM * total), False), (int(engine.HEADROOM * total) - 1, True),
                      (0, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index, free=free: (free, total))
        assert engine.CompiledModule.keep_headroom(gpu) == low
    assert len(released) == 2
