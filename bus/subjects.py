"""The one place that names NATS subjects.

Layout (namespace `ns`, default "ringserve"):

| subject                      | message            | publisher -> subscriber                           |
|------------------------------|--------------------|---------------------------------------------------|
| `{ns}.req.submit`            | GenerateRequest    | any client -> tokenizers (queue group)            |
| `{ns}.req.tokenized`         | TokenizedRequest   | tokenizer -> any scheduler replica (queue group)  |
| `{ns}.req.tokenized.{r}`     | TokenizedRequest   | tokenizer -> scheduler replica `r` (routed)       |
| `{ns}.tokens.{d}`            | BatchTokenOutput   | scheduler -> detokenizer `d` (one msg per step)   |
| `{ns}.out.{rid}`             | RequestOutput      | detokenizer/tokenizer/scheduler -> the requester  |
| `{ns}.abort.{rid}`           | AbortRequest       | requester -> scheduler                            |
| `{ns}.control.ready`         | ActorReady         | every actor -> launcher                           |
| `{ns}.control.heartbeat`     | Heartbeat          | every actor -> entry, launcher (liveness)         |
| `{ns}.control.gone`          | ActorGone          | launcher -> entry (an actor's process ended)      |
| `{ns}.kv.events.{r}`         | KvEvents           | scheduler replica `r` -> tokenizers (cache index) |
| `{ns}.kv.snapshot.{r}`       | (request/reply)    | tokenizer -> replica `r`, replies KvSnapshot      |
| `{ns}.kv.fetch.{r}`          | KvFetchRequest     | scheduler -> replica `r`, replies KvFetchReply (KV blocks) |
| `{ns}.kv.prefill.{r}`        | KvPrefillRequest   | decode replica -> prefill replica `r`, replies KvPrefillReply |
| `{ns}.control.scheduler.info`| (request/reply)    | anyone -> scheduler rank 0, replies SchedulerInfo |
| `{ns}.control.scheduler.command`| ControlCommand  | operator -> scheduler rank 0, replies ControlReply |
| `{ns}.tokenizer.tokenize`    | TokenizeQuery      | entry -> tokenizers (queue group), replies TokenizeReply |
| `{ns}.client.{c}.submit`     | GenerateRequest    | NATS client `c` -> tokenizers (queue group)       |
| `{ns}.client.{c}.out.{rid}`  | RequestOutput      | detokenizer/tokenizer/scheduler -> client `c`     |
| `{ns}.client.{c}.abort.{rid}`| AbortRequest       | client `c` -> scheduler                           |
| `{ns}.spans.{role}`          | OTLP span batch    | traced actors -> JetStream stream `{ns}-spans`    |
| `$KV.{ns}-replicas.{r}`      | replica claim JSON | scheduler replica `r` -> JetStream KV (its id)    |

(`{ns}.spans.*` only with `--trace-buffer jetstream`: OTLP protobuf bytes, stored by JetStream, read by the
trace exporter.) Tracing names spans after subject templates (`subject_template`: `out.{rid}`,
`tokens.{shard}`, ...), never after a concrete per-request subject.

A request's detokenizer `d` is chosen per request, among the live detokenizers, by the rendezvous hash of its
rid (`detokenizer_for`), and stamped on its TokenizedRequest.

Rids become subject tokens, so they are validated: `.`, `*`, `>` or whitespace in a rid would route a
stream to the wrong subscriber or let a wildcard subscriber read every stream.

Client-scoped requests (`{ns}.client.{c}.*`, see bus/permissions.py) travel inside the ring under the scoped
rid `{c}~{rid}`; `output()` and `abort()` map a scoped rid back to the client's subjects, so NATS permissions
on `{ns}.client.{c}.>` decide who can read or abort them. `~` is not allowed in a client-chosen rid, so no
unscoped rid (e.g. one from HTTP) can alias a client's request.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from typing import Iterable

# One pattern for every client-chosen subject token: request ids and namespaces.
RID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

TOKENIZER_QUEUE = "tokenizer"
SCHEDULER_QUEUE = "scheduler"
SCOPE_SEPARATOR = "~"  # between the client and its rid in a scoped rid; never in a client-chosen token


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


def scoped_rid(client: str, rid: str) -> str:
    """The ring-internal rid of client `client`'s request `rid` (both must be valid subject tokens)."""
    return f"{validate_rid(client)}{SCOPE_SEPARATOR}{validate_rid(rid)}"


def split_rid(rid: str) -> tuple[str | None, str]:
    """`(client, rid)` of a ring rid: `(None, rid)` for an unscoped one; raises InvalidRidError if malformed."""
    if not isinstance(rid, str):
        raise InvalidRidError(f"invalid request id {rid!r}")
    client, sep, local = rid.partition(SCOPE_SEPARATOR)
    if not sep:
        return None, validate_rid(rid)
    return validate_rid(client), validate_rid(local)


def validate_ring_rid(rid: object) -> str:
    """Return `rid` if it is a valid rid inside the ring: a client-chosen rid or a scoped `{client}~{rid}`."""
    split_rid(rid)  # type: ignore[arg-type]
    return rid  # type: ignore[return-value]


def rendezvous(key: bytes, members: Iterable[int]) -> int:
    """The member (a non-negative id) with the highest hash of `key` and its id: every process agrees without
    sharing state (unlike hash()). Removing a member moves only the keys it had; adding one takes about 1/n of
    the keys from the others and moves no other key. ValueError when `members` is empty."""
    return max(members, key=lambda member: hashlib.blake2b(key + member.to_bytes(4, "little"), digest_size=8).digest())


def detokenizer_for(rid: str, detokenizers: Iterable[int]) -> int:
    """Which of `detokenizers` (their ids) serves request `rid`: the rendezvous hash of the rid."""
    return rendezvous(rid.encode(), detokenizers)


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
        """Tokenized requests for any scheduler replica (a queue group: the fallback when none is routed)."""
        return f"{self.namespace}.req.tokenized"

    def tokenized_for(self, replica: int) -> str:
        """Tokenized requests routed to scheduler replica `replica` (actors/tokenizer/router.py)."""
        return f"{self.namespace}.req.tokenized.{int(replica)}"

    @property
    def tokenized_any_replica(self) -> str:
        return f"{self.namespace}.req.tokenized.*"

    def tokens(self, detokenizer: int) -> str:
        """The step messages for detokenizer `detokenizer` (its id, the `rank` in its heartbeat)."""
        return f"{self.namespace}.tokens.{int(detokenizer)}"

    def output(self, rid: str) -> str:
        """Where request `rid`'s outputs go: `{ns}.out.{rid}`, or `{ns}.client.{c}.out.{r}` for a scoped rid."""
        client, local = split_rid(rid)
        if client is not None:
            return f"{self.namespace}.client.{client}.out.{local}"
        return f"{self.namespace}.out.{local}"

    def abort(self, rid: str) -> str:
        """Where request `rid` is aborted: `{ns}.abort.{rid}`, or `{ns}.client.{c}.abort.{r}` for a scoped rid."""
        client, local = split_rid(rid)
        if client is not None:
            return f"{self.namespace}.client.{client}.abort.{local}"
        return f"{self.namespace}.abort.{local}"

    def client_submit(self, client: str) -> str:
        """Where NATS client `client` submits its GenerateRequests (rids are scoped to the client)."""
        return f"{self.namespace}.client.{validate_rid(client)}.submit"

    def client_subject_templates(self, client: str) -> dict[str, str]:
        """Client `client`'s subjects as its credentials file notes them, `{rid}` standing for a request id."""
        scoped = f"{self.namespace}.client.{validate_rid(client)}"
        return {"submit": self.client_submit(client), "output": f"{scoped}.out.{{rid}}",
                "abort": f"{scoped}.abort.{{rid}}"}

    @property
    def client_submit_any(self) -> str:
        """Wildcard the tokenizers listen on for every client's submissions."""
        return f"{self.namespace}.client.*.submit"

    @property
    def client_abort_any(self) -> str:
        """Wildcard the scheduler listens on for every client's aborts."""
        return f"{self.namespace}.client.*.abort.*"

    @property
    def client_output_any(self) -> str:
        """Every client's output subjects (what the actors that publish outputs may publish to)."""
        return f"{self.namespace}.client.*.out.*"

    def client_of(self, subject: str) -> str:
        """The client named in a client-scoped subject such as `{ns}.client.{c}.submit`."""
        parts = subject.split(".")
        if len(parts) < 3 or parts[0] != self.namespace or parts[1] != "client":
            raise InvalidRidError(f"not a client subject: {subject!r}")
        return validate_rid(parts[2])

    @property
    def abort_any(self) -> str:
        """Wildcard the scheduler listens on for every request's abort."""
        return f"{self.namespace}.abort.*"

    @property
    def tokenize(self) -> str:
        """Request/reply: tokenize a prompt or detokenize ids (TokenizeQuery -> TokenizeReply, bus/tokenize_messages.py)."""
        return f"{self.namespace}.tokenizer.tokenize"

    @property
    def ready(self) -> str:
        return f"{self.namespace}.control.ready"

    @property
    def heartbeat(self) -> str:
        return f"{self.namespace}.control.heartbeat"

    @property
    def gone(self) -> str:
        """The launcher says an actor's process ended (`ActorGone`): its streams end at once."""
        return f"{self.namespace}.control.gone"

    def kv_events(self, replica: int) -> str:
        """Scheduler replica `replica`'s prefix-cache events (`KvEvents`), which every tokenizer's router reads."""
        return f"{self.namespace}.kv.events.{int(replica)}"

    @property
    def kv_events_any(self) -> str:
        return f"{self.namespace}.kv.events.*"

    def kv_snapshot(self, replica: int) -> str:
        """Request/reply: replica `replica`'s whole prefix-cache index (`InfoQuery` -> `KvSnapshot`)."""
        return f"{self.namespace}.kv.snapshot.{int(replica)}"

    @property
    def kv_snapshot_any(self) -> str:
        return f"{self.namespace}.kv.snapshot.*"

    def kv_fetch(self, replica: int) -> str:
        """Request/reply: KV blocks of a prompt's prefix from replica `replica` (`KvFetchRequest` -> `KvFetchReply`,
        bus/kv_transfer.py)."""
        return f"{self.namespace}.kv.fetch.{int(replica)}"

    @property
    def kv_fetch_any(self) -> str:
        return f"{self.namespace}.kv.fetch.*"

    def kv_prefill(self, replica: int) -> str:
        """Request/reply: prefill replica `replica` computes a prompt's KV for a decode replica to fetch
        (`KvPrefillRequest` -> `KvPrefillReply`, bus/kv_transfer.py)."""
        return f"{self.namespace}.kv.prefill.{int(replica)}"

    @property
    def kv_prefill_any(self) -> str:
        return f"{self.namespace}.kv.prefill.*"

    @property
    def scheduler_info(self) -> str:
        return f"{self.namespace}.control.scheduler.info"

    @property
    def scheduler_command(self) -> str:
        return f"{self.namespace}.control.scheduler.command"

    def spans(self, role: str) -> str:
        """Where actors of `role` publish their finished spans (the JetStream span buffer's input)."""
        return f"{self.namespace}.spans.{validate_rid(role)}"

    def spans_filter(self) -> str:
        """Every role's span subject: what the span stream captures."""
        return f"{self.namespace}.spans.>"

    def span_stream(self) -> str:
        """The name of the JetStream stream buffering this deployment's spans (not a subject)."""
        return f"{self.namespace}-spans"

    def replica_bucket(self) -> str:
        """The JetStream key-value bucket where scheduler replicas claim their ids (bus/replica_claim.py)."""
        return f"{self.namespace}-replicas"

    def replica_bucket_stream(self) -> str:
        """The stream behind `replica_bucket` (JetStream names a bucket's stream `KV_<bucket>`)."""
        return f"KV_{self.replica_bucket()}"

    def replica_claims(self) -> str:
        """Every key of `replica_bucket`, as the subjects claims are written on (`$KV.<bucket>.<replica id>`)."""
        return f"$KV.{self.replica_bucket()}.>"

    def rid_of(self, subject: str) -> str:
        """The rid of a per-request subject: `{ns}.abort.{rid}` -> rid, `{ns}.client.{c}.abort.{r}` -> `c~r`."""
        local = validate_rid(subject.rsplit(".", 1)[-1])
        if subject.startswith(f"{self.namespace}.client."):
            return scoped_rid(self.client_of(subject), local)
        return local


_TEMPLATES = {  # subject tokens after the namespace -> template, by (first token, token count)
    ("tokens", 2): "tokens.{shard}", ("out", 2): "out.{rid}", ("abort", 2): "abort.{rid}",
    ("spans", 2): "spans.{role}",
}


def subject_template(subject: str) -> str:
    """The low-cardinality template of a concrete subject, without the namespace: what tracing names spans by.

    `ns.out.abc` -> `out.{rid}`, `ns.tokens.0` -> `tokens.{shard}`, `ns.client.c.out.r` -> `client.{client}.out.{rid}`,
    `ns.req.submit` -> `req.submit`, `ns.req.tokenized.1` -> `req.tokenized`, `ns.tokenizer.tokenize` -> `tokenizer.tokenize`, a reply inbox -> `_INBOX`; anything else -> `(other)`.
    """
    parts = subject.split(".")
    if parts[0] in ("_INBOX", "$JS"):
        return parts[0]
    rest = parts[1:]
    if not rest:
        return "(other)"
    if rest[:2] == ["req", "tokenized"]:  # routed or not, one name: which replica is not a new kind of hop
        return "req.tokenized"
    if rest[0] in ("req", "control"):
        return ".".join(rest)
    if rest == ["tokenizer", "tokenize"]:
        return "tokenizer.tokenize"
    if rest[0] == "client" and len(rest) == 4 and rest[2] in ("out", "abort"):
        return f"client.{{client}}.{rest[2]}.{{rid}}"
    if rest[0] == "client" and len(rest) == 3 and rest[2] == "submit":
        return "client.{client}.submit"
    return _TEMPLATES.get((rest[0], len(rest)), "(other)")
