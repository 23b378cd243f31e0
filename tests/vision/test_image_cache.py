"""The tokenizer's image cache (actors/tokenizer/image_cache.py) with the real processors of the tiny models of
tests/vision_models.py and a real image store (JetStream on the session's NATS server): ids and tensors equal the
processor's whole call (LLaVA with two images, Gemma 3 with and without pan-and-scan); an image sent again is not
processed again and gives the same ids and refs, its tensors put again once the store lost them; the cache is bounded
by bytes, least recently used first."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import nats
import numpy as np
import pytest

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.tokenizer.image_cache import ImageCache, ImagePart, ProcessedImage
from ringserve.actors.tokenizer.images import VisionPrompts
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.image_store import ImageStore, tensors_handle
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.tensor_codec import decode_tensors
from tests.vision.test_pan_and_scan import PAN_AND_SCAN, wide_image
from tests.vision.test_server_images import png
from tests.vision_models import random_image, save_tiny_vlm

CASES = [("llava", {}, [random_image(1), random_image(2, 48)]), ("gemma3", {}, [random_image(3)]),
         ("gemma3", PAN_AND_SCAN, [wide_image(4), random_image(5)])]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {kind: save_tiny_vlm(kind, tmp_path_factory.mktemp(kind)) for kind in ("llava", "gemma3")}


async def _encode_twice(directory: Path, url: str, options: dict[str, Any], images: list[Any]) -> dict[str, Any]:
    """Encode one prompt with `images` twice (the second time after the store lost the first image's tensors)."""
    client = await nats.connect(url)
    try:
        store = ImageStore(lambda: client, f"t{uuid.uuid4().hex[:8]}")
        prompts = VisionPrompts(resolve_model(str(directory)), store)
        handles = [await store.put_raw(png(image)) for image in images]
        text = " and ".join([prompts.placeholder] * len(images)) + " What are they?"
        request = GenerateRequest(rid="x", text=text, image_data=handles)
        first = await prompts.encode(request, None, options)
        after_first = prompts.counters()
        await (await store.open()).delete(first[1][0].handle)
        second = await prompts.encode(request, None, options)
        return {"prompts": prompts, "first": first, "second": second, "after_first": after_first,
                "after_second": prompts.counters(), "restored": await store.get(first[1][0].handle)}
    finally:
        await client.close()


@pytest.mark.parametrize("kind,options,images", CASES)
def test_a_repeated_image_is_not_processed_again(model_dirs: dict[str, Path], nats_server: EmbeddedNatsServer,
                                                 kind: str, options: dict[str, Any], images: list[Any]) -> None:
    got = asyncio.run(_encode_twice(model_dirs[kind], nats_server.url, options, images))
    prompts = got["prompts"]
    (ids, refs), (ids2, refs2) = got["first"], got["second"]
    text = " and ".join([prompts.placeholder] * len(images)) + " What are they?"
    whole = prompts._processor(text=[text], images=images, return_tensors="np", **options)
    assert ids == whole["input_ids"][0].tolist()
    parts = [part for entry in prompts._cache._entries.values() for part in entry.parts]  # in the images' order
    assert np.array_equal(np.concatenate([decode_tensors(p.encoded)["pixel_values"] for p in parts]),
                          whole["pixel_values"])
    assert len(refs) == len(whole["pixel_values"])  # an image's crops are images of their own
    assert got["after_first"]["images_processed"] == len(images) and got["after_first"]["image_cache_hits"] == 0
    assert got["after_second"]["images_processed"] == len(images)  # not processed again
    assert got["after_second"]["image_cache_hits"] == len(images)
    assert (ids2, refs2) == (ids, refs)
    assert got["restored"] == parts[0].encoded  # put again when the store had lost it


def test_the_cache_is_bounded_by_bytes_least_recently_used_first() -> None:
    def entry(size: int) -> ProcessedImage:
        return ProcessedImage("x", (ImagePart(b"\0" * size, "h", {}),))

    cache = ImageCache(max_bytes=100)
    cache.put("a", entry(40))
    cache.put("b", entry(40))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", entry(40))  # 120 bytes: b goes
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    cache.put("d", entry(101))  # larger than the whole bound: not kept
    assert cache.get("d") is None
    assert cache.counters() == {"images_processed": 4, "image_cache_hits": 3, "image_cache_entries": 2,
                                "image_cache_bytes": 80}
