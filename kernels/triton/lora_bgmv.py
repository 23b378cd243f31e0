"""The segmented low-rank (LoRA) matmul in Triton, BGMV as in Punica: `ringserve::lora_shrink_expand`'s CUDA
implementation (kernels/lora.py says the op and the `A`/`B^T` layout; `reference_lora_shrink_expand` is its
torch form).

Two kernels, each program one token's work, reading the token's slot from `slot_ids` on the device (so a CUDA
graph that captured the launch serves every step's mix); a base-model token (slot -1) masks every load and
store off. Shrink, grid `(T, P)`: `u[t, p*R:(p+1)*R] = A_{p,s} x[t]` in float32. Expand, one launch per fused
part `p`, grid `(T, cdiv(rows_p, BLOCK_N))`: `y[t, part p] += u[t, p] B_{p,s}^T`, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton import next_power_of_2


@triton.jit
def _slot_rows(Ids, t, part, SLOTS, RANK, BLOCK_R: tl.constexpr):
    """Token t's first row of A and B^T for `part`, its rank lanes and their mask, and 1 where it has an adapter
    (0 for a base-model token, whose lanes are all masked off)."""
    s = tl.load(Ids + t)
    live = tl.where(s >= 0, 1, 0)
    r = tl.arange(0, BLOCK_R)
    return (part * SLOTS + tl.maximum(s, 0)) * RANK, r, r < RANK * live, live


@triton.jit
def _shrink_kernel(X, A, U, Ids, stride_x, stride_a, stride_u, K, SLOTS, RANK, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    p = tl.program_id(1)
    row0, r, rmask, live = _slot_rows(Ids, t, p, SLOTS, RANK, BLOCK_R)
    k_end = K * live
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_end
        x = tl.load(X + t * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
        a = tl.load(A + (row0 + r)[:, None] * stride_a + k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(U + t * stride_u + p * RANK + r, acc, mask=rmask)


@triton.jit
def _expand_kernel(Y, BT, U, Ids, stride_y, stride_b, stride_u, OFFSET, N, SLOTS, RANK, PART,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    row0, r, rmask, live = _slot_rows(Ids, t, PART, SLOTS, RANK, BLOCK_R)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N * live
    u = tl.load(U + t * stride_u + PART * RANK + r, mask=rmask, other=0.0)
    b = tl.load(BT + (row0 + r)[:, None] * stride_b + (OFFSET + n)[None, :], mask=rmask[:, None] & nmask[None, :],
                other=0.0).to(tl.float32)
    delta = tl.sum(b * u[:, None], axis=0)
    out = Y + t * stride_y + OFFSET + n
    y = tl.load(out, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out, (y + delta).to(Y.dtype.element_ty), mask=nmask)


def lora_bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, slot_ids: torch.Tensor,
              slots: int, rank: int, part_rows: list[int]) -> None:
    """Add each token's own slot's low-rank update to `y` `[T, out]` in place (`x` `[T, in]`, `a` `[P*S*R, in]`,
    `b_t` `[P*S*R, out]`, `slot_ids` int with at least T entries, -1 for the base model's tokens)."""
    tokens, k = x.shape
    parts = len(part_rows)
    if tokens == 0:
        return
    assert y.stride(1) == 1 and a.stride(1) == 1 and b_t.stride(1) == 1, "rows must be contiguous"
    x = x if x.stride(1) == 1 else x.contiguous()
    u = torch.empty(tokens, parts * rank, dtype=torch.float32, device=x.device)
    block_r = next_power_of_2(rank)
    _shrink_kernel[(tokens, parts)](x, a, u, slot_ids, x.stride(0), a.stride(0), u.stride(0), k, slots, rank,
                                    BLOCK_R=block_r, BLOCK_K=min(128, next_power_of_2(k)))
    offset = 0
    for p, rows in enumerate(part_rows):
        block_n = min(128, next_power_of_2(rows))
        _expand_kernel[(tokens, triton.cdiv(rows, block_n))](y, b_t, u, slot_ids, y.stride(0), b_t.stride(0),
                                                             u.stride(0), offset, rows, slots, rank, p,
                                                             BLOCK_R=block_r, BLOCK_N=block_n)
        offset += rows
