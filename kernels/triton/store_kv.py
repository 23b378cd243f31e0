"""Store-KV in Triton: write a step's new keys and values into their pool slots (page size 1).

Grid `(T,)`: program `t` copies token `t`'s `[Hkv, D]` keys and values to slot `out_slots[t]` of one layer.
A negative slot means "do not store" (no request owns that row). A latent pool (models/mla.py: the values are the
keys' leading part, V one tensor with K) is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton import next_power_of_2


@triton.jit
def _store_kv_kernel(
    K, V, KPool, VPool, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ps, stride_ph,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE_V: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # The slot test is broadcast through a tensor: the interpreter rejects a scalar bool in a mask.
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & ((h[:, None] * 0 + slot) >= 0)
    dst = slot * stride_ps + h[:, None] * stride_ph + d[None, :]
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    tl.store(KPool + dst, k.to(KPool.dtype.element_ty), mask=mask)
    if STORE_V:
        v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        tl.store(VPool + dst, v.to(VPool.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, out_slots: torch.Tensor
) -> None:
    """Write `k`, `v` `[T, Hkv, D]` (any token/head strides) at `out_slots` `[T]` of `k_layer`/`v_layer`
    `[num_slots, Hkv, D]` (contiguous, as one layer of the pool is); once when `v_layer` is `k_layer`'s storage
    (a latent pool, whose `v` is `k`)."""
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_layer.is_contiguous() and v_layer.is_contiguous()
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_layer, v_layer, out_slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_layer.stride(0), k_layer.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        STORE_V=v_layer.data_ptr() != k_layer.data_ptr(),
    )
