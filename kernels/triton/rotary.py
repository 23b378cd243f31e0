"""Rotary position embedding in Triton (the default "rotate half" form), rounding like the reference.

The reference computes `x * cos + rotate_half(x) * sin` in the input dtype, rounding after each product and
after the sum; the kernel does the arithmetic in float32 and rounds at the same three points, so bf16 results
match it bit for bit. Grid `(T,)`: one program rotates every head of one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton import next_power_of_2


@triton.jit
def _rotary_kernel(
    X, Cos, Sin, Out, stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < NUM_HEADS) & (i[None, :] < HALF)
    i_mask = i < HALF
    dtype = Out.dtype.element_ty
    cos1 = tl.load(Cos + t * stride_ct + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(Cos + t * stride_ct + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(Sin + t * stride_st + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(Sin + t * stride_st + HALF + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    base = X + t * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    # out[:half] = x1 * cos1 + (-x2) * sin1 ; out[half:] = x2 * cos2 + x1 * sin2
    a1 = (x1 * cos1).to(dtype).to(tl.float32)
    b1 = (-(x2 * sin1)).to(dtype).to(tl.float32)
    a2 = (x2 * cos2).to(dtype).to(tl.float32)
    b2 = (x1 * sin2).to(dtype).to(tl.float32)
    out = Out + t * stride_ot + h[:, None] * stride_oh + i[None, :]
    tl.store(out, (a1 + b1).to(dtype), mask=mask)
    tl.store(out + HALF, (a2 + b2).to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, D]` (any token/head strides) by `cos`/`sin` `[T, D]`; returns a new contiguous
    tensor of `x`'s dtype."""
    tokens, num_heads, head_dim = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1 and head_dim % 2 == 0
    out = torch.empty((tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
            NUM_HEADS=num_heads, HALF=head_dim // 2, BLOCK_H=next_power_of_2(num_heads),
            BLOCK_HALF=next_power_of_2(head_dim // 2),
        )
    return out
