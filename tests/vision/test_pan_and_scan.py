"""Gemma 3's pan-and-scan in the engine: the tiny Gemma 3 of tests/vision_models.py with its processor's
`do_pan_and_scan` on crops a wide image into extra images; split per crop as the tokenizer splits them
(actors/tokenizer/images.py), each crop its own image, the engine gives transformers' greedy tokens."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from ringserve.actors.tokenizer.images import _per_image
from ringserve.bus.errors import ApiError
from ringserve.bus.images import ImageRef
from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import processor_kwargs
from tests.engine_helpers import engine_for, greedy, run_to_completion, tokens_of
from tests.vision_models import IMAGE_SIZE, IMAGE_TOKENS, random_image, tiny_hf_vlm

NEW_TOKENS = 6
# a 3:1 image cut into 3 crops of 32 pixels (the default smallest crop, 256 pixels, is larger than the tiny images)
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": IMAGE_SIZE}


def wide_image(seed: int) -> Any:
    return random_image(seed, 3 * IMAGE_SIZE).resize((3 * IMAGE_SIZE, IMAGE_SIZE))


def test_pan_and_scan_crops_are_images_of_their_own_with_transformers_tokens() -> None:
    model, processor = tiny_hf_vlm("gemma3")
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe this."}]}], add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=[wide_image(1)], return_tensors="np", **PAN_AND_SCAN)
    per_image = _per_image(dict(inputs))
    assert len(per_image) == 4  # the image, then its 3 crops
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == processor.tokenizer.image_token_id][::IMAGE_TOKENS]
    refs, tensors = [], {}
    for start, each in zip(starts, per_image):
        digest = hashlib.sha256(each["pixel_values"].tobytes()).hexdigest()
        refs.append(ImageRef(digest, start, IMAGE_TOKENS, handle=f"img-{digest[:8]}"))
        tensors[digest] = each
    assert len(tensors) == 4  # each crop its own hash
    engine = engine_for(model)
    assert engine.add_request(TokenizedRequest("p", ids, greedy(NEW_TOKENS, ignore_eos=True), images=refs),
                              tensors) is None
    got = tokens_of(run_to_completion(engine, [])["p"])
    with torch.no_grad():
        pt = {k: torch.as_tensor(v) for k, v in inputs.items()}
        want = model.generate(**pt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert got == want


def test_processor_kwargs_are_checked_by_their_declaration() -> None:
    assert processor_kwargs({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": None}) == {
        "do_pan_and_scan": True}
    for bad, says in (({"do_resize": False}, "not an image processor option"),
                      ({"do_pan_and_scan": "yes"}, "mm_processor_kwargs.do_pan_and_scan must be a boolean"),
                      ({"pan_and_scan_max_num_crops": 99}, r"pan_and_scan_max_num_crops must be in \[1, 16\], got 99"),
                      ([], "must be an object")):
        with pytest.raises(ApiError, match=says) as info:
            processor_kwargs(bad)
        assert info.value.param == "mm_processor_kwargs"
