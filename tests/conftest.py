"""Shared fixtures: a real NATS server, a real ringserve serving SmolLM2-135M-Instruct, and a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, save_tiny_model, start_server

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a 4096-token context: a whole ring starts in seconds."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), 4096)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def smollm_server(nats_server: EmbeddedNatsServer) -> Iterator[ServerHandle]:
    """The real model behind the whole ring, on a NATS server the tests can also talk to directly."""
    handle = start_server(DEFAULT_MODEL, nats_url=nats_server.url)
    yield handle
    assert len(handle.actor_pids()) == 4  # scheduler, tokenizer, detokenizer, entry: separate processes
    code = handle.stop()  # Ctrl-C
    assert code == 0, f"ringserve exited with {code} on Ctrl-C:\n{handle.log()[-3000:]}"
    assert handle.live_actors() == [], "Ctrl-C left actor processes running"
