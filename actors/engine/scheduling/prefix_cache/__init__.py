"""The engine's prefix cache: token-id prefixes mapped to the KV-pool slots that hold them (page size 1).

`create_prefix_cache(enabled, device)` gives a `RadixPrefixCache` when caching is on and a
`NaivePrefixCache` (which holds nothing) when it is off; both implement `BasePrefixCache`.
"""

from __future__ import annotations

import torch

from ringserve.actors.engine.scheduling.prefix_cache.base import BasePrefixCache, PrefixHandle
from ringserve.actors.engine.scheduling.prefix_cache.naive import NaiveHandle, NaivePrefixCache
from ringserve.actors.engine.scheduling.prefix_cache.radix import RadixHandle, RadixNode, RadixPrefixCache

__all__ = [
    "BasePrefixCache",
    "NaiveHandle",
    "NaivePrefixCache",
    "PrefixHandle",
    "RadixHandle",
    "RadixNode",
    "RadixPrefixCache",
    "create_prefix_cache",
]


def create_prefix_cache(enabled: bool, device: str | torch.device) -> BasePrefixCache:
    """The radix cache when `enabled`, else the naive one; slot tensors live on `device`."""
    return RadixPrefixCache(device) if enabled else NaivePrefixCache(device)
