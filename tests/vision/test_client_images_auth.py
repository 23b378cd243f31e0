"""Images from an outside NATS client under authentication (issue 44): on a ring of the tiny LLaVA of
tests/vision_models.py started with `--nats-client c` (its embedded NATS has per-role users), `ringserve.Client` with
c's credentials file puts images into c's own bucket and gets transformers' greedy tokens (`/generate`-style and
chat); a handle that is not in c's bucket, even one an HTTP user's request put into the shared bucket, is a 400
naming it, and the ring serves on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

import ringserve
from ringserve.bus.errors import ApiError
from ringserve.bus.image_store import client_bucket_name, raw_handle
from ringserve.bus.messages import GenerateRequest
from tests.server_helpers import ServerHandle, start_server
from tests.shared_rings import logged
from tests.vision.test_server_images import NEW_TOKENS, data_url, hf_greedy, image_chat, png
from tests.vision_models import PLACEHOLDER, process, random_image, save_tiny_vlm, tiny_hf_vlm

TEXT = f"{PLACEHOLDER['llava']}What is it?"
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def llava_c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(str(save_tiny_vlm("llava", tmp_path_factory.mktemp("llava-c"))), extra=["--nats-client", "c"])
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture(scope="module")
def creds(llava_c: ServerHandle) -> Path:
    return Path(logged(llava_c, r"nats client credentials client=c file=(\S+)"))


def test_a_client_sends_images_with_its_credentials_file(llava_c: ServerHandle, creds: Path) -> None:
    assert json.loads(creds.read_text())["image_bucket"] == client_bucket_name(llava_c.namespace, "c")
    image = random_image(41)

    async def run() -> tuple[Any, Any]:
        async with ringserve.Client(creds=creds) as ring:
            generated = await ring.generate(TEXT, GREEDY, image_data=image, timeout=120)
            chatted = await ring.chat(image_chat(data_url(png(image))), max_tokens=NEW_TOKENS, temperature=0,
                                      timeout=120)
            return generated, chatted

    generated, chatted = asyncio.run(run())
    hf = tiny_hf_vlm("llava")
    assert generated.output_ids == hf_greedy(hf, dict(hf[1](text=TEXT, images=[image], return_tensors="pt")))[1]
    assert chatted.output_ids == hf_greedy(hf, process(hf[1], [image]))[1]


def test_a_handle_not_in_the_clients_bucket_is_a_400_naming_it(llava_c: ServerHandle, creds: Path) -> None:
    image = random_image(42)
    over_http = httpx.post(f"{llava_c.base_url}/generate", timeout=120, json={  # now in the shared bucket
        "text": TEXT, "image_data": data_url(png(image)), "sampling_params": {"max_new_tokens": 1}})
    assert over_http.status_code == 200, over_http.text
    handles = [raw_handle(png(image)), "raw-" + "0" * 64]

    async def run() -> tuple[list[ApiError], Any]:
        errors = []
        async with ringserve.Client(creds=creds) as ring:
            for i, handle in enumerate(handles):
                with pytest.raises(ApiError) as refused:
                    await ring.run_all([GenerateRequest(rid=f"h{i}", text=TEXT, sampling=GREEDY,
                                                        image_data=[handle])], timeout=120)
                errors.append(refused.value)
            return errors, await ring.generate(TEXT, GREEDY, image_data=image, timeout=120)

    errors, served = asyncio.run(run())
    for handle, error in zip(handles, errors):
        assert error.code == 400 and error.param == "image_data", error
        assert f"image {handle} is not in client c's image store" in error.message
    assert len(served.output_ids) == NEW_TOKENS  # the ring serves on, the same image now from c's own bucket


def test_the_python_client_passes_image_processor_options(llava_c: ServerHandle, creds: Path) -> None:
    """`mm_processor_kwargs` reach the tokenizer from `Client.generate` and `Client.stream`: an option LLaVA's
    image processor does not take is its 400 naming the field (were it dropped, the request would be served)."""

    async def run() -> list[ApiError]:
        errors = []
        async with ringserve.Client(creds=creds) as ring:
            with pytest.raises(ApiError) as refused:
                await ring.generate(TEXT, GREEDY, image_data=random_image(43), timeout=120,
                                    mm_processor_kwargs={"do_pan_and_scan": True})
            errors.append(refused.value)
            with pytest.raises(ApiError) as refused:
                async for _ in ring.stream(TEXT, GREEDY, image_data=random_image(43),
                                           mm_processor_kwargs={"do_pan_and_scan": True}):
                    pass
            errors.append(refused.value)
        return errors

    for error in asyncio.run(run()):
        assert error.code == 400 and error.param == "mm_processor_kwargs", error
        assert "does not take it" in error.message
