"""Dense attention over already gathered keys, with an optional logit soft-cap: the one piece of math the torch
backend and the CPU kernels' torch references share.

`scaled_dot_product_attention` has no soft-cap, so a capped layer runs the same math by hand: scores in float32,
`soft_cap * tanh(scores / soft_cap)`, the mask, the softmax, the weighted values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           soft_cap: float | None = None) -> torch.Tensor:
    """`softmax(cap(scale * q @ k^T) masked) @ v` over the last two dims (`q` `[..., M, D]`, `k`/`v` `[..., N, D]`,
    `mask` broadcastable to `[..., M, N]`, True = may attend); `soft_cap` None or 0: no cap (SDPA)."""
    if not soft_cap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
