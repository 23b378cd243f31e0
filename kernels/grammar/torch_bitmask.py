"""Packed token bitmasks in xgrammar's layout, and applying them to a batch of logits with plain torch.

Layout: an int32 tensor [rows, ceil(vocab / 32)]; token `t` is allowed in row `r` when bit `t % 32` of word
`bitmask[r, t // 32]` is 1 (least significant bit first). A row of -1 allows everything. Grammar matchers fill
rows on the host; `apply_bitmask` copies the mask to the logits' device and sets the disallowed logits of the
constrained rows to -inf in one vectorised pass, leaving every other row untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ringserve.kernels.host_copy import host_to_device, to_device

BITMASK_DTYPE = torch.int32
ALL_ALLOWED = -1  # an int32 word with all 32 bits set

Rows = Sequence[int] | torch.Tensor


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A host bitmask [batch, ceil(vocab_size / 32)] with every token allowed.

    `pin_memory` makes the per-step copy to a CUDA device asynchronous (only where CUDA is available).
    """
    mask = torch.full((batch, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=BITMASK_DTYPE)
    return mask.pin_memory() if pin_memory and torch.cuda.is_available() else mask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: True where the token is allowed.

    Ids the bitmask does not cover (a logits vocabulary padded past the tokenizer's) come out False.
    """
    shifts = torch.arange(32, dtype=BITMASK_DTYPE, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.bool).flatten(-2)
    covered = bits.shape[-1]
    if covered >= vocab_size:
        return bits[..., :vocab_size]
    allowed = torch.zeros(*bits.shape[:-1], vocab_size, dtype=torch.bool, device=bitmask.device)
    allowed[..., :covered] = bits
    return allowed


def set_allowed(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Fill `bitmask[row]` so that only `token_ids` are allowed (used for a finished matcher's stop tokens)."""
    bitmask[row].zero_()
    for token in token_ids:
        word, bit = divmod(int(token), 32)
        if word < bitmask.shape[-1]:
            # int32 words: bit 31 set is a negative number, so build the word with Python ints and wrap.
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Rows | None = None) -> None:
    """Set logits of disallowed tokens to -inf, in place, in the constrained `rows` only.

    `logits` is [B, V] on any device; `bitmask` is [>= B, W] (row i masks logits row i), on the host or on
    the logits' device. `rows` lists the constrained rows (unique), as a list or an index tensor; None means
    every row. Rows not listed are not written at all, so they stay bit-for-bit what they were. Logits ids
    past the bitmask's coverage (W * 32 < V: a padded model vocabulary) are masked in the constrained rows.
    Allowed logits keep their exact values, except that NaN becomes -inf in constrained rows.
    """
    if rows is not None and len(rows) == 0:
        return
    device = logits.device
    if bitmask.device != device:
        bitmask = host_to_device(bitmask, device)
    if rows is None:
        masked = _masked(logits, bitmask[: logits.shape[0]])
        if masked is not logits:
            logits.copy_(masked)
        return
    if isinstance(rows, torch.Tensor):
        index = rows.to(device=device, dtype=torch.long)
    else:
        index = to_device(list(rows), device)
    logits.index_copy_(0, index, _masked(logits.index_select(0, index), bitmask.index_select(0, index)))


def _masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] with disallowed ids at -inf (in place when possible), given `bitmask` [R, W]."""
    vocab = logits.shape[-1]
    if sys.byteorder != "little":  # the byte view below relies on little-endian words
        return logits.masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))
    # min(logit, +inf) keeps a logit bit-for-bit, min(logit, -inf) masks it; one gather and one vectorised
    # minimum run several times faster on CPU than masked_fill/where with a bool mask.
    table = _cap_table(logits.dtype, logits.device)
    cap = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).long(), table).flatten(-2)
    covered = cap.shape[-1]
    if covered >= vocab:
        cap = cap[..., :vocab]
    else:
        cap = torch.cat([cap, cap.new_full((cap.shape[0], vocab - covered), float("-inf"))], dim=-1)
    out = torch.minimum(logits, cap, out=logits) if logits.is_contiguous() else torch.minimum(logits, cap)
    # minimum keeps NaN; a NaN must not stay selectable where the grammar forbids the token.
    return out.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


_CAP_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _cap_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, +inf where its bit (LSB first) is set, else -inf."""
    key = (dtype, device)
    table = _CAP_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), float("inf"), float("-inf")).to(device=device, dtype=dtype)
        _CAP_TABLES[key] = table
    return table
