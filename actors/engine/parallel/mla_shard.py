"""Latent attention over tensor-parallel ranks: placeholder until models/mla.py lands."""

from __future__ import annotations

from typing import Any

from ringserve.actors.engine.parallel.tensor_parallel import TPGroup


def shard_latent_attention(attn: Any, group: TPGroup) -> None:
    """Keep `group.rank`'s heads of a `LatentAttention` (not implemented yet)."""
    raise NotImplementedError("latent attention is not sharded yet")
