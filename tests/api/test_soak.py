"""Soak: concurrent mixed traffic against one ring, then the ring must be as it was.

Worker threads loop, each over every kind of request the server takes (streamed chat, clients hanging up
mid-stream, n > 1 with logprobs, JSON schemas, forced tool calls, embeddings, Responses, Messages, a long
prompt, bad requests), through the official `openai` and `anthropic` clients (httpx for the hang-ups), until
the soak's time is up. Every request must get its expected status and a well-formed answer; afterwards no
request state may be left (no running or waiting request, no KV held outside the prefix cache, no live request
or extra subscription at the entry, no actor holding a request), no actor may have restarted, every actor's
resident memory must be flat after the warm-up round, and a greedy answer must be the one given before.

The ring serves the tiny model (random weights, SmolLM2's tokenizer): what is checked is the server, not the
text. CI runs a short soak (`SOAK_SECONDS_DEFAULT`); the long version is the same test with more time:

    RINGSERVE_SOAK_SECONDS=600 .venv/bin/python -m pytest -q -n 0 -s tests/api/test_soak.py

(`-s` shows what ran, the slowest request of each kind and each actor's memory.)
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import anthropic
import httpx
import openai
import pytest

from tests.server_helpers import ServerHandle, server_info, start_server, wait_for, wait_until_idle

pytestmark = pytest.mark.soak

SOAK_SECONDS_DEFAULT = 5.0
SOAK_SECONDS = float(os.environ.get("RINGSERVE_SOAK_SECONDS", SOAK_SECONDS_DEFAULT))
WORKERS = 6
# a bound on each worker's rounds besides the time (a round, one request of each kind, takes far over 50 ms)
MAX_ROUNDS = int(SOAK_SECONDS * 20) + 2
RSS_TOLERANCE = 64 * 1024 * 1024  # bytes an actor may grow by after warm-up without counting as a leak
REQUEST_TIMEOUT = 60.0
# room for every worker's long prompt at once (the tiny model's KV is 512 bytes a token), so that on a busy CI
# host no request waits for memory near its timeout; a full pool is tests/engine/test_engine_chunked_prefill.py's
POOL_TOKENS = 32768

ASK = [{"role": "user", "content": "Name three colours."}]
SCHEMAS = [{"type": "object", "properties": {key: {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
            "required": [key, "bright"], "additionalProperties": False} for key in ("colour", "shade", "hue")]
# enums only: a random-weight model fills a free string to max_tokens, and xgrammar (0.2.9) lets a maxLength
# string hold raw control characters, which no JSON parser takes (reported on issue 53)
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMETERS}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
                     "input_schema": WEATHER_PARAMETERS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
LONG_PROMPT = "Here is a long account of the history of paint and its colours. " * 220  # ~2.9k of 4096 tokens
TOO_LONG_PROMPT = "word " * 6000  # past the tiny model's 4096-token context


@dataclass
class Ring:
    """The soak's ring and its clients."""

    server: ServerHandle
    model: str
    oai: openai.OpenAI
    claude: anthropic.Anthropic
    http: httpx.Client


@pytest.fixture(scope="module")
def ring(tiny_model_dir: Path) -> Iterator[Ring]:
    """The tiny model on a ring of its own (the soak looks at the whole ring's state and memory, so no other
    test's requests may run on it)."""
    server = start_server(str(tiny_model_dir), extra=["--max-total-tokens", str(POOL_TOKENS)])
    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT) as http:
        yield Ring(server, model,
                   openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                 timeout=REQUEST_TIMEOUT),
                   anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                       timeout=REQUEST_TIMEOUT),
                   http)
    assert server.stop() == 0, server.log()[-3000:]


# --- one request of each kind, checked; `i` varies what a kind asks for --------------------------------------


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def streamed_chat(ring: Ring, i: int) -> None:
    stream = ring.oai.chat.completions.create(model=ring.model, messages=ASK, max_tokens=8 + i % 16, stream=True,
                                              temperature=0.7, seed=i, stream_options={"include_usage": True})
    text, finishes, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            expect(choice.index == 0, f"a chunk for choice {choice.index}")
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    expect(finishes in (["stop"], ["length"]), f"finish reasons {finishes}")
    expect(usage is not None and 0 < usage.completion_tokens <= 8 + i % 16, f"usage {usage}")


def hang_up(ring: Ring, i: int) -> None:
    """Open a long stream (chat, or Messages), read its first chunks, and close the connection."""
    path, body = (("/v1/chat/completions", {"messages": ASK, "stream": True})
                  if i % 2 == 0 else ("/v1/messages", {"model": ring.model, "messages": ASK, "stream": True}))
    with ring.http.stream("POST", path, json={**body, "max_tokens": 1000, "temperature": 0.8}) as response:
        expect(response.status_code == 200, f"{path}: status {response.status_code}")
        read = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                json.loads(line[len("data: "):])  # a well-formed event
                read += 1
                if read == 2 + i % 3:
                    break
        expect(read == 2 + i % 3, f"{path}: the stream ended after {read} events")


def n_with_logprobs(ring: Ring, i: int) -> None:
    reply = ring.oai.chat.completions.create(model=ring.model, messages=ASK, max_tokens=6, n=3, temperature=1.0,
                                             seed=i, logprobs=True, top_logprobs=2)
    expect(sorted(c.index for c in reply.choices) == [0, 1, 2], f"choices {[c.index for c in reply.choices]}")
    tokens = 0
    for choice in reply.choices:
        content = choice.logprobs.content
        expect(choice.finish_reason in ("stop", "length") and 0 < len(content) <= 6, f"choice {choice}")
        expect(all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), f"logprobs {content}")
        tokens += len(content)
    expect(reply.usage.completion_tokens == tokens, f"usage {reply.usage} for {tokens} tokens")


def json_schema(ring: Ring, i: int) -> None:
    schema = SCHEMAS[i % len(SCHEMAS)]
    reply = ring.oai.chat.completions.create(
        model=ring.model, messages=ASK, max_tokens=40, temperature=0.7, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    [choice] = reply.choices
    value = json.loads(choice.message.content)
    key = next(iter(schema["properties"]))
    expect(choice.finish_reason == "stop" and set(value) == {key, "bright"} and value[key] in ("red", "green", "blue")
           and isinstance(value["bright"], bool), f"schema answer {choice}")


def weather_input_valid(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"city", "unit"} and value["city"] in ("Paris", "London", "Tokyo")
            and value["unit"] in ("celsius", "fahrenheit"))


def tool_call(ring: Ring, i: int) -> None:
    reply = ring.oai.chat.completions.create(model=ring.model, messages=WEATHER_ASK, max_tokens=60, tools=[WEATHER],
                                             temperature=0.7, seed=i,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [choice] = reply.choices
    calls = choice.message.tool_calls or []
    expect(len(calls) == 1 and calls[0].function.name == "get_weather"
           and weather_input_valid(json.loads(calls[0].function.arguments)), f"tool call {choice}")


def embeddings(ring: Ring, i: int) -> None:
    texts = [f"text {i}", "The quick brown fox.", "ok"][: 1 + i % 3]
    reply = ring.oai.embeddings.create(model=ring.model, input=texts, encoding_format="float")
    expect([d.index for d in reply.data] == list(range(len(texts))), f"indices {[d.index for d in reply.data]}")
    expect(len({len(d.embedding) for d in reply.data}) == 1 and len(reply.data[0].embedding) > 0, "vector sizes")
    expect(all(abs(sum(x * x for x in d.embedding) - 1) < 1e-3 for d in reply.data), "vectors not normalized")


def responses(ring: Ring, i: int) -> None:
    fields = {"model": ring.model, "input": "Name three colours.", "instructions": "Answer briefly.",
              "max_output_tokens": 10, "temperature": 0.7, "store": i % 4 == 0}
    if i % 2:
        events = list(ring.oai.responses.create(stream=True, **fields))
        expect([e.sequence_number for e in events] == list(range(len(events))), "sequence numbers")
        last = events[-1]
        expect(last.type in ("response.completed", "response.incomplete"), f"last event {last.type}")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        expect(text == last.response.output_text, "the deltas are not the text")
    else:
        reply = ring.oai.responses.create(**fields)
        expect(reply.status in ("completed", "incomplete") and reply.output[0].type == "message", f"{reply}")
        expect(0 < reply.usage.output_tokens <= 10, f"usage {reply.usage}")


def messages(ring: Ring, i: int) -> None:
    common = {"model": ring.model, "max_tokens": 40, "extra_body": {"temperature": 0.7}}
    if i % 3 == 0:  # a forced tool call
        reply = ring.claude.messages.create(messages=WEATHER_ASK, tools=[ANTHROPIC_WEATHER],
                                            tool_choice={"type": "tool", "name": "get_weather"}, **common)
        calls = [b for b in reply.content if b.type == "tool_use"]
        expect(reply.stop_reason == "tool_use" and len(calls) == 1 and weather_input_valid(calls[0].input),
               f"message {reply}")
    elif i % 3 == 1:
        with ring.claude.messages.create(messages=ASK, stream=True, **common) as stream:
            kinds = [e.type for e in stream]
        expect(kinds[:2] == ["message_start", "content_block_start"]
               and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], f"events {kinds}")
    else:
        reply = ring.claude.messages.create(messages=ASK, system="Be brief.", **common)
        expect(reply.stop_reason in ("end_turn", "max_tokens") and [b.type for b in reply.content] == ["text"]
               and 0 < reply.usage.output_tokens <= 40, f"message {reply}")


def long_prompt(ring: Ring, i: int) -> None:
    reply = ring.oai.chat.completions.create(model=ring.model, max_tokens=4, temperature=0.7, seed=i, messages=[
        {"role": "user", "content": f"{i} {LONG_PROMPT}"}])
    expect(reply.usage.prompt_tokens > 2500 and 0 < reply.usage.completion_tokens <= 4, f"usage {reply.usage}")


def bad_request(ring: Ring, i: int) -> None:
    """One of several requests the server must refuse with a 400 (naming the field where it promises to)."""
    oai, claude, model = ring.oai, ring.claude, ring.model
    cases: list[tuple[str | None, Callable[[], Any]]] = [
        ("temperature", lambda: oai.chat.completions.create(model=model, messages=ASK, temperature=-1)),
        ("max_tokens", lambda: oai.chat.completions.create(model=model, messages=ASK, max_tokens=10**6)),
        (None, lambda: oai.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": TOO_LONG_PROMPT}])),
        ("response_format", lambda: oai.chat.completions.create(model=model, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "b", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}})),
        ("input", lambda: oai.embeddings.create(model=model, input="")),
        ("max_output_tokens", lambda: oai.responses.create(model=model, input="hi", max_output_tokens=0)),
        ("bogus", lambda: oai.chat.completions.create(model=model, messages=ASK, extra_body={"bogus": 1})),
        (None, lambda: claude.messages.create(model=model, max_tokens=4, messages=ASK,
                                              thinking={"type": "enabled"})),  # type: ignore[typeddict-item]
    ]
    param, call = cases[i % len(cases)]
    try:
        call()
    except (openai.BadRequestError, anthropic.BadRequestError) as refused:
        body = refused.body if isinstance(refused.body, dict) else {}
        message = json.dumps(body)
        expect(param is None or param in message, f"case {i % len(cases)}: a 400 not naming {param}: {message}")
        return
    raise AssertionError(f"case {i % len(cases)} ({param}) was not refused")


KINDS: list[Callable[[Ring, int], None]] = [streamed_chat, hang_up, n_with_logprobs, json_schema, tool_call,
                                            embeddings, responses, messages, long_prompt, bad_request]


# --- the soak -------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the workers did: requests per kind, the slowest of each, and every failure with its traceback."""

    done: dict[str, int] = field(default_factory=dict)
    slowest: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, ring: Ring, kind: Callable[[Ring, int], None], i: int) -> None:
        started = time.monotonic()
        try:
            kind(ring, i)
        except Exception:  # every failure is kept, so the report names each request that failed
            with self.lock:
                self.failures.append(f"{kind.__name__} #{i}:\n{traceback.format_exc(limit=4)}")
        name, took = kind.__name__, time.monotonic() - started
        with self.lock:
            self.done[name] = self.done.get(name, 0) + 1
            self.slowest[name] = round(max(took, self.slowest.get(name, 0.0)), 2)

    def __str__(self) -> str:
        return ", ".join(f"{name} {n} (slowest {self.slowest[name]} s)" for name, n in sorted(self.done.items()))


def traffic(ring: Ring, tally: Tally, seconds: float | None) -> None:
    """WORKERS threads at once, each going round every kind: one round each when `seconds` is None (the warm-up:
    every worker starts on the same kind, so each kind's requests meet and its largest batches are seen), else
    from its own offset until `seconds` have passed (at most MAX_ROUNDS rounds)."""
    deadline = time.monotonic() + (seconds or 0)

    def worker(w: int) -> None:
        for n in range(MAX_ROUNDS if seconds else 1):
            if seconds and time.monotonic() > deadline:
                return
            for k in range(len(KINDS)):
                i = (n * len(KINDS) + k) * WORKERS + w
                tally.run(ring, KINDS[(w + k if seconds else k) % len(KINDS)], i)

    with ThreadPoolExecutor(WORKERS) as pool:
        for future in [pool.submit(worker, w) for w in range(WORKERS)]:
            future.result()


def greedy_answer(ring: Ring) -> tuple[str, list[str]]:
    reply = ring.oai.chat.completions.create(model=ring.model, messages=ASK, max_tokens=24, temperature=0,
                                             logprobs=True)
    return reply.choices[0].message.content, [t.token for t in reply.choices[0].logprobs.content]


def resident_bytes(pid: int) -> int:
    """VmRSS of process `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def settled(ring: Ring) -> dict[str, Any]:
    """The ring's info once no request runs, waits, holds KV or is held by any actor (heartbeats lag a beat)."""
    info = wait_until_idle(ring.server.base_url, timeout=30)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0, info
    assert info["kv_running_tokens"] == 0, f"KV held outside the prefix cache: {info['kv_running_tokens']} tokens"

    def quiet() -> bool:
        nonlocal info
        info = server_info(ring.server.base_url)
        return (info["entry_live_requests"] == 0 and info["entry_admitted_total"] == info["entry_terminal_total"]
                and all(actor["live_rids"] == 0 for actor in info["actors"].values()))

    assert wait_for(quiet, timeout=30), f"request state left behind: {json.dumps(info, indent=1)[:3000]}"
    return info


@pytest.mark.timeout(int(4 * SOAK_SECONDS) + 300)
def test_mixed_traffic_leaves_the_ring_as_it_was(ring: Ring) -> None:
    before = greedy_answer(ring)
    assert before[1], before
    pids = ring.server.actor_pids()
    assert len(pids) == 4, pids

    started = time.monotonic()
    warm_up = Tally()
    traffic(ring, warm_up, None)  # every kind from every worker once: caches, compiled grammars, allocators
    assert warm_up.failures == [], "\n".join(warm_up.failures)
    warm_info = settled(ring)
    warm_rss = {name: resident_bytes(pid) for name, pid in pids.items()}
    warmed = time.monotonic()

    soak = Tally()
    traffic(ring, soak, SOAK_SECONDS)
    assert soak.failures == [], f"{len(soak.failures)} failed of {soak}:\n" + "\n".join(soak.failures[:10])
    assert set(soak.done) == {kind.__name__ for kind in KINDS}, soak.done
    info = settled(ring)
    print(f"soak: warm-up {warmed - started:.1f} s ({warm_up}); traffic and settling "
          f"{time.monotonic() - warmed:.1f} s ({soak})")

    assert ring.server.actor_pids() == pids and sorted(ring.server.live_actors()) == sorted(pids), (
        f"an actor restarted or died: {pids} -> {ring.server.actor_pids()}\n{ring.server.log()[-3000:]}")
    assert info["entry_subscriptions"] <= warm_info["entry_subscriptions"], (
        f"the entry's subscriptions grew: {warm_info['entry_subscriptions']} -> {info['entry_subscriptions']}")
    def grown_now() -> dict[str, int]:
        return {name: resident_bytes(pid) - warm_rss[name] for name, pid in pids.items()}

    # what the scheduler's steps freed goes back to the system a second after the traffic ends
    # (actors/common/heap_trim.py): memory still over the bound some seconds later is kept
    wait_for(lambda: all(growth <= RSS_TOLERANCE for growth in grown_now().values()), timeout=10)
    grown = grown_now()
    print(f"soak: resident memory after warm-up { {n: f'{b / 2**20:.0f} MiB' for n, b in warm_rss.items()} }, "
          f"growth since { {n: f'{b / 2**20:+.1f} MiB' for n, b in grown.items()} }")
    assert all(growth <= RSS_TOLERANCE for growth in grown.values()), (
        f"resident memory grew past {RSS_TOLERANCE >> 20} MiB after warm-up: "
        f"{ {name: f'{growth / 2**20:+.1f} MiB' for name, growth in grown.items()} } over {soak}")
    assert greedy_answer(ring) == before
