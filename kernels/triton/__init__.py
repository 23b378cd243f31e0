"""Triton kernels for the GPU path: paged decode and extend attention, store-KV, RMSNorm and rotary.

Every kernel reads the page-size-1 KV pool through rows of the request-to-token table, exactly as the torch
reference backend does. On a machine without a GPU the kernels run under Triton's interpreter when
`TRITON_INTERPRET=1` is set before `triton` is first imported (the tests do this); otherwise they need CUDA
tensors.

This `__init__` imports no `triton` (the kernel modules do); `ringserve.kernels.attention` registers the `triton`
backend only when the package is installed (it is in the `test` and `gpu` extras, not the base dependencies).
Kernels are decorated when their module is first imported, so `TRITON_INTERPRET` must be set before that.
"""

from __future__ import annotations

import os


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in the (CPU) interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: object) -> str:
    """`tl.dot` input precision: exact ("ieee") for float32 so fp32 runs match torch; tensor-core default else."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= `n` (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())
