"""Qwen2-VL and Qwen2.5-VL through the engine, against transformers' own (tests/vision_models.py): the tower's
image features, greedy tokens for one image and for two of different sizes, a batch of different images, a chunk
boundary inside an image, the prefix cache keyed by image, the compiled decode graph, and bad image tensors."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from ringserve.bus.images import ImageRef
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import compiled_engine, engine_for, greedy, run_to_completion, tokens_of
from tests.vision.test_engine_vision import NEW_TOKENS, hf_tokens, serve
from tests.vision_models import QWEN_KINDS, process, random_image, tiny_hf_vlm
WIDE = (40, 24)  # a 40x24 image: 10x6 patches, 15 image tokens, Qwen2.5-VL windows cut short at its edges


@pytest.fixture(scope="module", params=QWEN_KINDS)
def vlm(request: Any) -> tuple[Any, Any]:
    return tiny_hf_vlm(request.param)


def tokenized(processor: Any, images: list[Any], rid: str, text: str = "Describe this.",
              **params: Any) -> tuple[TokenizedRequest, dict[str, dict[str, Any]], dict[str, Any]]:
    """The request the tokenizer actor would send for `images` and `text` (each image's patches and grid), the
    tensors it would store, and the processor's batch (for transformers)."""
    inputs = process(processor, images, text)
    ids = inputs["input_ids"][0].tolist()
    positions = [i for i, t in enumerate(ids) if t == processor.tokenizer.image_token_id]
    refs, tensors, taken, patches = [], {}, 0, 0
    for grid in inputs["image_grid_thw"]:
        each = {"pixel_values": inputs["pixel_values"][patches:patches + int(grid.prod())].numpy(),
                "image_grid_thw": grid[None].numpy()}
        length = int(grid.prod()) // 4
        digest = hashlib.sha256(each["pixel_values"].tobytes()).hexdigest()
        refs.append(ImageRef(digest, positions[taken], length, handle=f"img-{digest[:8]}"))
        tensors[digest] = each
        taken, patches = taken + length, patches + int(grid.prod())
    params.setdefault("ignore_eos", True)
    return TokenizedRequest(rid, ids, greedy(NEW_TOKENS, **params), images=refs), tensors, inputs


def test_the_tower_embeds_images_of_any_size_as_transformers(vlm: tuple[Any, Any]) -> None:
    from ringserve.actors.engine.models.weights import model_from_hf

    model, processor = vlm
    inputs = process(processor, [random_image(0), random_image(1, *WIDE)])
    ours = model_from_hf(model.config, model.state_dict())
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
        got = ours.visual(inputs["pixel_values"], grids)
    assert [e.shape[0] for e in got] == [16, 15]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sizes", [[(32, 32)], [(32, 32), WIDE]], ids=["one", "two_sizes"])
def test_greedy_tokens_equal_transformers(vlm: tuple[Any, Any], sizes: list[tuple[int, int]]) -> None:
    model, processor = vlm
    request = tokenized(processor, [random_image(k, *size) for k, size in enumerate(sizes)], "a")
    assert request[0].images[0].length == 16
    assert serve(engine_for(model), request)["a"] == hf_tokens(model, request[2])


def test_two_requests_with_different_images_in_one_batch_get_their_solo_output(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    first = tokenized(processor, [random_image(1)], "x")
    second = tokenized(processor, [random_image(2, *WIDE)], "y", "What is it?")
    together = serve(engine_for(model), first, second)
    assert together["x"] == hf_tokens(model, first[2])
    assert together["y"] == hf_tokens(model, second[2])
    assert together["x"] != together["y"]


def test_a_chunk_boundary_inside_an_image(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    request = tokenized(processor, [random_image(3), random_image(4, *WIDE)], "c")
    engine = engine_for(model, chunked_prefill_size=request[0].images[0].offset + 5)
    assert serve(engine, request)["c"] == hf_tokens(model, request[2])


def test_the_same_image_hits_the_prefix_cache_with_the_same_tokens(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    engine = engine_for(model)
    first = tokenized(processor, [random_image(5, *WIDE)], "p", "Describe this.")
    serve(engine, first)
    again = tokenized(processor, [random_image(5, *WIDE)], "q", "Describe this, again.")
    assert engine.add_request(again[0], again[1]) is None
    rows = run_to_completion(engine, [])["q"]
    image = again[0].images[0]
    assert rows[0].cached_tokens >= image.offset + image.length + 1  # the text after the image too
    assert tokens_of(rows) == hf_tokens(model, again[2])


def test_bad_image_tensors_are_400s_naming_them(vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    engine = engine_for(model)
    request, tensors, _ = tokenized(processor, [random_image(6)], "e")
    digest = request.images[0].hash
    no_grid = {digest: {"pixel_values": tensors[digest]["pixel_values"]}}
    error = engine.add_request(request, no_grid)
    assert error is not None and error.code == 400 and "no image_grid_thw" in error.message
    short = {digest: {**tensors[digest], "pixel_values": tensors[digest]["pixel_values"][:-4]}}
    error = engine.add_request(request, short)
    assert error is not None and error.code == 400 and "pixel_values of shape [60," in error.message
    assert engine.add_request(request, tensors) is None


def test_an_image_request_decodes_in_the_compiled_cpu_graph(monkeypatch: Any) -> None:
    model, processor = tiny_hf_vlm("qwen2_vl")
    engine = compiled_engine(model, monkeypatch)
    request = tokenized(processor, [random_image(7, *WIDE)], "g")
    assert serve(engine, request)["g"] == hf_tokens(model, request[2])
