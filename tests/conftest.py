"""Shared fixtures: a real NATS server, a real ringserve serving SmolLM2-135M-Instruct, and a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, start_server

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama saved as safetensors, with the real SmolLM2 tokenizer: a ring starts in seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.common.model_source import load_tokenizer, resolve_model

    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)
    load_tokenizer(resolve_model("SmolLM2-135M-Instruct")).save_pretrained(directory)
    return directory


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
