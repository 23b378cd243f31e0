"""Gemma 3 images through one real ring served with `--tp 2` (two scheduler ranks; real NATS, real HTTP, the official
openai client), the tiny Gemma 3 of tests/vision_models.py: a chat `image_url` gives transformers' greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, start_server
from tests.test_server_images import chat, data_url, hf_greedy, image_chat, png
from tests.vision_models import process, random_image, save_tiny_vlm, tiny_hf_vlm


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory, nats_server: EmbeddedNatsServer) -> Iterator[ServerHandle]:
    directory = save_tiny_vlm("gemma3", tmp_path_factory.mktemp("gemma3"))
    handle = start_server(str(directory), nats_url=nats_server.url,
                          extra=["--tp", "2", "--torch-threads", "1", "--max-total-tokens", "4096"])
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    return tiny_hf_vlm("gemma3")


@pytest.fixture(scope="module")
def client(gemma3: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gemma3.base_url}/v1", api_key="unused", max_retries=0)


def test_an_image_under_tp2_gives_transformers_tokens(gemma3: ServerHandle, client: openai.OpenAI,
                                                       hf: tuple[Any, Any]) -> None:
    info = httpx.get(f"{gemma3.base_url}/get_server_info", timeout=30).json()
    assert [(r["tp_size"], r["up"]) for r in info["replicas"]] == [(2, True)]
    image = random_image(11)
    body = chat(client, image_chat(data_url(png(image)))).model_dump()
    prompt, tokens = hf_greedy(hf, process(hf[1], [image]))
    assert body["prompt_token_ids"] == prompt
    assert body["choices"][0]["token_ids"] == tokens
