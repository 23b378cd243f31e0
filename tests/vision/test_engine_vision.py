"""Images through the engine, against transformers' own LLaVA and Gemma 3 (tests/vision_models.py): greedy tokens
for one and two images, a batch of different images, a chunk boundary inside an image's run, the prefix cache
keyed by image, and the errors that refuse an image."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from ringserve.bus.images import ImageRef
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import compiled_engine, engine_for, greedy, run_to_completion, tokens_of
from tests.vision_models import IMAGE_TOKENS, process, random_image, tiny_hf_vlm

NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def vlm(request: Any) -> tuple[Any, Any, str]:
    model, processor = tiny_hf_vlm(request.param)
    return model, processor, request.param


def tokenized(processor: Any, images: list[Any], rid: str, text: str = "Describe this.",
              **params: Any) -> tuple[TokenizedRequest, dict[str, dict[str, Any]], dict[str, Any]]:
    """The request the tokenizer actor would send for `images` and `text`, the tensors it would store, and the
    processor's batch (for transformers)."""
    inputs = process(processor, images, text)
    ids = inputs["input_ids"][0].tolist()
    token = processor.tokenizer.image_token_id
    positions = [i for i, t in enumerate(ids) if t == token]  # LLaVA's runs may touch: each image has its count
    refs, tensors = [], {}
    for k, start in enumerate(positions[::IMAGE_TOKENS]):
        pixels = inputs["pixel_values"][k:k + 1]
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        refs.append(ImageRef(digest, start, IMAGE_TOKENS, handle=f"img-{digest[:8]}"))
        tensors[digest] = {"pixel_values": pixels.numpy()}
    params.setdefault("ignore_eos", True)
    return TokenizedRequest(rid, ids, greedy(NEW_TOKENS, **params), images=refs), tensors, inputs


@torch.no_grad()
def hf_tokens(model: Any, inputs: dict[str, Any]) -> list[int]:
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def serve(engine: Any, *requests: tuple[TokenizedRequest, dict[str, dict[str, Any]], Any]) -> dict[str, list[int]]:
    for request, tensors, _ in requests:
        assert engine.add_request(request, tensors) is None, request.rid
    rows = run_to_completion(engine, [])
    return {rid: tokens_of(r) for rid, r in rows.items()}


@pytest.mark.parametrize("count", [1, 2])
def test_greedy_tokens_equal_transformers(vlm: tuple[Any, Any, str], count: int) -> None:
    model, processor, _ = vlm
    request = tokenized(processor, [random_image(k) for k in range(count)], "a")
    engine = engine_for(model)
    assert serve(engine, request)["a"] == hf_tokens(model, request[2])


def test_two_requests_with_different_images_in_one_batch_get_their_solo_output(vlm: tuple[Any, Any, str]) -> None:
    model, processor, _ = vlm
    first, second = tokenized(processor, [random_image(1)], "x"), tokenized(processor, [random_image(2)], "y")
    together = serve(engine_for(model), first, second)
    assert together["x"] == serve(engine_for(model), first)["x"] == hf_tokens(model, first[2])
    assert together["y"] == hf_tokens(model, second[2])
    assert together["x"] != together["y"]


def test_a_chunk_boundary_inside_the_image(vlm: tuple[Any, Any, str]) -> None:
    model, processor, _ = vlm
    request = tokenized(processor, [random_image(3)], "c")
    offset = request[0].images[0].offset
    engine = engine_for(model, chunked_prefill_size=offset + IMAGE_TOKENS // 2)
    assert serve(engine, request)["c"] == hf_tokens(model, request[2])


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(vlm: tuple[Any, Any, str]) -> None:
    model, processor, _ = vlm
    engine = engine_for(model)
    first = tokenized(processor, [random_image(4)], "p", "Describe this.")
    serve(engine, first)
    again = tokenized(processor, [random_image(4)], "q", "Describe this, again.")
    other = tokenized(processor, [random_image(5)], "r", "Describe this, again.")
    image_end = first[0].images[0].offset + IMAGE_TOKENS
    for request in (again, other):
        assert engine.add_request(request[0], request[1]) is None
        rows = run_to_completion(engine, [])[request[0].rid]
        cached = rows[0].cached_tokens
        if request is again:
            assert cached >= image_end
        else:
            assert cached <= first[0].images[0].offset
        assert tokens_of(rows) == hf_tokens(model, request[2])


def test_image_errors_are_400s_naming_the_image_and_the_engine_serves_on(vlm: tuple[Any, Any, str]) -> None:
    model, processor, _ = vlm
    engine = engine_for(model)
    request, tensors, inputs = tokenized(processor, [random_image(6)], "e")
    missing = engine.add_request(request, {})
    assert missing is not None and missing.code == 400 and "image 0" in missing.message
    short = TokenizedRequest("s", request.input_ids, request.sampling,
                             images=[ImageRef(request.images[0].hash, request.images[0].offset, IMAGE_TOKENS - 1,
                                              "h")])
    error = engine.add_request(short, tensors)
    assert error is not None and error.code == 400 and f"{IMAGE_TOKENS - 1} image tokens" in error.message
    assert serve(engine, (request, tensors, inputs))["e"] == hf_tokens(model, inputs)


def test_a_text_model_refuses_images() -> None:
    from tests.engine_helpers import tiny_hf_llama

    _, processor = tiny_hf_vlm("llava")
    request, tensors, _ = tokenized(processor, [random_image(7)], "t")
    engine = engine_for(tiny_hf_llama(vocab_size=len(processor.tokenizer)))
    assert not engine.takes_images
    error = engine.add_request(request, tensors)
    assert error is not None and error.code == 400 and "takes no images" in error.message


def test_a_saved_checkpoint_serves_from_its_directory(vlm: tuple[Any, Any, str], tmp_path: Any) -> None:
    """The names transformers saves (`language_model.model.*`, `vision_tower.*`) load as its in-memory ones do,
    and the registry tells the ring side the image token without torch."""
    import json

    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.common.model_catalog import image_token_id
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    model, processor, _ = vlm
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    token = processor.tokenizer.image_token_id
    assert image_token_id(json.loads((tmp_path / "config.json").read_text())) == token
    engine = EngineCore.from_source(resolve_model(str(tmp_path)), EngineConfig(device="cpu", torch_threads=1,
                                                                           max_total_tokens=4096))
    assert engine.takes_images and engine.image_token_id == token
    request = tokenized(processor, [random_image(8)], "d")
    assert serve(engine, request)["d"] == hf_tokens(model, request[2])


def test_image_tokens_without_their_image_are_refused() -> None:
    model, processor = tiny_hf_vlm("llava")
    request, _, _ = tokenized(processor, [random_image(9)], "n")
    error = engine_for(model).add_request(TokenizedRequest("n", request.input_ids, request.sampling))
    assert error is not None and error.code == 400 and f"{IMAGE_TOKENS} image token(s)" in error.message


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_over_a_siglip_tower_embeds_images_as_transformers(strategy: str) -> None:
    """LLaVA's feature choice over a SigLIP tower (no class token) and several feature layers: our embeddings
    are transformers' image features."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    from ringserve.actors.engine.models.weights import model_from_hf

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=299, vision_feature_layer=[-3, -1],
                         vision_feature_select_strategy=strategy, projector_hidden_act="gelu")
    torch.manual_seed(0)
    hf = LlavaForConditionalGeneration(config).eval()
    ours = model_from_hf(hf.config, hf.state_dict())
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = torch.stack(list(hf.model.get_image_features(pixels, return_dict=True).pooler_output))
        got = ours.embed_images(pixels)
    assert got.shape == expected.shape == (2, 16 - (strategy == "default"), 64)
    assert ours.image_tokens({}) == got.shape[1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_cached_prefix_ending_inside_a_two_way_image_continues_it() -> None:
    """Gemma 3: prompt logprobs from inside the image stop the cached prefix there; the rest of the image is
    computed attending to the whole image, and the tokens stay transformers'."""
    model, processor = tiny_hf_vlm("gemma3")
    engine = engine_for(model)
    first = tokenized(processor, [random_image(10)], "f")
    serve(engine, first)
    inside = first[0].images[0].offset + 5
    again = tokenized(processor, [random_image(10)], "g", return_logprob=True, logprob_start_len=inside)
    assert engine.add_request(again[0], again[1]) is None
    rows = run_to_completion(engine, [])["g"]
    assert rows[0].cached_tokens == inside - 1
    assert tokens_of(rows) == hf_tokens(model, again[2])


def test_a_steps_images_run_through_the_tower_together_once_per_image(vlm: tuple[Any, Any, str]) -> None:
    model, processor, _ = vlm
    engine = engine_for(model)
    batches: list[int] = []
    tower = engine.runner.model.vision_tower.embeddings.patch_embedding
    handle = tower.register_forward_hook(lambda module, args, out: batches.append(args[0].shape[0]))
    try:
        requests = [tokenized(processor, [random_image(seed)], rid) for seed, rid in ((11, "a"), (12, "b"), (11, "c"))]
        out = serve(engine, *requests)
    finally:
        handle.remove()
    assert batches == [2]  # images 11 and 12 in the first step, 11 once for both requests holding it
    assert out["a"] == out["c"] == hf_tokens(model, requests[0][2])


def test_an_image_request_decodes_in_the_compiled_cpu_graph(monkeypatch: Any) -> None:
    model, processor = tiny_hf_vlm("llava")
    engine = compiled_engine(model, monkeypatch)
    request = tokenized(processor, [random_image(13)], "g")
    assert serve(engine, request)["g"] == hf_tokens(model, request[2])
