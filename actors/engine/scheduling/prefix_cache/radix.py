"""The radix-tree prefix cache (SGLang's RadixCache with page size 1).

Each edge of the tree carries a run of token ids and the KV slots holding them; the path from the root to a
node spells a cached prefix. Handles point at node boundaries (a match that ends inside an edge splits it),
and locking a handle pins every node on its path. Eviction frees least-recently-used unlocked leaves, which
may turn their parents into evictable leaves.

Requests with a `cache_salt` get a tree of their own per salt (a root of its own, evicted from like the
others): a salted prompt matches only prompts inserted with the same salt, so one tenant cannot learn from
its time to first token whether another sent a prompt. A salted tree's block hashes chain to the salt's seed
(`ringserve.bus.kv_blocks.salt_seed`), as the router computes them.

The cache also keeps the identity of every whole `BLOCK`-token block it holds (`ringserve.bus.kv_blocks`, the chained
hashes the tokenizers' router matches prompts by): each node owns the blocks whose last token lies on its
edge. It records which blocks were stored and evicted since the last `take_block_events`, netted (a block
stored and evicted again in between is not reported), so the scheduler can publish them as KV events.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ringserve.actors.engine.scheduling.prefix_cache.base import BasePrefixCache, PrefixHandle
from ringserve.bus.kv_blocks import BLOCK, block_hashes, salt_seed


class RadixNode:
    """One edge of the tree: `key` token ids, `value` their slots `[len(key)]`, children keyed by first token."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "uid", "depth", "blocks")

    def __init__(self, key: list[int], value: torch.Tensor, parent: RadixNode | None, uid: int,
                 depth: int = 0) -> None:
        self.key = key
        self.value = value
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0  # handles locked at this node or below
        self.last_access = 0
        self.uid = uid  # creation order; breaks LRU ties deterministically
        self.depth = depth  # tokens on the path above this edge
        self.blocks: list[bytes] = []  # hashes of the whole blocks whose last token is on this edge


@dataclass(eq=False)
class RadixHandle(PrefixHandle):
    """A match ending at `node`: the prefix is the path root..node."""

    node: RadixNode


class RadixPrefixCache(BasePrefixCache):
    """A radix tree of cached prefixes with reference-counted pins and LRU leaf eviction."""

    caches = True

    def __init__(self, device: str | torch.device, block: int = BLOCK) -> None:
        """`block`: tokens per reported block (`ringserve.bus.kv_blocks.BLOCK`, what the router hashes)."""
        self.device = torch.device(device)
        self.block = block
        # block hash -> whether it was held at the last take_block_events (only blocks that changed since)
        self._block_changes: dict[bytes, bool] = {}
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._uids = itertools.count()
        self._clock = 0
        self.root = RadixNode([], self._empty, None, next(self._uids))
        self._salted: dict[str, RadixNode] = {}  # cache_salt -> the root of its own tree
        self._seeds: dict[int, bytes] = {}  # a salted root's uid -> what its first block hash chains to
        self._evictable = 0
        self._protected = 0
        # told each evicted node's whole blocks, `(hash, slots)`, before their slots are freed (the KV tier)
        self.on_evict: Callable[[list[tuple[bytes, torch.Tensor]]], None] | None = None
        # told each new leaf's whole blocks, `(hash, slots)`, once inserted (the KV tier's write-through)
        self.on_store: Callable[[list[tuple[bytes, torch.Tensor]]], None] | None = None

    # --- matching and inserting -------------------------------------------------------------------------

    def match_prefix(self, ids: Sequence[int], salt: str | None = None) -> tuple[PrefixHandle, torch.Tensor]:
        node, length, values = self._walk(_as_list(ids), self._root_for(salt))
        slots = torch.cat(values) if values else self._empty
        return RadixHandle(cached_len=length, node=node), slots

    def insert_prefix(self, ids: Sequence[int], slots: torch.Tensor, salt: str | None = None) -> int:
        ids = _as_list(ids)
        if slots.dim() != 1 or slots.numel() < len(ids):
            raise ValueError(f"need a 1-D slot tensor of at least {len(ids)} entries, got shape {tuple(slots.shape)}")
        node, present, _ = self._walk(ids, self._root_for(salt))
        if present < len(ids):
            # Copy: the caller's tensor is often a view of its page-table row, which it will overwrite.
            value = slots[present : len(ids)].to(device=self.device, dtype=torch.int64, copy=True)
            leaf = RadixNode(ids[present:], value, node, next(self._uids), present)
            leaf.last_access = self._clock
            node.children[ids[present]] = leaf
            self._evictable += len(leaf.key)
            self._store_blocks(leaf, ids)
            if self.on_store is not None and leaf.blocks:
                self.on_store(self._block_slots(leaf))
        return present

    def _store_blocks(self, leaf: RadixNode, ids: list[int]) -> None:
        """Give a new leaf the hashes of the blocks ending on its edge, chained to the last block above it."""
        b = self.block
        first, end = leaf.depth // b, (leaf.depth + len(leaf.key)) // b
        if end <= first:
            return
        above = leaf.parent
        assert above is not None
        while above.parent is not None and not above.blocks:
            above = above.parent
        prev = above.blocks[-1] if above.blocks else self._seeds.get(above.uid, b"")  # a root: its seed
        leaf.blocks = block_hashes(ids[: end * b], b, prev, first * b)
        changes = self._block_changes
        for h in leaf.blocks:
            if changes.get(h) is True:  # evicted and stored again since the last report: no change
                del changes[h]
            else:
                changes[h] = False

    def _evict_blocks(self, node: RadixNode) -> None:
        changes = self._block_changes
        for h in node.blocks:
            if changes.get(h) is False:  # stored and evicted again since the last report: no change
                del changes[h]
            else:
                changes[h] = True

    def take_block_events(self) -> tuple[list[bytes], list[bytes]]:
        changes, self._block_changes = self._block_changes, {}
        return [h for h, held in changes.items() if not held], [h for h, held in changes.items() if held]

    def held_blocks(self) -> list[bytes]:
        return [h for node in self._nodes() for h in node.blocks]

    def cached_blocks(self) -> Iterator[tuple[bytes, torch.Tensor]]:
        # A walk touches every node it passes, so a node is never used more recently than its parent: ordered by
        # last use, then depth, a node's blocks come after those of its whole prefix.
        nodes = sorted((n for n in self._nodes() if n.blocks), key=lambda n: (-n.last_access, n.depth, n.uid))
        for node in nodes:
            yield from self._block_slots(node)

    def _root_for(self, salt: str | None) -> RadixNode:
        """The root of `salt`'s tree (made on first use); the shared root without one."""
        if salt is None:
            return self.root
        root = self._salted.get(salt)
        if root is None:
            root = self._salted[salt] = RadixNode([], self._empty, None, next(self._uids))
            self._seeds[root.uid] = salt_seed(salt)
        return root

    def _is_root(self, node: RadixNode) -> bool:
        return node is self.root or node.uid in self._seeds

    def _walk(self, ids: list[int], root: RadixNode) -> tuple[RadixNode, int, list[torch.Tensor]]:
        """Follow `ids` down from `root`, touching each node passed and splitting the edge a match ends in.

        Returns the deepest node whose path is a prefix of `ids`, that path's length, and its slot runs.
        """
        self._clock += 1
        now = self._clock
        node = root
        node.last_access = now
        pos = 0
        values: list[torch.Tensor] = []
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            matched = _common_prefix_len(child.key, ids, pos)
            partial = matched < len(child.key)
            if partial:
                child = self._split(child, matched)
            child.last_access = now
            values.append(child.value)
            node = child
            pos += matched
            if partial:
                break
        return node, pos, values

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node`'s edge after `at` tokens; returns the new upper node. Sizes and pins are unchanged."""
        upper = RadixNode(node.key[:at], node.value[:at], node.parent, next(self._uids), node.depth)
        split_blocks = (node.depth + at) // self.block - node.depth // self.block  # those ending on the upper part
        upper.blocks, node.blocks = node.blocks[:split_blocks], node.blocks[split_blocks:]
        node.depth += at
        upper.lock_ref = node.lock_ref  # every handle locked through `node` also passes through `upper`
        upper.last_access = node.last_access
        node.parent.children[node.key[0]] = upper  # type: ignore[union-attr]  # never the root
        node.key = node.key[at:]
        node.value = node.value[at:]  # views of one tensor: values are never written in place
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # --- pins ---------------------------------------------------------------------------------------------

    def lock(self, handle: PrefixHandle) -> None:
        node: RadixNode | None = self._node_of(handle)
        if node.parent is None and not self._is_root(node):  # evicted, or a salted root since dropped
            raise RuntimeError("lock of a stale prefix handle: its node was evicted")
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: PrefixHandle) -> None:
        node: RadixNode | None = self._node_of(handle)
        if node.lock_ref <= 0:
            raise RuntimeError("unlock of a prefix handle that is not locked")
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    def _node_of(self, handle: PrefixHandle) -> RadixNode:
        if not isinstance(handle, RadixHandle):
            raise TypeError(f"not a handle of the radix prefix cache: {handle!r}")
        return handle.node

    # --- eviction -------------------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= 0:
            return self._empty
        heap = [
            (n.last_access, n.uid, n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0 and not self._is_root(n)
        ]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            if self.on_evict is not None and node.blocks:
                self.on_evict(self._block_slots(node))
            del parent.children[node.key[0]]
            node.parent = None  # marks handles to it stale
            self._evict_blocks(node)
            freed.append(node.value)
            count += len(node.key)
            self._evictable -= len(node.key)
            if not self._is_root(parent) and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        self._drop_empty_salts()
        return torch.cat(freed) if freed else self._empty

    def _block_slots(self, node: RadixNode) -> list[tuple[bytes, torch.Tensor]]:
        """`node`'s whole blocks with the slots of their tokens (a block's head may lie on edges above)."""
        path: list[torch.Tensor] = []
        above: RadixNode | None = node
        while above is not None:
            path.append(above.value)
            above = above.parent
        slots = torch.cat(path[::-1])
        first, b = node.depth // self.block, self.block
        return [(h, slots[(first + i) * b:(first + i + 1) * b]) for i, h in enumerate(node.blocks)]

    def _drop_empty_salts(self) -> None:
        """Forget the salted trees left empty and unpinned (a salt per request must not grow the cache)."""
        for salt, root in list(self._salted.items()):
            if not root.children and root.lock_ref == 0:
                del self._salted[salt], self._seeds[root.uid]

    # --- accounting -----------------------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def all_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(values) if values else self._empty

    def _nodes(self) -> Iterator[RadixNode]:
        stack = [self.root, *self._salted.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        for root in (self.root, *self._salted.values()):
            assert root.parent is None and root.key == [] and root.value.numel() == 0, "roots must be empty and parentless"
        assert {r.uid for r in self._salted.values()} == set(self._seeds), "every salted root has its seed"
        evictable = protected = 0
        values: list[torch.Tensor] = []
        for node in self._nodes():
            where = f"node {node.uid} (key {node.key[:8]}{'...' if len(node.key) > 8 else ''})"
            assert node.lock_ref >= 0, f"{where}: negative lock count {node.lock_ref}"
            value = node.value
            assert value.dtype == torch.int64 and value.dim() == 1, f"{where}: slots must be 1-D int64"
            assert len(node.key) == value.numel(), f"{where}: {len(node.key)} tokens but {value.numel()} slots"
            end = node.depth + len(node.key)
            assert len(node.blocks) == end // self.block - node.depth // self.block, (
                f"{where}: {len(node.blocks)} block hashes for tokens [{node.depth}, {end})")
            for first, child in node.children.items():
                assert child.key, f"{where}: child {child.uid} has an empty key"
                assert child.key[0] == first, f"{where}: child {child.uid} filed under {first}, starts {child.key[0]}"
                assert child.parent is node, f"{where}: child {child.uid} points at another parent"
                assert child.depth == end, f"{where}: child {child.uid} at depth {child.depth}, not {end}"
                assert child.lock_ref <= node.lock_ref, (
                    f"{where}: lock count {node.lock_ref} below child {child.uid}'s {child.lock_ref}"
                )
            if self._is_root(node):
                continue
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            values.append(value)
        assert evictable == self._evictable, f"evictable_size {self._evictable}, nodes hold {evictable} unlocked"
        assert protected == self._protected, f"protected_size {self._protected}, nodes hold {protected} locked"
        if values:
            slots = torch.cat(values)
            unique, counts = torch.unique(slots, return_counts=True)
            dup = unique[counts > 1]
            assert dup.numel() == 0, f"slots held more than once: {dup[:16].tolist()}"


def _as_list(ids: Sequence[int]) -> list[int]:
    if isinstance(ids, list):
        return ids
    if isinstance(ids, torch.Tensor):
        return ids.tolist()
    return list(ids)


def _common_prefix_len(key: list[int], ids: list[int], start: int) -> int:
    """How many leading tokens of `key` equal `ids[start:]`."""
    end = start + len(key)
    if ids[start:end] == key:  # the common case, compared in C
        return len(key)
    n = min(len(key), len(ids) - start)
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i
