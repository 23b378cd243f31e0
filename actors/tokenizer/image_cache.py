"""The tokenizer's cache of processed images: an image file sent again (the same bytes, with the same image processor
options) skips fetching the file, the processor, the encoding and, while the image store still holds the tensors,
their upload.

An entry is keyed by the file's handle (`raw-<sha256 of its bytes>`, bus/image_store.py) and the request's processor
options, and holds what the processor made of that one image: the text its placeholder becomes in the prompt, and
each of its parts (the image, then any pan-and-scan crops) as encoded tensors with their hash. The cache is an LRU
bounded by the encoded bytes it holds (`IMAGE_CACHE_BYTES`). It keeps the bytes, not just the handles, because
objects in the store expire (`--image-ttl`) or are dropped when the bucket is full: the tokenizer puts a part again
whenever the store's copy is gone or old (`ImageStore.put_once`) before it hands out the handle.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

IMAGE_CACHE_BYTES = 256 * 1024 * 1024  # per tokenizer: about 190 LLaVA-1.5 images (1.3 MiB of tensors each)


@dataclass(frozen=True)
class ImagePart:
    """One run of image tokens' tensors: encoded (bus/tensor_codec.py), their hash, and what `ImageRef.meta` says
    of them (Qwen2-VL's `image_grid_thw`)."""

    encoded: bytes
    digest: str
    meta: dict[str, Any]


@dataclass(frozen=True)
class ProcessedImage:
    """One image file as the processor made it: its placeholder's `replacement` text, and its parts in order."""

    replacement: str
    parts: tuple[ImagePart, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(part.encoded) for part in self.parts)


def cache_key(handle: str, options: dict[str, Any]) -> str:
    """The key of an image file (`handle`) processed with `options` (checked `mm_processor_kwargs`)."""
    return handle + json.dumps(options, sort_keys=True)


class ImageCache:
    """`ProcessedImage`s by `cache_key`, the least recently used dropped first beyond `max_bytes`; counts its
    hits and what it was given to keep (each one a processor run)."""

    def __init__(self, max_bytes: int = IMAGE_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.processed = 0

    def get(self, key: str) -> ProcessedImage | None:
        """The entry under `key`, now the most recently used; None when there is none."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: str, entry: ProcessedImage) -> None:
        """Keep `entry` (just processed) under `key`, dropping the least recently used beyond the bound; an entry
        larger than the whole bound is not kept."""
        self.processed += 1
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes

    def counters(self) -> dict[str, int]:
        """What the tokenizer reports in its heartbeats (/get_server_info's `actors`)."""
        return {"images_processed": self.processed, "image_cache_hits": self.hits,
                "image_cache_entries": len(self._entries), "image_cache_bytes": self._bytes}
