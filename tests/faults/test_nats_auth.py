"""NATS least privilege on a real nats-server: each role may use exactly its subjects, strangers are refused,
a client cannot read (or abort, or submit as) another client, and the whole ring serves with auth on without a
password on any command line or in the launcher's log."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import nats
import pytest

from ringserve.actors.launcher.nats_auth import DeploymentAuth, generate_auth
from ringserve.bus.codec import decode, encode
from ringserve.bus.connection import BusConnection
from ringserve.bus.credentials import PASSWORD_ENV, CredentialsError, credentials_from_options
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.image_store import ImageMissing, ImageStore
from ringserve.bus.messages import AbortRequest, Accepted, GenerateRequest, RequestOutput, TokenizedRequest
from ringserve.bus.permissions import inbox_prefix
from tests.faults.nats_auth_helpers import Probe, make_tls_files, next_message, tls_block
from tests.server_helpers import REPO, ServerHandle, start_server
from tests.shared_rings import CLIENTS, logged

NS = "auth"
S = {  # one concrete subject of each kind in the subject table, and some that no role should get
    "submit": f"{NS}.req.submit", "tokenized": f"{NS}.req.tokenized", "tokenized_1": f"{NS}.req.tokenized.1",
    "tokens": f"{NS}.tokens.0",
    "out": f"{NS}.out.r1", "abort": f"{NS}.abort.r1", "ready": f"{NS}.control.ready",
    "heartbeat": f"{NS}.control.heartbeat", "gone": f"{NS}.control.gone", "info": f"{NS}.control.scheduler.info",
    "command": f"{NS}.control.scheduler.command", "tokenize": f"{NS}.tokenizer.tokenize",
    "kv_events_1": f"{NS}.kv.events.1", "kv_snapshot_1": f"{NS}.kv.snapshot.1",
    "kv_fetch_1": f"{NS}.kv.fetch.1", "kv_prefill_1": f"{NS}.kv.prefill.1",
    **{f"{c}_{kind}": f"{NS}.client.{c}.{kind}" + ("" if kind == "submit" else ".r1")
       for c in ("alice", "bob") for kind in ("submit", "out", "abort")},
    "all": ">", "ns_all": f"{NS}.>", "out_any": f"{NS}.out.*", "client_out_any": f"{NS}.client.*.out.*",
    "other_ns": "other.req.submit", "inbox_default": "_INBOX.x",
    **{f"inbox_{r}": f"_INBOX.{NS}.{r}.x.y" for r in ("launcher", "entry", "tokenizer", "scheduler", "detokenizer")},
    **{f"inbox_{c}": f"_INBOX.{NS}.client.{c}.x.y" for c in ("alice", "bob")},
    # the shared image bucket and each client's own: write an object's chunk, create the stream, read (a consumer)
    **{f"{owner}img_{kind}": subject.format(bucket=f"{NS}-{infix}images")
       for owner, infix in (("", ""), ("alice_", "client-alice-"), ("bob_", "client-bob-"))
       for kind, subject in (("write", "$O.{bucket}.C.x"), ("create", "$JS.API.STREAM.CREATE.OBJ_{bucket}"),
                             ("read", "$JS.API.CONSUMER.CREATE.OBJ_{bucket}"))},
}
IMAGES = {"img_write", "img_create", "img_read"}
OUTPUTS = {"out", "alice_out", "bob_out"}
ANNOUNCE = {"ready", "heartbeat"}
# The least-privilege table, written out independently of bus/permissions.py.
MAY_PUBLISH = {
    "launcher": {"gone"},  # an actor's process ended: the entry ends its streams at once
    "entry": {"submit", "abort", "info", "command", "tokenize"} | ANNOUNCE | IMAGES,
    "tokenizer": {"tokenized", "tokenized_1", "inbox_entry", "inbox_alice", "inbox_bob", "kv_snapshot_1"} | OUTPUTS
    | ANNOUNCE | IMAGES | {"alice_img_read", "bob_img_read"},  # a client's images: read only
    # another replica's KV (--kv-share): its fetch and prefill subjects, the replies to its inbox
    "scheduler": {"tokens", "inbox_entry", "inbox_tokenizer", "inbox_scheduler", "kv_events_1", "kv_fetch_1",
                  "kv_prefill_1"} | OUTPUTS | ANNOUNCE | IMAGES,
    "detokenizer": OUTPUTS | ANNOUNCE,
    "alice": {"alice_submit", "alice_abort"} | {f"alice_{kind}" for kind in IMAGES},  # its own image bucket only
    "bob": {"bob_submit", "bob_abort"} | {f"bob_{kind}" for kind in IMAGES},
}
MAY_SUBSCRIBE = {
    "launcher": {"ready", "heartbeat", "inbox_launcher"},
    "entry": {"out", "out_any", "heartbeat", "gone", "inbox_entry"},
    "tokenizer": {"submit", "alice_submit", "bob_submit", "tokenize", "heartbeat", "kv_events_1",
                  "inbox_tokenizer"},  # routing: loads and KV events
    "scheduler": {"tokenized", "tokenized_1", "abort", "alice_abort", "bob_abort", "info", "command", "kv_snapshot_1",
                  "kv_fetch_1", "kv_prefill_1", "heartbeat", "inbox_scheduler"},  # heartbeat: a worker's replica id must be free
    "detokenizer": {"tokens", "abort", "alice_abort", "bob_abort", "inbox_detokenizer"},  # aborts: forget lost rows
    "alice": {"alice_out", "inbox_alice"},
    "bob": {"bob_out", "inbox_bob"},
}


@pytest.fixture(scope="module")
def auth_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNatsServer, DeploymentAuth]]:
    auth = generate_auth(NS, tmp_path_factory.mktemp("auth") / "creds", ["alice", "bob"])
    with EmbeddedNatsServer(extra_config=auth.authorization()) as server:
        yield server, auth


def creds_of(auth: DeploymentAuth, who: str) -> Path:
    return auth.client_files[who] if who in auth.client_files else auth.role_files[who]


def inbox_of(who: str) -> str:
    return inbox_prefix(NS, "client", who) if who in ("alice", "bob") else inbox_prefix(NS, who)


@pytest.mark.parametrize("who", sorted(MAY_PUBLISH))
def test_each_role_may_use_exactly_its_subjects(auth_nats: tuple[EmbeddedNatsServer, DeploymentAuth],
                                                who: str) -> None:
    server, auth = auth_nats

    async def run() -> tuple[set[str], set[str]]:
        probe = await Probe.connect(server.url, creds_of(auth, who), inbox_of(who))
        try:
            literal = [s for s in S.values() if "*" not in s and ">" not in s]
            refused_pub = await probe.denied_publishes(literal)
            refused_sub = await probe.denied_subscriptions(list(S.values()))
            published = {k for k, s in S.items() if s in literal and s not in refused_pub}
            subscribed = {k for k, s in S.items() if s not in refused_sub}
        finally:
            await probe.close()
        return published, subscribed

    published, subscribed = asyncio.run(run())
    assert published == MAY_PUBLISH[who]
    assert subscribed == MAY_SUBSCRIBE[who]


def test_unauthenticated_and_wrong_password_connections_are_refused(
        auth_nats: tuple[EmbeddedNatsServer, DeploymentAuth]) -> None:
    server, auth = auth_nats
    user = json.loads(auth.role_files["entry"].read_text())["user"]

    async def refused(**options: object) -> bool:
        try:
            client = await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)
        except Exception as exc:  # nats-py: "Authorization Violation"
            return "authorization" in str(exc).lower()
        await client.close()
        return False

    assert asyncio.run(refused())
    assert asyncio.run(refused(user=user, password="wrong"))
    assert asyncio.run(refused(user="nobody", password="x"))


def test_an_injected_message_outside_a_users_subjects_is_never_delivered(
        auth_nats: tuple[EmbeddedNatsServer, DeploymentAuth]) -> None:
    server, auth = auth_nats

    async def run() -> None:
        scheduler = await Probe.connect(server.url, auth.role_files["scheduler"], inbox_of("scheduler"))
        alice = await Probe.connect(server.url, auth.client_files["alice"], inbox_of("alice"))
        tokenizer = await Probe.connect(server.url, auth.role_files["tokenizer"], inbox_of("tokenizer"))
        try:
            inbox = await scheduler.client.subscribe(S["tokenized"])
            await scheduler.client.flush()
            forged = encode(TokenizedRequest(rid="x", input_ids=[1], sampling=None))  # type: ignore[arg-type]
            assert not await alice.can_publish(S["tokenized"], forged)
            assert await next_message(inbox, 0.5) is None, "a client's message reached the scheduler's inbox"
            assert await tokenizer.can_publish(S["tokenized"], b"from the tokenizer")
            got = await next_message(inbox, 5)
            assert got is not None and got.data == b"from the tokenizer"
        finally:
            for probe in (scheduler, alice, tokenizer):
                await probe.close()

    asyncio.run(run())


def test_a_client_cannot_read_another_clients_output(auth_nats: tuple[EmbeddedNatsServer, DeploymentAuth]) -> None:
    server, auth = auth_nats

    async def run() -> None:
        alice = await Probe.connect(server.url, auth.client_files["alice"], inbox_of("alice"))
        bob = await Probe.connect(server.url, auth.client_files["bob"], inbox_of("bob"))
        detok = await Probe.connect(server.url, auth.role_files["detokenizer"], inbox_of("detokenizer"))
        try:
            attempts = [f"{NS}.client.alice.out.r1", f"{NS}.client.alice.out.*", f"{NS}.client.*.out.*",
                        f"{NS}.client.alice.>", f"{NS}.client.>", f"{NS}.>", ">", f"_INBOX.{NS}.client.alice.>"]
            assert await bob.denied_subscriptions(attempts) == set(attempts)
            mine = await alice.client.subscribe(f"{NS}.client.alice.out.*")
            bobs = await bob.client.subscribe(f"{NS}.client.bob.out.*")
            await alice.client.flush()
            await bob.client.flush()
            await detok.client.publish(f"{NS}.client.alice.out.r1", b"alice's secret")
            await detok.client.flush()
            got = await next_message(mine, 5)
            assert got is not None and got.data == b"alice's secret"
            assert await next_message(bobs, 0.5) is None
            assert not await bob.can_publish(f"{NS}.client.alice.abort.r1")  # nor abort alice's requests
            assert not await bob.can_publish(f"{NS}.abort.r1")  # nor an HTTP request
            assert not await bob.can_publish(f"{NS}.client.alice.submit")  # nor submit as alice
        finally:
            for probe in (alice, bob, detok):
                await probe.close()

    asyncio.run(run())


def test_a_client_puts_images_into_its_own_bucket_and_the_tokenizer_only_reads_them(
        auth_nats: tuple[EmbeddedNatsServer, DeploymentAuth]) -> None:
    """alice creates her bucket with her first put and reads it back; the tokenizer reads her file there, and a
    handle that is not in a client's bucket (bob put nothing yet) is ImageMissing naming it, at once."""
    server, auth = auth_nats

    async def run() -> None:
        alice = await Probe.connect(server.url, auth.client_files["alice"], inbox_of("alice"))
        tokenizer = await Probe.connect(server.url, auth.role_files["tokenizer"], inbox_of("tokenizer"))
        try:
            mine = ImageStore(lambda: alice.client, NS, client="alice")
            handle = await mine.put_raw(b"alice's picture")
            assert await mine.get(handle) == b"alice's picture"
            shared = ImageStore(lambda: tokenizer.client, NS)
            assert await shared.client_reader("alice").get(handle) == b"alice's picture"
            with pytest.raises(ImageMissing, match=f"{handle} is not in client bob's image store"):
                await shared.client_reader("bob").get(handle)
            assert alice.errors == [] and tokenizer.errors == []  # no permission violation on the way
        finally:
            await alice.close()
            await tokenizer.close()

    asyncio.run(run())


def test_user_and_password_from_the_environment_and_never_from_argv(
        auth_nats: tuple[EmbeddedNatsServer, DeploymentAuth]) -> None:
    server, auth = auth_nats
    data = json.loads(auth.role_files["entry"].read_text())
    with pytest.raises(CredentialsError, match=PASSWORD_ENV):
        credentials_from_options(user=data["user"], environ={})
    creds = credentials_from_options(user=data["user"], environ={PASSWORD_ENV: data["password"]})
    assert creds is not None and data["password"] not in repr(creds)

    async def run() -> None:
        bus = await BusConnection.connect(server.url, "env-test", credentials=creds, inbox_prefix=inbox_of("entry"))
        await bus.close()

    asyncio.run(run())


def process_ids(server: ServerHandle) -> dict[str, int]:
    """Every process of the deployment: launcher, nats-server, actors."""
    pids = {"launcher": server.proc.pid, **server.actor_pids()}
    found = re.search(r"started nats-server pid=(\d+)", server.log())
    if found:
        pids["nats-server"] = int(found.group(1))
    return pids


def completion_works(server: ServerHandle) -> None:
    reply = httpx.post(server.base_url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


async def read_until_last(sub: nats.aio.subscription.Subscription, timeout: float = 30) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while not outputs or not outputs[-1].is_last:
        msg = await next_message(sub, timeout)
        assert msg is not None, f"no terminal output; got {outputs}"
        outputs.append(decode(msg.data, RequestOutput))
    return outputs


async def clients_use_the_ring(url: str, ns: str, alice_file: Path, bob_file: Path, **options: object) -> None:
    """alice generates and aborts over NATS; bob can neither read nor abort alice's requests."""
    notes = json.loads(alice_file.read_text())
    assert notes["submit"] == f"{ns}.client.alice.submit"
    alice = await Probe.connect(url, alice_file, notes["inbox_prefix"], **options)
    bob = await Probe.connect(url, bob_file, json.loads(bob_file.read_text())["inbox_prefix"], **options)
    try:
        bobs = await bob.client.subscribe(f"{ns}.client.bob.out.*")
        out1 = await alice.client.subscribe(f"{ns}.client.alice.out.a1")
        request = GenerateRequest(rid="a1", text="Hello", sampling={"max_new_tokens": 4, "temperature": 0})
        reply = await alice.client.request(notes["submit"], encode(request), timeout=30)
        assert decode(reply.data, Accepted).rid == "alice~a1"
        outputs = await read_until_last(out1)
        assert outputs[-1].finish is not None and outputs[-1].completion_tokens == 4
        assert {o.rid for o in outputs} == {"alice~a1"}

        out2 = await alice.client.subscribe(f"{ns}.client.alice.out.a2")
        long = GenerateRequest(rid="a2", text="Hello", sampling={"max_new_tokens": 2000, "ignore_eos": True})
        await alice.client.request(notes["submit"], encode(long), timeout=30)
        assert await next_message(out2, 30) is not None
        assert not await bob.can_publish(f"{ns}.client.alice.abort.a2", encode(AbortRequest(rid="a2")))
        assert await bob.can_publish(f"{ns}.client.bob.abort.a2", encode(AbortRequest(rid="a2")))  # bob's own a2
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # alice's a2 runs on after bob aborted his own a2
            msg = await next_message(out2, 0.1)
            assert msg is None or decode(msg.data, RequestOutput).finish is None
        await alice.client.publish(f"{ns}.client.alice.abort.a2", encode(AbortRequest(rid="a2")))
        rest = await read_until_last(out2, timeout=10)
        assert rest[-1].finish is not None and rest[-1].finish.type == "abort"
        assert await next_message(bobs, 0.2) is None, "bob received output of alice's requests"
        assert not await bob.can_subscribe(f"{ns}.client.alice.out.*")

        # bob's submissions with reply subjects of his choosing: the tokenizer answers only in bob's inbox
        victim = await alice.client.subscribe(f"{ns}.client.alice.out.victim1")
        await alice.client.flush()
        forged = GenerateRequest(rid="b1", text="Hi", sampling={"max_new_tokens": 1})
        for reply in (f"{ns}.client.alice.out.victim1", f"$JS.API.STREAM.PURGE.{ns}-spans", f"{ns}.spans.entry",
                      f"_INBOX.{ns}.client.alice.x"):
            await bob.client.publish(f"{ns}.client.bob.submit", encode(forged), reply=reply)
        await bob.client.flush()
        assert await next_message(victim, 1.0) is None, "a reply bob chose reached alice's output stream"
        own = await bob.client.request(f"{ns}.client.bob.submit", encode(GenerateRequest(
            rid="b2", text="Hi", sampling={"max_new_tokens": 1})), timeout=30)
        assert decode(own.data, Accepted).rid == "bob~b2"
    finally:
        await alice.close()
        await bob.close()


def test_the_ring_serves_with_generated_users_and_no_secret_in_argv_or_log(clients_ring: ServerHandle) -> None:
    """On the shared clients ring (tests/conftest.py), whose teardown checks that its credentials directory goes
    with the launcher."""
    server = clients_ring
    completion_works(server)
    url = logged(server, r"started nats-server pid=\d+ url=(\S+)")
    creds_dir = Path(logged(server, r"nats per-role users credentials_dir=(\S+)"))
    files = {name: Path(logged(server, rf"nats client credentials client={name} file=(\S+)")) for name in CLIENTS}
    assert creds_dir.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in creds_dir.iterdir())
    asyncio.run(clients_use_the_ring(url, server.namespace, files["alice"], files["bob"]))

    async def stranger_refused() -> bool:
        try:
            await (await nats.connect(url, allow_reconnect=False, connect_timeout=2)).close()
        except Exception as exc:
            return "authorization" in str(exc).lower()
        return False

    assert asyncio.run(stranger_refused())
    secrets = {json.loads(f.read_text())["password"] for f in creds_dir.glob("*.json")}
    assert len(secrets) == 6 + len(CLIENTS)  # six roles (trace_exporter included), and the clients
    pids = process_ids(server)
    assert len(pids) == 6, pids
    for name, pid in pids.items():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(s in argv for s in secrets), f"a NATS password is on the command line of {name}"
        if name not in ("launcher", "nats-server"):
            assert "--nats-creds" in argv
    assert not any(s in server.log() for s in secrets), "a NATS password is in the launcher log"


def test_the_ring_serves_on_an_external_nats_with_per_role_users_and_mutual_tls(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path)
    creds_dir = tmp_path / "nats-users"
    made = subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "nats-config", "--out", str(creds_dir),
                           "--namespace", NS, "--client", "alice", "--client", "bob"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    config = tls_block(tls) + (creds_dir / "nats-auth.conf").read_text()
    with EmbeddedNatsServer(extra_config=config) as nats_server:
        tls_args = ["--nats-tls-ca", str(tls["ca"]), "--nats-tls-cert", str(tls["client"]),
                    "--nats-tls-key", str(tls["client_key"])]
        server = start_server(str(tiny_model_dir), nats_url=nats_server.url,
                              extra=["--namespace", NS, "--nats-creds-dir", str(creds_dir), *tls_args])
        try:
            completion_works(server)
            tls_only = credentials_from_options(tls_ca=str(tls["ca"]), tls_cert=str(tls["client"]),
                                                tls_key=str(tls["client_key"]))
            assert tls_only is not None

            async def alice_submits() -> str:
                alice = await Probe.connect(nats_server.url, creds_dir / "client-alice.json",
                                            inbox_prefix(NS, "client", "alice"), tls=tls_only.ssl_context())
                try:
                    request = GenerateRequest(rid="t1", text="Hi", sampling={"max_new_tokens": 1})
                    reply = await alice.client.request(f"{NS}.client.alice.submit", encode(request), timeout=30)
                    return decode(reply.data, Accepted).rid
                finally:
                    await alice.close()

            assert asyncio.run(alice_submits()) == "alice~t1"
            secrets = {json.loads(f.read_text())["password"] for f in creds_dir.glob("*.json")}
            for name, pid in process_ids(server).items():
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                assert not any(s in argv for s in secrets), f"a NATS password is on the command line of {name}"
        finally:
            assert server.stop() == 0

