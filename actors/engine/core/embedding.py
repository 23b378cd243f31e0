"""Embedding requests in the engine: a request with no output tokens whose result is its prompt's pooled
final-norm hidden state.

An embedding request is prefilled like any other (chunked, batched beside generation) with `max_new_tokens`
0, so it ends at the step that computes its prompt's last token. The runner asks the model for the hidden
states of the positions its pooling needs (`hidden_positions`) and folds them into the request's
`EmbedState` on the device (`pool_chunk`); the engine turns that into the vector of its last row.
`last` pooling needs only the last token's state, which is never taken from the prefix cache, so a cached
prefix is reused; `mean` needs every position's, so such a request takes nothing from the prefix cache
(`Req.prefix_limit` is 0) and computes the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.bus.errors import ApiError
from ringserve.bus.params import EmbedParams


@dataclass(eq=False)
class EmbedState:
    """One embedding request's pooling: the sum of its hidden states so far (`mean`) or the last one (`last`),
    a float32 tensor on the device, and how many positions went into it."""

    pooling: str
    normalize: bool
    total: torch.Tensor | None = None
    count: int = 0

    def vector(self) -> bytes:
        """The pooled (and, if asked, unit-length) vector as little-endian float32 bytes (waits for the device)."""
        assert self.total is not None and self.count > 0, "an embedding request ended before its prompt ran"
        v = self.total / self.count
        if self.normalize:
            v = v / v.norm().clamp_min(1e-12)
        return v.to("cpu", torch.float32).numpy().astype("<f4").tobytes()


def embed_state(params: EmbedParams, default_pooling: str, max_new_tokens: int) -> EmbedState | ApiError:
    """The state of a request asking for `params` (its pooling defaulting to the server's), or why it cannot
    run as an embedding request."""
    if max_new_tokens != 0:
        return ApiError(f"an embedding request generates nothing: max_new_tokens must be 0, got {max_new_tokens}",
                        param="max_new_tokens")
    return EmbedState(params.pooling or default_pooling, params.normalize)


def hidden_positions(states: list[EmbedState | None], starts: list[int], extend_lens: list[int],
                     samples: list[bool]) -> list[tuple[int, int, int]]:
    """`(row, flat index of the row's first position needed, count)` for each batch row whose hidden states its
    pooling needs this step: a `mean` row's every computed position, a `last` row's final prompt position
    (only in the chunk that reaches it, the one that samples)."""
    plan = []
    flat = 0
    for b, (state, n) in enumerate(zip(states, extend_lens)):
        if state is not None:
            if state.pooling == "mean":
                plan.append((b, flat, n))
            elif samples[b]:
                plan.append((b, flat + n - 1, 1))
        flat += n
    return plan


def pool_chunk(state: EmbedState, start: int, hidden: torch.Tensor) -> None:
    """Fold the hidden states `[n, C]` of the positions `[start, start + n)` a step computed into `state`."""
    rows = hidden.float()
    if state.pooling == "last":
        state.total, state.count = rows[-1], 1
    elif start == 0 or state.total is None:  # the prompt's first chunk (again, after a recompute)
        state.total, state.count = rows.sum(0), rows.shape[0]
    else:
        state.total, state.count = state.total + rows.sum(0), state.count + rows.shape[0]
