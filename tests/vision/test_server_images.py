"""Images through a real ring (real NATS, real HTTP, the official openai client) with the tiny LLaVA of
tests/vision_models.py: chat `image_url` parts and `/generate` `image_data` give transformers' greedy tokens (one
image, two, a batch of prompts each with its own); what the entry refuses is a 400 naming the image while the ring
serves on; the bus carries handles, never the pixels; a text-only model answers an image with a 400; and each role's
NATS permissions reach the image bucket as the ring uses it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from pathlib import Path
from typing import Any, Iterator

import httpx
import nats
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.image_store import ImageStore, tensors_handle
from ringserve.bus.permissions import NatsUser, authorization_block, inbox_prefix, role_permissions
from tests.server_helpers import ServerHandle, start_server
from tests.vision_models import PLACEHOLDER, process, random_image, save_tiny_vlm, tiny_hf_vlm

MAX_IMAGE_BYTES = 300_000
NEW_TOKENS = 6


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def noise(side: int, seed: int = 0) -> bytes:
    """A PNG of random pixels (it does not compress: about 3 bytes per pixel)."""
    return png(Image.fromarray(np.random.RandomState(seed).randint(0, 255, (side, side, 3), dtype=np.uint8)))


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_chat(*urls: str, text: str = "Describe this.") -> list[dict[str, Any]]:
    """One user turn: the images, then the text (as tests/vision_models.py `process` renders it)."""
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, nats_server: EmbeddedNatsServer,
          media_dir: Path) -> Iterator[ServerHandle]:
    directory = save_tiny_vlm("llava", tmp_path_factory.mktemp("llava"))
    handle = start_server(str(directory), nats_url=nats_server.url, extra=[
        "--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-images-per-request", "2",
        "--allowed-local-media-path", str(media_dir)])
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    return tiny_hf_vlm("llava")


@pytest.fixture(scope="module")
def client(llava: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llava.base_url}/v1", api_key="unused", max_retries=0)


@torch.no_grad()
def hf_greedy(hf: tuple[Any, Any], inputs: dict[str, Any]) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens for processed `inputs`."""
    model, _ = hf
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS,  # type: ignore
                                          temperature=0, extra_body={"return_token_ids": True, **extra})


def refused(client: openai.OpenAI, messages: list[dict[str, Any]]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages)
    return info.value


@pytest.mark.parametrize("count", [1, 2])
def test_chat_image_url_gives_transformers_tokens(client: openai.OpenAI, hf: tuple[Any, Any], count: int) -> None:
    images = [random_image(seed) for seed in range(1, count + 1)]
    reply = chat(client, image_chat(*(data_url(png(image)) for image in images)))
    prompt, tokens = hf_greedy(hf, process(hf[1], images))
    body = reply.model_dump()
    assert body["prompt_token_ids"] == prompt
    assert body["choices"][0]["token_ids"] == tokens
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)


def test_generate_image_data_gives_transformers_tokens(llava: ServerHandle, hf: tuple[Any, Any]) -> None:
    _, processor = hf
    first, second = random_image(3), random_image(4)
    texts = [f"{PLACEHOLDER['llava']}What is it?", f"Compare {PLACEHOLDER['llava']} and {PLACEHOLDER['llava']}."]
    reply = httpx.post(f"{llava.base_url}/generate", timeout=120, json={
        "text": texts, "image_data": [data_url(png(first)), [base64.b64encode(png(second)).decode(),
                                                              data_url(png(first))]],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    for result, text, images in zip(reply.json(), texts, [[first], [second, first]]):
        _, tokens = hf_greedy(hf, dict(processor(text=text, images=images, return_tensors="pt")))
        assert result["output_ids"] == tokens
    single = httpx.post(f"{llava.base_url}/generate", timeout=120, json={
        "text": texts[0], "image_data": data_url(png(first)),
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}})
    assert single.status_code == 200 and single.json()["output_ids"] == reply.json()[0]["output_ids"]
    miscounted = httpx.post(f"{llava.base_url}/generate", json={"text": "no placeholder",
                                                                "image_data": data_url(png(first))})
    assert miscounted.status_code == 400 and miscounted.json()["error"]["param"] == "image_data"


def test_corrupt_and_over_large_images_are_400s_naming_them(client: openai.OpenAI, llava: ServerHandle) -> None:
    good = data_url(png(random_image(5)))
    error = refused(client, image_chat(good, data_url(noise(16)[:60])))  # the second: a PNG cut short
    assert "messages[0].content[1]" in error.message and "cannot be decoded" in error.message
    large = noise(360)  # about 390 KB
    assert len(large) > MAX_IMAGE_BYTES
    error = refused(client, image_chat(data_url(large)))
    assert "messages[0].content[0]" in error.message and "--max-image-bytes" in error.message
    reply = httpx.post(f"{llava.base_url}/generate", json={
        "text": ["<image> a", "<image> b"], "image_data": [good, base64.b64encode(b"not an image").decode()]})
    assert reply.status_code == 400 and "image_data[1][0]" in reply.json()["error"]["message"], reply.text
    assert chat(client, image_chat(good)).choices[0].finish_reason == "length"  # the ring serves on


def test_image_sources_behind_flags(client: openai.OpenAI, media_dir: Path, tmp_path: Path) -> None:
    inside, outside = media_dir / "inside.png", tmp_path / "outside.png"
    inside.write_bytes(png(random_image(6)))
    outside.write_bytes(png(random_image(6)))
    error = refused(client, image_chat(outside.as_uri()))
    assert "not under the allowed media directory" in error.message
    from_file = chat(client, image_chat(inside.as_uri())).model_dump()["choices"][0]["token_ids"]
    inline = chat(client, image_chat(data_url(inside.read_bytes()))).model_dump()["choices"][0]["token_ids"]
    assert from_file == inline
    error = refused(client, image_chat("https://example.com/cat.png"))
    assert "--allow-remote-images" in error.message
    error = refused(client, image_chat(*(data_url(png(random_image(s))) for s in range(3))))
    assert "--max-images-per-request" in error.message
    error = refused(client, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(random_image(6))), "detail": "low"}}]}])
    assert "detail" in error.message


def test_the_bus_carries_handles_not_pixels(llava: ServerHandle, nats_server: EmbeddedNatsServer) -> None:
    image = noise(260, seed=5)
    assert 200_000 < len(image) < MAX_IMAGE_BYTES

    async def sizes() -> dict[str, int]:
        nc = await nats.connect(nats_server.url)
        seen: dict[str, int] = {}

        async def record(msg: Any) -> None:
            kind = msg.subject.split(".")[2]  # submit or tokenized
            seen[kind] = max(seen.get(kind, 0), len(msg.data))

        sub = await nc.subscribe(f"{llava.namespace}.req.>", cb=record)
        await nc.flush()
        async with httpx.AsyncClient(timeout=120) as http:
            reply = await http.post(f"{llava.base_url}/v1/chat/completions", json={
                "messages": image_chat(data_url(image)), "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        await nc.flush()
        await sub.unsubscribe()
        await nc.close()
        return seen

    seen = asyncio.run(sizes())
    assert set(seen) == {"submit", "tokenized"} and max(seen.values()) < 4096, seen


def test_a_text_model_refuses_images(clients_ring: ServerHandle) -> None:
    url = data_url(png(random_image(7)))
    reply = httpx.post(f"{clients_ring.base_url}/v1/chat/completions",
                       json={"messages": image_chat(url), "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    assert "this model takes no images" in reply.json()["error"]["message"]
    reply = httpx.post(f"{clients_ring.base_url}/generate", json={"text": "<image> hi", "image_data": url})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "image_data", reply.text
    served = httpx.post(f"{clients_ring.base_url}/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2}})
    assert served.status_code == 200, served.text


def test_processor_options_the_model_does_not_take_are_400s(client: openai.OpenAI,
                                                            clients_ring: ServerHandle) -> None:
    """LLaVA's image processor has no pan-and-scan; a text model has no image processor at all."""
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, image_chat(data_url(png(random_image(8)))), mm_processor_kwargs={"do_pan_and_scan": True})
    assert info.value.body["param"] == "mm_processor_kwargs" and "does not take it" in info.value.body["message"]
    reply = httpx.post(f"{clients_ring.base_url}/generate", json={
        "text": "hi", "mm_processor_kwargs": {"do_pan_and_scan": True}, "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "mm_processor_kwargs", reply.text
    assert "takes no images" in reply.json()["error"]["message"]


def test_each_role_reaches_the_image_bucket_under_nats_auth() -> None:
    """The entry puts a file, the tokenizer reads it and puts tensors, the scheduler reads those: with the
    per-role users `ringserve serve` makes, on a real nats-server."""
    namespace = "imgauth"
    users = [NatsUser(role, f"pw-{role}", role_permissions(namespace, role))
             for role in ("entry", "tokenizer", "scheduler", "detokenizer")]

    async def roundtrip(url: str) -> None:
        conns = {user.user: await nats.connect(url, user=user.user, password=user.password,
                                               inbox_prefix=inbox_prefix(namespace, user.user).encode())
                 for user in users}
        stores = {role: ImageStore(lambda c=conn: c, namespace) for role, conn in conns.items()}
        try:
            handle = await stores["entry"].put_raw(noise(200))
            file = await stores["tokenizer"].get(handle)
            tensors = file[::-1]
            stored = tensors_handle(hashlib.sha256(tensors).hexdigest())
            assert await stores["tokenizer"].put_once(stored, tensors)
            assert not await stores["tokenizer"].put_once(stored, tensors)  # the same image is stored once
            assert await stores["scheduler"].get(stored) == tensors
            with pytest.raises(Exception):  # a role with no business there cannot read it
                await asyncio.wait_for(stores["detokenizer"].get(stored), 2)
        finally:
            for conn in conns.values():
                await conn.close()

    with EmbeddedNatsServer(extra_config=authorization_block(users)) as server:
        asyncio.run(roundtrip(server.url))


def test_python_client_sends_images_over_nats(llava: ServerHandle, nats_server: EmbeddedNatsServer,
                                              client: openai.OpenAI, media_dir: Path) -> None:
    """`ringserve.Client` (what `ringserve.Engine` calls) stores the images itself and submits handles: a PIL image,
    file bytes or a path give what the HTTP routes give."""
    import ringserve

    image = random_image(8)
    path = media_dir / "client.png"
    path.write_bytes(png(image))
    text = f"{PLACEHOLDER['llava']}What is it?"
    over_http = httpx.post(f"{llava.base_url}/generate", timeout=120, json={
        "text": text, "image_data": data_url(png(image)), "sampling_params": {"max_new_tokens": NEW_TOKENS,
                                                                             "temperature": 0}}).json()

    async def run() -> tuple[Any, Any, Any]:
        async with ringserve.Client(nats_server.url, llava.namespace) as ring:
            greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0}
            one = await ring.generate(text, greedy, image_data=image)
            two = await ring.generate([text, text], greedy, image_data=[png(image), path])
            chatted = await ring.chat(image_chat(path.as_uri()), max_tokens=NEW_TOKENS, temperature=0)
            return one, two, chatted

    one, two, chatted = asyncio.run(run())
    assert one.output_ids == over_http["output_ids"] == two[0].output_ids == two[1].output_ids
    assert chatted.output_ids == chat(client, image_chat(data_url(png(image)))).model_dump()["choices"][0]["token_ids"]
    with ringserve.Engine(nats_url=nats_server.url, namespace=llava.namespace) as engine:  # joins the ring
        assert engine.generate(text, {"max_new_tokens": NEW_TOKENS, "temperature": 0},
                               image_data=path).output_ids == one.output_ids


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(client: openai.OpenAI) -> None:
    first, other = data_url(png(random_image(21))), data_url(png(random_image(22)))
    chat(client, image_chat(first, text="A long question about this picture, asked twice over."))
    again = chat(client, image_chat(first, text="A long question about this picture, asked twice over."))
    changed = chat(client, image_chat(other, text="A long question about this picture, asked twice over."))
    assert again.usage.prompt_tokens_details.cached_tokens > changed.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """Gemma 3 on a ring of its own NATS (per-role users, as `ringserve serve` runs by default)."""
    handle = start_server(str(save_tiny_vlm("gemma3", tmp_path_factory.mktemp("gemma3"))))
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


def test_gemma3_chat_with_two_images_gives_transformers_tokens(gemma3: ServerHandle) -> None:
    images = [random_image(31), random_image(32)]
    reply = httpx.post(f"{gemma3.base_url}/v1/chat/completions", timeout=120, json={
        "messages": image_chat(*(data_url(png(image)) for image in images)), "max_tokens": NEW_TOKENS,
        "temperature": 0, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    model = tiny_hf_vlm("gemma3")
    prompt, tokens = hf_greedy(model, process(model[1], images))
    assert reply.json()["prompt_token_ids"] == prompt and reply.json()["choices"][0]["token_ids"] == tokens


def test_a_nats_submit_names_images_by_handle(llava: ServerHandle, nats_server: EmbeddedNatsServer) -> None:
    """A NATS client puts the file into the bucket and submits its handle; a handle that finds nothing fails that
    request alone, with a 400 saying so."""
    import ringserve
    from ringserve.bus.errors import ApiError
    from ringserve.bus.messages import GenerateRequest

    text = f"{PLACEHOLDER['llava']}What is it?"
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0}

    async def run() -> tuple[Any, ApiError, Any]:
        async with ringserve.Client(nats_server.url, llava.namespace) as ring:
            store = ImageStore(lambda: ring.ring.bus.client, llava.namespace)
            handle = await store.put_raw(png(random_image(9)))
            [ok] = await ring.run_all([GenerateRequest(rid="nats-img", text=text, sampling=greedy,
                                                       image_data=[handle])])
            with pytest.raises(ApiError) as missing:
                await ring.run_all([GenerateRequest(rid="nats-none", text=text, sampling=greedy,
                                                    image_data=["raw-" + "0" * 64])])
            via_data = await ring.generate(text, greedy, image_data=random_image(9))
            return ok, missing.value, via_data

    ok, missing, via_data = asyncio.run(run())
    assert ok.output_ids == via_data.output_ids
    assert missing.code == 400 and missing.param == "image_data" and "not in the image store" in missing.message


def test_remote_images_when_allowed(nats_server: EmbeddedNatsServer) -> None:
    """With --allow-remote-images the entry fetches http(s) URLs (a real HTTP server here): a 200 is stored, any
    other status, a body over --max-image-bytes or a server slower than the timeout is a 400 naming the part."""
    import http.server
    import threading

    from ringserve.actors.entry.image_input import ImageIntake, ImageLimits
    from ringserve.bus.errors import ApiError

    image = png(random_image(10))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/slow.png":
                threading.Event().wait(3)
            body = noise(360) if self.path == "/large.png" else image
            self.send_response(200 if self.path != "/gone.png" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    async def run() -> dict[str, Any]:
        nc = await nats.connect(nats_server.url)
        intake = ImageIntake(ImageStore(lambda: nc, "remote"), ImageLimits(MAX_IMAGE_BYTES, 4, True, 1.0))
        outcomes: dict[str, Any] = {}
        for name in ("ok", "gone", "large", "slow"):
            try:
                outcomes[name] = await intake.load(f"{base}/{name}.png", "messages[0].content[0]", "messages")
            except ApiError as exc:
                outcomes[name] = exc.message
        await nc.close()
        return outcomes

    try:
        outcomes = asyncio.run(run())
    finally:
        server.shutdown()
    assert outcomes["ok"] == image
    assert "answered HTTP 404" in outcomes["gone"]
    assert "--max-image-bytes" in outcomes["large"]
    assert "fetching" in outcomes["slow"] and "failed" in outcomes["slow"]
    assert all("messages[0].content[0]" in outcomes[name] for name in ("gone", "large", "slow"))


def test_messages_and_responses_take_images_as_chat_does(llava: ServerHandle, client: openai.OpenAI) -> None:
    """Anthropic's image blocks and the Responses API's input_image parts reach the model as chat's image_url
    parts do; a bad image is a 400 in the route's own error shape, naming where it was."""
    image = png(random_image(11))
    expected = chat(client, image_chat(data_url(image))).choices[0].message.content
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}
    messages = httpx.post(f"{llava.base_url}/v1/messages", timeout=120, json={
        "model": client.models.list().data[0].id, "max_tokens": NEW_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Describe this."}]}]})
    assert messages.status_code == 200, messages.text
    assert messages.json()["content"][0]["text"] == expected
    response = client.responses.create(model=client.models.list().data[0].id, temperature=0,
                                       max_output_tokens=NEW_TOKENS, input=[{"role": "user", "content": [
                                           {"type": "input_image", "image_url": data_url(image)},
                                           {"type": "input_text", "text": "Describe this."}]}])
    assert response.output_text == expected
    bad = httpx.post(f"{llava.base_url}/v1/messages", json={
        "model": client.models.list().data[0].id, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}},
            {"type": "text", "text": "Describe this."}]}]})
    assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
    assert "messages.0.content.0" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused_file:
        client.responses.create(model=client.models.list().data[0].id, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}])
    assert "file_id" in refused_file.value.message


def test_token_counts_with_images_equal_the_generations(llava: ServerHandle, client: openai.OpenAI) -> None:
    image = png(random_image(12))
    usage = chat(client, image_chat(data_url(image))).usage
    tokenized = httpx.post(f"{llava.base_url}/v1/tokenize", json={"messages": image_chat(data_url(image))})
    assert tokenized.status_code == 200 and tokenized.json()["count"] == usage.prompt_tokens, tokenized.text
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}
    counted = httpx.post(f"{llava.base_url}/v1/messages/count_tokens", json={
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Describe this."}]}]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] == usage.prompt_tokens, counted.text
