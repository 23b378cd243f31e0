"""Scheduler replicas claim their id on the bus: the lowest free one, or the one asked for, never one held.

Each replica id of a namespace is a key of the JetStream key-value bucket `{ns}-replicas`
(`Subjects.replica_bucket`): key `"3"` holds replica 3's claim, a small JSON of who holds it (host, pid, the
pid's start time, boot and pid-namespace ids, and a random token). A claim is a KV `create`, which the server
refuses when the key exists, so of two schedulers claiming one id at the same moment exactly one wins; no
heartbeat window to race in. A scheduler without `--dp-replica-id` tries 0, 1, 2, ... and keeps the first it
creates. One with an id whose key is held waits to see whether the holder lives (below): if it does, it loses
(`ClaimError`, the worker exits 2); if the claim lapses, it takes it.

**Why a TTL refreshed by the holder, not a check against the heartbeat.** The bucket's `max_age` is TTL_SECONDS,
and the holder rewrites its key every REFRESH_SECONDS (`update` against its last revision) from a thread with
its own event loop and NATS connection, from the moment it claims (before the model loads, long before the
first heartbeat). The server drops a claim whose holder stopped refreshing, whatever the reason (killed, host
gone, partitioned), and no claimant has to judge from a short window of heartbeats whether a busy replica (a
long step, a graph compile: the ones issue 36 saw declared dead) or one still loading its model is alive.
A claimant sees a live holder within one refresh (the revision moves) and a dead one once its claim expires.
One shortcut: a holder on this same host and pid namespace whose process is gone (or is another process under
that pid) is dead now, so its key is taken over at once, with `update` against the revision read (two
claimants doing so race on that revision, and one wins). A launcher restarting a killed replica therefore
waits for no TTL.

The holder keeps its claim as long as its process lives: if a refresh finds the key expired (its thread was
starved for TTL_SECONDS, or NATS lost the bucket) it creates it again; if someone else holds it by then, the
holder has lost its id (`on_lost`: the scheduler exits, as two replicas with one id would both take that id's
requests). Its own stop deletes the key (`release`), so the id is free at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType

from ringserve.bus.connection import BusConnection
from ringserve.bus.credentials import NatsCredentials
from ringserve.bus.subjects import Subjects
from ringserve.observability.logging import log_event

log = logging.getLogger("replica_claim")
TTL_SECONDS = 10.0  # a claim not refreshed for this long expires (the bucket's max_age)
REFRESH_SECONDS = 2.0
POLL_SECONDS = 0.25  # how often a claimant of a held id looks again
MAX_AUTO_ID = 1023  # the highest id a scheduler without --dp-replica-id takes
CONNECT_SECONDS = 10.0
API_SECONDS = 5.0
JETSTREAM_PATIENCE_SECONDS = 30.0  # how long a claimant waits for a busy JetStream (a cluster electing a leader)
JETSTREAM_NOT_ENABLED = 10039  # JetStream's error code: not enabled for the account
NO_RESPONDERS_SECONDS = 3.0  # how long no JetStream API at all may last (a server still starting) before giving up


class ClaimError(Exception):
    """The id could not be claimed (held by a live replica, or every id up to MAX_AUTO_ID is)."""


class JetStreamUnavailable(ClaimError):
    """The NATS server has no JetStream, so ids cannot be claimed."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (/proc), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def my_identity() -> dict[str, Any]:
    """Who this process is, as its claims say it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
            "boot": _boot_id(), "pidns": _pid_namespace(), "token": secrets.token_hex(8)}


def dead_here(holder: dict[str, Any]) -> bool:
    """Whether `holder` (a claim's JSON) was a process of this host and pid namespace that no longer runs."""
    if not holder.get("boot") or holder.get("boot") != _boot_id() or holder.get("pidns") != _pid_namespace():
        return False
    if holder.get("host") != socket.gethostname():
        return False
    return _start_time(int(holder.get("pid", 0))) != holder.get("start")


def describe(holder: dict[str, Any]) -> str:
    """"pid 123 on host h" for a claim's JSON."""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"


async def open_bucket(js: Any, subjects: Subjects, patience: float = 0.0) -> Any:
    """The namespace's claims bucket (created when missing): memory storage, one value per key, TTL_SECONDS.
    Replicated three times on a cluster, once on a single server (which refuses replicas). JetStream busy (a
    cluster electing its leader answers 503, or not at all) is asked again for up to `patience` seconds."""
    started = asyncio.get_running_loop().time()
    while True:
        try:
            return await _open_bucket(js, subjects)
        except (nats.js.errors.ServiceUnavailableError, asyncio.TimeoutError, nats.errors.TimeoutError) as exc:
            waited = asyncio.get_running_loop().time() - started
            code = getattr(exc, "err_code", 0)
            if code == JETSTREAM_NOT_ENABLED:
                raise JetStreamUnavailable("JetStream is not enabled for this NATS account") from exc
            # nats-py reports "no responders" to the JetStream API as a 503 without a code: no JetStream there
            if code is None and waited >= min(patience, NO_RESPONDERS_SECONDS):
                raise JetStreamUnavailable("JetStream is not enabled on this NATS server") from exc
            if waited >= patience:
                raise
            await asyncio.sleep(POLL_SECONDS)


async def _open_bucket(js: Any, subjects: Subjects) -> Any:
    config = KeyValueConfig(bucket=subjects.replica_bucket(), history=1, ttl=TTL_SECONDS, storage=StorageType.MEMORY,
                            description="ringserve scheduler replica ids (bus/replica_claim.py)")
    last: Exception | None = None
    for replicas in (3, 1):
        try:
            return await js.create_key_value(config, replicas=replicas)
        except nats.js.errors.ServiceUnavailableError:  # busy, or not enabled: open_bucket decides
            raise
        except nats.js.errors.APIError as exc:  # no cluster for 3 (code 500), or it exists as another config
            last = exc
    try:
        return await js.key_value(subjects.replica_bucket())  # made before with another configuration: use it
    except nats.js.errors.BucketNotFoundError:
        raise ClaimError(f"could not create the replica-claims bucket: {last}") from last


async def _holder(kv: Any, key: str) -> tuple[dict[str, Any], int] | None:
    """The claim now in `key` and its revision, or None when the key is free."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    try:
        return json.loads(entry.value or b"{}"), entry.revision
    except ValueError:
        return {}, entry.revision


async def _try(kv: Any, key: str, value: bytes) -> tuple[int | None, dict[str, Any] | None]:
    """One attempt at `key`: (our revision, None) when claimed, (None, holder) when a live-looking holder has it.
    A holder that died on this host is taken over."""
    for _ in range(3):  # the key may expire between the create and the read
        try:
            return await kv.create(key, value), None
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        found = await _holder(kv, key)
        if found is not None:
            break
    else:
        return None, {}
    holder, revision = found
    if dead_here(holder):
        try:
            return await kv.update(key, value, last=revision), None
        except nats.js.errors.KeyWrongLastSequenceError:  # another claimant took it over first
            found = await _holder(kv, key)
            return None, (found[0] if found else {})
    return None, holder


async def claim(kv: Any, replica: int | None, identity: dict[str, Any], wait: float = TTL_SECONDS + 2 * POLL_SECONDS
                ) -> tuple[int, int]:
    """Claim `replica` (None: the lowest free id) in bucket `kv`; (the id, the claim's revision). Raises
    ClaimError when `replica` stays held by a live holder (its claim refreshed within `wait` seconds)."""
    value = json.dumps(identity).encode()
    if replica is None:
        for candidate in range(MAX_AUTO_ID + 1):
            revision, _ = await _try(kv, str(candidate), value)
            if revision is not None:
                return candidate, revision
        raise ClaimError(f"every replica id from 0 to {MAX_AUTO_ID} is claimed")
    key = str(replica)
    first = await _holder(kv, key)
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        revision, holder = await _try(kv, key, value)
        if revision is not None:
            return replica, revision
        now = await _holder(kv, key)
        if first is not None and now is not None and now[1] != first[1]:  # refreshed: its holder lives
            break
        if first is None:
            first = now
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    raise ClaimError(f"scheduler replica {replica} is already claimed by a live replica ({describe(holder or {})}); "
                     "give another --dp-replica-id, leave it out to take the lowest free id, or stop that replica")


class ReplicaClaim:
    """A claimed replica id, kept by a daemon thread (its own event loop and NATS connection) that refreshes
    it every REFRESH_SECONDS until `release`. Made by `acquire`."""

    def __init__(self, url: str, subjects: Subjects, credentials: NatsCredentials | None, inbox_prefix: str | None,
                 on_lost: Callable[[dict[str, Any]], None]) -> None:
        self.replica = -1
        self._url, self._subjects = url, subjects
        self._credentials, self._inbox_prefix = credentials, inbox_prefix
        self._on_lost = on_lost
        self._identity = my_identity()
        self._value = json.dumps(self._identity).encode()
        self._kv: Any = None
        self._revision = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, url: str, subjects: Subjects, replica: int | None, credentials: NatsCredentials | None = None,
                inbox_prefix: str | None = None, on_lost: Callable[[dict[str, Any]], None] | None = None,
                ) -> ReplicaClaim:
        """Claim `replica` (None: the lowest free id) in `subjects`' namespace and keep it from a thread; blocks
        until claimed. Raises ClaimError (JetStreamUnavailable without JetStream), ConnectionError or
        TimeoutError. `on_lost(holder)` runs (on the thread) if another process ever holds the id instead."""
        self = cls(url, subjects, credentials, inbox_prefix, on_lost or (lambda holder: None))
        result: Future[int] = Future()
        self._thread = threading.Thread(target=self._run, args=(replica, result), name="replica-claim", daemon=True)
        self._thread.start()
        self.replica = result.result()
        return self

    def release(self, timeout: float = 3.0) -> None:
        """Stop refreshing and delete the claim (so the id is free at once); waits up to `timeout` seconds."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout)

    def _run(self, replica: int | None, result: Future[int]) -> None:
        asyncio.run(self._main(replica, result))

    async def _main(self, replica: int | None, result: Future[int]) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        bus: BusConnection | None = None
        try:
            bus = await asyncio.wait_for(
                BusConnection.connect(self._url, f"scheduler-claim-{os.getpid()}", max_reconnect_attempts=-1,
                                      credentials=self._credentials, inbox_prefix=self._inbox_prefix),
                CONNECT_SECONDS)
            js = bus.client.jetstream(timeout=API_SECONDS)
            self._kv = await open_bucket(js, self._subjects, JETSTREAM_PATIENCE_SECONDS)
            self.replica, self._revision = await claim(self._kv, replica, self._identity)
        except BaseException as exc:  # handed to the caller of acquire
            if bus is not None:
                await bus.close()
            result.set_exception(ConnectionError(f"no NATS connection within {CONNECT_SECONDS:g}s")
                                 if isinstance(exc, asyncio.TimeoutError) and bus is None else exc)
            return
        result.set_result(self.replica)
        try:
            while not await self._stopped_within(REFRESH_SECONDS):
                if not await self._refresh(js):
                    return
            try:
                await asyncio.wait_for(self._kv.delete(str(self.replica), last=self._revision), API_SECONDS)
            except Exception:  # a lapsed or lost claim, or no NATS: the TTL frees it
                pass
        finally:
            await bus.close()

    async def _stopped_within(self, seconds: float) -> bool:
        assert self._stop is not None
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def _refresh(self, js: Any) -> bool:
        """Rewrite the claim; False when another process holds the id now (after `on_lost`)."""
        key = str(self.replica)
        try:
            self._revision = await self._kv.update(key, self._value, last=self._revision)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            pass  # it lapsed, or someone took it
        except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
                nats.js.errors.ServiceUnavailableError):
            pass  # the bucket is gone (a restarted server without the store): made again below
        except Exception as exc:  # no NATS for now: the next refresh tries again
            log_event(log, logging.WARNING, "could not refresh the replica claim", replica=self.replica,
                      error=repr(exc))
            return True
        try:
            self._kv = await open_bucket(js, self._subjects)
            found = await _holder(self._kv, key)
            if found is not None and found[0].get("token") == self._identity["token"]:
                self._revision = found[1]
                return True
            revision, holder = await _try(self._kv, key, self._value)
        except Exception as exc:
            log_event(log, logging.WARNING, "could not renew the replica claim", replica=self.replica, error=repr(exc))
            return True
        if revision is not None:
            log_event(log, logging.WARNING, "replica claim had lapsed; claimed again", replica=self.replica)
            self._revision = revision
            return True
        log_event(log, logging.ERROR, "replica id lost to another process", replica=self.replica,
                  holder=describe(holder or {}))
        self._on_lost(holder or {})
        return False
