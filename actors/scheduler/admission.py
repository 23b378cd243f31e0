"""Admission at the scheduler: caps on live requests, in total and per NATS client.

Every request reaches the scheduler, whichever way it came in (HTTP through the entry, or a NATS client on
`{ns}.client.{c}.submit`), so the caps hold here for all of them. A request is live from its admission until
its final row (finish set) is published, it is aborted, or the engine rejects it. A NATS client's rid is scoped
`c~rid` (bus/subjects.py), so the client is the rid's prefix; an unscoped rid (HTTP, or a raw submission on
`{ns}.req.submit`) counts only toward the total. Over a cap, a request is refused at once with a 503 and
`retry_after` 1, the same answer the entry gives beyond `--max-queued-requests`, and never queued.

Kept by rid, so releasing is idempotent: a rid released twice (its abort row and a final row) or never admitted
(an early abort, a rejection) changes no count. Imported by the launcher: no torch here.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field

from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import ADMISSION

from ringserve.bus.errors import ApiError
from ringserve.bus.subjects import SCOPE_SEPARATOR

DEFAULT_MAX_LIVE_REQUESTS = 1024  # the entry's default --max-queued-requests
DEFAULT_MAX_CLIENT_REQUESTS = 256


def client_of_rid(rid: str) -> str | None:
    """The NATS client of a scoped rid `c~rid`; None for an unscoped one."""
    client, sep, _ = rid.partition(SCOPE_SEPARATOR)
    return client if sep else None


def busy(message: str) -> ApiError:
    """A 503 the requester should retry shortly (as the entry's `server_busy`)."""
    return ApiError(message, 503, type="server_error", retry_after=1)


class Admission:
    """Counts live requests, in total and per NATS client, and refuses one over a cap."""

    def __init__(self, max_live: int = DEFAULT_MAX_LIVE_REQUESTS,
                 max_per_client: int = DEFAULT_MAX_CLIENT_REQUESTS) -> None:
        if max_live < 1 or max_per_client < 1:
            raise ValueError("admission caps must be at least 1")
        self.max_live = max_live
        self.max_per_client = max_per_client
        self._live: dict[str, str | None] = {}  # rid -> its client (None: unscoped)
        self._per_client: Counter[str] = Counter()
        self.refused_total = 0

    def __contains__(self, rid: object) -> bool:
        return rid in self._live

    def __len__(self) -> int:
        return len(self._live)

    def client_live(self, client: str) -> int:
        """How many live requests NATS client `client` has."""
        return self._per_client.get(client, 0)

    def admit(self, rid: str) -> ApiError | None:
        """Take a slot for `rid`, or the 503 that refuses it (nothing taken). `rid` must not be live already."""
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is live already")
        client = client_of_rid(rid)
        if len(self._live) >= self.max_live:
            self.refused_total += 1
            return busy(f"the server is at its limit of {self.max_live} live requests; retry shortly")
        if client is not None and self._per_client[client] >= self.max_per_client:
            self.refused_total += 1
            return busy(f"NATS client {client!r} is at its limit of {self.max_per_client} live requests; "
                        "retry shortly")
        self._live[rid] = client
        if client is not None:
            self._per_client[client] += 1
        return None

    def release(self, rid: str) -> bool:
        """Free `rid`'s slot; False (and no change) if it holds none."""
        if rid not in self._live:
            return False
        client = self._live.pop(rid)
        if client is not None:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
        return True


def _positive_int(text: str) -> int:
    """A cap's value: an int of at least 1 (argparse's error names the flag otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


@dataclass
class AdmissionFlags:
    """The scheduler's admission flags (also `ringserve serve`'s), declared once (actors/common/flag_fields.py)."""

    max_live_requests: int = field(default=DEFAULT_MAX_LIVE_REQUESTS, metadata=flag(
        "live (waiting + running) requests the scheduler admits in total, from HTTP and NATS clients; beyond, 503 "
        "with retry_after 1", group=ADMISSION, type=_positive_int))
    max_client_requests: int = field(default=DEFAULT_MAX_CLIENT_REQUESTS, metadata=flag(
        "live requests one NATS client (`c~rid`) may have; beyond, 503 with retry_after 1 on its output subject",
        group=ADMISSION, type=_positive_int))

    def admission(self) -> Admission:
        """The admission these caps make."""
        return Admission(self.max_live_requests, self.max_client_requests)
