"""A token's raw bytes, as OpenAI's logprob `bytes` field reports them.

Decoding one token of a multi-byte character alone gives U+FFFD, so its text cannot give its bytes; the
token's vocabulary form can. GPT-2-style byte-level BPE (SmolLM2, Llama 3, Qwen) spells each byte as one
printable character (`bytes_to_unicode`): map the token's characters back. Sentencepiece byte fallback spells
a byte as `<0xAB>`. Added (special) tokens and any other token are the UTF-8 of their decoded text.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte value -> the printable character that spells it in a byte-level vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of `bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def byte_level_bytes(piece: str) -> list[int] | None:
    """The bytes a byte-level BPE piece spells, or None if a character of it is not in the table."""
    table = unicode_to_bytes()
    try:
        return [table[ch] for ch in piece]
    except KeyError:
        return None


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is not None:
        return "ByteLevel" in repr(decoder)
    # a slow tokenizer: byte-level if its vocabulary spells every one of the 256 bytes as one character
    vocab = tokenizer.get_vocab()
    return all(ch in vocab for ch in bytes_to_unicode().values())


class TokenBytes:
    """Maps token ids to their raw bytes for one tokenizer; caches each id's answer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str | None = None) -> list[int]:
        """The raw bytes of `token_id`; `text` is its decoded text if the caller has it."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id, text)
        return list(cached)

    def _compute(self, token_id: int, text: str | None) -> list[int]:
        if text is None:
            text = self._tokenizer.decode([token_id])
        if token_id not in self._added:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                match = _BYTE_PIECE.fullmatch(piece)
                if match:
                    return [int(match.group(1), 16)]
                if self._byte_level:
                    raw = byte_level_bytes(piece)
                    if raw is not None:
                        return raw
        return list(text.encode("utf-8", errors="replace"))
