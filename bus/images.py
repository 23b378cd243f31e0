"""Images on the bus: a tokenized prompt names its images by handle; their processed tensors travel apart.

The tokenizer actor runs the model's image processor, expands each image's placeholder into its image tokens and
puts the processed tensors (pixel values, grid sizes, ...) into the NATS object store under the image's hash. A
`TokenizedRequest` then carries one `ImageRef` per image, a few hundred bytes however large the image, and the
scheduler fetches the tensors once before the engine admits the request. `image_key` is how a prompt with images
is keyed wherever KV is matched (the prefix cache, the KV tier, the router's block hashes): each image token
as a pseudo id of its image's hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

PSEUDO_BASE = 1 << 31  # pseudo ids lie in [2^31, 2^32): past any vocabulary, within the uint32 block hashes


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


def image_key(input_ids: list[int], refs: list[ImageRef]) -> list[int]:
    """`input_ids` as the prefix cache keys them: token `j` of an image's run becomes a pseudo id drawn from the
    image's hash and `j` (31 bits each, so two images share no run of them but by a 2^-31 chance per token)."""
    key = list(input_ids)
    for ref in refs:
        seed = bytes.fromhex(ref.hash) if _is_hex(ref.hash) else ref.hash.encode()
        for j in range(ref.length):
            digest = hashlib.blake2b(seed + j.to_bytes(4, "little"), digest_size=4).digest()
            key[ref.offset + j] = PSEUDO_BASE | (int.from_bytes(digest, "little") & (PSEUDO_BASE - 1))
    return key


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
