"""Small host arrays to the device without waiting for it."""

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
