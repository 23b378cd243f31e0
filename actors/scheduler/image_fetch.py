"""The scheduler's side of images: fetch a request's processed image tensors from the image store before the engine
takes it, each image once (a small LRU by hash), so the same image in many requests is read and decoded once.

A handle that finds nothing (expired, or dropped when the bucket was full) fails that request alone, with a 400
saying to send the image again; the store unreachable is a 503.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.image_store import ImageMissing, ImageStore, ImageStoreUnavailable
from ringserve.bus.images import ImageRef
from ringserve.bus.codec import DecodeError
from ringserve.bus.tensor_codec import decode_tensors

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


class ImageFetcher:
    """Fetches and decodes image tensors by `ImageRef`, keeping the most recent up to `cache_bytes`."""

    def __init__(self, store: ImageStore, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._store = store
        self._cache: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self._cached_bytes = 0
        self._cache_bytes = cache_bytes
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}  # one fetch per hash at a time
        self.fetched = 0  # images read from the store (the rest came from the cache)

    async def fetch(self, refs: list[ImageRef]) -> dict[str, dict[str, Any]]:
        """Each image's tensors by hash (what `EngineCore.add_request` takes); ApiError as the module says."""
        hashes = list(dict.fromkeys(ref.hash for ref in refs))
        by_hash = {ref.hash: ref for ref in refs}
        tensors = await asyncio.gather(*(self._one(by_hash[h]) for h in hashes))
        return dict(zip(hashes, tensors))

    async def _one(self, ref: ImageRef) -> dict[str, Any]:
        cached = self._cache.get(ref.hash)
        if cached is not None:
            self._cache.move_to_end(ref.hash)
            return cached[0]
        pending = self._pending.get(ref.hash)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[ref.hash] = future
        try:
            tensors = await self._read(ref)
            future.set_result(tensors)
            return tensors
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a fetch nobody else waits on must not log "never retrieved"
            raise
        finally:
            del self._pending[ref.hash]

    async def _read(self, ref: ImageRef) -> dict[str, Any]:
        try:
            data = await self._store.get(ref.handle)
            if ref.handle.split("-", 1)[1] != ref.hash:
                raise ImageMissing(f"handle {ref.handle[:100]} is not the image {ref.hash[:16]}...")
            tensors = decode_tensors(data)
        except (ImageMissing, DecodeError) as exc:
            raise ApiError(f"an image of the request is not available: {exc}; send the request again",
                           param="images") from exc
        except ImageStoreUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc
        self.fetched += 1
        self._cache[ref.hash] = (tensors, len(data))
        self._cached_bytes += len(data)
        while self._cached_bytes > self._cache_bytes and len(self._cache) > 1:
            _, (_, size) = self._cache.popitem(last=False)
            self._cached_bytes -= size
        return tensors
