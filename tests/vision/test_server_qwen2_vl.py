"""Qwen2.5-VL through a real ring (real NATS, real HTTP, the official openai client) with the tiny model of
tests/vision_models.py: its processor runs in the tokenizer actor (without torchvision), images of different sizes
make different numbers of tokens, and chat `image_url` parts and `/generate` `image_data` give transformers' greedy
tokens; the same image again is served from the prefix cache with the same tokens."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest
import torch

from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, start_server
from tests.vision.test_server_images import data_url, image_chat, png
from tests.vision_models import QWEN_PLACEHOLDER, process, random_image, save_tiny_vlm, tiny_hf_vlm

KIND = "qwen2_5_vl"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, nats_server: EmbeddedNatsServer) -> Iterator[ServerHandle]:
    handle = start_server(str(save_tiny_vlm(KIND, tmp_path_factory.mktemp(KIND))), nats_url=nats_server.url)
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    return tiny_hf_vlm(KIND)


@torch.no_grad()
def hf_greedy(hf: tuple[Any, Any], inputs: dict[str, Any]) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens for processed `inputs`."""
    out = hf[0].generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def test_chat_image_url_gives_transformers_tokens_and_the_cache_serves_it_again(server: ServerHandle,
                                                                                hf: tuple[Any, Any]) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    images = [random_image(1), random_image(2, 40, 24)]  # 16 and 15 image tokens
    messages = image_chat(*(data_url(png(image)) for image in images))
    prompt, tokens = hf_greedy(hf, process(hf[1], images))
    replies = [client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=NEW_TOKENS,  # type: ignore[arg-type]
        temperature=0, extra_body={"return_token_ids": True}) for _ in range(2)]
    for reply in replies:
        body = reply.model_dump()
        assert body["prompt_token_ids"] == prompt
        assert body["choices"][0]["token_ids"] == tokens
    usage = replies[1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    last_image_end = max(i for i, t in enumerate(prompt) if t == hf[1].tokenizer.vision_end_token_id)
    assert usage.prompt_tokens_details.cached_tokens > last_image_end  # both images and the text between


def test_generate_image_data_gives_transformers_tokens(server: ServerHandle, hf: tuple[Any, Any]) -> None:
    first, second = random_image(3, 24, 40), random_image(4)
    texts = [f"{QWEN_PLACEHOLDER}What is it?", f"Compare {QWEN_PLACEHOLDER} and {QWEN_PLACEHOLDER}."]
    reply = httpx.post(f"{server.base_url}/generate", timeout=120, json={
        "text": texts, "image_data": [data_url(png(first)), [data_url(png(second)), data_url(png(first))]],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    for result, text, images in zip(reply.json(), texts, [[first], [second, first]]):
        _, tokens = hf_greedy(hf, dict(hf[1](text=text, images=images, return_tensors="pt")))
        assert result["output_ids"] == tokens
