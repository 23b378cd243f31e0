"""Flatten table rows into a CSR page list (FlashInfer's `kv_indices`) on the device, without a host sync.

With page size 1 a request's pages are its token slots: request `b`'s `kv_lens[b]` slots
`token_table[req_rows[b], :kv_lens[b]]` go to `kv_indices[kv_indptr[b] : kv_indptr[b] + kv_lens[b]]`.
Grid `(B,)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 512


@triton.jit
def _kv_indices_kernel(Table, ReqRows, KvIndptr, KvLens, Out, stride_table, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(ReqRows + b).to(tl.int64)
    start = tl.load(KvIndptr + b).to(tl.int64)
    kv_len = tl.load(KvLens + b).to(tl.int32)
    for n0 in range(0, kv_len, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        mask = n < kv_len
        slots = tl.load(Table + row * stride_table + n, mask=mask, other=0)
        tl.store(Out + start + n, slots.to(Out.dtype.element_ty), mask=mask)


def build_kv_indices(
    token_table: torch.Tensor, req_rows: torch.Tensor, kv_indptr: torch.Tensor, kv_lens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill `out` (int32, at least `sum(kv_lens)` long) with the requests' slots in CSR order; returns `out`.

    `req_rows`, `kv_indptr` (`[B + 1]` or longer, only the first `B` are read) and `kv_lens` `[B]` live on the
    table's device.
    """
    batch = req_rows.shape[0]
    if batch:
        _kv_indices_kernel[(batch,)](token_table, req_rows, kv_indptr, kv_lens, out, token_table.stride(0),
                                     BLOCK=BLOCK)
    return out
