"""Next-token sampling with per-row temperature, top-k, top-p and per-request random generators.

Greedy rows (temperature 0) are exactly `argmax` of the logits. Sampled rows are filtered on one descending
sort shared by top-k and top-p, then drawn with the row's own `torch.Generator`, so a request seeded the same
way draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SamplingRow:
    """One request's sampling settings for this step."""

    temperature: float  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    generator: torch.Generator | None = None  # None = torch's global generator


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Pick one token per row of `logits` `[B, V]`; returns the `B` token ids."""
    tokens = logits.argmax(dim=-1)
    sampled = [b for b, row in enumerate(rows) if row.temperature > 0]
    if sampled:
        picked = [rows[b] for b in sampled]
        index = torch.tensor(sampled, device=logits.device)
        drawn = _draw(logits[index].float(), picked)
        tokens[index] = drawn
    return tokens.tolist()


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, then one multinomial draw per row; returns `[B]` token ids."""
    device = logits.device
    temperature = torch.tensor([r.temperature for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], device=device)
    top_k = torch.tensor([r.top_k if r.top_k > 0 else logits.shape[-1] for r in rows], device=device)
    sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p; the top token always stays.
    # Rows with top_p = 1 skip the filter, so float rounding of the cumsum cannot cut their tail.
    outside = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    outside[:, 0] = False
    probs = probs.masked_fill(outside, 0.0)
    picks = [torch.multinomial(probs[b], 1, generator=r.generator) for b, r in enumerate(rows)]
    return order.gather(1, torch.stack(picks)).squeeze(1)
