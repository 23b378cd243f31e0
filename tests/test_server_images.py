"""Images through a real ring (real NATS, real HTTP, the official openai client): what the entry refuses, named in
the route's error shape while the ring serves on, and what the bus carries (handles, never the pixels).

The ring here serves a text-only model with small image limits: an image it cannot take is refused at the entry
(too large, corrupt, a file outside the allowed directory, a remote URL, too many); one it could take reaches the
tokenizer, which answers that the model takes no images.
"""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import numpy as np
import openai
import pytest
from PIL import Image

from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.server_helpers import ServerHandle, start_server

MAX_IMAGE_BYTES = 300_000


def png(side: int, seed: int = 0) -> bytes:
    """A PNG of random pixels (it does not compress: about 3 bytes per pixel)."""
    pixels = np.random.RandomState(seed).randint(0, 255, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_chat(url: str, text: str = "What is in the image?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def text_ring(tiny_model_dir: Path, nats_server: EmbeddedNatsServer, media_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(str(tiny_model_dir), nats_url=nats_server.url, extra=[
        "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-images-per-request", "2",
        "--allowed-local-media-path", str(media_dir)])
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture(scope="module")
def client(text_ring: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{text_ring.base_url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 2) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,  # type: ignore
                                          temperature=0)


def refused(client: openai.OpenAI, messages: list[dict[str, Any]]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages)
    return info.value


def served_after(client: openai.OpenAI) -> None:
    """The ring serves on: a text request right after is answered."""
    reply = chat(client, [{"role": "user", "content": "Hi"}])
    assert reply.choices[0].finish_reason == "length"


def test_text_model_refuses_an_image_part_and_serves_on(client: openai.OpenAI, text_ring: ServerHandle) -> None:
    error = refused(client, image_chat(data_url(png(16))))
    assert "this model takes no images" in error.message and error.body["param"] == "messages"
    reply = httpx.post(f"{text_ring.base_url}/generate", json={"text": "<image> hi", "image_data": data_url(png(8)),
                                                          "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "image_data", reply.text
    assert "this model takes no images" in reply.json()["error"]["message"]
    served_after(client)


def test_corrupt_and_over_large_images_are_400s_naming_them(client: openai.OpenAI, text_ring: ServerHandle) -> None:
    corrupt = png(16)[:60]  # a PNG cut short
    error = refused(client, image_chat(data_url(corrupt)))
    assert "messages[0].content[1]" in error.message and "cannot be decoded" in error.message
    large = png(360)  # about 390 KB
    assert len(large) > MAX_IMAGE_BYTES
    error = refused(client, image_chat(data_url(large)))
    assert "messages[0].content[1]" in error.message and "--max-image-bytes" in error.message
    reply = httpx.post(f"{text_ring.base_url}/generate", json={"text": ["<image> a", "<image> b"],
                                                          "image_data": [data_url(png(8)), base64.b64encode(
                                                              b"not an image").decode()]})
    assert reply.status_code == 400 and "image_data[1][0]" in reply.json()["error"]["message"], reply.text
    served_after(client)


def test_image_sources_behind_flags(client: openai.OpenAI, media_dir: Path, tmp_path: Path) -> None:
    inside = media_dir / "inside.png"
    inside.write_bytes(png(8))
    outside = tmp_path / "outside.png"
    outside.write_bytes(png(8))
    error = refused(client, image_chat(outside.as_uri()))
    assert "not under the allowed media directory" in error.message
    error = refused(client, image_chat(inside.as_uri()))  # read and stored: the model is what refuses it
    assert "this model takes no images" in error.message
    error = refused(client, image_chat("https://example.com/cat.png"))
    assert "--allow-remote-images" in error.message
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(8, s))}}
                                          for s in range(3)]}]
    error = refused(client, three)
    assert "--max-images-per-request" in error.message
    error = refused(client, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(8)), "detail": "low"}}]}])
    assert "detail" in error.message


def test_the_bus_carries_handles_not_pixels(text_ring: ServerHandle, nats_server: EmbeddedNatsServer) -> None:
    image = png(260, seed=5)
    assert 200_000 < len(image) < MAX_IMAGE_BYTES

    async def sizes() -> list[int]:
        nc = await nats.connect(nats_server.url)
        seen: list[int] = []

        async def record(msg: Any) -> None:
            seen.append(len(msg.data))

        sub = await nc.subscribe(f"{text_ring.namespace}.req.>", cb=record)
        await nc.flush()
        async with httpx.AsyncClient(timeout=60) as http:
            reply = await http.post(f"{text_ring.base_url}/generate", json={
                "text": "<image> hi", "image_data": base64.b64encode(image).decode(),
                "sampling_params": {"max_new_tokens": 2}})
        assert reply.status_code == 400 and "takes no images" in reply.text  # it reached the tokenizer
        await nc.flush()
        await sub.unsubscribe()
        await nc.close()
        return seen

    seen = asyncio.run(sizes())
    assert seen and max(seen) < 4096, seen
