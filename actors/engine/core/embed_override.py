"""What a step writes over some of its token embeddings: its images' tokens (`EmbedOverride`), with the runs
among them that attend to each other both ways (`BidirectionalSpan`, models/vision/span_attention.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BidirectionalSpan:
    """The part of one image's run a step computes, through the image's end (it starts later than the image when a
    cached prefix ends inside it, whose earlier tokens the causal mask already shows): its first token's flat index
    in the step, its length, its first token's position, and the pool slots of the request's tokens
    `[0, position + length)`."""

    first: int
    length: int
    position: int
    key_slots: torch.Tensor


@dataclass
class EmbedOverride:
    """Embeddings written over some of a step's token embeddings (images' tokens), after any embedding scale:
    `index` `[n]` flat token indices of the step, `embeds` `[n, C]`; `spans`: runs among them that attend to
    each other both ways (Gemma 3's images, models/vision/span_attention.py); `rope_positions` `[3, n]`: their
    M-RoPE (temporal, height, width) positions (models/mrope.py), None for other models."""

    index: torch.Tensor
    embeds: torch.Tensor
    spans: list[BidirectionalSpan] = field(default_factory=list)
    rope_positions: torch.Tensor | None = None
