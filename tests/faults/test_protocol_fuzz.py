"""Hostile values for every declared parameter and every field of a submission, sent over NATS as any client
could: each request ends at once with its one terminal output (a 400 naming the field, or a normal finish),
never a hang, never a 5xx, and the ring keeps serving."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgpack
import nats

from ringserve.bus.params import SPECS
from tests.server_helpers import ServerHandle, wait_until_idle

HOSTILE: list[Any] = [
    "x", "²", "9" * 5000, True, -1, 0, 2**63 - 1, -(2**63), 1e308, -1e308, math.nan, math.inf, [], ["a"], [1, "a"],
    [[1]], [2**63 - 1], {}, {"²": 1}, {"9" * 5000: 1}, {"1": "x"}, {"1": math.nan}, {"-1": 1}, {"a": {"b": 1}},
]
MALFORMED_FIELDS: list[dict[str, Any]] = [
    {"text": 5}, {"text": ["a"]}, {"input_ids": ["a"]}, {"input_ids": [2**64 - 1]}, {"input_ids": 7},
    {"messages": [{"role": 1, "content": "x"}]}, {"messages": "hi"}, {"messages": [{"role": "user"}]},
    {"sampling": "x"}, {"sampling": [1]}, {"text": "hi", "input_ids": [1]}, {},
]


def _pack(body: dict[str, Any]) -> bytes:
    return msgpack.packb({"type": "GenerateRequest", "body": body}, use_bin_type=True)


def _submissions() -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every submission by rid, and which parameter each parameter submission attacks."""
    out: dict[str, dict[str, Any]] = {}
    target: dict[str, str] = {}
    for p, name in enumerate(SPECS):
        for i, value in enumerate(HOSTILE):
            rid = f"fuzz-param{p}-{i}"
            out[rid], target[rid] = {"text": "Hi", "sampling": {"max_new_tokens": 1, name: value}}, name
    for i, fields in enumerate(MALFORMED_FIELDS):
        out[f"fuzz-field{i}"] = {"sampling": {"max_new_tokens": 1}, **fields}
    return out, target


def test_every_field_and_parameter_ends_at_once(smollm_server: ServerHandle) -> None:
    ns = smollm_server.namespace
    submissions, target = _submissions()

    async def scenario() -> dict[str, dict[str, Any]]:
        nc = await nats.connect(smollm_server.nats_url)
        last: dict[str, dict[str, Any]] = {}
        sub = await nc.subscribe(f"{ns}.out.*")
        await nc.flush()
        for rid, body in submissions.items():
            await nc.publish(f"{ns}.req.submit", _pack({"rid": rid, **body}))
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + 120
        while len(last) < len(submissions) and asyncio.get_running_loop().time() < deadline:
            try:
                msg = await sub.next_msg(timeout=5)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            out = msgpack.unpackb(msg.data, strict_map_key=False)["body"]
            if out["rid"] in submissions and (out["finish"] or out["error"]):
                last[out["rid"]] = out
        await nc.close()
        return last

    last = asyncio.run(scenario())
    missing = sorted(set(submissions) - set(last))
    assert not missing, f"{len(missing)} requests never ended, e.g. {missing[:5]}"
    errors = {rid: out["error"] for rid, out in last.items() if out["error"]}
    # a bad value is a 400; an adapter name that is well formed but not loaded is OpenAI's 404 for a model
    refused = {rid: e for rid, e in errors.items() if not (e["code"] == 400 and e["type"] == "invalid_request_error")
               and not (e["code"] == 404 and e["param"] == "lora_name")}
    assert not refused, list(refused.items())[:5]
    for rid, error in errors.items():  # a bad parameter's error names it, natively (a NATS client sent it so)
        if rid in target:
            spec = SPECS[target[rid]]
            assert error["param"] in (spec.name, "max_new_tokens"), (rid, error)  # native names over NATS
        else:
            assert error["param"] in ("text", "input_ids", "messages", "sampling", "prompt"), (rid, error)
    assert len(errors) > len(last) // 2  # most of these values are refused
    assert wait_until_idle(smollm_server.base_url)["num_running_reqs"] == 0
    assert smollm_server.proc.poll() is None
