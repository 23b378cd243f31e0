"""`--stream-interval`: a request's rows joined k tokens at a time on their way out of the scheduler.

Unit tests of the coalescer (first and final rows at once, joined rows keep every token and logprob, a request
that produced nothing in a step is flushed), the scheduler's loop flushing what it holds when the engine pauses,
the real ring with `--stream-interval 3`: the same tokens and text as the plain server, streamed three at a
time, with logprobs per token; and a request read whole (`stream` false, as non-streamed HTTP answers are) sent
in three outputs instead of a hundred, with the same tokens."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import msgpack
import nats
import pytest

from ringserve.actors.common.model_source import DEFAULT_MODEL
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.scheduler.actor import SchedulerActor
from ringserve.actors.scheduler.stream_interval import WHOLE_OUTPUT_INTERVAL, StreamCoalescer
from ringserve.bus.messages import BatchTokenOutput, FinishReason, TokenizedRequest, TokenRow
from ringserve.bus.params import DecodeParams, SamplingParams
from tests.faults.test_client_flood import FakeCtx, FakeEngine
from tests.server_helpers import ServerHandle, server_info, sse_events, wait_until_idle


def row(rid: str, n: int, done: int, first: bool = False, finish: bool = False) -> TokenRow:
    """Request `rid`'s row of tokens done+1..done+n (token ids equal their position), logprob -position."""
    ids = list(range(done + 1, done + n + 1))
    return TokenRow(rid=rid, token_ids=ids, prompt_tokens=5, completion_tokens=done + n,
                    finish=FinishReason(type="length") if finish else None,
                    decode=DecodeParams() if first else None, queue_time=0.5 if first else None,
                    logprobs=[-float(t) for t in ids], top_ids=[[t] for t in ids],
                    top_logprobs=[[-float(t)] for t in ids])


def test_an_interval_of_one_publishes_every_row_as_it_comes() -> None:
    streams = StreamCoalescer(1)
    rows = [row("a", 1, 0, first=True), row("b", 1, 3)]
    assert streams.take(rows, after_step=True) is rows and len(streams) == 0


def test_rows_are_held_until_they_carry_the_interval_and_keep_every_token() -> None:
    streams = StreamCoalescer(3)
    assert [r.token_ids for r in streams.take([row("a", 1, 0, first=True)], True)] == [[1]]  # first: at once
    assert streams.take([row("a", 1, 1)], True) == [] and streams.take([row("a", 1, 2)], True) == []
    (out,) = streams.take([row("a", 1, 3)], True)
    assert (out.token_ids, out.completion_tokens, out.logprobs) == ([2, 3, 4], 4, [-2.0, -3.0, -4.0])
    assert (out.top_ids, out.top_logprobs, out.decode, out.queue_time) == ([[2], [3], [4]], [[-2.0], [-3.0], [-4.0]],
                                                                           None, None)
    assert streams.take([row("a", 4, 4)], True)[0].token_ids == [5, 6, 7, 8]  # a long row (jump forward) goes
    assert streams.take([row("a", 1, 8)], True) == []
    (last,) = streams.take([row("a", 1, 9, finish=True)], True)  # the final row carries what was held
    assert (last.token_ids, last.completion_tokens, last.finish) == ([9, 10], 10, FinishReason(type="length"))
    assert len(streams) == 0


def test_a_request_absent_from_a_step_or_aborted_between_steps_gets_what_was_held() -> None:
    streams = StreamCoalescer(4)
    streams.take([row("a", 1, 0, first=True), row("b", 1, 0, first=True)], True)
    assert streams.take([row("a", 1, 1), row("b", 1, 1)], True) == []
    (b,) = streams.take([row("a", 1, 2)], True)  # b produced nothing this step (paused, retracted, prefill)
    assert (b.rid, b.token_ids) == ("b", [2])
    abort = TokenRow(rid="a", token_ids=[], prompt_tokens=5, completion_tokens=3, finish=FinishReason(type="abort"))
    (a,) = streams.take([abort], after_step=False)
    assert (a.token_ids, a.completion_tokens, a.finish.type) == ([2, 3], 3, "abort")
    streams.take([row("c", 1, 0, first=True)], True)
    streams.take([row("c", 1, 1)], True)
    assert [r.token_ids for r in streams.flush()] == [[2]] and len(streams) == 0


def test_a_whole_output_request_is_held_64_tokens_at_a_time_until_its_final_row() -> None:
    streams = StreamCoalescer(1)
    streams.whole_output("w")
    assert [r.rid for r in streams.take([row("w", 1, 0, first=True), row("s", 1, 0, first=True)], True)] == ["w", "s"]
    published = [r for done in range(1, 1 + WHOLE_OUTPUT_INTERVAL)
                 for r in streams.take([row("w", 1, done), row("s", 1, done)], True)]
    assert [r.token_ids for r in published if r.rid == "w"] == [list(range(2, 2 + WHOLE_OUTPUT_INTERVAL))]
    assert len([r for r in published if r.rid == "s"]) == WHOLE_OUTPUT_INTERVAL  # a streamed one, row by row
    assert streams.take([row("w", 1, 65)], True) == []
    (last,) = streams.take([row("w", 2, 66, finish=True)], True)
    assert (last.token_ids, last.completion_tokens, last.finish.type) == ([66, 67, 68], 68, "length")
    again = [row("w", 1, 0, first=True), row("w", 1, 1)]  # forgotten with its final row: a new "w" streams
    assert streams.take(again, True) is again
    assert StreamCoalescer(100)._whole_interval == 100  # a longer stream interval holds it longer still


def test_the_interval_is_a_validated_flag() -> None:
    assert EngineConfig().stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose steps give request "a" one token each, then pauses after `steps` steps."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps_left, self.done, self.paused = steps, 0, False

    def has_work(self) -> bool:
        return bool(self.live) and not self.paused

    def step(self) -> list[TokenRow]:
        self.done += 1
        self.steps_left -= 1
        self.paused = self.steps_left == 0
        return [row("a", 1, self.done - 1, first=self.done == 1)]

    def last_plan(self) -> None:
        return None

    def kv_events(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def on_idle(self) -> None:
        pass


class NoKvEvents:
    async def publish(self, stored: list[bytes], removed: list[bytes]) -> None:
        pass


def test_the_scheduler_publishes_held_tokens_when_the_engine_pauses() -> None:
    async def run() -> list[list[int]]:
        ctx, engine = FakeCtx(), ScriptedEngine(steps=4)
        ctx.stopping, ctx.fail = asyncio.Event(), lambda reason: None
        actor = SchedulerActor(ctx, engine, stream_interval=8)  # type: ignore[arg-type]
        actor._kv = NoKvEvents()
        sampling = SamplingParams(max_new_tokens=8)
        actor._inbox.append(("add", TokenizedRequest(rid="a", input_ids=[1], sampling=sampling)))
        loop = asyncio.create_task(actor._run())

        def sent() -> list[list[int]]:
            return [r.token_ids for _, m in ctx.bus.published if isinstance(m, BatchTokenOutput) for r in m.rows]

        for _ in range(200):
            if sum(map(len, sent())) == 4:
                break
            await asyncio.sleep(0.01)
        ctx.stopping.set()
        actor._wake.set()
        await loop
        return sent()

    assert asyncio.run(run()) == [[1], [2, 3, 4]]  # 3 held tokens of 8, published once nothing would follow


# --- the real ring ------------------------------------------------------------------------------------------------

PROMPT = "Write a short story about a lighthouse keeper."


def streamed_generate(base_url: str, max_new_tokens: int) -> list[list[int]]:
    body = {"text": PROMPT, "stream": True, "stream_deltas": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as response:
        assert response.status_code == 200
        return [event["output_ids"] for event in sse_events(response) if event != "[DONE]"]


def streamed_completion(base_url: str) -> tuple[str, list[str], int]:
    body = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "stream": True}
    text, tokens, chunks = "", [], 0
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            if event == "[DONE]" or not event["choices"]:
                continue
            choice: dict[str, Any] = event["choices"][0]
            text += choice["text"]
            if choice.get("logprobs"):
                tokens += choice["logprobs"]["tokens"]
                assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
                chunks += 1
    return text, tokens, chunks


@pytest.fixture
def interval_server(overlap_shards_server: ServerHandle) -> ServerHandle:
    """SmolLM2 with `--stream-interval 3` (and the overlap loop, two detokenizer shards: tests/conftest.py)."""
    return overlap_shards_server


def test_the_ring_streams_the_same_tokens_three_at_a_time(smollm_server: ServerHandle,
                                                          interval_server: ServerHandle) -> None:
    assert server_info(interval_server.base_url)["stream_interval"] == 3
    assert server_info(smollm_server.base_url)["stream_interval"] == 1
    plain = streamed_generate(smollm_server.base_url, 16)
    joined = streamed_generate(interval_server.base_url, 16)
    assert [len(c) for c in plain] == [1] * 16
    assert [t for c in joined for t in c] == [t for c in plain for t in c]
    assert [len(c) for c in joined] == [1, 3, 3, 3, 3, 3]  # the first token at once, the rest three at a time
    text, tokens, chunks = streamed_completion(interval_server.base_url)
    assert (text, tokens) == streamed_completion(smollm_server.base_url)[:2] and len(tokens) == 20
    assert chunks <= 1 + 7  # 20 tokens: the first, then at most three per chunk
    wait_until_idle(interval_server.base_url)


def nats_outputs(server: ServerHandle, rid: str, stream: bool, max_new_tokens: int) -> list[dict[str, Any]]:
    """The RequestOutput bodies of one request a plain NATS client submits with `stream`."""
    async def scenario() -> list[dict[str, Any]]:
        nc = await nats.connect(server.nats_url)
        sub = await nc.subscribe(f"{server.namespace}.out.{rid}")
        await nc.publish(f"{server.namespace}.req.submit", msgpack.packb({"type": "GenerateRequest", "body": {
            "rid": rid, "text": PROMPT, "stream": stream,
            "sampling": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}}))
        outputs = []
        while not outputs or not (outputs[-1]["finish"] or outputs[-1]["error"]):
            outputs.append(msgpack.unpackb((await sub.next_msg(timeout=60)).data)["body"])
        await nc.close()
        return outputs

    return asyncio.run(scenario())


def outputs_during(server: ServerHandle, call: Any) -> tuple[Any, int]:
    """`call()`'s result and how many request outputs the ring published meanwhile (nothing else running)."""
    async def scenario() -> tuple[Any, int]:
        nc = await nats.connect(server.nats_url)
        sub = await nc.subscribe(f"{server.namespace}.out.>")
        await nc.flush()
        result = await asyncio.to_thread(call)
        count = 0
        with contextlib.suppress(nats.errors.TimeoutError):
            while True:
                await sub.next_msg(timeout=0.5)
                count += 1
        await nc.close()
        return result, count

    return asyncio.run(scenario())


def test_a_request_read_whole_costs_the_ring_three_outputs_not_a_hundred(smollm_server: ServerHandle) -> None:
    streamed = nats_outputs(smollm_server, "streamed-1", True, 100)
    whole = nats_outputs(smollm_server, "whole-1", False, 100)
    assert len(streamed) == 100
    assert [len(out["token_ids"]) for out in whole] == [1, WHOLE_OUTPUT_INTERVAL, 100 - 1 - WHOLE_OUTPUT_INTERVAL]
    assert [t for out in whole for t in out["token_ids"]] == [t for out in streamed for t in out["token_ids"]]
    assert "".join(out["text"] for out in whole) == "".join(out["text"] for out in streamed)
    native = {"text": PROMPT, "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}}
    answer, published = outputs_during(smollm_server, lambda: httpx.post(
        smollm_server.base_url + "/generate", json=native, timeout=120).json())
    assert answer["output_ids"] == [t for out in streamed for t in out["token_ids"]] and published == 3
    openai = {"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    answer, published = outputs_during(smollm_server, lambda: httpx.post(
        smollm_server.base_url + "/v1/completions", json=openai, timeout=120).json())
    assert answer["choices"][0]["text"] == "".join(out["text"] for out in streamed) and published == 3
