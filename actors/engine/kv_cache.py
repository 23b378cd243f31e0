"""The paged KV cache: a fixed pool of token slots per layer, a free-list allocator, and per-request page tables.

Pages hold one token (SGLang's token pool), so a request's page table is simply its slot list in token order,
kept as one row of a `[max_requests, max_len]` table on the device; a step gathers the rows it needs with one
indexing op. Slots are taken lazily as tokens are computed and returned on finish, abort or preemption.
"""

from __future__ import annotations

import torch


class KVCache:
    """Owns the K/V tensors `[num_layers, num_slots, n_kv_heads, head_dim]`, the free slots and page-table rows."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        max_len: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Zeros, not empty: padded reads are masked, but NaN garbage would still leak through 0 * NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self._free_slots = torch.arange(num_slots, dtype=torch.int64, device=device)
        self.page_table = torch.zeros((max_requests, max_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return self._free_slots.numel()

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def assign_row(self) -> int:
        """Take a page-table row for a request entering the running batch."""
        return self._free_rows.pop()

    def append(self, rows: list[int], starts: list[int], counts: list[int]) -> torch.Tensor:
        """Allocate `counts[b]` slots for row `rows[b]` at token positions `starts[b]...`; returns the slots `[T]`.

        Raises RuntimeError when the pool is short (the batch policy should have preempted first).
        """
        total = sum(counts)
        if total > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {total} slots, {self.num_free} free")
        slots, self._free_slots = self._free_slots[:total], self._free_slots[total:]
        row_index = [row for row, n in zip(rows, counts) for _ in range(n)]
        col_index = [col for start, n in zip(starts, counts) for col in range(start, start + n)]
        device = self.page_table.device
        self.page_table[torch.tensor(row_index, device=device), torch.tensor(col_index, device=device)] = slots
        return slots

    def page_rows(self, rows: list[int], width: int) -> torch.Tensor:
        """`[B, width]` slot lists of `rows`; entries past a request's length are stale and must be masked."""
        return self.page_table[torch.tensor(rows, device=self.page_table.device), :width]

    def release(self, row: int, length: int) -> None:
        """Return a request's first `length` slots and its row to the free lists."""
        self._free_slots = torch.cat([self._free_slots, self.page_table[row, :length]])
        self._free_rows.append(row)
