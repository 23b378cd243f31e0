"""KV blocks between scheduler replicas over NATS: a replica that lacks a prompt's prefix fetches it from one that
holds it, in request/reply exchanges within the server's payload limit.

The asker names the prompt's leading tokens (whole `BLOCK`-token blocks), its cache namespace (`cache_salt`,
LoRA adapter) and its KV tier's namespace (the weights, kernels and pool layout its KV depends on), and the
first block it lacks; the holder answers with as many whole blocks as fit one message, each with a blake2b
checksum of its bytes, exported from its prefix cache or its own tier. A holder whose tier namespace differs
(other weights, another kernel plan) has nothing to give: its KV would not be the asker's to the bit. The asker
asks again from the next block until it has what it wanted, a reply comes back short, or its deadline passes:
what it got by then it loads (through its tier store), the rest it computes. No torch here: blocks are bytes.

Prefill/decode disaggregation uses the same exchange: a decode replica first asks a prefill replica to compute a
prompt's whole blocks (`KvPrefillRequest`, answered when they are in its cache), then fetches them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

CHECKSUM_BYTES = 16
REPLY_OVERHEAD = 64 * 1024  # room in a reply for its envelope, checksums and headers


def checksum(payload: bytes) -> bytes:
    """The block checksum a reply carries (blake2b, 16 bytes)."""
    return hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).digest()


@dataclass
class KvFetchRequest:
    """Ask replica `r` (`{ns}.kv.fetch.{r}`) for blocks `[first_block, first_block + max_blocks)` of the prompt
    whose leading tokens are `input_ids` (whole blocks through the last one asked), cached under `cache_key`,
    for a tier of namespace `namespace`."""

    input_ids: list[int]
    cache_key: str | None
    namespace: str
    first_block: int
    max_blocks: int


@dataclass
class KvFetchReply:
    """Blocks from `first_block` on, in order (each the K then V bytes as the holder's pool holds them), with
    their checksums; empty when the holder has none of them (or another namespace: `error` says so)."""

    blocks: list[bytes] = field(default_factory=list)
    checksums: list[bytes] = field(default_factory=list)
    error: str = ""


@dataclass
class KvPrefillRequest:
    """Ask prefill replica `r` (`{ns}.kv.prefill.{r}`) to compute the KV of `input_ids` (whole blocks) under
    the asker's cache salt and LoRA adapter, for a tier of `namespace`, and keep it until fetched."""

    input_ids: list[int]
    namespace: str
    notify: str  # the asker's inbox subject, where the `KvPrefillReply` saying it is done goes
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass
class KvPrefillReply:
    """The reply to a `KvPrefillRequest` says it was taken (`blocks` 0) or refused (`error`); the message to its
    `notify` subject says the prompt's `blocks` are cached (to fetch), or why not (`error`)."""

    blocks: int = 0
    error: str = ""


@dataclass
class FetchResult:
    """What one fetch got: `blocks` (checked, in order from the first asked), how many replies it took, the
    bytes, the seconds, and why it stopped short if it did."""

    blocks: list[bytes]
    replies: int = 0
    bytes: int = 0
    seconds: float = 0.0
    stopped: str = ""


async def fetch_blocks(bus: Any, subject: str, ask: KvFetchRequest, deadline_s: float) -> FetchResult:
    """Fetch `ask.max_blocks` blocks from the holder at `subject` (its `kv_fetch` subject) over `bus` (a
    `BusConnection`), asking again from the next block after each reply, until all came, a reply is short,
    a block's checksum does not match (it and the rest are dropped: computed instead), or `deadline_s`
    passes. Never raises for the holder's failures: they end the fetch with `stopped` saying why."""
    started = time.monotonic()
    result = FetchResult(blocks=[])
    wanted, first = ask.max_blocks, ask.first_block
    while len(result.blocks) < wanted:
        left = deadline_s - (time.monotonic() - started)
        if left <= 0:
            result.stopped = "deadline"
            break
        part = KvFetchRequest(ask.input_ids, ask.cache_key, ask.namespace, first + len(result.blocks),
                              wanted - len(result.blocks))
        try:
            reply = await bus.request(subject, part, KvFetchReply, left)
        except asyncio.TimeoutError:
            result.stopped = "deadline"
            break
        except Exception as exc:  # no responders (the holder is gone), a malformed reply
            result.stopped = f"holder failed: {exc!r}"[:300]
            break
        result.replies += 1
        if reply.error or not reply.blocks:
            result.stopped = reply.error or "the holder has no more of them"
            break
        for payload, sent in zip(reply.blocks, reply.checksums):
            if checksum(payload) != sent:
                result.stopped = "a block's checksum did not match"
                break
            result.blocks.append(payload)
            result.bytes += len(payload)
        if result.stopped or len(reply.checksums) != len(reply.blocks):
            result.stopped = result.stopped or "a reply without a checksum per block"
            break
    result.seconds = time.monotonic() - started
    return result


def reply_budget(max_payload: int) -> int:
    """Bytes of blocks one reply may carry under the server's `max_payload`."""
    return max(1, max_payload - REPLY_OVERHEAD)
