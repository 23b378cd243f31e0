"""A prompt with images: the model's own processor turns it into token ids and per-image tensors stored on the bus.

For a vision-language model (a `config.json` with a `vision_config`), `VisionPrompts` loads transformers'
processor from the model directory (processor_loader.py: without a video processor where that needs torchvision).
A request's images come as handles of their files in the image store
(bus/image_store.py); they are fetched, decoded, and given with the prompt's text to the processor, which resizes
and normalises them and expands each image placeholder into the image's run of image tokens. The chat template
renders an image part as the model's placeholder; a text prompt (`/generate`) must hold one placeholder per image.

Each image's tensors (the processor's output for that one image: `pixel_values`, and e.g. `image_grid_thw`) are
encoded (bus/tensor_codec.py), hashed, and put into the store under the hash, once; the request carries an
`ImageRef` per image: hash, the run of its tokens in `input_ids`, the handle. The request's `mm_processor_kwargs`
(bus/params.py `ImageProcessing`, those the model's image processor takes) go to the processor; Gemma 3's
pan-and-scan crops come out as images of their own (each crop its run of tokens, its tensors, its hash).
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.actors.common.model_source import ModelSource
from ringserve.actors.engine.models.registry import image_token_id
from ringserve.actors.tokenizer.processor_loader import load_processor
from ringserve.bus.errors import ApiError
from ringserve.bus.image_store import ImageMissing, ImageStore, ImageStoreUnavailable, tensors_handle
from ringserve.bus.images import ImageRef
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.params import PROCESSOR_KWARGS
from ringserve.bus.tensor_codec import encode_tensors, tensors_hash

NOT_PER_IMAGE = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}  # per token, not per image


def image_handles(req: GenerateRequest) -> list[str]:
    """The handles of `req`'s images in prompt order: its messages' image parts, then its `image_data`."""
    handles = [part.get("handle", "") for turn in req.messages or [] for part in turn.parts or []
               if part.get("type") == "image"]
    return handles + list(req.image_data or [])


def images_param(req: GenerateRequest) -> str:
    """The field a request's images came in, for its errors."""
    return "messages" if req.messages is not None else "image_data"


def is_vision_model(source: ModelSource) -> bool:
    """Whether the model directory holds a vision-language model (its config has a vision tower)."""
    config = Path(source.directory) / "config.json"
    if source.gguf_file or not config.is_file():
        return False
    return "vision_config" in json.loads(config.read_text())


class VisionPrompts:
    """The model's processor and image token, and the image store the tensors go to."""

    def __init__(self, source: ModelSource, store: ImageStore) -> None:
        from transformers import AutoConfig

        self._processor = load_processor(source.directory)
        token = image_token_id(AutoConfig.from_pretrained(source.directory))
        if token is None:
            raise ValueError(f"{source.directory} is not a vision-language model this server serves")
        self.image_token_id: int = token
        # what a text prompt holds for each image (Gemma 3 expands its begin-of-image token)
        self.placeholder: str = getattr(self._processor, "boi_token", None) or self._processor.image_token
        image_processor = getattr(self._processor, "image_processor", None)
        self._merge = getattr(image_processor, "merge_size", 1) or 1
        # the options this image processor takes (transformers declares them as a TypedDict)
        self._options = set(getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {}))
        self._processor_name = type(image_processor).__name__
        self._store = store

    def check_options(self, options: dict[str, Any]) -> None:
        """ApiError 400 naming the first of `options` (checked `mm_processor_kwargs`) this model's image processor
        does not take."""
        for key in options:
            if key not in self._options:
                raise ApiError(f"{PROCESSOR_KWARGS}.{key}: this model's image processor ({self._processor_name}) "
                               "does not take it", param=PROCESSOR_KWARGS)

    async def encode(self, req: GenerateRequest, chat_text: str | None,
                     options: dict[str, Any] | None = None) -> tuple[list[int], list[ImageRef]]:
        """Token ids and image refs of `req` (its chat template's text `chat_text`, or its `text`), its images'
        tensors stored; `options`: the image processor's (`check_options`). ApiError 400 naming the images for a
        missing or undecodable one or a placeholder count that does not match; 503 when the store cannot be
        reached."""
        param = images_param(req)
        handles = image_handles(req)
        if req.input_ids is not None:
            raise ApiError("images need a text prompt (text or messages) holding their placeholders, not input_ids",
                           param="image_data")
        text = chat_text if chat_text is not None else req.text or ""
        if chat_text is None and text.count(self.placeholder) != len(handles):
            raise ApiError(f"the prompt holds {text.count(self.placeholder)} image placeholders "
                           f"({self.placeholder!r}) for {len(handles)} images in image_data: put one where each "
                           "image goes", param="image_data")
        try:
            files = await asyncio.gather(*(self._store.get(h) for h in handles))
        except ImageMissing as exc:
            raise ApiError(f"{exc}; send the image again", param=param) from exc
        except ImageStoreUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc
        ids, tensors = await asyncio.to_thread(self._process, text, files, param, chat_text is not None,
                                               options or {})
        refs = []
        for (offset, length), each in zip(self._runs(ids, tensors), tensors):
            encoded = encode_tensors(each)
            digest = tensors_hash(encoded)
            try:
                await self._store.put_once(tensors_handle(digest), encoded)
            except ImageStoreUnavailable as exc:
                raise ApiError(str(exc), 503, type="server_error") from exc
            meta = {"image_grid_thw": [int(v) for v in each["image_grid_thw"].reshape(-1)]} \
                if "image_grid_thw" in each else {}
            refs.append(ImageRef(hash=digest, offset=offset, length=length, handle=tensors_handle(digest),
                                 nbytes=len(encoded), meta=meta))
        return ids, refs

    def _process(self, text: str, files: list[bytes], param: str, chat: bool,
                 options: dict[str, Any]) -> tuple[list[int], list[dict[str, np.ndarray]]]:
        """Run the processor (in a worker thread): the ids, and each image's (or crop's) own tensors."""
        from PIL import Image

        images = []
        for k, data in enumerate(files):
            try:
                image = Image.open(io.BytesIO(data))
                image.load()
            except Exception as exc:  # the entry checked it; a NATS client's may be anything
                raise ApiError(f"image {k} of the request cannot be decoded: {exc}", param=param) from exc
            images.append(image)
        try:  # a chat template's text holds its special tokens already, as for text chat (prompt.py)
            out = self._processor(text=[text], images=images, return_tensors="np", add_special_tokens=not chat,
                                  **options)
        except ValueError as exc:
            raise ApiError(f"the model's processor refused the images: {exc}", param=param) from exc
        return [int(t) for t in out["input_ids"][0]], _per_image(dict(out))

    def _runs(self, ids: list[int], tensors: list[dict[str, np.ndarray]]) -> list[tuple[int, int]]:
        """(offset, length) of each image's run of image tokens in `ids`, in order."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if tensors and "image_grid_thw" in tensors[0]:
            lengths = [int(np.prod(t["image_grid_thw"])) // self._merge ** 2 for t in tensors]
        else:
            lengths = [len(positions) // len(tensors)] * len(tensors) if tensors else []
        if sum(lengths) != len(positions):
            raise ApiError(f"the processor gave {len(positions)} image tokens for {len(tensors)} images",
                           500, type="server_error")
        runs, start = [], 0
        for length in lengths:
            first = positions[start]
            if positions[start + length - 1] != first + length - 1:
                raise ApiError("an image's tokens are not one run", 500, type="server_error")
            runs.append((first, length))
            start += length
        return runs


def _per_image(out: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """Split the processor's batched image tensors into each image's own, as the processor gives them for that
    image alone (Qwen2-VL's patches by `image_grid_thw`, the rest by their first axis: one entry per image, or per
    crop with Gemma 3's pan-and-scan, whose crops follow their image)."""
    grids = np.asarray(out["image_grid_thw"]) if "image_grid_thw" in out else None
    count = len(grids) if grids is not None else len(out["pixel_values"])
    tensors: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    for name, value in out.items():
        if name in NOT_PER_IMAGE:
            continue
        array = np.asarray(value)
        if name == "pixel_values" and grids is not None:
            bounds = np.cumsum([0, *[int(np.prod(g)) for g in grids]])
            pieces = [array[bounds[i]:bounds[i + 1]] for i in range(count)]
        elif array.ndim and array.shape[0] == count:
            pieces = [array[i:i + 1] for i in range(count)]
        else:
            raise ApiError(f"the model's processor returned {name} of shape {array.shape}, not per image", 500,
                           type="server_error")
        for each, piece in zip(tensors, pieces):
            each[name] = piece
    return tensors
