"""A NATS client that floods the ring gets the fast refusal HTTP gets: the scheduler caps live requests per NATS
client (`--max-client-requests`, by the `c~rid` prefix) and in total (`--max-live-requests`, every way in), and
answers a request over a cap at once with a 503 and `retry_after` 1 on its output subject, never queueing it.

The ring test (on the clients ring shared with other files, tests/shared_rings.py) pauses generation while it
floods, so what is live is exactly what was admitted (no request can finish meanwhile): the counts it asserts do
not depend on the machine's speed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ringserve.actors.scheduler.actor import SchedulerActor
from ringserve.actors.scheduler.admission import Admission, client_of_rid
from ringserve.bus.codec import decode, encode
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import (
    AbortRequest, FinishReason, GenerateRequest, RequestOutput, SchedulerInfo, TokenizedRequest, TokenRow,
)
from ringserve.bus.params import SamplingParams
from ringserve.bus.subjects import Subjects
from tests.faults.nats_auth_helpers import Probe
from tests.server_helpers import ServerHandle, server_info, wait_until_idle
from tests.shared_rings import CLIENT_CAP, TOTAL_CAP, logged
FLOOD = 200
LONG = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}  # stays live until aborted


# --- admission.py --------------------------------------------------------------------------------------------


def test_admission_caps_each_client_and_the_total_and_counts_exactly() -> None:
    adm = Admission(max_live=5, max_per_client=2)
    assert client_of_rid("alice~r1") == "alice" and client_of_rid("r1") is None
    assert adm.admit("alice~a") is None and adm.admit("alice~b") is None
    refused = adm.admit("alice~c")
    assert isinstance(refused, ApiError)
    assert (refused.code, refused.type, refused.retry_after) == (503, "server_error", 1)
    assert "alice" in refused.message and "alice~c" not in adm
    assert adm.admit("bob~a") is None  # another client has its own cap
    assert adm.admit("h1") is None and adm.admit("h2") is None  # HTTP rids count only toward the total
    assert len(adm) == 5 and adm.client_live("alice") == 2 and adm.client_live("bob") == 1
    total = adm.admit("h3")
    assert total is not None and total.code == 503 and "5 live requests" in total.message
    assert adm.admit("carol~x") is not None  # the total holds for a client under its own cap
    assert adm.refused_total == 3

    assert adm.release("alice~a") and not adm.release("alice~a")  # idempotent: a second release changes nothing
    assert not adm.release("never-admitted")
    assert adm.client_live("alice") == 1 and len(adm) == 4
    assert adm.admit("alice~c") is None and adm.client_live("alice") == 2
    with pytest.raises(ValueError):
        adm.admit("alice~c")  # a live rid is never counted twice
    for rid in ("alice~b", "alice~c", "bob~a", "h1", "h2"):
        assert adm.release(rid)
    assert len(adm) == 0 and adm.client_live("alice") == 0 and adm.client_live("bob") == 0
    with pytest.raises(ValueError):
        Admission(max_live=0)


# --- the scheduler actor with a fake engine -------------------------------------------------------------------


class FakeEngine:
    """Just enough of EngineInterface: holds requests, rejects rids starting with `bad`, finishes on demand."""

    def __init__(self) -> None:
        self.live: dict[str, TokenizedRequest] = {}

    def add_request(self, request: TokenizedRequest) -> ApiError | None:
        if request.rid in self.live:
            return ApiError(f"request id {request.rid!r} is already in use", param="rid")
        if request.rid.split("~")[-1].startswith("bad"):
            return ApiError("rejected by the engine")
        self.live[request.rid] = request
        return None

    def abort(self, rid: str) -> TokenRow | None:
        if self.live.pop(rid, None) is None:
            return None
        return TokenRow(rid=rid, token_ids=[], prompt_tokens=1, completion_tokens=0, finish=FinishReason(type="abort"))

    def abort_all(self) -> list[TokenRow]:
        return [row for rid in list(self.live) if (row := self.abort(rid)) is not None]

    def finish(self, rid: str) -> TokenRow:
        del self.live[rid]
        return TokenRow(rid=rid, token_ids=[5], prompt_tokens=1, completion_tokens=1,
                        finish=FinishReason(type="length"))

    def stats(self) -> SchedulerInfo:
        return SchedulerInfo(rank=0, num_running_reqs=0, num_waiting_reqs=len(self.live), kv_used_tokens=0,
                             kv_total_tokens=100, context_length=100, step=0, model="fake")

    def live_rids(self) -> int:
        return len(self.live)


class FakeBus:
    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []

    async def publish(self, subject: str, msg: Any, traceparent: str | None = None) -> None:
        self.published.append((subject, msg))

    async def publish_split(self, subject: str, items: list[Any], build: Any, traceparent: str | None = None) -> list:
        await self.publish(subject, build(items))
        return []


class FakeCtx:
    def __init__(self) -> None:
        self.bus = FakeBus()
        self.subjects = Subjects("t")
        self.rank = 0


def test_the_scheduler_refuses_over_a_cap_and_frees_slots_on_finish_abort_and_rejection() -> None:
    async def run() -> None:
        ctx, engine = FakeCtx(), FakeEngine()
        actor = SchedulerActor(ctx, engine, Admission(max_live=4, max_per_client=2))  # type: ignore[arg-type]

        def req(rid: str) -> tuple[str, TokenizedRequest]:
            return ("add", TokenizedRequest(rid=rid, input_ids=[1], sampling=SamplingParams(max_new_tokens=4)))

        async def apply(*items: tuple[str, Any]) -> list[RequestOutput]:
            ctx.bus.published.clear()
            actor._inbox.extend(items)
            await actor._rows.publish(await actor._apply_inbox())
            return [msg for _, msg in ctx.bus.published if isinstance(msg, RequestOutput)]

        errors = await apply(req("alice~a"), req("alice~b"), req("alice~c"), req("alice~bad1"), req("h1"))
        assert [(e.rid, e.error.code, e.error.retry_after) for e in errors] == [("alice~c", 503, 1),
                                                                                 ("alice~bad1", 503, 1)]
        assert ("t.client.alice.out.c", errors[0]) in ctx.bus.published  # on the client's own output subject
        assert set(engine.live) == {"alice~a", "alice~b", "h1"}  # refused ones never reached the engine
        errors = await apply(req("bob~bad2"))  # an engine rejection frees its slot at once
        assert [(e.rid, e.error.code) for e in errors] == [("bob~bad2", 400)]
        assert len(actor._admission) == 3 and actor._admission.client_live("bob") == 0
        errors = await apply(req("alice~a"))  # a live rid again: the engine's rejection frees nothing
        assert [e.error.code for e in errors] == [400] and actor._admission.client_live("alice") == 2
        errors = await apply(req("h2"), req("h3"))  # the total cap (4) holds for HTTP rids too
        assert [(e.rid, e.error.code) for e in errors] == [("h3", 503)]

        await actor._rows.publish([engine.finish("alice~a")])  # a final row frees the slot
        assert actor._admission.client_live("alice") == 1 and len(actor._admission) == 3
        assert await apply(("abort", ("alice~b", True))) == [] and actor._admission.client_live("alice") == 0
        assert await apply(("abort", ("alice~never", True))) == [] and len(actor._admission) == 2  # an early abort
        assert await apply(req("alice~d"), req("alice~e")) == []  # the client may submit again
        assert actor._admission.client_live("alice") == 2 and len(actor._admission) == 4
        await actor._rows.publish(engine.abort_all())
        assert len(actor._admission) == 0

    asyncio.run(run())


# --- the real ring ---------------------------------------------------------------------------------------------


def post(base: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(base + path, json={} if body is None else body, timeout=60)


def live(base: str) -> int:
    info = server_info(base)
    return info["num_running_reqs"] + info["num_waiting_reqs"]


class Client:
    """One NATS client of the ring, collecting every output on its `client.{c}.out.*`."""

    def __init__(self, server: ServerHandle, name: str) -> None:
        self.server, self.name = server, name
        self.file = Path(logged(server, rf"nats client credentials client={name} file=(\S+)"))
        self.notes = json.loads(self.file.read_text())
        self.outputs: dict[str, list[RequestOutput]] = {}

    async def connect(self) -> None:
        url = logged(self.server, r"started nats-server pid=\d+ url=(\S+)")
        self.probe = await Probe.connect(url, self.file, self.notes["inbox_prefix"])

        async def on_output(msg: Any) -> None:
            out = decode(msg.data, RequestOutput)
            self.outputs.setdefault(out.rid.split("~", 1)[1], []).append(out)

        await self.probe.client.subscribe(f"{self.server.namespace}.client.{self.name}.out.*", cb=on_output)
        await self.probe.client.flush()

    async def submit(self, rids: list[str], sampling: dict[str, Any]) -> None:
        """Submit every rid at once (each a request for the tokenizer's `Accepted`)."""
        await asyncio.gather(*(self.probe.client.request(
            self.notes["submit"], encode(GenerateRequest(rid=rid, text="Hello", sampling=sampling)), timeout=30)
            for rid in rids))

    async def abort(self, rids: list[str]) -> None:
        for rid in rids:
            await self.probe.client.publish(f"{self.server.namespace}.client.{self.name}.abort.{rid}",
                                            encode(AbortRequest(rid=rid)))
        await self.probe.client.flush()

    def refused(self, rids: list[str]) -> list[str]:
        return [r for r in rids if self.outputs.get(r) and self.outputs[r][0].error is not None
                and self.outputs[r][0].error.code == 503]

    def ended(self, rids: list[str]) -> list[str]:
        return [r for r in rids if self.outputs.get(r) and self.outputs[r][-1].is_last]

    async def close(self) -> None:
        await self.probe.close()


async def until(condition: Any, what: str, timeout: float = 60.0) -> None:
    """Wait for `condition()` (a deadline only against a hang; nothing is asserted about speed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_flooding_nats_client_is_capped_and_http_still_answers(clients_ring: ServerHandle) -> None:
    """On the shared clients ring (tests/conftest.py), idle when the test starts and when it ends."""
    ring, base = clients_ring, clients_ring.base_url
    assert wait_until_idle(base)["num_waiting_reqs"] == 0 and live(base) == 0

    async def run() -> None:
        alice, bob = Client(ring, "alice"), Client(ring, "bob")
        await alice.connect()
        await bob.connect()
        loop = asyncio.get_running_loop()
        try:
            assert post(base, "/pause_generation").json()["success"] is True
            # alice floods: exactly her cap is admitted (waiting, as generation is paused), the rest refused
            flood = [f"f{i}" for i in range(FLOOD)]
            await alice.submit(flood, LONG)
            await until(lambda: len(alice.refused(flood)) + live(base) >= FLOOD, "every flood request's fate")
            refused = alice.refused(flood)
            assert len(refused) == FLOOD - CLIENT_CAP and live(base) == CLIENT_CAP
            for rid in refused:
                [out] = alice.outputs[rid]
                assert out.error is not None and out.error.retry_after == 1 and out.error.type == "server_error"
                assert "'alice'" in out.error.message and out.rid == f"alice~{rid}"
            admitted = [r for r in flood if r not in refused]
            assert not any(alice.outputs.get(r) for r in admitted)  # queued, no output while paused

            # bob is under his own cap, but the total cap holds across clients
            bobs = [f"b{i}" for i in range(CLIENT_CAP)]
            await bob.submit(bobs, LONG)
            await until(lambda: len(bob.refused(bobs)) + live(base) >= CLIENT_CAP + len(bobs), "bob's fates")
            assert live(base) == TOTAL_CAP and len(bob.refused(bobs)) == CLIENT_CAP - (TOTAL_CAP - CLIENT_CAP)
            assert all(f"{TOTAL_CAP} live requests" in bob.outputs[r][0].error.message for r in bob.refused(bobs))

            # HTTP gets the same fast 503 from the scheduler's total cap (even while paused: never queued)
            busy = await loop.run_in_executor(None, lambda: post(base, "/v1/completions", {
                "prompt": "Hello", "max_tokens": 3, "temperature": 0}))
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
            assert live(base) == TOTAL_CAP

            bob_live = [r for r in bobs if r not in bob.refused(bobs)]
            await bob.abort(bob_live)
            await until(lambda: live(base) == CLIENT_CAP, "bob's aborts to free the total")
            assert post(base, "/continue_generation").json()["success"] is True

            # alice's capped requests run; an HTTP request at the same time completes
            await until(lambda: all(alice.outputs.get(r) for r in admitted), "alice's admitted requests to run")
            reply = await loop.run_in_executor(None, lambda: post(base, "/v1/completions", {
                "prompt": "Hello", "max_tokens": 3, "temperature": 0}))
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3, reply.text
            assert live(base) <= CLIENT_CAP
            more = [f"m{i}" for i in range(20)]  # still capped while her requests run
            await alice.submit(more, LONG)
            # (running, each request answers: a refusal, or its first tokens if one of hers had finished)
            await until(lambda: all(alice.outputs.get(r) for r in more), "the second flood's fates")
            assert live(base) <= CLIENT_CAP
            assert all(alice.outputs[r][0].error.retry_after == 1 for r in alice.refused(more))
            assert len(alice.refused(more)) >= len(more) - len(alice.ended(admitted))

            # aborting frees alice's slots: she can submit again, and finishing frees them too
            holding = [r for r in admitted + more if r not in alice.refused(more)]
            await alice.abort(holding)
            await until(lambda: len(alice.ended(holding)) == len(holding), "alice's aborts")
            assert {alice.outputs[r][-1].finish.type for r in holding} <= {"abort", "length"}
            await until(lambda: live(base) == 0, "the aborted requests to leave the engine")
            for round_ in range(2):
                short = [f"s{round_}_{i}" for i in range(CLIENT_CAP)]
                await alice.submit(short, {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0})
                await until(lambda: len(alice.ended(short)) == len(short), "the short requests to finish")
                assert alice.refused(short) == []
                assert all(alice.outputs[r][-1].finish.type == "length" for r in short)
            assert wait_until_idle(base)["num_waiting_reqs"] == 0 and live(base) == 0
        finally:
            post(base, "/continue_generation")
            post(base, "/abort_request", {"abort_all": True})
            await alice.close()
            await bob.close()

    asyncio.run(run())
