"""`ringserve.Client`, `ringserve submit` and the JSON submit, against real rings: a served ring on its embedded
NATS (with auth) and a NATS client user `c` (the clients ring, shared with other files), and the SmolLM2 server
(unauthenticated NATS). A client with its credentials generates, streams and aborts with the HTTP API's errors;
without them NATS refuses it; `ringserve submit` prints the answer; a JSON submission (as `nats req` sends it) is answered in
JSON and generates; and an `Engine` joins the served SmolLM2 ring with `nats_url=`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgpack
import nats
import pytest

import ringserve
from ringserve.bus.codec import decode
from ringserve.bus.messages import RequestOutput
from tests.server_helpers import REPO, ServerHandle

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def served(clients_ring: ServerHandle) -> tuple[ServerHandle, str, str]:
    """The shared clients ring (tests/conftest.py: a `ringserve serve` on its embedded NATS with client user `c`
    among others): (server, its NATS URL, c's credentials)."""
    log = clients_ring.log()
    creds = re.search(r"nats client credentials client=c file=(\S+)", log)
    url = re.search(r"NATS (nats://[\d.:]+)\)", log)
    assert creds and url, log[-2000:]
    return clients_ring, url.group(1), creds.group(1)


def http_generate(server: ServerHandle, body: dict[str, Any]) -> Any:
    return httpx.post(server.base_url + "/generate", json=body, timeout=60).json()


def test_client_with_credentials_generates_streams_and_aborts(served: tuple[ServerHandle, str, str]) -> None:
    server, _, creds = served
    expected = http_generate(server, {"text": ["Hello", "Bye"], "sampling_params": GREEDY})
    bad = httpx.post(server.base_url + "/generate", timeout=30, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "top_p": 2}}).json()["error"]

    async def session() -> None:
        async with ringserve.Client(creds=creds) as client:  # the file's notes give URL, namespace and client
            assert client.client == "c"
            results = await client.generate(["Hello", "Bye"], GREEDY, rid="mine")
            assert [(r.text, r.output_ids) for r in results] == [(e["text"], e["output_ids"]) for e in expected]
            assert [r.meta_info["id"] for r in results] == ["mine-0", "mine-1"]  # the client's own rids
            deltas = [d async for d in client.stream("Hello", GREEDY)]
            assert "".join(d.text for d in deltas) == expected[0]["text"] and deltas[-1].finished

            with pytest.raises(ringserve.ApiError) as refused:  # the same error as over HTTP
                await client.generate("Hello", {"max_new_tokens": 4, "top_p": 2})
            assert (refused.value.code, refused.value.param, refused.value.message) == (
                bad["code"], bad["param"], bad["message"])
            with pytest.raises(ringserve.ApiError) as operator:  # a client may not flush, pause or swap weights
                await client.flush_cache()
            assert operator.value.code == 403

            long = asyncio.ensure_future(client.generate("Hello", {"max_new_tokens": 3000, "ignore_eos": True},
                                                         rid="long"))
            while client.live_requests == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            await client.abort("long")
            aborted = await asyncio.wait_for(long, 30)
            assert aborted.finish_reason["type"] == "abort" and aborted.meta_info["completion_tokens"] < 3000

            with pytest.raises(ringserve.ApiError) as late:
                await client.generate("Hello", {"max_new_tokens": 3000, "ignore_eos": True}, timeout=0.5)
            assert late.value.code == 504

    asyncio.run(session())


def test_nats_refuses_a_client_without_credentials(served: tuple[ServerHandle, str, str], tmp_path: Path) -> None:
    server, url, creds = served

    async def connect(**kwargs: Any) -> None:
        async with ringserve.Client(url, server.namespace, **kwargs):
            pass

    with pytest.raises(ConnectionError, match="refused"):
        asyncio.run(connect())
    notes = json.loads(Path(creds).read_text())
    wrong = tmp_path / "wrong.json"  # not beside c's own file: that directory is the shared ring's
    wrong.write_text(json.dumps({**notes, "password": "not-it"}))
    with pytest.raises(ConnectionError, match="refused these credentials"):
        asyncio.run(connect(creds=wrong))


def submit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "submit", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_ringserve_submit_end_to_end(served: tuple[ServerHandle, str, str]) -> None:
    server, _, creds = served
    expected = http_generate(server, {"text": "Hello", "sampling_params": GREEDY})
    plain = submit("--creds", creds, "--text", "Hello", "--max-new-tokens", "8", "--temperature", "0")
    assert plain.returncode == 0 and plain.stdout == expected["text"] + "\n", plain.stderr
    assert '"type": "length"' in plain.stderr
    streamed = submit("--creds", creds, "--text", "Hello", "--sampling", json.dumps(GREEDY), "--stream")
    assert streamed.returncode == 0 and streamed.stdout == expected["text"] + "\n", streamed.stderr

    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    lines = submit("--creds", creds, "--messages", json.dumps(messages), "--max-new-tokens", "6", "--temperature",
                   "0", "--json", "--rid", "sub-1")
    assert lines.returncode == 0, lines.stderr
    outputs = [json.loads(line) for line in lines.stdout.splitlines()]
    assert all(o["type"] == "RequestOutput" and o["body"]["rid"] == "c~sub-1" for o in outputs)
    assert [o["body"]["seq"] for o in outputs] == list(range(len(outputs)))
    assert "".join(o["body"]["text"] for o in outputs) == chat["choices"][0]["message"]["content"]
    assert outputs[-1]["body"]["finish"]["type"] == "length"

    refused = submit("--creds", creds, "--text", "Hello", "--temperature", "-1")
    assert refused.returncode == 1 and json.loads(refused.stderr)["error"]["param"] == "temperature"
    nobody = submit("--nats-url", "nats://127.0.0.1:1", "--text", "Hello")
    assert nobody.returncode == 2 and "no NATS server" in nobody.stderr


def test_a_json_submission_as_the_nats_cli_sends_it(served: tuple[ServerHandle, str, str]) -> None:
    """`nats req --inbox-prefix _INBOX.{ns}.client.c {ns}.client.c.submit '{"rid": ..., "text": ...}'`."""
    server, url, creds = served
    notes = json.loads(Path(creds).read_text())
    expected = http_generate(server, {"text": "Hello", "sampling_params": GREEDY})

    async def session() -> tuple[bytes, list[RequestOutput], bytes]:
        nc = await nats.connect(url, user=notes["user"], password=notes["password"],
                                inbox_prefix=notes["inbox_prefix"])
        try:
            outputs = await nc.subscribe(f"{server.namespace}.client.c.out.j1")
            body = {"rid": "j1", "text": "Hello", "sampling": GREEDY}
            reply = await nc.request(notes["submit"], json.dumps(body).encode(), timeout=10)
            got: list[RequestOutput] = []
            while not got or not got[-1].is_last:
                got.append(decode((await outputs.next_msg(timeout=30)).data, RequestOutput))
            errors = await nc.subscribe(f"{server.namespace}.client.c.out.j2")
            malformed = await nc.request(notes["submit"], b'{"rid": "j2", "text": 42}', timeout=10)
            error = (await errors.next_msg(timeout=10)).data
            assert json.loads(malformed.data) == {"type": "Accepted", "body": {"rid": "c~j2", "replica": None,
                                                                              "detokenizer": None}}
            return reply.data, got, error
        finally:
            await nc.close()

    reply, got, error = asyncio.run(session())
    # answered in JSON, as it was asked, naming the replica and the detokenizer that took it
    assert json.loads(reply) == {"type": "Accepted", "body": {"rid": "c~j1", "replica": 0, "detokenizer": 0}}
    assert "".join(o.text for o in got) == expected["text"] and got[-1].finish is not None
    refusal = msgpack.unpackb(error)["body"]["error"]  # outputs stay msgpack
    assert refusal["code"] == 400 and refusal["param"] == "text"


def test_an_engine_joins_a_served_ring_with_nats_url(smollm_server: ServerHandle) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    expected = http_generate(smollm_server, {"text": prompts, "sampling_params": GREEDY})
    with ringserve.Engine(nats_url=smollm_server.nats_url, namespace=smollm_server.namespace) as engine:
        assert engine.pids() == {}  # it started nothing
        results = engine.generate(prompts, GREEDY)
        assert [(r.text, r.output_ids) for r in results] == [(e["text"], e["output_ids"]) for e in expected]
        info = engine.get_server_info()
        assert info["model"] == "SmolLM2-135M-Instruct" and info["weight_version"] == "1"
        assert engine.flush_cache()["success"] is True
    assert httpx.get(smollm_server.base_url + "/health", timeout=10).status_code == 200  # the ring serves on
