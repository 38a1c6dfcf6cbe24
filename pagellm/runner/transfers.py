"""Host <-> device copies that never make the host wait for the GPU, so asynchronous scheduling stays
asynchronous. Both go through pinned memory: a copy from pageable memory may wait for the stream (and
`torch.tensor(..., device=cuda)` always does), and `.tolist()` on a device tensor waits for everything queued."""

from __future__ import annotations

import torch


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, the copy enqueued on the current stream."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, complete once the stream passes this point (record an event)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
