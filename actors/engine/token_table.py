"""The request-to-token table: row `r`, column `i` holds the pool slot of token `i` of the request on row `r`.

Rows are handed to requests when they are admitted and returned when they finish, abort or are retracted.
The table lives on the engine's device so attention backends index it without a copy.
"""

from __future__ import annotations

import torch


class TokenTable:
    """`table` `[max_requests, max_len]` int64 plus a free list of rows."""

    def __init__(self, max_requests: int, max_len: int, device: torch.device) -> None:
        self.table = torch.zeros((max_requests, max_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def assign(self) -> int:
        """Take a free row (the scheduler never admits more requests than there are rows)."""
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        """Give a row back."""
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` as the slots of tokens `start...` of `row`."""
        self.table[row, start : start + slots.numel()] = slots

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """The slots of tokens `[start, end)` of `row`."""
        return self.table[row, start:end]
