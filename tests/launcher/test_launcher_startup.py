"""What `ringserve serve` shows in its first seconds: a port in use or an unreachable `--nats-url` is one line and a
non-zero exit before any model is read or actor started (and one taken later, by a race, one line from the entry); the model is read once (its GGUF header, never its
tensors); a ring's log shows each step as a line, with no progress bar redrawn in it."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_helpers import REPO, ServerHandle


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_a_port_in_use_is_one_line_and_an_exit_before_the_model_is_read(held_port: int) -> None:
    result = _serve("--port", str(held_port))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines == [f"ringserve: port {held_port} is already in use on 127.0.0.1: stop what holds it or pass --port"]
    assert "reading the model" not in result.stdout + result.stderr


def test_a_port_taken_after_the_check_is_one_line_from_the_entry(held_port: int, nats_server) -> None:
    """The port taken between the launcher's check and the entry's bind (a race): the entry logs uvicorn's
    reason and one line of its own, with no traceback, and exits non-zero."""
    result = subprocess.run([sys.executable, "-m", "ringserve.actors.entry", "--nats-url", nats_server.url,
                             "--host", "127.0.0.1", "--port", str(held_port), "--served-model-name", "m"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and "address already in use" in lines[0], result.stderr
    assert "could not start" in lines[1] and f"127.0.0.1:{held_port}" in lines[1], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_an_unreachable_nats_url_is_one_line_and_an_exit_before_any_actor() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    with socket.socket() as http:
        http.bind(("127.0.0.1", 0))
        free_http = http.getsockname()[1]
    result = _serve("--port", str(free_http), "--nats-url", f"nats://127.0.0.1:{closed}")
    assert result.returncode != 0
    assert f"ringserve: NATS at nats://127.0.0.1:{closed} is not reachable" in result.stderr
    assert "Traceback" not in result.stderr and "started actor" not in result.stderr


def test_the_embedded_nats_port_in_use_says_so(held_port: int) -> None:
    from ringserve.bus.embedded_server import EmbeddedNatsServer, PortInUse

    with pytest.raises(PortInUse, match=f"port {held_port} is already in use"):
        EmbeddedNatsServer(port=held_port).start()


def test_the_launcher_reads_the_model_once_and_never_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    from ringserve.actors.common import model_source
    from ringserve.actors.launcher.ring import Ring
    from ringserve.actors.launcher.serve_flags import serve_args

    reads: list[str] = []
    real = model_source.read_gguf_metadata
    monkeypatch.setattr(model_source, "read_gguf_metadata", lambda path: reads.append(path) or real(path))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("the launcher parsed the whole GGUF"))
    model_source._gguf_metadata.cache_clear()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = serve_args({"port": port})  # --tool-call-parser and --reasoning-parser auto: the chat template is read
    ring = Ring(args)
    ring.close()
    assert len(reads) == 1
    assert args.tool_call_parser == "hermes"  # chosen from the template that one read found


def test_the_header_reader_agrees_with_gguf_on_every_scalar_and_string() -> None:
    import gguf

    from ringserve.actors.common.gguf_metadata import read_gguf_metadata
    from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model

    source = resolve_model(DEFAULT_MODEL)
    path = str(Path(source.directory) / str(source.gguf_file))
    ours = read_gguf_metadata(path)
    theirs = {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()
              if not key.startswith("GGUF.") and not isinstance(field.contents(), list)}
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if isinstance(value, float) else ours[key] == value, key


def test_a_rings_log_shows_each_step_as_a_line_and_no_progress_bar(smollm_server: ServerHandle) -> None:
    log = smollm_server.log()
    before_ready = log[:log.index("ringserve is ready")]
    steps = ["reading the model", "model read and serve flags checked", "started nats-server" if
             smollm_server.nats_url is None else "started actor", "loading weights", "weights loaded", "actor ready"]
    assert [step for step in steps if step not in before_ready] == []
    assert "\r" not in log, "a progress bar was drawn into the log"
