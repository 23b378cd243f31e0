"""Stored Responses-API responses on the bus: a JetStream key-value bucket `{ns}-responses` that every entry replica
reads and writes, so any replica continues any conversation and an entry restart loses nothing.

One key per response (`resp_...`), its value the JSON record the entry keeps (bus-agnostic here: a dict). The
bucket's stream keeps each key's last value only, drops values older than the TTL, and holds at most `max_bytes`
(the oldest records go first when it is full). Who owns a record is the entry's business: it stores a hash of the
caller's API key, never the key (`key_hash`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any, Callable

import nats.errors
import nats.js.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from ringserve.bus.jetstream_bucket import JetStreamBucket

DEFAULT_TTL_SECONDS = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class StoreUnavailable(Exception):
    """The bucket cannot be reached (no JetStream, or its API does not answer)."""


def bucket_name(namespace: str) -> str:
    """The bucket of namespace `namespace`'s stored responses."""
    return f"{namespace}-responses"


def store_api(namespace: str) -> tuple[str, ...]:
    """The subjects an entry publishes to for the bucket: create and inspect its stream, get a key's last value
    (direct or through the API), write and delete keys; nothing of any other stream."""
    stream = f"KV_{bucket_name(namespace)}"
    api = "$JS.API"
    return (f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>", f"$KV.{bucket_name(namespace)}.>")


def key_hash(api_key: str | None) -> str | None:
    """What a record stores of its creator's API key: a SHA-256 hex digest (None without a key)."""
    return None if api_key is None else hashlib.sha256(api_key.encode("utf-8")).hexdigest()


class ResponseStore(JetStreamBucket):
    """The bucket over one NATS connection (`connection()` gives the nats-py client), opened (created if missing)
    on first use."""

    unavailable = StoreUnavailable
    what = "the response store"

    def __init__(self, connection: Callable[[], Any], namespace: str, ttl: float = DEFAULT_TTL_SECONDS,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(connection, bucket_name(namespace), ttl, max_bytes)

    async def _open(self) -> Any:
        # the KV layout nats-py makes (create_key_value), but a full bucket drops its oldest records
        config = StreamConfig(name=f"KV_{self.bucket}", subjects=[f"$KV.{self.bucket}.>"], allow_direct=True,
                              allow_rollup_hdrs=True, deny_delete=True, discard=DiscardPolicy.OLD,
                              duplicate_window=min(120.0, self.ttl), max_age=self.ttl, max_bytes=self.max_bytes,
                              max_msgs_per_subject=1, max_msgs=-1, max_consumers=-1, storage=StorageType.FILE)
        return await self.open_with(config, lambda js: js.key_value(self.bucket))

    async def get(self, response_id: str) -> dict[str, Any] | None:
        """The record stored under `response_id`; None if there is none (never stored, deleted or expired)."""
        kv = await self._call(self._open())
        try:
            entry = await self._call(kv.get(response_id))
        except nats.js.errors.KeyNotFoundError:
            return None
        return json.loads(entry.value) if entry.value else None

    async def put(self, record: dict[str, Any]) -> None:
        """Store `record` under its `id` (replacing what was there)."""
        kv = await self._call(self._open())
        await self._call(kv.put(record["id"], json.dumps(record, ensure_ascii=False).encode("utf-8")))

    async def delete(self, response_id: str) -> None:
        """Forget `response_id`."""
        kv = await self._call(self._open())
        await self._call(kv.purge(response_id))

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except StoreUnavailable:
            raise
        except nats.js.errors.KeyNotFoundError:
            raise
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"the response store (JetStream bucket {self.bucket}) failed: {exc!r}") from exc
