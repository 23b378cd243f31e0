"""Host-to-device copies of small index lists that never block the host.

On CUDA a plain `torch.tensor(values, device="cuda")` waits for the copy (and so for all queued GPU work);
staging through pinned memory with `non_blocking=True` lets the host go on planning while the GPU runs.
PyTorch's caching host allocator keeps a pinned block alive until its copy has finished, so the staging
tensor needs no reference here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list, or equal-length lists) as a tensor on `device`, copied without a host sync on CUDA."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor built on the host, on `device`, copied without a host sync on CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
