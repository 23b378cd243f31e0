"""Grammars that would take the ring down, through real HTTP against the real ring (SmolLM2): each is a 400
naming the field the client sent, within the compile timeout, with the scheduler's memory bounded, and the ring
serves the next request; what xgrammar prints about a client's `$ref` forges no line of the server's log.

Before the compile workers, the unsatisfiable schema grew the scheduler by ~200 MB/s (the text jump-forward
computes never ends) until the OOM killer took it and the whole ring stopped.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.server_helpers import ServerHandle

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Describe a node as JSON."}]
UNSATISFIABLE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                 "$ref": "#/$defs/n"}
FORGED_REF = "zzz\n22:40:00.000 ERROR [launcher] FORGED LINE admin password=hunter2"
COMPILE_TIMEOUT = 30.0  # --grammar-compile-timeout's default
RSS_GROWTH = 300 << 20


def post(server: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def scheduler_rss(server: ServerHandle) -> int:
    pid = next(pid for name, pid in server.actor_pids().items() if name.startswith("scheduler"))
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def assert_bounded_400(server: ServerHandle, body: dict[str, Any], param: str, match: str) -> None:
    """`body` answers 400 naming `param` within the compile timeout, the scheduler's memory stays put, and a
    normal request answers 200 after it."""
    before, started = scheduler_rss(server), time.monotonic()
    response = post(server, CHAT, {"messages": MSG, "max_tokens": 16, **body})
    assert response.status_code == 400, response.text
    assert time.monotonic() - started < COMPILE_TIMEOUT
    error = response.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), response.text
    assert scheduler_rss(server) - before < RSS_GROWTH
    follow = post(server, CHAT, {"messages": MSG, "max_tokens": 4, "temperature": 0})
    assert follow.status_code == 200, follow.text


def test_unsatisfiable_schema_in_response_format(smollm_server: ServerHandle) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "node", "schema": UNSATISFIABLE}}
    assert_bounded_400(smollm_server, {"response_format": fmt}, "response_format", "infinitely nested")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "grow"}}],
                         ids=["required", "named"])
def test_unsatisfiable_tool_parameters(smollm_server: ServerHandle, choice: Any) -> None:
    tools = [{"type": "function", "function": {"name": "grow", "parameters": UNSATISFIABLE}}]
    assert_bounded_400(smollm_server, {"tools": tools, "tool_choice": choice}, "tools", "infinitely nested")


def test_grammar_forcing_unbounded_text_in_guided_grammar(smollm_server: ServerHandle) -> None:
    """Parses fine (the tokenizer's check passes it); the scheduler's compile worker refuses it under its cap."""
    assert_bounded_400(smollm_server, {"guided_grammar": 'root ::= "a" root'}, "guided_grammar",
                       "unbounded length")


def test_forged_ref_leaves_no_line_of_ours_in_the_log(smollm_server: ServerHandle) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": FORGED_REF}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "forged", "schema": schema}}
    for path, body in ((CHAT, {"messages": MSG, "response_format": fmt}),
                       ("/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(schema),
                                                                        "max_new_tokens": 4}})):
        response = post(smollm_server, path, {"max_tokens": 4, **body} if path == CHAT else body)
        assert response.status_code in (200, 400), response.text
        assert "\n" not in response.text.strip()
    time.sleep(0.5)  # let the actors' output reach the launcher's log
    forged = [line for line in smollm_server.log().splitlines() if line.startswith("22:40:00.000")]
    assert forged == [], forged
