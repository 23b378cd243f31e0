"""Scheduler replicas claim their id on the bus (bus/replica_claim.py), all real: a NATS with per-role users (the
scheduler's credentials may use the claims bucket, the tokenizer's may not), and real `ringserve worker` and
`ringserve serve` processes with the tiny model.

- Claims in-process: the lowest free ids, distinct under concurrency; a held id is refused within a refresh;
  a released id is free at once; a dead holder of this host is taken over at once, one elsewhere once its
  claim expires; a holder renews a claim that lapsed (or whose bucket the server lost) and gives up
  (`on_lost`) one someone else holds; no JetStream, no claim; only the scheduler role may claim.
- Two scheduler workers started at once without ids both join, with ids 0 and 1, and both serve.
- Two started at once with one id: one serves, the other exits 2 saying the id is claimed.
- A scheduler worker without an id joins a `ringserve serve` ring as replica 1.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import nats.js.errors
import pytest

from ringserve.actors.launcher.nats_auth import DeploymentAuth, generate_auth
from ringserve.bus import replica_claim
from ringserve.bus.embedded_server import EmbeddedNatsServer, free_port
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.replica_claim import ClaimError, JetStreamUnavailable, ReplicaClaim
from ringserve.bus.subjects import Subjects
from tests.server_helpers import start_server, wait_for
from tests.scale_out.test_workers import Worker, start_worker, wait_healthy, wait_ready


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNatsServer, DeploymentAuth, str]]:
    """A NATS with one namespace's per-role users (as `ringserve nats-config` makes them)."""
    namespace = f"c{uuid.uuid4().hex[:10]}"
    auth = generate_auth(namespace, tmp_path_factory.mktemp("claim-auth") / "creds")
    with EmbeddedNatsServer(extra_config=auth.authorization()) as server:
        yield server, auth, namespace


def acquire(secured: tuple[EmbeddedNatsServer, DeploymentAuth, str], replica: int | None,
            role: str = "scheduler") -> ReplicaClaim:
    server, auth, namespace = secured
    return ReplicaClaim.acquire(server.url, Subjects(namespace), replica, auth.credentials(role),
                                inbox_prefix(namespace, role))


def test_concurrent_claims_take_the_lowest_free_ids_and_a_held_id_is_refused(secured: Any) -> None:
    with ThreadPoolExecutor(4) as pool:
        claims = list(pool.map(lambda _: acquire(secured, None), range(4)))
    try:
        assert sorted(c.replica for c in claims) == [0, 1, 2, 3]
        started = time.monotonic()
        with pytest.raises(ClaimError, match="replica 2 is already claimed by a live replica"):
            acquire(secured, 2)
        assert time.monotonic() - started < replica_claim.REFRESH_SECONDS + 2, "a live holder is seen within a refresh"
        next(c for c in claims if c.replica == 2).release()
        again = acquire(secured, None)
        assert again.replica == 2, "a released id is free at once"
        claims.append(again)
    finally:
        for claim in claims:
            claim.release()


def test_the_claim_of_a_process_gone_from_this_host_is_taken_over_at_once(secured: Any) -> None:
    server, auth, namespace = secured
    gone = {**replica_claim.my_identity(), "pid": 2 ** 22 + 7, "start": "1"}  # no such process
    remote = {**gone, "host": "elsewhere", "boot": "another-boot"}

    async def write(key: str, holder: dict[str, Any]) -> None:
        creds = auth.credentials("scheduler")
        nc = await nats.connect(server.url, user=creds.user, password=creds.password,
                                inbox_prefix=inbox_prefix(namespace, "scheduler").encode())
        kv = await replica_claim.open_bucket(nc.jetstream(), Subjects(namespace))
        await kv.create(key, json.dumps(holder).encode())
        await nc.close()

    asyncio.run(write("40", gone))
    asyncio.run(write("41", remote))
    started = time.monotonic()
    claim = acquire(secured, 40)
    try:
        assert claim.replica == 40 and time.monotonic() - started < 2
        started = time.monotonic()
        late = acquire(secured, 41)  # a holder on another host: taken once its claim expires unrefreshed
        elapsed = time.monotonic() - started
        late.release()
        assert late.replica == 41 and 1 < elapsed < replica_claim.TTL_SECONDS + 3, elapsed
    finally:
        claim.release()


def test_a_holder_renews_a_lapsed_claim_and_exits_when_another_holds_its_id(secured: Any) -> None:
    server, auth, namespace = secured
    lost: list[dict[str, Any]] = []
    claim = ReplicaClaim.acquire(server.url, Subjects(namespace), 60, auth.credentials("scheduler"),
                                 inbox_prefix(namespace, "scheduler"), on_lost=lost.append)

    async def kv_call(method: str, *args: Any) -> None:
        creds = auth.credentials("scheduler")
        nc = await nats.connect(server.url, user=creds.user, password=creds.password,
                                inbox_prefix=inbox_prefix(namespace, "scheduler").encode())
        kv = await replica_claim.open_bucket(nc.jetstream(), Subjects(namespace))
        await getattr(kv, method)(*args)
        await nc.close()

    async def holder_token() -> str | None:
        creds = auth.credentials("scheduler")
        nc = await nats.connect(server.url, user=creds.user, password=creds.password,
                                inbox_prefix=inbox_prefix(namespace, "scheduler").encode())
        kv = await replica_claim.open_bucket(nc.jetstream(), Subjects(namespace))
        try:
            return json.loads((await kv.get("60")).value)["token"]
        except nats.js.errors.KeyNotFoundError:
            return None
        finally:
            await nc.close()

    try:
        asyncio.run(kv_call("delete", "60"))  # as if it had expired
        mine = claim._identity["token"]
        assert wait_for(lambda: asyncio.run(holder_token()) == mine, replica_claim.REFRESH_SECONDS + 3)
        assert not lost
        asyncio.run(kv_call("put", "60", json.dumps({"host": "elsewhere", "pid": 1, "token": "theirs"}).encode()))
        assert wait_for(lambda: bool(lost), replica_claim.REFRESH_SECONDS + 3), "the holder did not notice"
        assert lost[0]["token"] == "theirs"
    finally:
        claim.release()


def test_a_holder_makes_its_bucket_again_when_the_server_lost_it() -> None:
    namespace = "lostbucket"

    async def call(action: str) -> str | None:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            if action == "drop":
                await js.delete_key_value(Subjects(namespace).replica_bucket())
                return None
            kv = await js.key_value(Subjects(namespace).replica_bucket())
            return json.loads((await kv.get("0")).value)["token"]
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError, nats.js.errors.NotFoundError):
            return None
        finally:
            await nc.close()

    with EmbeddedNatsServer() as server:
        claim = ReplicaClaim.acquire(server.url, Subjects(namespace), None)
        try:
            asyncio.run(call("drop"))
            assert asyncio.run(call("read")) is None
            mine = claim._identity["token"]
            assert wait_for(lambda: asyncio.run(call("read")) == mine, replica_claim.REFRESH_SECONDS + 3)
        finally:
            claim.release()


def test_without_jetstream_no_id_can_be_claimed() -> None:
    with EmbeddedNatsServer(extra_config="jetstream: disabled\n") as server:
        with pytest.raises(JetStreamUnavailable):
            ReplicaClaim.acquire(server.url, Subjects("nojs"), None)


def test_only_the_scheduler_role_may_claim(secured: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_claim, "JETSTREAM_PATIENCE_SECONDS", 1.0)  # denied reads as no answer
    with pytest.raises(Exception) as caught:
        acquire(secured, 50, role="tokenizer")
    assert not isinstance(caught.value, ClaimError) or "claimed" not in str(caught.value)


def start_ring(nats_url: str, auth: DeploymentAuth, namespace: str, model: Path, port: int,
               schedulers: list[tuple[str, ...]]) -> dict[str, Worker]:
    """A tokenizer, a detokenizer, an entry on `port` and one scheduler worker per flag tuple, all at once."""
    def start(role: str, *flags: str) -> Worker:
        return start_worker(nats_url, namespace, role, *auth.actor_args(role), "--model", str(model), *flags)

    workers = {f"scheduler{i}": start("scheduler", "--max-total-tokens", "4096", *flags)
               for i, flags in enumerate(schedulers)}
    workers.update(tokenizer=start("tokenizer"), detokenizer=start("detokenizer"),
                   entry=start("entry", "--port", str(port)))
    return workers


def replicas(base_url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base_url}/get_server_info", timeout=10).json()["replicas"]


def test_two_schedulers_started_at_once_without_ids_both_join_and_serve(tmp_path: Path, tiny_model_dir: Path) -> None:
    namespace = f"a{uuid.uuid4().hex[:10]}"
    auth = generate_auth(namespace, tmp_path / "creds")
    with EmbeddedNatsServer(extra_config=auth.authorization()) as nats_server:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        workers = start_ring(nats_server.url, auth, namespace, tiny_model_dir, port, [(), ()])
        try:
            for worker in workers.values():
                wait_ready(worker)
            wait_healthy(base_url)
            claimed = sorted(int(re.search(r"claimed replica id (\d+)", workers[name].log()).group(1))
                             for name in ("scheduler0", "scheduler1"))
            assert claimed == [0, 1]
            deadline = time.monotonic() + 20
            while sorted(r["id"] for r in replicas(base_url)) != [0, 1]:
                assert time.monotonic() < deadline, replicas(base_url)
                time.sleep(0.2)
            for i in range(12):  # distinct prefixes: the rendezvous hash spreads them over both replicas
                response = httpx.post(f"{base_url}/v1/completions", timeout=60,
                                      json={"prompt": f"{i} {uuid.uuid4().hex} tell me", "max_tokens": 4})
                assert response.status_code == 200, response.text
            routed = {r["id"]: r["requests_routed"] for r in replicas(base_url)}
            assert all(count > 0 for count in routed.values()), routed
        finally:
            codes = {name: worker.stop() for name, worker in workers.items()}
        assert all(code == 0 for code in codes.values()), codes


def test_two_schedulers_started_at_once_with_one_id_one_wins_the_other_exits_2(secured: Any,
                                                                                  tiny_model_dir: Path) -> None:
    server, auth, namespace = secured
    both = [start_worker(server.url, namespace, "scheduler", *auth.actor_args("scheduler"), "--model",
                         str(tiny_model_dir), "--max-total-tokens", "4096", "--dp-replica-id", "7") for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while all(w.proc.poll() is None for w in both):
            assert time.monotonic() < deadline, [w.log()[-2000:] for w in both]
            time.sleep(0.1)
        [loser] = [w for w in both if w.proc.poll() is not None]
        [winner] = [w for w in both if w is not loser]
        assert loser.proc.returncode == 2, loser.log()[-2000:]
        assert "scheduler replica 7 is already claimed by a live replica" in loser.log()
        wait_ready(winner)
        assert "claimed replica id 7" in winner.log()
        assert winner.stop() == 0
    finally:
        for worker in both:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait()


def test_a_scheduler_worker_without_an_id_joins_a_serve_ring_as_replica_1(tiny_model_dir: Path) -> None:
    server = start_server(str(tiny_model_dir))
    worker = None
    try:
        creds = Path(re.search(r"nats per-role users credentials_dir=(\S+)", server.log()).group(1))
        worker = wait_ready(start_worker(server.nats_url or re.search(r"started nats-server .*url=(\S+)",
                                                                      server.log()).group(1),
                                         server.namespace, "scheduler", "--nats-creds", str(creds / "scheduler.json"),
                                         "--model", str(tiny_model_dir), "--max-total-tokens", "4096"))
        assert "claimed replica id 1" in worker.log()
        deadline = time.monotonic() + 20
        while sorted(r["id"] for r in replicas(server.base_url)) != [0, 1]:
            assert time.monotonic() < deadline, replicas(server.base_url)
            time.sleep(0.2)
        assert worker.stop() == 0
    finally:
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()
        assert server.stop() == 0, server.log()[-3000:]
