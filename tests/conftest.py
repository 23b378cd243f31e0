"""Shared fixtures: a real NATS server, a real ringserve serving SmolLM2-135M-Instruct, a tiny model (saved for
a whole ring, or as a transformers model for engine tests), and torch on one thread in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, save_tiny_model, start_server

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a 4096-token context: a whole ring starts in seconds."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), 4096)


@pytest.fixture(autouse=True, scope="module")
def torch_single_thread() -> Iterator[None]:
    """Run each test module's in-process torch work on one thread.

    On a small shared machine two OpenMP threads competing with other processes spin at barriers and run
    tiny matmuls tens of times slower; one thread keeps the engine tests fast and their timing stable.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf() -> Any:
    """A tiny random transformers Llama (tests/engine_helpers.py `tiny_hf_llama`), the engine tests' reference."""
    from tests.engine_helpers import tiny_hf_llama  # imported late: test_kernels_triton sets its env first

    return tiny_hf_llama()


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
