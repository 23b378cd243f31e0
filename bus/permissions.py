"""Least-privilege NATS permissions of each ringserve role, derived from the subject table in bus/subjects.py.

One deployment (namespace `ns`) has six internal roles and any number of outside NATS clients:

| role        | may publish                                          | may subscribe                               |
|-------------|------------------------------------------------------|---------------------------------------------|
| launcher    | gone                                                 | ready, heartbeat                            |
| entry       | submit, `abort.*`, info, command, tokenize, ANN, STORE, IMG | `out.*`, heartbeat, gone                    |
| tokenizer   | tokenized (`.*`), OUT, ANN, entry's and clients' inboxes, `kv.snapshot.*`, IMG, each client's CIMG read only | submit, `client.*.submit`, tokenize, heartbeat, `kv.events.*` |
| scheduler   | `tokens.*`, OUT, ANN, entry's, tokenizer's and scheduler's inboxes, `kv.events.*`, `kv.fetch.*`, `kv.prefill.*`, CLAIM, IMG | tokenized (`.*`), `abort.*`, `client.*.abort.*`, info, command, `kv.snapshot.*`, `kv.fetch.*`, `kv.prefill.*`, heartbeat |
| detokenizer | OUT, ANN                                             | `tokens.*`, `abort.*`, `client.*.abort.*`   |
| trace_exporter | ANN, JS (the span stream's JetStream API)        | `spans.>`                                   |
| client `c`  | `client.c.submit`, `client.c.abort.*`, its CIMG      | `client.c.out.*`                            |

(all subjects under `{ns}.`; OUT = `out.*` and `client.*.out.*`; ANN = ready and heartbeat; info, command =
`control.scheduler.*`; tokenize = `tokenizer.tokenize`, request/reply for `/v1/tokenize` and `/v1/detokenize`,
answered in the entry's inbox). Replies go only to the requesters' inboxes, never to a reply subject a sender chose:
the server allows publishing there and nowhere else (no `allow_responses`), and the bus checks each reply
against the inbox of the subject the request came on (a client's submission is answered in that client's
inbox only, see `reply_inbox`). Entry,
tokenizer, scheduler and detokenizer may also publish their own `spans.{role}` (finished spans, stored by the
JetStream span stream `{ns}-spans` when `--trace-buffer jetstream` is on); JS = creating that stream and its
consumers, fetching and acking its messages (`$JS.API.*.{ns}-spans...`, `$JS.ACK.{ns}-spans.>`), which
`ringserve trace` also uses with the trace_exporter's credentials. CLAIM = the scheduler's replica-id bucket
`{ns}-replicas` (bus/replica_claim.py): create it, read its keys, write `$KV.{ns}-replicas.>`, nothing of any
other stream or bucket. STORE = the entry's stored-responses bucket `{ns}-responses` (bus/response_store.py):
create and inspect its stream, get, write and delete its keys. IMG = the image bucket `{ns}-images`
(bus/image_store.py), whose objects the entry, the tokenizer and the scheduler put and read: its stream, the
ordered consumers that read an object's chunks, its `$O.{ns}-images.>` subjects. CIMG = client c's own image bucket
`{ns}-client-c-images` (bus/image_store.py `client_bucket_name`), the same subjects for that bucket: c puts the image
files it sends there (creating the bucket on first use), and the tokenizer reads them there only (no create, no
write, no purge), so the tokenizer's lists name each client the deployment has (`role_permissions`'s `clients`).
Every role also subscribes its own reply inbox, `inbox_prefix(ns, role)` + `.>`, and must connect with that inbox prefix
(nats-py's `inbox_prefix`), so no role can read another's replies. A client sees only subjects with its own
name in them: it cannot read, abort or submit as another client, nor touch an HTTP request's stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from ringserve.bus.image_store import bucket_name, client_bucket_name, image_store_api
from ringserve.bus.response_store import store_api
from ringserve.bus.subjects import Subjects, validate_rid

ROLES = ("launcher", "entry", "tokenizer", "scheduler", "detokenizer", "trace_exporter")
CLIENT_ROLE = "client"


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may do: subjects (NATS wildcards allowed) it may publish and subscribe to."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(namespace: str, role: str, client: str | None = None) -> str:
    """The reply-inbox prefix a role connects with: `_INBOX.{ns}.{role}` or `_INBOX.{ns}.client.{c}`."""
    Subjects(namespace)  # validates the namespace
    if role == CLIENT_ROLE:
        if client is None:
            raise ValueError("the client role needs a client name")
        return f"_INBOX.{namespace}.client.{validate_rid(client)}"
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {ROLES + (CLIENT_ROLE,)}")
    return f"_INBOX.{namespace}.{role}"


def role_permissions(namespace: str, role: str, clients: Sequence[str] = ()) -> Permissions:
    """The allow lists of internal role `role` (one of ROLES) in deployment `namespace`, whose named NATS clients
    are `clients` (the tokenizer reads their image buckets)."""
    s = Subjects(namespace)
    ns = namespace
    inbox = inbox_prefix(namespace, role) + ".>"
    announce = (s.ready, s.heartbeat)
    outputs = (f"{ns}.out.*", s.client_output_any)
    if role == "launcher":
        return Permissions(publish=(s.gone,), subscribe=(s.ready, s.heartbeat, inbox))
    if role == "trace_exporter":
        return Permissions(publish=(*span_stream_api(s), *announce), subscribe=(s.spans_filter(), inbox))
    announce = (*announce, s.spans(role)) if role in ROLES else announce  # traced actors store their spans
    if role == "entry":
        return Permissions(publish=(s.submit, s.abort_any, s.scheduler_info, s.scheduler_command, s.tokenize,
                                    *announce, *store_api(ns), *image_store_api(bucket_name(ns))),
                           subscribe=(f"{ns}.out.*", s.heartbeat, s.gone, inbox))
    if role == "tokenizer":
        replies = (inbox_prefix(ns, "entry") + ".>", f"_INBOX.{ns}.client.*.>")
        client_images = (subject for c in clients for subject in image_store_api(client_bucket_name(ns, c), True))
        return Permissions(publish=(s.tokenized, s.tokenized_any_replica, *outputs, *announce, *replies,
                                    s.kv_snapshot_any, *image_store_api(bucket_name(ns)), *client_images),
                           subscribe=(s.submit, s.client_submit_any, s.tokenize, s.heartbeat, s.kv_events_any, inbox))
    if role == "scheduler":
        replies = (inbox_prefix(ns, "entry") + ".>", inbox_prefix(ns, "tokenizer") + ".>")
        replies += (inbox_prefix(ns, "scheduler") + ".>",)  # a peer replica's KV fetch
        return Permissions(publish=(f"{ns}.tokens.*", *outputs, *announce, *replies, s.kv_events_any,
                                    s.kv_fetch_any, s.kv_prefill_any, *replica_claim_api(s),
                                    *image_store_api(bucket_name(ns))),
                           subscribe=(s.tokenized, s.tokenized_any_replica, s.abort_any, s.client_abort_any,
                                      s.scheduler_info, s.kv_snapshot_any, s.kv_fetch_any, s.kv_prefill_any,
                                      s.heartbeat, s.scheduler_command, inbox))
    if role == "detokenizer":
        return Permissions(publish=(*outputs, *announce),
                           subscribe=(f"{ns}.tokens.*", s.abort_any, s.client_abort_any, inbox))
    raise ValueError(f"unknown role {role!r}; one of {ROLES}")


def span_stream_api(s: Subjects) -> tuple[str, ...]:
    """The JetStream API subjects that manage and read the span stream: create/update/inspect it, create,
    inspect and delete its consumers, fetch (`MSG.NEXT`) and acknowledge its messages."""
    stream = s.span_stream()
    api = "$JS.API"
    return (f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.UPDATE.{stream}", f"{api}.STREAM.INFO.{stream}",
            f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
            f"{api}.CONSUMER.DURABLE.CREATE.{stream}.*", f"{api}.CONSUMER.INFO.{stream}.*",
            f"{api}.CONSUMER.DELETE.{stream}.*", f"{api}.CONSUMER.MSG.NEXT.{stream}.*", f"$JS.ACK.{stream}.>")


def replica_claim_api(s: Subjects) -> tuple[str, ...]:
    """What a scheduler needs of JetStream to claim its replica id: create and inspect the claims bucket's stream,
    get a key's last message (direct or through the API) and write its keys."""
    stream = s.replica_bucket_stream()
    api = "$JS.API"
    return (f"{api}.STREAM.CREATE.{stream}", f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}",
            f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>", s.replica_claims())


def reply_inbox(namespace: str, request_subject: str) -> str:
    """Where a reply to a request that came on `request_subject` may go: a client's submission only to that
    client's inbox, anything else to an inbox (`_INBOX.`); never a subject the sender chose outside them."""
    s = Subjects(namespace)
    if request_subject.startswith(f"{namespace}.client."):
        return inbox_prefix(namespace, CLIENT_ROLE, s.client_of(request_subject)) + "."
    return "_INBOX."


def client_permissions(namespace: str, client: str) -> Permissions:
    """The allow lists of outside NATS client `client`: submit, read and abort its own requests only, and put the
    image files it sends into its own image bucket."""
    s = Subjects(namespace)
    base = f"{namespace}.client.{validate_rid(client)}"
    return Permissions(publish=(s.client_submit(client), f"{base}.abort.*",
                                *image_store_api(client_bucket_name(namespace, client))),
                       subscribe=(f"{base}.out.*", inbox_prefix(namespace, CLIENT_ROLE, client) + ".>"))


@dataclass(frozen=True)
class NatsUser:
    """One user of a nats-server `authorization` block."""

    user: str
    password: str = field(repr=False)
    permissions: Permissions


def authorization_block(users: list[NatsUser]) -> str:
    """The nats-server config `authorization { users = [...] }` giving each user exactly its allow lists.

    A user with nothing to publish gets `deny: [">"]` (an empty allow list would mean "no restriction").
    """
    lines = ["authorization {", "  users = ["]
    for u in users:
        perms = u.permissions
        publish = {"allow": list(perms.publish)} if perms.publish else {"deny": [">"]}
        subscribe = {"allow": list(perms.subscribe)} if perms.subscribe else {"deny": [">"]}
        body: dict[str, object] = {"publish": publish, "subscribe": subscribe}
        entry = {"user": u.user, "password": u.password, "permissions": body}
        lines.append(f"    {json.dumps(entry)}")
    lines += ["  ]", "}", ""]
    return "\n".join(lines)
