"""The bus layer: subject scheme, rid validation, typed msgpack codec, and a real NATS round trip."""

from __future__ import annotations

import asyncio
import pickle

import msgpack
import pytest

from ringserve.bus.codec import DecodeError, decode, encode
from ringserve.bus.connection import BusConnection, PayloadTooLarge
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.messages import (
    BatchTokenOutput, ChatMessage, DecodeParams, FinishReason, GenerateRequest, InfoQuery, RequestOutput,
    SchedulerInfo, TokenRow,
)
from ringserve.bus.subjects import InvalidRidError, Subjects, detokenizer_for, new_rid, validate_rid
from ringserve.observability.traceparent import is_valid_traceparent


@pytest.mark.parametrize("rid", ["a.b", "*", ">", "a b", "a\tb", "", "x" * 65, "é", None, 5])
def test_rids_that_would_break_routing_are_rejected(rid: object) -> None:
    with pytest.raises(InvalidRidError):
        validate_rid(rid)
    with pytest.raises(InvalidRidError):
        Subjects().output(rid)  # type: ignore[arg-type]


def test_generated_rids_are_valid_and_distinct() -> None:
    rids = {new_rid() for _ in range(1000)}
    assert len(rids) == 1000 and all(validate_rid(r) for r in rids)
    assert Subjects("ns").output("abc_-1") == "ns.out.abc_-1"
    assert Subjects("ns").rid_of("ns.abort.abc") == "abc"


def test_detokenizer_choice_is_stable_and_among_the_given() -> None:
    assert detokenizer_for("abc", [0, 1, 2, 3]) == detokenizer_for("abc", [3, 2, 1, 0])
    assert {detokenizer_for(new_rid(), [0, 4, 9]) for _ in range(200)} == {0, 4, 9}


def test_round_trip_of_nested_messages() -> None:
    batch = BatchTokenOutput(step=3, rows=[
        TokenRow("r1", [1, 2, 3], 5, 3, 2, FinishReason("stop", "</s>"), DecodeParams(stop=["x"]), logprobs=[-0.5, -1.0, -2.0],
                 top_ids=[[1], [2], [3]], top_logprobs=[[-0.5], [-1.0], [-2.0]]),
        TokenRow("r2", [9], 2, 1, 0, FinishReason("stop", 2)),
        TokenRow("r3", [], 2, 0),
    ])
    assert decode(encode(batch), BatchTokenOutput) == batch
    req = GenerateRequest(rid="r", messages=[ChatMessage("user", "你好 😀")], sampling={"temperature": 0.5})
    assert decode(encode(req), GenerateRequest) == req


@pytest.mark.parametrize("payload", [
    b"\xc1garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"type": "RequestOutput", "body": {"rid": 5}}),
    msgpack.packb({"type": "RequestOutput", "body": {"text": "no rid"}}),
    msgpack.packb({"type": "BatchTokenOutput", "body": {"step": 1, "rows": [{"rid": "a", "token_ids": ["x"],
                                                                             "prompt_tokens": 1, "completion_tokens": 1}]}}),
    msgpack.packb({"type": "TokenRow", "body": {}}),
    pickle.dumps(RequestOutput("a")),
])
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    expected = BatchTokenOutput if b"BatchTokenOutput" in payload else RequestOutput
    with pytest.raises(DecodeError):
        decode(payload, expected)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    payload = msgpack.packb({"type": "RequestOutput", "body": {"rid": "a", "text": "hi", "future_field": [1]}})
    assert decode(payload, RequestOutput) == RequestOutput(rid="a", text="hi")


def test_publish_subscribe_and_request_over_a_real_nats_server() -> None:
    async def scenario() -> None:
        with EmbeddedNatsServer() as server:
            bus = await BusConnection.connect(server.url, "test")
            subjects = Subjects("unit")
            received: asyncio.Queue = asyncio.Queue()

            async def on_output(msg: RequestOutput, delivery) -> None:
                await received.put((msg, delivery))

            async def on_info(query: InfoQuery, delivery) -> SchedulerInfo:
                return SchedulerInfo(0, 1, 2, 3, 4, 5, 6, "m")

            await bus.subscribe(subjects.output("r1"), RequestOutput, on_output)
            await bus.subscribe(subjects.scheduler_info, InfoQuery, on_info)
            parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            await bus.publish(subjects.output("r1"), RequestOutput("r1", text="a"), traceparent=parent)
            await bus.client.publish(subjects.output("r1"), b"not msgpack")  # dropped, not fatal
            await bus.publish(subjects.output("r1"), RequestOutput("r1", text="b"))
            first, d1 = await asyncio.wait_for(received.get(), 5)
            second, d2 = await asyncio.wait_for(received.get(), 5)
            assert (first.text, second.text) == ("a", "b")
            assert d1.traceparent == parent and is_valid_traceparent(d2.traceparent)
            info = await bus.request(subjects.scheduler_info, InfoQuery(), SchedulerInfo, timeout=5)
            assert info.kv_total_tokens == 4
            await bus.close()

    asyncio.run(scenario())


def test_step_messages_split_to_fit_max_payload() -> None:
    async def scenario() -> None:
        with EmbeddedNatsServer(max_payload=2048) as server:
            bus = await BusConnection.connect(server.url, "test")
            got: list[TokenRow] = []
            done = asyncio.Event()

            async def on_batch(batch: BatchTokenOutput, delivery) -> None:
                got.extend(batch.rows)
                if any(r.rid == "r99" for r in batch.rows):
                    done.set()

            await bus.subscribe("unit.tokens.0", BatchTokenOutput, on_batch)
            rows = [TokenRow(f"r{i}", list(range(20)), 5, 20) for i in range(100)]  # ~10 KB together
            huge = TokenRow("huge", list(range(5000)), 5, 5000)
            with pytest.raises(PayloadTooLarge):
                await bus.publish("unit.tokens.0", BatchTokenOutput(1, rows))
            left = await bus.publish_split("unit.tokens.0", rows[:50] + [huge] + rows[50:],
                                           lambda part: BatchTokenOutput(1, part))
            await asyncio.wait_for(done.wait(), 5)
            assert left == [huge]
            assert [r.rid for r in got] == [r.rid for r in rows]  # every row once, in order
            await bus.close()

    asyncio.run(scenario())
