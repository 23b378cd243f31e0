"""The torch reference of the CPU paged decode attention kernel (`paged_attention.cpp`).

`torch.ops.ringserve_cpu.paged_decode_attention(q, k_layer, v_layer, table, rows, kv_lens, scale, window=0,
soft_cap=0.0)`: one query token per request, `q` `[B, H, D]`, attends to the last `window` (0: all) of the first
`kv_lens[b]` slots of row `rows[b]` of the request-to-token `table`, read in place from one layer of the KV pool
(`k_layer`, `v_layer` `[S, Hkv, D]`), GQA heads `h` reading KV head `h // (H // Hkv)`; logits `x` become
`soft_cap * tanh(x / soft_cap)` when `soft_cap` > 0. This module holds the same math in plain torch: the op's
fallback when the C++ library cannot be built, and what the kernel is tested against.
"""

from __future__ import annotations

import torch

from ringserve.kernels.attention.dense import attend


def reference_paged_decode_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                                     table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                                     scale: float, window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    """`[B, H, D]` attention outputs, one request at a time (gather and SDPA, or its math with capped logits)."""
    b, h, d = q.shape
    hkv = k_layer.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(kv_lens[i])
        slots = table[rows[i], max(0, n - window) if window > 0 else 0 : n]
        k = k_layer[slots].transpose(0, 1)  # [Hkv, n, D]
        v = v_layer[slots].transpose(0, 1)
        qi = q[i].reshape(hkv, h // hkv, d)  # [Hkv, rep, D]
        out[i] = attend(qi, k, v, None, scale, soft_cap).reshape(h, d)
    return out
