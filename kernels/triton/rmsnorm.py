"""RMSNorm in Triton, with the rounding of the reference (`actors/engine/models/llama.py`, as in Hugging Face):
normalise in float32, round to the input dtype, then multiply by the weight in that dtype.

Grid `(N,)`: one program per row of `x` `[N, C]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton import next_power_of_2


@triton.jit
def _rmsnorm_kernel(X, W, Out, stride_x, stride_o, eps, N_COLS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < N_COLS
    x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N_COLS
    normed = (x * tl.rsqrt(var + eps)).to(Out.dtype.element_ty)  # rounded like `x.to(dtype)`
    w = tl.load(W + c, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Out + row * stride_o + c, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / rms(x))` over the last dim of `x` `[..., C]`; returns a new tensor of `x`'s dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), eps,
                                        N_COLS=shape[-1], BLOCK=next_power_of_2(shape[-1]))
    return out.reshape(shape)


class TritonRMSNorm(torch.nn.Module):
    """Drop-in for the model's RMSNorm module (same `weight` parameter and `eps`), computed by `rms_norm`."""

    def __init__(self, weight: torch.nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
