"""The request-to-token tables: row `r`, column `i` holds the pool slot (`table`) and the token id (`ids`) of
token `i` of the request on row `r`.

Rows are handed to requests when they are admitted and returned when they finish, abort or are retracted.
Both tables live on the engine's device: attention backends index `table` without a copy, and a step gathers
its input ids from `ids` on the device. A request's known tokens are written to its `ids` row at admission;
after that each step writes the tokens it samples there itself, so the next step can read them before the
host has seen them.

One more row, `scratch_row`, is never handed out: every column of it maps to a scratch slot that no request
owns, with token id 0. Padding rows of a CUDA-graph batch run on it (position 0, one key), so they neither
write nor read any request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringserve.kernels.host_copy import to_device


class TokenTable:
    """`table` and `ids`, both `[max_requests + 1, max_len]` int64 (the last row is `scratch_row`), plus a free
    list of rows."""

    def __init__(self, max_requests: int, max_len: int, device: torch.device, scratch_slot: int) -> None:
        """`scratch_slot`: the KV pool's slot that no request owns (`KVPool.scratch_slot`)."""
        self.table = torch.zeros((max_requests + 1, max_len), dtype=torch.int64, device=device)
        self.ids = torch.zeros((max_requests + 1, max_len), dtype=torch.int64, device=device)
        self.scratch_row = max_requests
        self.table[self.scratch_row] = scratch_slot
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

    def write_ids(self, row: int, ids: Sequence[int]) -> None:
        """Record `ids` as the token ids of tokens `0...` of `row` (a non-blocking copy)."""
        if ids:
            self.ids[row, : len(ids)] = to_device(list(ids), self.ids.device)

    def write_ids_at(self, row: int, start: int, ids: Sequence[int]) -> None:
        """Record `ids` as the token ids of tokens `start...` of `row` (draft tokens; a verify step's own token)."""
        if ids:
            self.ids[row, start:start + len(ids)] = to_device(list(ids), self.ids.device)

    def slots(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        """The slots of tokens `[start, end)` of `row`."""
        return self.table[row, start:end]
