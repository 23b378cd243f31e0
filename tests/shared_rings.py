"""Tiny-model rings shared by several test files (session fixtures in tests/conftest.py), and their flags.

Starting a ring costs about ten seconds of CPU on a small machine, so test files whose flags do not get in each
other's way share one ring instead of each starting its own. A test that leaves a shared ring changed (killed,
stopped or re-weighted actors) keeps a ring of its own; one that pauses generation resumes it before it returns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.server_helpers import ServerHandle, start_server

# The clients ring: NATS client users, with the scheduler's per-client and total caps on live requests.
CLIENTS = ("alice", "bob", "c")
CLIENT_CAP = 8
TOTAL_CAP = 12

# The small ring: a bounded entry queue, a short body-read timeout, small prefill chunks, tracing on, and the
# grammar warm-up on (reasoning_tools/test_grammar_warm_up_ring.py; the other rings of the suite start without it).
QUEUE_CAPACITY = 3
BODY_READ_TIMEOUT = 1.5
PREFILL_CHUNK = 32


def start_clients_ring(model_dir: Path) -> ServerHandle:
    """A ring on its embedded NATS (per-role users) with a NATS user for each of `CLIENTS`."""
    clients = [flag for name in CLIENTS for flag in ("--nats-client", name)]
    return start_server(str(model_dir), extra=[*clients, "--max-client-requests", str(CLIENT_CAP),
                                               "--max-live-requests", str(TOTAL_CAP)])


def start_small_ring(model_dir: Path, otlp_endpoint: str) -> ServerHandle:
    """A ring with an 8192-token KV pool, at most `QUEUE_CAPACITY` queued requests at the entry, a
    `BODY_READ_TIMEOUT` for request bodies, prefill in `PREFILL_CHUNK`-token chunks and steps, its spans
    exported to `otlp_endpoint` (within 0.1 s of their end, so tests reading them do not wait), and its grammar
    compilers warm before ready (`--grammar-warm-up`, which `start_server` otherwise turns off)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        return start_server(str(model_dir), extra=["--otlp-endpoint", otlp_endpoint, "--max-total-tokens", "8192",
                                                   "--max-queued-requests", str(QUEUE_CAPACITY),
                                                   "--body-read-timeout", str(BODY_READ_TIMEOUT),
                                                   "--chunked-prefill-size", str(PREFILL_CHUNK),
                                                   "--max-prefill-tokens", str(PREFILL_CHUNK),
                                                   "--grammar-warm-up"])


def logged(server: ServerHandle, pattern: str) -> str:
    """The first group of `pattern` in the launcher's log (asserted to be there)."""
    found = re.search(pattern, server.log())
    assert found, f"{pattern!r} not in the launcher log:\n{server.log()[-3000:]}"
    return found.group(1)
