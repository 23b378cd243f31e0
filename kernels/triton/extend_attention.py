"""Paged extend (prefill / mixed batch) attention in Triton over the page-size-1 KV pool.

A step's `T` new tokens are flat: request `b` owns query rows `[q_starts[b], q_starts[b] + q_lens[b])` and its
`kv_lens[b]` keys (prefix plus the new ones, all already stored in the pool) sit at
`token_table[req_rows[b], :kv_lens[b]]`. New token `i` of request `b` may see key `j` when
`j <= kv_lens[b] - q_lens[b] + i` (causal, shifted by the cached prefix) and, with a sliding window, when
`j > kv_lens[b] - q_lens[b] + i - window`. Logits are capped (`cap * tanh(s / cap)`) when a soft-cap is set.

Grid `(B, H, ceil(max_q / BLOCK_M))`: each program takes `BLOCK_M` queries of one head of one request and runs
an online softmax over key blocks, from the first key its rows may see (0, or the window's start for its first
row) to the last. Decode rows (`q_len == 1`) work
too, but the decode kernel is faster for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringserve.kernels.triton import dot_precision, next_power_of_2
from ringserve.kernels.triton.decode_attention import NO_WINDOW
from ringserve.kernels.triton.soft_cap import soft_cap

BLOCK_M = 32  # queries per program
BLOCK_N = 32  # keys per inner step


@triton.jit
def _extend_kernel(
    Q, K, V, Out, Table, ReqRows, QStarts, QLens, KvLens,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_table,
    sm_scale, window, cap,
    REP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    g = h // REP
    q_start = tl.load(QStarts + b).to(tl.int64)
    q_len = tl.load(QLens + b).to(tl.int32)
    kv_len = tl.load(KvLens + b).to(tl.int32)
    row = tl.load(ReqRows + b).to(tl.int64)
    prefix = kv_len - q_len

    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + (q_start + m[:, None]) * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # Keys past the block's last query position are masked for every row; blocks past q_len do nothing.
    end = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)
    end = tl.where(mblk * BLOCK_M < q_len, end, 0)
    lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0)  # the first key the block's first row sees
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(Table + row * stride_table + n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_ks + g * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale  # [BLOCK_M, BLOCK_N]
        if HAS_CAP:
            s = soft_cap(s, cap)
        pos = prefix + m[:, None]
        allowed = (n[None, :] <= pos) & (n[None, :] > pos - window) & n_mask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        # With a window a row may see no key of this block yet (its window starts later): shift by 0, not -inf,
        # so its weights stay 0 instead of exp(-inf + inf).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + g * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows past q_len saw no key; they are not stored
    tl.store(Out + (q_start + m[:, None]) * stride_ot + h * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    token_table: torch.Tensor,
    req_rows: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its paged keys (each query the last `window` of them
    when set; logits capped at `logits_soft_cap` when set).

    `q` `[T, H, D]`; `k_layer`/`v_layer` `[num_slots, Hkv, D]`; `token_table` `[R, L]` int64; `req_rows`,
    `q_starts`, `q_lens`, `kv_lens` `[B]` on `q`'s device; `max_q_len` (a host int) sizes the grid.
    Returns `out` `[T, H, D]` in `q`'s dtype.
    """
    assert q.stride(2) == 1 and k_layer.stride(2) == 1 and v_layer.stride(2) == 1
    _, num_heads, head_dim = q.shape
    rep = num_heads // k_layer.shape[1]
    if out is None:
        out = torch.empty_like(q)
    batch = req_rows.shape[0]
    grid = (batch, num_heads, triton.cdiv(max_q_len, BLOCK_M))
    _extend_kernel[grid](
        q, k_layer, v_layer, out, token_table, req_rows, q_starts, q_lens, kv_lens,
        q.stride(0), q.stride(1), k_layer.stride(0), k_layer.stride(1), v_layer.stride(0), v_layer.stride(1),
        out.stride(0), out.stride(1), token_table.stride(0),
        sm_scale, window or NO_WINDOW, logits_soft_cap or 0.0,
        REP=rep, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, next_power_of_2(head_dim)), DOT_PREC=dot_precision(q.dtype), HAS_CAP=bool(logits_soft_cap),
    )
    return out
