"""DeepSeek's multi-head latent attention (MLA): placeholder until the latent KV layout lands."""

from __future__ import annotations

from torch import nn

from ringserve.actors.engine.models.spec import LayerShape


class LatentAttention(nn.Module):
    """Multi-head latent attention over a KV pool holding each token's compressed latent and rotary key."""

    def __init__(self, shape: LayerShape, layer: int) -> None:
        super().__init__()
        raise NotImplementedError("latent attention is not implemented yet")
