"""A JetStream-backed bucket opened on first use: the common part of the stored responses' key-value bucket
(bus/response_store.py) and the images' object store (bus/image_store.py).

The first user creates the bucket's stream with its own settings (a TTL as the stream's max age, a size cap whose
oldest messages go first); a stream made by another actor, perhaps with other settings, is used as it is.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js.api import StreamConfig

API_SECONDS = 5.0


class JetStreamBucket:
    """One bucket over one NATS connection (`connection()` gives the nats-py client); `opened` is the handle
    `open_handle` made (a KeyValue, an ObjectStore), None until first use. `unavailable`: the exception raised
    when JetStream does not answer."""

    unavailable: type[Exception] = Exception
    what = "bucket"  # named in errors, e.g. "the response store"

    def __init__(self, connection: Callable[[], Any], bucket: str, ttl: float, max_bytes: int) -> None:
        self._connection = connection
        self.bucket = bucket
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.opened: Any = None
        self._lock = asyncio.Lock()

    async def open_with(self, config: StreamConfig, open_handle: Callable[[Any], Awaitable[Any]]) -> Any:
        """The bucket's handle: its stream created from `config` unless it exists, then `open_handle(js)`."""
        async with self._lock:
            if self.opened is not None:
                return self.opened
            js = self._connection().jetstream(timeout=API_SECONDS)
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError:
                pass  # made by another replica with other settings: use it as it is
            except (nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError,
                    nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                raise self.unavailable(f"{self.what} (JetStream bucket {self.bucket}) is unavailable: "
                                       f"{exc!r}") from exc
            self.opened = await open_handle(js)
            return self.opened

    def jetstream(self) -> Any:
        """The connection's JetStream context."""
        return self._connection().jetstream(timeout=API_SECONDS)
