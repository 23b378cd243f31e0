"""A replica's KV blocks for another replica, and another replica's blocks into this one's tier.

What crosses replicas is whole `BLOCK`-token blocks of a prompt's prefix, as the pool holds them (K then V of
every layer), keyed like the tier's own blocks (`KVTier.key`: the tier namespace and the chained block hash
under the request's cache key). A holder exports them from its prefix cache (the blocks still in the pool) and
then from its tier store; the asker puts what it fetched into its tier store, from which admission loads it
exactly as it loads an evicted block of its own (`CacheManager._load_from_tier`). All three run on the engine's
thread, between steps.
"""

from __future__ import annotations

from typing import Sequence

from ringserve.actors.engine.lora.serving import LoraServing
from ringserve.actors.engine.models.rope import RopeLengthRule
from ringserve.actors.engine.scheduling.cache_manager import CacheManager
from ringserve.bus.kv_blocks import block_hashes, cache_namespace, salt_seed
from ringserve.bus.messages import TokenizedRequest


def held_blocks(cache: CacheManager, ids: Sequence[int], cache_key: str | None) -> int:
    """How many leading whole blocks of `ids` this replica holds: in its prefix cache, then its tier."""
    tier = cache.tier
    assert tier is not None
    b = tier.block
    handle, _ = cache.prefix_cache.match_prefix(ids[: len(ids) // b * b], cache_key)
    cached = handle.cached_len // b
    hashes = block_hashes(ids[: len(ids) // b * b], b, salt_seed(cache_key))
    return cached + tier.present(hashes[cached:])


def export_blocks(cache: CacheManager, ids: Sequence[int], cache_key: str | None, first: int, count: int,
                  budget: int) -> list[bytes]:
    """Blocks `[first, first + count)` of `ids` (from the first, up to the first this replica lacks), at most
    `budget` bytes of them (at least one block)."""
    tier = cache.tier
    assert tier is not None
    b = tier.block
    end = min(first + count, len(ids) // b)
    handle, slots = cache.prefix_cache.match_prefix(ids[: end * b], cache_key)
    in_pool = handle.cached_len // b
    out: list[bytes] = []
    size = 0
    hashes = block_hashes(ids[: end * b], b, salt_seed(cache_key))
    for i in range(first, end):
        payload = tier.payload(slots[i * b:(i + 1) * b]) if i < in_pool else tier.store.get(tier.key(hashes[i]))
        if payload is None or (out and size + len(payload) > budget):
            break
        out.append(payload)
        size += len(payload)
    return out


def import_blocks(cache: CacheManager, ids: Sequence[int], cache_key: str | None, first: int,
                  payloads: list[bytes]) -> None:
    """Keep fetched blocks `first, first + 1, ...` of `ids` in this replica's tier store, where admitting the
    request finds them."""
    tier = cache.tier
    assert tier is not None
    b = tier.block
    hashes = block_hashes(ids[: (first + len(payloads)) * b], b, salt_seed(cache_key))
    for block_hash, payload in zip(hashes[first:], payloads):
        if len(payload) != tier.block_bytes:  # not this pool's layout: never loaded into it
            raise ValueError(f"a fetched KV block has {len(payload)} bytes; this pool's blocks have "
                             f"{tier.block_bytes}")
        tier.store.put(tier.key(block_hash), payload)


class KvShare:
    """The engine's side of KV sharing between replicas, run on its thread: the keys it shares under and the
    blocks it holds, exports and imports."""

    def __init__(self, cache: CacheManager, adapters: LoraServing, rope_rule: RopeLengthRule | None) -> None:
        """`rope_rule`: the model's (a length-dependent rotary keys long prompts apart), None for most."""
        self.cache, self.adapters, self.rope_rule = cache, adapters, rope_rule

    def namespace(self) -> str | None:
        """The KV tier's namespace (what this replica's KV depends on), None without a tier: blocks cross
        replicas only between equal namespaces."""
        return self.cache.tier.namespace if self.cache.tier is not None else None

    def cache_key(self, request: TokenizedRequest) -> str | None:
        """The prefix-cache tree `request`'s KV belongs to (`Req.cache_key`, as admission will key it)."""
        rule, length = self.rope_rule, len(request.input_ids)
        return cache_namespace(request.sampling.cache_salt, self.adapters.cache_name(request.sampling.lora_name),
                               None if rule is None else rule.cache_name(length))

    def held_blocks(self, ids: list[int], cache_key: str | None) -> int:
        """Leading whole blocks of `ids` this replica holds, in the pool or the tier."""
        return held_blocks(self.cache, ids, cache_key)

    def export_blocks(self, ids: list[int], cache_key: str | None, first: int, count: int,
                      budget: int) -> list[bytes]:
        """Blocks `[first, first + count)` of `ids` for another replica, at most `budget` bytes."""
        return export_blocks(self.cache, ids, cache_key, first, count, budget)

    def import_blocks(self, ids: list[int], cache_key: str | None, first: int, payloads: list[bytes]) -> None:
        """Keep blocks fetched from another replica in the tier, for admission to load."""
        import_blocks(self.cache, ids, cache_key, first, payloads)
