"""The one definition of a KV block's identity: chained hashes of whole `BLOCK`-token blocks of a token sequence.

Entry i of `block_hashes(ids)` identifies the prefix `ids[:(i + 1) * BLOCK]`: it hashes block i's token ids
together with the hash of block i - 1, so equal hashes mean equal prefixes (up to a 128-bit collision). The
scheduler replicas' prefix caches report the blocks they store and evict by these hashes (`KvEvents` in
bus/messages.py), and the tokenizers' router matches a prompt's hashes against them, so both sides must
compute them the same way: here. Torch-free, like the rest of bus/.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK = 64  # tokens per hashed block: prefixes are matched and reported in whole blocks
HASH_BYTES = 16


def cache_namespace(salt: str | None, lora_name: str | None, rope_name: str | None = None) -> str | None:
    """The prefix-cache namespace of a request (what `salt_seed` and the prefix cache's trees are keyed by): its
    `cache_salt`, apart per LoRA adapter, since KV computed under one adapter is never another's, and apart per
    rotary length class (`rope_name`: keys a length-dependent rotary turned for a long sequence)."""
    if lora_name is None and rope_name is None:
        return salt
    base = salt if lora_name is None else f"lora\0{lora_name}\0{salt or ''}"
    return base if rope_name is None else f"rope\0{rope_name}\0{base or ''}"


def salt_seed(salt: str | None) -> bytes:
    """What a request's first block chains to: b"" without a `cache_salt`, else a hash of the salt, so the
    blocks of salted prompts never equal another salt's (or an unsalted prompt's)."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + salt.encode("utf-8"), digest_size=HASH_BYTES).digest()


def block_hash(prev: bytes, block_ids: Sequence[int]) -> bytes:
    """The hash of one block of token ids that follows the prefix whose last block hashed to `prev` (b"" first)."""
    return hashlib.blake2b(prev + array("I", block_ids).tobytes(), digest_size=HASH_BYTES).digest()


def block_hashes(ids: Sequence[int], block: int = BLOCK, prev: bytes = b"", start: int = 0) -> list[bytes]:
    """Chained hashes of the whole blocks of `ids[start:]`, the first chained to `prev`.

    With the defaults, entry i identifies the prefix of `(i + 1) * block` tokens. `start` and `prev` let a
    caller continue a chain: `start` is a multiple of `block` and `prev` the hash of the block ending there.
    """
    out = []
    for begin in range(start, len(ids) - block + 1, block):
        prev = block_hash(prev, ids[begin:begin + block])
        out.append(prev)
    return out
