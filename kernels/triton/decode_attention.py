"""Paged decode attention in Triton: one query token per request over its table row of KV slots.

Split-KV ("flash decoding") in two stages, so a batch of one still fills the GPU:

1. `_decode_stage1`, grid `(B, Hkv, S)`: program `(b, g, s)` takes the `rep = H / Hkv` query heads that share
   KV head `g` (GQA, padded to a block of at least 16 rows for `tl.dot`) and attends over the `s`-th of `S`
   equal parts of request `b`'s keys, gathered slot by slot through `token_table[req_rows[b]]`. It writes the
   part's normalised output and log-sum-exp. With a sliding window the keys are only the last `window` ones
   (the parts split those); with a soft-cap the logits are capped before the softmax.
2. `_decode_stage2`, grid `(B, H)`: merges the non-empty parts with their log-sum-exps.

The grid depends only on `B` and the fixed `S`, never on sequence lengths (which are read on the device), so
the launch can be captured in a CUDA graph and replayed with other lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton import dot_precision, next_power_of_2
from ringserve.kernels.triton.soft_cap import soft_cap

NO_WINDOW = 1 << 30  # the window passed for full attention: every key is inside it

DEFAULT_NUM_SPLITS = 8  # KV parts per request; stage 2 merges them
BLOCK_N = 32  # keys per inner step


@triton.jit
def _decode_stage1(
    Q, K, V, Table, ReqRows, KvLens, PartOut, PartLse,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_table,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    sm_scale, window, cap,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    h_off = tl.arange(0, BLOCK_H)
    heads = g * REP + h_off
    h_mask = h_off < REP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    row = tl.load(ReqRows + b).to(tl.int64)
    kv_len = tl.load(KvLens + b).to(tl.int32)
    first = tl.maximum(kv_len - window, 0)  # the window's first key
    per_split = tl.cdiv(kv_len - first, NUM_SPLITS)
    start = first + split * per_split
    end = tl.minimum(start + per_split, kv_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(Table + row * stride_table + n, mask=n_mask, other=0).to(tl.int64)  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_ks + g * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale  # [BLOCK_H, BLOCK_N]
        if HAS_CAP:
            s = soft_cap(s, cap)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + g * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if end > start:
        out = acc / l_i[:, None]
        tl.store(PartOut + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out,
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(PartLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i), mask=h_mask)


@triton.jit
def _decode_stage2(
    PartOut, PartLse, KvLens, Out,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh, window,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    kv_len = tl.load(KvLens + b).to(tl.int32)
    first = tl.maximum(kv_len - window, 0)
    per_split = tl.cdiv(kv_len - first, NUM_SPLITS)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        start = first + split * per_split
        end = tl.minimum(start + per_split, kv_len)
        if end > start:
            lse = tl.load(PartLse + b * stride_lb + h * stride_lh + split)
            part = tl.load(PartOut + b * stride_pb + h * stride_ph + split * stride_ps + d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * part
            l_i = l_i * alpha + w
            m_i = m_new
    tl.store(Out + b * stride_ot + h * stride_oh + d, (acc / l_i).to(Out.dtype.element_ty), mask=d_mask)


def decode_buffers(
    max_bs: int, num_heads: int, head_dim: int, device: torch.device, num_splits: int = DEFAULT_NUM_SPLITS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for the split parts: outputs `[max_bs, H, S, D]` and log-sum-exps `[max_bs, H, S]`, float32."""
    out = torch.empty(max_bs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(max_bs, num_heads, num_splits, dtype=torch.float32, device=device)
    return out, lse


def decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    token_table: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query per request over its paged keys (the last `window` of them when set; logits capped
    at `logits_soft_cap` when set).

    `q` `[B, H, D]`; `k_layer`/`v_layer` `[num_slots, Hkv, D]` (one layer of the pool); `token_table` `[R, L]`
    int64; `req_rows` `[B]` rows of the table; `kv_lens` `[B]` keys per request (the new token's included,
    already stored). `buffers` from `decode_buffers` (at least `B` rows, same split count) avoids allocating.
    Returns `out` `[B, H, D]` in `q`'s dtype.
    """
    assert q.stride(2) == 1 and k_layer.stride(2) == 1 and v_layer.stride(2) == 1
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_layer.shape[1]
    rep = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if buffers is None:
        buffers = decode_buffers(batch, num_heads, head_dim, q.device)
    part_out, part_lse = buffers
    num_splits = part_out.shape[2]
    block_d = max(16, next_power_of_2(head_dim))
    _decode_stage1[(batch, num_kv_heads, num_splits)](
        q, k_layer, v_layer, token_table, req_rows, kv_lens, part_out, part_lse,
        q.stride(0), q.stride(1), k_layer.stride(0), k_layer.stride(1), v_layer.stride(0), v_layer.stride(1),
        token_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        sm_scale, window or NO_WINDOW, logits_soft_cap or 0.0,
        REP=rep, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_H=max(16, next_power_of_2(rep)),
        BLOCK_D=block_d, BLOCK_N=BLOCK_N, DOT_PREC=dot_precision(q.dtype), HAS_CAP=bool(logits_soft_cap),
    )
    _decode_stage2[(batch, num_heads)](
        part_out, part_lse, kv_lens, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), window or NO_WINDOW,
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_D=block_d,
    )
    return out
