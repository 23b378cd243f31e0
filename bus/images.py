"""Images on the bus: a tokenized prompt names its images by handle; their processed tensors travel apart.

The tokenizer actor runs the model's image processor, expands each image's placeholder into its image tokens and
puts the processed tensors (pixel values, grid sizes, ...) into the NATS object store under the image's hash. A
`TokenizedRequest` then carries one `ImageRef` per image, a few hundred bytes however large the image, and the
scheduler fetches the tensors once before the engine admits the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ImageRef:
    """One image of a tokenized prompt.

    `hash` identifies the processed image (sha256 hex of its tensors; the prefix cache keys its tokens by it),
    `offset` is the index in `input_ids` of its first image token and `length` its number of image tokens (the
    run the engine replaces with the vision tower's embeddings), `handle` the object store key of its tensors
    (`nbytes` long). `meta` holds small per-image values the processor returns besides pixels (e.g. a grid
    size), for the engine.
    """

    hash: str
    offset: int
    length: int
    handle: str
    nbytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
