"""Logit soft-capping inside the Triton attention kernels: `cap * tanh(s / cap)` (Gemma 2's attention).

tanh from `exp(-2|x|)`, `(1 - e) / (1 + e)` with the sign put back: no overflow for large logits, and only
`tl.exp`, which the interpreter and every GPU backend have.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    """`cap * tanh(s / cap)` elementwise."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)
