"""A request's images in the engine: checked at intake, embedded when prefill first reaches them, keyed apart in
the prefix cache.

`request_images` checks each `ImageRef` of a request against the model (a vision-language model, its tensors
given and as the model takes them, `VisionCausalLM.check_image`, a run of exactly the model's image token count of
image tokens) and keeps its tensors on the request; for an M-RoPE model (models/mrope.py) also its tokens' rope
positions and the shift of the rope positions after it (`rope_positions` gives a step's).
`step_override` runs the vision tower and projector for the images a step's prefill chunks cover, once per image
hash across the step's requests (the embeddings stay with each request for its life), and gives the model the
chunk's slice of them (a chunk may start or end inside an image). The prefix cache keys a prompt by
`bus/images.py` `image_key`: each image token becomes a pseudo id drawn from its image's hash and its place in
the run, so the same image twice shares KV and two images never do; the routers hash the same key.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch

from ringserve.actors.engine.core.embed_override import BidirectionalSpan, EmbedOverride
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.core.batch import Batch
from ringserve.bus.errors import ApiError
from ringserve.bus.images import ImageRef


@dataclass(eq=False)
class ReqImage:
    """One image of a request: where its tokens are, its processed tensors, and its embeddings once computed.
    M-RoPE: `rope` its tokens' `[3, length]` rope positions, `rope_shift` the rope position minus the sequence
    position of the text after it (0 for other models)."""

    ref: ImageRef
    tensors: dict[str, torch.Tensor]  # the processor's for this image: pixel_values, e.g. image_grid_thw
    embeds: torch.Tensor | None = None  # [length, C]
    rope: torch.Tensor | None = None
    rope_shift: int = 0

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.tensors["pixel_values"]

    @property
    def start(self) -> int:
        return self.ref.offset

    @property
    def end(self) -> int:
        return self.ref.offset + self.ref.length


def request_images(model: CausalLM, input_ids: list[int], refs: list[ImageRef],
                   images: dict[str, dict[str, Any]] | None) -> list[ReqImage] | ApiError:
    """The request's images checked against `model` and `input_ids`, or a 400 naming the first bad one."""
    token = getattr(model, "image_token_id", None)
    if refs and token is None:
        return ApiError("this model takes no images (it is a text-only model)", param="images")
    out: list[ReqImage] = []
    end = shift = 0
    for i, ref in enumerate(refs):
        name = f"image {i} ({ref.hash[:12]})"
        tensors = (images or {}).get(ref.hash)
        if tensors is None:
            return ApiError(f"{name}: its processed tensors were not given to the engine", param="images")
        tensors = {key: torch.as_tensor(value) for key, value in tensors.items()}
        try:
            expected = model.check_image(tensors)  # type: ignore[attr-defined]
        except ValueError as exc:
            return ApiError(f"{name}: {exc}", param="images")
        if ref.length != expected:
            return ApiError(f"{name}: a run of {ref.length} image tokens, the model makes {expected} per image",
                            param="images")
        if ref.offset < end or ref.offset + ref.length > len(input_ids):
            return ApiError(f"{name}: its tokens [{ref.offset}, {ref.offset + ref.length}) overlap another image's "
                            f"or pass the prompt's {len(input_ids)} tokens", param="images")
        if any(t != token for t in input_ids[ref.offset:ref.offset + ref.length]):
            return ApiError(f"{name}: its run holds tokens other than the image token {token}", param="images")
        end = ref.offset + ref.length
        image = ReqImage(ref, tensors)
        rope = model.image_rope(tensors)  # type: ignore[attr-defined]
        if rope is not None:
            offsets, advance = rope
            image.rope = offsets + (ref.offset + shift)
            shift += advance - ref.length
            image.rope_shift = shift
        out.append(image)
    stray = sum(t == token for t in input_ids) - sum(ref.length for ref in refs)
    if token is not None and stray:
        return ApiError(f"the prompt holds {stray} image token(s) (id {token}) outside its images' runs",
                        param="input_ids")
    return out


def chunk_tokens(images: list[ReqImage], start: int, n: int) -> int:
    """How many tokens from `start` a prefill chunk of (at most) `n` may compute when the model's images attend
    both ways: `n`, unless it would end inside an image; then up to the image's start, or, when the chunk starts
    at or inside it, through its end (more than `n`)."""
    for image in images:
        if image.start < start + n < image.end:
            return image.start - start if image.start > start else image.end - start
    return n


def _covered(batch: Batch) -> list[tuple[ReqImage, Any, int, int, int]]:
    """(image, request, chunk start, chunk length, the chunk's first flat index) of each image a prefill chunk of
    `batch` reaches."""
    d = batch.num_decode
    flats = [d + sum(batch.extend_lens[d:b]) for b in range(d, len(batch.reqs))]  # decode rows: 1 token each
    chunks = zip(batch.reqs[d:], batch.starts[d:], batch.extend_lens[d:], flats)
    return [(image, req, start, n, flat) for req, start, n, flat in chunks
            for image in req.images if image.start < start + n and start < image.end]


def embed_step_images(model: CausalLM, batch: Batch) -> None:
    """Run the vision tower on the images `batch`'s prefill chunks reach that have no embeddings yet (what
    `step_override` would run), e.g. before taking a lock the tower must not hold (scheduling/tp_engine.py)."""
    _embed([image for image, *_ in _covered(batch)], model)


def step_override(model: CausalLM, batch: Batch, token_table: torch.Tensor) -> EmbedOverride | None:
    """The image embeddings of `batch`'s prefill chunks, None when no chunk covers an image token. Images not
    embedded yet are embedded together, once per hash."""
    covered = _covered(batch)
    if not covered:
        return None
    _embed([image for image, *_ in covered], model)
    index: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    spans: list[BidirectionalSpan] = []
    ropes: list[torch.Tensor] = []
    device = token_table.device
    for image, req, start, n, flat in covered:
        lo, hi = max(image.start, start), min(image.end, start + n)
        first = flat + lo - start
        index.append(torch.arange(first, first + hi - lo, device=device))
        assert image.embeds is not None
        embeds.append(image.embeds[lo - image.start:hi - image.start])
        if image.rope is not None:
            ropes.append(image.rope[:, lo - image.start:hi - image.start])
        if model.bidirectional_images:  # type: ignore[attr-defined]
            assert hi == image.end, "a chunk never ends inside an image whose tokens attend both ways"
            spans.append(BidirectionalSpan(first, hi - lo, lo, token_table[req.row, :hi]))
    rope = torch.cat(ropes, dim=1).to(device) if ropes else None
    return EmbedOverride(torch.cat(index), torch.cat(embeds), spans, rope)


def _embed(images: list[ReqImage], model: CausalLM) -> None:
    """Compute the embeddings of those of `images` that have none, in one batch; images of the same hash (across
    requests) share one computation."""
    todo: dict[str, list[ReqImage]] = {}
    for image in images:
        if image.embeds is None:
            todo.setdefault(image.ref.hash, []).append(image)
    if not todo:
        return
    device = model.model.embed_tokens.weight.device
    tensors = [{**group[0].tensors, "pixel_values": group[0].pixel_values.to(device)} for group in todo.values()]
    out = model.embed_image_batch(tensors)  # type: ignore[attr-defined]  # each [length, C]
    for group, embeds in zip(todo.values(), out):
        for image in group:
            image.embeds = embeds
