"""A session with one ring over NATS: connect (saying why a connection was refused), submit requests and read
their outputs, abort them on close. Bus level, so `ringserve submit` (actors/launcher/submit_cmd.py) and the
Python `ringserve.Client` (which adds generation helpers and operator commands on top) share it.

Two identities: a NATS client `c` (a user from `ringserve serve --nats-client c`) submits on its own
`{ns}.client.c.*` subjects; without a client name the session speaks on the unscoped subjects as the HTTP entry
does. A client's credentials file (JSON) notes its name, namespace and URL. A request refused because the ring
is at its admission cap (503 with `retry_after`) is retried after that many seconds, up to `busy_retries` times.
"""

from __future__ import annotations

import asyncio
import json
import contextlib
import logging
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

from ringserve.bus.connection import BusConnection
from ringserve.bus.credentials import NatsCredentials, load_credentials_file
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import GenerateRequest, RequestOutput
from ringserve.bus.permissions import CLIENT_ROLE, inbox_prefix
from ringserve.bus.ring_client import RequestStream, RingClient, RingUnavailable
from ringserve.bus.subjects import Subjects, validate_rid

log = logging.getLogger("ringserve.session")
DEFAULT_URL = "nats://127.0.0.1:4222"
CLIENT_IN_FLIGHT = 128  # below the scheduler's default --max-client-requests (256)
ENTRY_IN_FLIGHT = 512  # below its default --max-live-requests (1024)
RECONNECT_ATTEMPTS = 60  # once connected: as the actors, ~30 s of NATS outage before the connection is given up


def _credential_notes(path: str | Path) -> dict[str, Any]:
    """The notes of a ringserve JSON credentials file (`client`, `namespace`, `url`); {} for a NATS .creds file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

class RingSession:
    """An async connection to one ring (one namespace on one NATS): `async with RingSession(...)`."""
    """An async connection to one ring (one namespace on one NATS); use `async with Client(...) as client`."""

    def __init__(self, nats_url: str | None = None, namespace: str | None = None, creds: str | Path | None = None,
                 *, client: str | None = None, credentials: NatsCredentials | None = None,
                 submit_timeout: float = 30.0, stall_timeout: float | None = None, max_in_flight: int | None = None,
                 busy_retries: int = 30, served_model: str | None = None, name: str = "ringserve-client") -> None:
        """`creds`: a credentials file (ringserve JSON or a NATS .creds file); its notes give the defaults of
        `nats_url` (else nats://127.0.0.1:4222), `namespace` (else "ringserve") and `client` (else unscoped).
        `credentials`: the same, already loaded (the Engine passes the entry role's). `stall_timeout`: seconds
        a request may go without output before it fails with a 503 (None: never). `served_model`: the model
        name chat responses carry (default: the scheduler's, or the namespace)."""
        notes = self.notes = _credential_notes(creds) if creds is not None else {}
        self.url = nats_url or notes.get("url") or DEFAULT_URL
        self.subjects = Subjects(namespace or notes.get("namespace") or "ringserve")
        self.client = validate_rid(client) if client is not None else notes.get("client")
        self._credentials = credentials if credentials is not None else (
            load_credentials_file(creds) if creds is not None else None)
        self.submit_timeout = submit_timeout
        self.stall_timeout = stall_timeout
        self.max_in_flight = max_in_flight or (CLIENT_IN_FLIGHT if self.client else ENTRY_IN_FLIGHT)
        self.busy_retries = busy_retries
        self.served_model = served_model
        self._name = name
        self._ring: RingClient | None = None
        self._live: dict[str, RequestStream] = {}

    # --- connection ---------------------------------------------------------------------------------------

    async def connect(self) -> "RingSession":
        """Connect to NATS; raises ConnectionError saying why it failed (no server, refused credentials)."""
        if self._ring is not None:
            return self
        namespace = self.subjects.namespace
        inbox = inbox_prefix(namespace, CLIENT_ROLE, self.client) if self.client else inbox_prefix(namespace, "entry")
        try:
            bus = await BusConnection.connect(self.url, self._name, credentials=self._credentials, inbox_prefix=inbox,
                                              max_reconnect_attempts=1)
        except Exception as exc:  # nats-py raises unrelated types for a refused, absent or unauthorized server
            raise ConnectionError(f"cannot connect to NATS at {self.url}: {await self._why_refused()} "
                                  f"({exc!r})") from exc
        bus.client.options["max_reconnect_attempts"] = RECONNECT_ATTEMPTS  # fail fast at first, then ride out blips
        self._ring = RingClient(bus, self.subjects, self.submit_timeout, self.stall_timeout, client=self.client)
        if not self.client:  # an operator: commands go to every replica, so count them
            await self._ring.track_replicas()
        return self

    async def _why_refused(self) -> str:
        """Why the connection failed: nothing listens there, or the server refused these credentials."""
        first = urlsplit(self.url.split(",")[0].strip())
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(first.hostname, first.port or 4222), 3)
        except (OSError, asyncio.TimeoutError):
            return "no NATS server answers there"
        writer.close()
        if self._credentials is None:
            return ("the server refused the connection: a NATS with auth needs credentials (creds=FILE; "
                    "`ringserve submit --creds FILE`), e.g. a client's file, which `ringserve serve --nats-client "
                    "NAME` writes and logs (`nats client credentials client=NAME file=...`)")
        return "the server refused these credentials, or the TLS settings"

    async def close(self) -> None:
        """Abort every request still running and close the connection."""
        ring, self._ring = self._ring, None
        if ring is None:
            return
        for stream in list(self._live.values()):
            with contextlib.suppress(Exception):
                await stream.abort("client closed")
        self._live.clear()
        with contextlib.suppress(Exception):
            await ring.bus.close()

    async def fail_all(self, error: ApiError) -> None:
        """End every running request with `error` now (and abort it): what the Engine does when the ring dies."""
        for stream in list(self._live.values()):
            with contextlib.suppress(Exception):
                await stream.fail(error, "ring failed")

    async def __aenter__(self) -> "RingSession":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def ring(self) -> RingClient:
        if self._ring is None:
            raise RuntimeError("not connected: use `async with` or `await client.connect()`")
        return self._ring

    @property
    def live_requests(self) -> int:
        """Requests of this client not finished yet."""
        return len(self._live)

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request` and yield the ring's RequestOutput messages for it as they arrive, the last one
        terminal (`finish` or `error`); a refusal because the ring is busy is retried (`busy_retries`). Closing
        the iterator early (`contextlib.aclosing`) aborts the request."""
        ring = self.ring
        for attempt in range(self.busy_retries + 1):
            stream = ring.stream(request.rid)
            if stream.rid in self._live:
                raise ApiError(f"request id {request.rid!r} is already in use", param="rid")
            self._live[stream.rid] = stream
            try:
                try:
                    await ring.open(stream, request)
                except RingUnavailable as exc:
                    raise ApiError(str(exc), 503, type="server_error") from exc
                first = await stream.next()
                busy = first.error is not None and first.error.retry_after is not None
                if busy and attempt < self.busy_retries:
                    await asyncio.sleep(first.error.retry_after or 1)  # type: ignore[union-attr]
                    continue
                yield first
                while not stream.finished:
                    yield await stream.next()
                return
            finally:
                del self._live[stream.rid]
                if not stream.finished:
                    await asyncio.shield(stream.abort("client"))
