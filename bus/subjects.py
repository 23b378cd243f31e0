"""The one place that names NATS subjects.

Layout (namespace `ns`, default "ringserve"):

| subject                      | message            | publisher -> subscriber                           |
|------------------------------|--------------------|---------------------------------------------------|
| `{ns}.req.submit`            | GenerateRequest    | any client -> tokenizers (queue group)            |
| `{ns}.req.tokenized`         | TokenizedRequest   | tokenizer -> scheduler rank 0 (queue group)       |
| `{ns}.tokens.{shard}`        | BatchTokenOutput   | scheduler -> detokenizer shard (one msg per step) |
| `{ns}.out.{rid}`             | RequestOutput      | detokenizer/tokenizer/scheduler -> the requester  |
| `{ns}.abort.{rid}`           | AbortRequest       | requester -> scheduler                            |
| `{ns}.control.ready`         | ActorReady         | every actor -> launcher                           |
| `{ns}.control.heartbeat`     | Heartbeat          | every actor -> entry, launcher (liveness)         |
| `{ns}.control.scheduler.info`| (request/reply)    | anyone -> scheduler rank 0, replies SchedulerInfo |
| `{ns}.control.scheduler.command`| ControlCommand  | operator -> scheduler rank 0, replies ControlReply |

Rids become subject tokens, so they are validated: `.`, `*`, `>` or whitespace in a rid would route a
stream to the wrong subscriber or let a wildcard subscriber read every stream.
"""

from __future__ import annotations

import re
import uuid
import zlib
from dataclasses import dataclass

# One pattern for every client-chosen subject token: request ids and namespaces.
RID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

TOKENIZER_QUEUE = "tokenizer"
SCHEDULER_QUEUE = "scheduler"


class InvalidRidError(ValueError):
    """A request id that cannot be used as a NATS subject token."""


def new_rid() -> str:
    """A fresh random request id that is always a valid subject token."""
    return uuid.uuid4().hex


def validate_rid(rid: object) -> str:
    """Return `rid` if it matches `[A-Za-z0-9_-]{1,64}`, else raise InvalidRidError."""
    if not isinstance(rid, str) or not RID_PATTERN.match(rid):
        raise InvalidRidError(f"invalid request id {rid!r}: use 1-64 characters from A-Z a-z 0-9 _ -")
    return rid


def detokenizer_shard(rid: str, num_shards: int) -> int:
    """Which detokenizer shard owns `rid` (stable across processes, unlike hash())."""
    return zlib.crc32(rid.encode()) % num_shards


@dataclass(frozen=True)
class Subjects:
    """Subject names for one ringserve deployment, isolated from others on the same NATS by `namespace`."""

    namespace: str = "ringserve"

    def __post_init__(self) -> None:
        if not RID_PATTERN.match(self.namespace):
            raise ValueError(f"invalid namespace {self.namespace!r}: use 1-64 characters from A-Z a-z 0-9 _ -")

    @property
    def submit(self) -> str:
        return f"{self.namespace}.req.submit"

    @property
    def tokenized(self) -> str:
        return f"{self.namespace}.req.tokenized"

    def tokens(self, shard: int) -> str:
        return f"{self.namespace}.tokens.{int(shard)}"

    def output(self, rid: str) -> str:
        return f"{self.namespace}.out.{validate_rid(rid)}"

    def abort(self, rid: str) -> str:
        return f"{self.namespace}.abort.{validate_rid(rid)}"

    @property
    def abort_any(self) -> str:
        """Wildcard the scheduler listens on for every request's abort."""
        return f"{self.namespace}.abort.*"

    @property
    def ready(self) -> str:
        return f"{self.namespace}.control.ready"

    @property
    def heartbeat(self) -> str:
        return f"{self.namespace}.control.heartbeat"

    @property
    def scheduler_info(self) -> str:
        return f"{self.namespace}.control.scheduler.info"

    @property
    def scheduler_command(self) -> str:
        return f"{self.namespace}.control.scheduler.command"

    def rid_of(self, subject: str) -> str:
        """The rid at the end of a per-request subject such as `{ns}.abort.{rid}`."""
        return validate_rid(subject.rsplit(".", 1)[-1])
