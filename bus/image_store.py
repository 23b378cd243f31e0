"""Image bytes on the bus: a JetStream object store bucket `{ns}-images` that carries what the request messages only
name by handle.

Two kinds of objects, both named by the sha256 of their content, so the same image is stored once however often it
comes: `raw-<sha256>` holds an image file as a client sent it (the entry puts it, the tokenizer reads it) and
`px-<sha256>` the processed tensors of one image (`bus/tensor_codec.py`; the tokenizer puts them, the scheduler
reads them; the hash is `ImageRef.hash`). A reader checks that the content it got hashes to its name.

The bucket keeps objects `ttl` seconds (the stream's max age) and at most `max_bytes` (the oldest go first when it is
full), so nothing grows without bound; an object is put again when its copy is older than half the TTL, so a
request never finds one about to expire. A handle that finds nothing is `ImageMissing`: an error for that request.

Each named NATS client `c` (bus/permissions.py) has a bucket of its own, `{ns}-client-c-images`
(`client_bucket_name`), for the files it sends: only it may write there, and the tokenizer resolves the raw handles
of a submission on `{ns}.client.c.submit` there alone (`client_reader`: read only, never created by the reader), so
no client reads or overwrites another's (or an HTTP user's) images. Processed tensors go to the shared bucket.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import datetime
from typing import Any, Callable

import nats.errors
import nats.js.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from ringserve.bus.jetstream_bucket import JetStreamBucket
from ringserve.bus.subjects import validate_rid

DEFAULT_TTL_SECONDS = 3600.0
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
GET_SECONDS = 20.0  # an object's chunks come through an ordered consumer; missing chunks would wait forever
RAW_PREFIX = "raw-"
TENSORS_PREFIX = "px-"


class ImageMissing(Exception):
    """A handle names no object (never put, expired, dropped when the bucket was full, or corrupt)."""


class ImageStoreUnavailable(Exception):
    """The bucket cannot be reached (no JetStream, or its API does not answer)."""


def bucket_name(namespace: str) -> str:
    """The image bucket of namespace `namespace`."""
    return f"{namespace}-images"


def client_bucket_name(namespace: str, client: str) -> str:
    """The image bucket of named NATS client `client` in namespace `namespace`."""
    return f"{namespace}-client-{validate_rid(client)}-images"


def image_store_api(bucket: str, read_only: bool = False) -> tuple[str, ...]:
    """The subjects a role publishes to for image bucket `bucket`: inspect its stream, read an object's meta
    (direct or through the API), read its chunks through an ordered consumer; unless `read_only`, also create the
    stream, write chunks and meta, purge the chunks an object's new copy replaces; nothing of any other stream."""
    stream = f"OBJ_{bucket}"
    api = "$JS.API"
    read = (f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}", f"{api}.DIRECT.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}.>", f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
            f"{api}.CONSUMER.DELETE.{stream}.*", f"$JS.FC.{stream}.>")
    if read_only:
        return read
    return (f"{api}.STREAM.CREATE.{stream}", *read, f"{api}.STREAM.PURGE.{stream}", f"$O.{bucket}.>")


def raw_handle(data: bytes) -> str:
    """The handle of an image file's bytes."""
    return RAW_PREFIX + hashlib.sha256(data).hexdigest()


def tensors_handle(image_hash: str) -> str:
    """The handle of the processed tensors of the image with hash `image_hash`."""
    return TENSORS_PREFIX + image_hash


class _NoBucket(Exception):
    """A reader found no bucket: nothing was ever put into it (or it was deleted)."""


class ImageStore(JetStreamBucket):
    """The bucket over one NATS connection (`connection()` gives the nats-py client), opened (created if missing,
    with this store's `ttl` and `max_bytes`) on first use: the shared one, or named client `client`'s. A store made
    with `create=False` only reads: it never creates the bucket, and a missing one holds no image."""

    unavailable = ImageStoreUnavailable
    what = "the image store"

    def __init__(self, connection: Callable[[], Any], namespace: str, ttl: float = DEFAULT_TTL_SECONDS,
                 max_bytes: int = DEFAULT_MAX_BYTES, *, client: str | None = None, create: bool = True) -> None:
        bucket = bucket_name(namespace) if client is None else client_bucket_name(namespace, client)
        super().__init__(connection, bucket, ttl, max_bytes)
        self.namespace = namespace
        self.create = create
        if client is not None:
            self.what = f"client {client}'s image store"

    def client_reader(self, client: str) -> "ImageStore":
        """A read-only store of client `client`'s bucket over this store's connection (what the tokenizer reads a
        client's image files from)."""
        return ImageStore(self._connection, self.namespace, client=client, create=False)

    async def open(self) -> Any:
        """The nats-py ObjectStore of the bucket, created if missing (unless this store only reads)."""
        if not self.create:
            if self.opened is None:  # no lock needed: opening twice gives the same store
                self.opened = await self._open_store(self.jetstream())
            return self.opened
        # nats-py's object store layout (create_object_store), but a full bucket drops its oldest objects
        config = StreamConfig(name=f"OBJ_{self.bucket}", subjects=[f"$O.{self.bucket}.C.>", f"$O.{self.bucket}.M.>"],
                              max_age=self.ttl, max_bytes=self.max_bytes, discard=DiscardPolicy.OLD,
                              allow_rollup_hdrs=True, allow_direct=True, storage=StorageType.FILE)
        return await self.open_with(config, self._open_store)

    async def _open_store(self, js: Any) -> Any:
        """The object store; this store's `ttl` becomes the bucket's own (the actor that made it set it, from
        `--image-ttl`), so `put_once` judges a copy's age by the TTL that expires it."""
        try:
            info = await js.stream_info(f"OBJ_{self.bucket}")
            if info.config.max_age:
                self.ttl = float(info.config.max_age)
            return await js.object_store(self.bucket)
        except nats.js.errors.NotFoundError as exc:
            if self.create:
                raise
            raise _NoBucket(self.bucket) from exc

    async def put_once(self, handle: str, data: bytes) -> bool:
        """Store `data` under `handle` unless a copy younger than half the TTL is there; whether it was put."""
        store = await self._call(self.open())
        try:
            info = await self._call(store.get_info(handle))
            if _age(info.mtime) < self.ttl / 2:
                return False
        except nats.js.errors.ObjectNotFoundError:
            pass
        await self._call(store.put(handle, data))
        return True

    async def put_raw(self, data: bytes) -> str:
        """Store an image file's bytes (once); its handle."""
        handle = raw_handle(data)
        await self.put_once(handle, data)
        return handle

    async def get(self, handle: str) -> bytes:
        """The bytes stored under `handle`, checked against the hash it is named by; ImageMissing if there are
        none (or they do not match)."""
        if not handle.startswith((RAW_PREFIX, TENSORS_PREFIX)):
            raise ImageMissing(f"{handle[:100]!r} is not an image handle")
        try:
            store = await self._call(self.open())
            info = await self._call(store.get_info(handle))
            data = await self._call(asyncio.wait_for(self._chunks(info.nuid, info.size), GET_SECONDS))
        except (nats.js.errors.ObjectNotFoundError, _NoBucket) as exc:
            raise ImageMissing(f"image {handle[:100]} is not in {self.what} (expired or never stored)") from exc
        except ImageStoreUnavailable as exc:
            if isinstance(exc.__cause__, asyncio.TimeoutError):
                raise ImageMissing(f"image {handle[:100]} could not be read whole in {GET_SECONDS:g}s") from exc
            raise
        if len(data) != info.size or hashlib.sha256(data).hexdigest() != handle.split("-", 1)[1]:
            raise ImageMissing(f"image {handle[:100]} does not hold what its name says")
        return data

    async def _chunks(self, nuid: str, size: int) -> bytes:
        """An object's chunks, read through an ordered consumer on its stream (named, so the role needs no
        right to look streams up by subject)."""
        if size == 0:
            return b""
        sub = await self.jetstream().subscribe(f"$O.{self.bucket}.C.{nuid}", stream=f"OBJ_{self.bucket}", ordered_consumer=True)
        data = bytearray()
        try:
            async for msg in sub.messages:
                data += msg.data
                if msg.metadata.num_pending == 0 or len(data) >= size:
                    break
        finally:
            await sub.unsubscribe()
        return bytes(data)

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (ImageStoreUnavailable, nats.js.errors.ObjectNotFoundError, _NoBucket):
            raise
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            raise ImageStoreUnavailable(f"the image store (JetStream bucket {self.bucket}) failed: {exc!r}") from exc


def _age(mtime: str | None) -> float:
    """Seconds since an object's `mtime` (ISO 8601); infinite when unknown."""
    try:
        return time.time() - datetime.fromisoformat(str(mtime).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("inf")
