"""Image tokens that attend to each other both ways (Gemma 3), over any attention backend.

transformers masks a Gemma 3 prompt with `token_type_ids`: each image's run of tokens sees the whole run, the
rest stays causal (sliding layers keep their window on past keys). `SpanAttention` wraps the step's backend: the
backend stores the step's keys and values and attends causally as always, then each span's queries attend again
over their request's keys up to the span's end, read from the pool, and replace the causal rows. A span is always
whole within a step (the engine never splits such an image across prefill chunks), so its later keys are in the
pool by then.
"""

from __future__ import annotations

from typing import Any

import torch

from ringserve.actors.engine.core.embed_override import BidirectionalSpan
from ringserve.kernels.attention import AttentionBackend, AttentionMetadata


class SpanAttention:
    """`backend` for one forward, with `spans` attending bidirectionally; everything else is the backend's."""

    def __init__(self, backend: AttentionBackend, spans: list[BidirectionalSpan]) -> None:
        self.backend = backend
        self.spans = spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                meta: AttentionMetadata) -> torch.Tensor:
        """The backend's attention `[T, H, D]`, each span's rows recomputed with the span visible to itself."""
        out = self.backend.forward(q, k, v, layer, meta).clone()
        for span in self.spans:
            rows = slice(span.first, span.first + span.length)
            out[rows] = self._attend(q[rows], layer, span).to(out.dtype)
        return out

    def _attend(self, q: torch.Tensor, layer: int, span: BidirectionalSpan) -> torch.Tensor:
        spec = self.backend.layers[layer]
        keys = self.backend.k_pool[layer][span.key_slots].float()  # [K, Hkv, D]
        values = self.backend.v_pool[layer][span.key_slots].float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [K, H, D]
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * spec.scale  # [H, Q, K]
        if spec.soft_cap is not None:
            scores = torch.tanh(scores / spec.soft_cap) * spec.soft_cap
        device = q.device
        query_pos = torch.arange(span.position, span.position + span.length, device=device)[:, None]
        key_pos = torch.arange(keys.shape[0], device=device)[None, :]
        allowed = (key_pos <= query_pos) | (key_pos >= span.position)  # causal, or later in the image
        if spec.window is not None:
            allowed &= key_pos > query_pos - spec.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
