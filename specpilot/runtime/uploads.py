"""Small arrays between the host and the device without waiting for kernels queued after them."""

from __future__ import annotations

import numpy as np
import torch


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``.  On a GPU the copy goes from pinned memory, queued behind the
    kernels already launched: a copy from pageable memory would first wait for them all, leaving the
    device idle while the host prepares what comes next (torch's host allocator keeps the pinned buffer
    until the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Download:
    """A device tensor's copy to the host, queued now where the stream stands: `wait` returns it once
    that copy has run, without waiting for kernels launched after it (a plain read would wait for every
    one of them).  On the CPU the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            self.host, self.copied = tensor, None
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def wait(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host
