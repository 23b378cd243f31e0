"""Gemma 3 images through one real ring served with `--tp 2` (two scheduler ranks; real NATS, real HTTP, the official
openai client), the tiny Gemma 3 of tests/vision_models.py: a chat `image_url` gives transformers' greedy tokens,
with `mm_processor_kwargs` turning pan-and-scan on as well (the crops are images of their own); a processor option
the server does not declare, or a bad value, is a 400 naming `mm_processor_kwargs`; an image sent again is not
processed again by the tokenizer (its counters in /get_server_info) and gives the same tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import torch

from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, start_server
from tests.vision.test_server_images import chat, data_url, hf_greedy, image_chat, png
from tests.vision.test_pan_and_scan import PAN_AND_SCAN, wide_image
from tests.vision_models import IMAGE_TOKENS, process, random_image, save_tiny_vlm, tiny_hf_vlm


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


def test_pan_and_scan_through_chat_gives_transformers_tokens(client: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    image = wide_image(12)
    body = chat(client, image_chat(data_url(png(image))), mm_processor_kwargs=PAN_AND_SCAN).model_dump()
    prompt, tokens = hf_greedy(hf, {k: torch.as_tensor(v) for k, v in hf[1](
        text=[hf[1].apply_chat_template(image_chat("x"), add_generation_prompt=True, tokenize=False)],
        images=[image], return_tensors="np", **PAN_AND_SCAN).items()})
    token = hf[1].tokenizer.image_token_id
    assert body["prompt_token_ids"] == prompt and prompt.count(token) == 4 * IMAGE_TOKENS  # the image, 3 crops
    assert body["choices"][0]["token_ids"] == tokens
    plain = chat(client, image_chat(data_url(png(image)))).model_dump()
    assert plain["prompt_token_ids"].count(token) == IMAGE_TOKENS  # off unless asked for


@pytest.mark.parametrize("options", [{"do_resize": False}, {"do_pan_and_scan": "yes"}, []])
def test_bad_processor_options_are_400s(client: openai.OpenAI, options: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, image_chat(data_url(png(random_image(13)))), mm_processor_kwargs=options)
    assert info.value.body["param"] == "mm_processor_kwargs", info.value.body


def tokenizer_counters(server: ServerHandle, since: float) -> dict[str, int]:
    """The tokenizer's counters as its heartbeat reports them, as of a moment after `since` (time.monotonic())."""
    deadline = time.monotonic() + 60
    while True:
        actor = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["actors"]["tokenizer0"]
        if time.monotonic() - actor["age_s"] - actor["loop_lag_s"] > since:  # its numbers were read after `since`
            return actor.get("counters", {})
        assert time.monotonic() < deadline, actor
        time.sleep(0.2)


def test_a_repeated_image_is_processed_once(gemma3: ServerHandle, client: openai.OpenAI,
                                            hf: tuple[Any, Any]) -> None:
    image = random_image(14)
    before = tokenizer_counters(gemma3, time.monotonic())
    first, second = (chat(client, image_chat(data_url(png(image)))).model_dump() for _ in range(2))
    after = tokenizer_counters(gemma3, time.monotonic())
    assert after["images_processed"] - before.get("images_processed", 0) == 1
    assert after["image_cache_hits"] - before.get("image_cache_hits", 0) == 1
    prompt, tokens = hf_greedy(hf, process(hf[1], [image]))
    for body in (first, second):
        assert body["prompt_token_ids"] == prompt and body["choices"][0]["token_ids"] == tokens
