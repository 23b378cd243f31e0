"""Logs cannot be forged and error bodies stay small (issue 36).

A client's text that reaches a log (a log message's arguments, a field, an exception's message, a native
library's stderr) never starts a line of its own: our lines start `HH:MM:SS.mmm LEVEL [actor]`, and nothing a
client sends may produce one. Checked on the formatter itself, on an actor process writing to descriptor 2 as
native code does (tests/native_stderr_actor.py, on the session's NATS server), and through real requests on
the shared clients ring. Error bodies quote at most ~200 characters of a bad value.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.observability.logging import _KeyValueFormatter
from tests.native_stderr_actor import FLOOD_END, FLOOD_LINES, FORGED
from tests.server_helpers import REPO, ServerHandle, wait_for

OUR_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} [A-Z]+ +\[\w+\] ")
FORGED_START = FORGED.split("FORGED")[0]


def forged_lines(log: str) -> list[str]:
    """Lines that start as the client's forged text does (`22:40:00.000 ERROR [launcher] `): lines that read
    like ours but are not."""
    return [line for line in log.splitlines() if line.startswith(FORGED_START)]


def format_record(message: str, *args: Any, exc: BaseException | None = None, **fields: Any) -> str:
    record = logging.LogRecord("t", logging.ERROR, __file__, 1, message, args,
                               (type(exc), exc, exc.__traceback__) if exc is not None else None)
    record.fields = fields
    return _KeyValueFormatter("entry").format(record)


def test_messages_fields_and_exception_messages_are_escaped_and_bounded() -> None:
    forged = f"x\n{FORGED}\r\x1b[31m\u2028"
    try:
        try:
            raise KeyError(forged)
        except KeyError as inner:
            raise ValueError(f"bad {forged}") from inner
    except ValueError as exc:
        text = format_record("request %s failed", forged, exc=exc, value=forged, plain=f"a{forged}", long="v" * 50_000)
    lines = text.splitlines()
    assert OUR_LINE.match(lines[0]) and all(line.startswith("  | ") for line in lines[1:]), text
    assert not any(ch in text for ch in "\r\x1b\u2028"), text
    assert forged_lines(text) == [], text
    assert r"x\n22:40:00.000 ERROR [launcher] FORGED-native" in lines[0]  # still readable, on its line
    assert sum("FORGED" in line for line in lines[1:]) == 2  # the two messages, one line each
    assert len(text) < 6000  # the 50,000-character value is cut
    assert "…[+49000 chars]" in text


def actor_log(nats: EmbeddedNatsServer, tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "actor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.native_stderr_actor", "--nats-url", nats.url, *flags],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def test_native_stderr_of_an_actor_comes_out_as_escaped_log_lines(nats_server: EmbeddedNatsServer,
                                                                  tmp_path: Path) -> None:
    """A native write to descriptor 2 becomes our lines, one per native line, marked, escaped and bounded; a
    1 MB write made while holding the GIL does not deadlock the actor."""
    proc, log = actor_log(nats_server, tmp_path)
    try:
        assert wait_for(lambda: FLOOD_END in log.read_text() and " ready " in log.read_text(), 60), log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    text = log.read_text()
    assert forged_lines(text) == [], text[-3000:]
    native = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} WARNING \[detokenizer\] native stderr: ")
    assert any(native.match(line) and line.endswith(r"FORGED-native password=hunter2\rOVERWRITE \x1b[2K\x1b[31mred")
               for line in text.splitlines()), text[-3000:]
    assert "\x1b" not in text and "\r" not in text
    flood = [line for line in text.splitlines() if native.match(line) and "yyyy" in line]
    assert len(flood) == FLOOD_LINES and all(len(line) < 2200 for line in flood)  # one each, bounded


def test_a_crash_traceback_reaches_stderr_with_its_message_escaped(nats_server: EmbeddedNatsServer,
                                                                   tmp_path: Path) -> None:
    proc, log = actor_log(nats_server, tmp_path, "--crash")
    try:
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
    assert wait_for(lambda: "FORGED-traceback" in log.read_text(), 10), log.read_text()
    text = log.read_text()
    assert re.search(r"ERROR \[detokenizer\] detokenizer crashed\n  \| Traceback", text), text
    assert r"  | ValueError: bad value 'q\n22:40:00.000 ERROR [launcher] FORGED-traceback" in text, text
    assert forged_lines(text) == [], text


@pytest.fixture(scope="module")
def ring(clients_ring: ServerHandle) -> ServerHandle:
    return clients_ring


def test_a_forged_value_in_a_request_leaves_no_forged_line(ring: ServerHandle) -> None:
    """The issue's repro: a JSON schema `$ref` whose value forges a line (xgrammar printed it raw to stderr),
    and other client strings that reach the ring."""
    marker = f"FORGED-{uuid.uuid4().hex[:8]}"
    forged = f"zzz\n22:40:00.000 ERROR [launcher] {marker} admin password=hunter2"
    schema = {"type": "object", "properties": {"a": {"$ref": forged}}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for body in ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                 {**chat, "model": forged}, {**chat, forged: 1}, {**chat, "stop": [forged] * 100}):
        httpx.post(ring.base_url + "/v1/chat/completions", json=body, timeout=120)
    wait_for(lambda: marker in ring.log(), 3)  # native stderr arrives through a pipe: give it a moment
    assert forged_lines(ring.log()) == [], ring.log()[-3000:]


@pytest.mark.parametrize("body", [
    {"x" * 100_000: 1},  # an unknown field name (came back whole: a 101 KB body)
    {"stream_options": {"y" * 100_000: 1}, "stream": True},
    {"model": "m" * 100_000},
    {"logit_bias": {str(i): 1 for i in range(5000)}},  # over-long: came back in full
    {"stop": ["s" * 300] * 5000},
    {"stop": ["s" * 100_000]},
    {"temperature": "t" * 100_000},
], ids=["unknown-field", "stream-options", "model", "logit-bias", "stop-list", "stop-string", "temperature"])
def test_error_bodies_quote_a_bounded_part_of_a_bad_value(ring: ServerHandle, body: dict[str, Any]) -> None:
    reply = httpx.post(ring.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert 400 <= reply.status_code < 500, reply.text[:500]
    assert len(reply.content) < 1024, reply.text[:2000]
    error = reply.json()["error"]
    assert error["message"] and (error["param"] is None or len(error["param"]) <= 250), error


def test_a_deep_path_of_long_field_names_stays_short(ring: ServerHandle) -> None:
    """The JSON checks name where a bad value sits: each field name on that path is cut short."""
    deep: Any = 2**70
    for _ in range(8):
        deep = {"k" * 20_000: deep}
    started = time.monotonic()
    reply = httpx.post(ring.base_url + "/v1/chat/completions", timeout=60, json={"messages": deep})
    assert reply.status_code == 400 and len(reply.content) < 1024, reply.text[:2000]
    assert time.monotonic() - started < 30
