"""A prompt with images: the model's own processor turns it into token ids and per-image tensors stored on the bus.

For a vision-language model (a `config.json` with a `vision_config`), `VisionPrompts` loads transformers'
processor from the model directory (processor_loader.py: without a video processor where that needs torchvision).
A request's images come as handles of their files in the image store
(bus/image_store.py: a NATS client's in its own bucket, read only there; anyone else's in the shared one); they
are fetched, decoded, and given with the prompt's text to the processor, which resizes and normalises them and
expands each image placeholder into the image's run of image tokens. The chat template
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
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.actors.common.model_catalog import image_token_id
from ringserve.actors.common.model_source import ModelSource
from ringserve.actors.tokenizer.processor_loader import load_processor
from ringserve.actors.tokenizer.image_cache import ImageCache, ImagePart, ProcessedImage, cache_key
from ringserve.bus.errors import ApiError
from ringserve.bus.image_store import ImageMissing, ImageStore, ImageStoreUnavailable, tensors_handle
from ringserve.bus.images import ImageRef
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.params import PROCESSOR_KWARGS
from ringserve.bus.tensor_codec import encode_tensors, tensors_hash

NOT_PER_IMAGE = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}  # per token, not per image
CLIENT_READERS = 256  # clients' buckets kept open (an unauthenticated NATS may bring any number of client names)


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
        self._client_stores: OrderedDict[str, ImageStore] = OrderedDict()  # read only, most recently used last
        self._cache = ImageCache()

    def check_options(self, options: dict[str, Any]) -> None:
        """ApiError 400 naming the first of `options` (checked `mm_processor_kwargs`) this model's image processor
        does not take."""
        for key in options:
            if key not in self._options:
                raise ApiError(f"{PROCESSOR_KWARGS}.{key}: this model's image processor ({self._processor_name}) "
                               "does not take it", param=PROCESSOR_KWARGS)

    async def encode(self, req: GenerateRequest, chat_text: str | None, options: dict[str, Any] | None = None,
                     client: str | None = None) -> tuple[list[int], list[ImageRef]]:
        """Token ids and image refs of `req` (its chat template's text `chat_text`, or its `text`), its images'
        tensors stored; `options`: the image processor's (`check_options`); `client`: the NATS client whose bucket
        holds the files (None: the shared bucket). An image sent before from the same bucket with the same
        options comes from the cache (image_cache.py), neither fetched nor processed again. ApiError 400 naming
        the images for a missing or undecodable one or a placeholder count that does not match; 503 when the
        store cannot be reached."""
        param = images_param(req)
        files_store = self._store if client is None else self._client_store(client)
        handles = image_handles(req)
        if req.input_ids is not None:
            raise ApiError("images need a text prompt (text or messages) holding their placeholders, not input_ids",
                           param="image_data")
        text = chat_text if chat_text is not None else req.text or ""
        if text.count(self.placeholder) != len(handles):
            where = "image_data: put one where each image goes" if chat_text is None else "the messages"
            raise ApiError(f"the prompt holds {text.count(self.placeholder)} image placeholders "
                           f"({self.placeholder!r}) for {len(handles)} images in {where}", param=param)
        options = options or {}
        # a client's entries are its own: another's (or the shared bucket's) copy of a file is not in its bucket
        keys = [cache_key(h if client is None else f"{files_store.bucket}/{h}", options) for h in handles]
        cached: dict[str, ProcessedImage] = {}
        todo: dict[str, tuple[int, str]] = {}  # the images to process: their first index, their handle
        for k, (key, handle) in enumerate(zip(keys, handles)):
            if key not in cached and key not in todo:
                hit = self._cache.get(key)
                if hit is None:
                    todo[key] = (k, handle)
                else:
                    cached[key] = hit
        try:
            files = await asyncio.gather(*(files_store.get(handle) for _, handle in todo.values()))
        except ImageMissing as exc:
            raise ApiError(f"{exc}; send the image again", param=param) from exc
        except ImageStoreUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc
        processed = await asyncio.to_thread(self._process, [(k, data) for (k, _), data in zip(todo.values(), files)],
                                            param, options)
        for key, image in zip(todo, processed):
            self._cache.put(key, image)
            cached[key] = image
        images = [cached[key] for key in keys]
        ids = await asyncio.to_thread(self._tokenize, text, [image.replacement for image in images],
                                      chat_text is not None)
        parts = [part for image in images for part in image.parts]
        refs = []
        for (offset, length), part in zip(self._runs(ids, parts), parts):
            try:  # again when the store's copy is gone or old: a handle handed out names an object
                await self._store.put_once(tensors_handle(part.digest), part.encoded)
            except ImageStoreUnavailable as exc:
                raise ApiError(str(exc), 503, type="server_error") from exc
            refs.append(ImageRef(hash=part.digest, offset=offset, length=length, handle=tensors_handle(part.digest),
                                 nbytes=len(part.encoded), meta=part.meta))
        return ids, refs

    def _client_store(self, client: str) -> ImageStore:
        """Client `client`'s bucket, read only (kept open for the `CLIENT_READERS` most recent clients)."""
        store = self._client_stores.pop(client, None) or self._store.client_reader(client)
        self._client_stores[client] = store
        if len(self._client_stores) > CLIENT_READERS:
            self._client_stores.popitem(last=False)
        return store

    def counters(self) -> dict[str, int]:
        """The image cache's counters (what the tokenizer's heartbeats report)."""
        return self._cache.counters()

    def _process(self, files: list[tuple[int, bytes]], param: str,
                 options: dict[str, Any]) -> list[ProcessedImage]:
        """Run the image processor on each file `(its index in the request, bytes)` alone (in a worker thread):
        its placeholder's replacement text, and each of its parts' (the image's, its crops') encoded tensors.

        This is transformers' `ProcessorMixin.__call__` taken apart (its merged kwargs, `_process_images`, then
        `get_text_with_replacements` in `_tokenize`), so that an image is processed once for any prompt it is
        in; tests/vision/test_image_cache.py checks the ids and tensors equal the whole call's."""
        from PIL import Image

        processor = self._processor
        kwargs = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs, return_tensors="np",
                                         **options)["images_kwargs"]
        unused = set(getattr(processor, "unused_input_names", ()))  # e.g. Gemma 3's num_crops
        out = []
        for k, data in files:
            try:
                image = Image.open(io.BytesIO(data))
                image.load()
            except Exception as exc:  # the entry checked it; a NATS client's may be anything
                raise ApiError(f"image {k} of the request cannot be decoded: {exc}", param=param) from exc
            try:
                tensors, replacements = processor._process_images([image], **kwargs)
            except ValueError as exc:
                raise ApiError(f"the model's processor refused image {k}: {exc}", param=param) from exc
            parts = []
            for each in _per_image({name: v for name, v in tensors.items() if name not in unused}):
                encoded = encode_tensors(each)
                meta = {"image_grid_thw": [int(v) for v in each["image_grid_thw"].reshape(-1)]} \
                    if "image_grid_thw" in each else {}
                parts.append(ImagePart(encoded, tensors_hash(encoded), meta))
            out.append(ProcessedImage(replacements[0], tuple(parts)))
        return out

    def _tokenize(self, text: str, replacements: list[str], chat: bool) -> list[int]:
        """`text`'s ids with each image placeholder replaced by its image's text, as the processor tokenizes it (a
        chat template's text holds its special tokens already, as for text chat: prompt.py)."""
        processor = self._processor
        kwargs = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs,
                                         add_special_tokens=not chat)["text_kwargs"]
        for name in ("return_mm_token_type_ids", "return_text_replacement_offsets", "return_tensors"):
            kwargs.pop(name, None)
        expanded = processor.get_text_with_replacements([text], replacements)[0][0]
        return [int(t) for t in processor.tokenizer(expanded, **kwargs)["input_ids"]]

    def _runs(self, ids: list[int], parts: list[ImagePart]) -> list[tuple[int, int]]:
        """(offset, length) of each image part's run of image tokens in `ids`, in order."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if parts and "image_grid_thw" in parts[0].meta:
            lengths = [int(np.prod(part.meta["image_grid_thw"])) // self._merge ** 2 for part in parts]
        else:
            lengths = [len(positions) // len(parts)] * len(parts) if parts else []
        if sum(lengths) != len(positions):
            raise ApiError(f"the processor gave {len(positions)} image tokens for {len(parts)} images",
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
