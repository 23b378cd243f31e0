"""`KVTier`: the KV pool's blocks to and from a `BlockStore`, keyed by what made them.

A block is `block` tokens of one prefix, identified by the chained hash the radix cache and the router use
(`ringserve.bus.kv_blocks`; a `cache_salt` seeds it). The store's key adds the tier's namespace: a fingerprint of
the weights (sampled bytes of every parameter and buffer, so an update of the weights, another checkpoint or
another quantization keys apart), the kernel each quantized linear shape and row count runs (kernels round
differently: a plan measured again after a restart may choose others), and the pool's layout and dtype.
A block's K/V is saved when the prefix cache evicts it (with `--kv-tier-write-through`, already when it becomes
a cached prefix block) and loaded into fresh pool slots when a request's prompt continues past its cached prefix
with blocks the store holds (`CacheManager.admit`). A graceful stop saves the blocks still cached (`save_cached`:
most recently used first, within the store's bound and `KV_TIER_STOP_SAVE_SECONDS` of actors/engine/config.py), so
a restart on the same directory answers them from disk.

Loading is used while it is faster than computing: after `JUDGE_AFTER` loads, their average seconds per token
is compared with the engine's prefill seconds per token (`note_prefill`); a tier slower than prefill on this
host stops loading (and says so once in the log).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from ringserve.actors.engine.kv_tier.store import CHECKSUM_BYTES, BlockStore
from ringserve.observability.logging import log_event

log = logging.getLogger("engine.kv_tier")
SAMPLE = 256  # elements of each tensor's start and end that the weights' fingerprint reads
JUDGE_AFTER = 4  # loads before the tier's speed is compared with prefill's (the first ones fault pages in)


def weights_fingerprint(model: torch.nn.Module, extra: str = "") -> str:
    """A short hash naming the weights `model` holds now, and `extra` (the kernel plan, the pool's layout)."""
    digest = hashlib.blake2b(extra.encode(), digest_size=16)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        flat = tensor.detach().reshape(-1)
        sample = torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]) if flat.numel() > 2 * SAMPLE else flat
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(sample.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class KVTier:
    """Saves evicted blocks of `pool` to `store` and loads them back, under `namespace`."""

    def __init__(self, pool: Any, store: BlockStore, block: int, namespace: str, write_through: bool = False) -> None:
        """`write_through`: save each block as it becomes a cached prefix block (`keep`), not only when evicted."""
        self.pool, self.store, self.block, self.namespace = pool, store, block, namespace
        self.write_through = write_through
        self.saved_blocks = self.loaded_blocks = self.loaded_bytes = 0
        self.load_seconds = 0.0
        self._loads = self._loaded_tokens = 0
        self._prefill_s_per_token: float | None = None
        self.loading = True  # false once loading measured slower than prefill

    def key(self, block_hash: bytes) -> str:
        """The store's key of a block: the namespace and the block's hash."""
        return hashlib.blake2b(self.namespace.encode() + block_hash, digest_size=20).hexdigest()

    def save(self, blocks: list[tuple[bytes, torch.Tensor]]) -> None:
        """Keep each `(hash, slots)` block's K/V (`block` slots of the pool, in token order)."""
        for block_hash, slots in blocks:
            self.saved_blocks += self.store.put(self.key(block_hash), self.payload(slots))

    def keep(self, blocks: list[tuple[bytes, torch.Tensor]]) -> None:
        """Write-through: save each `(hash, slots)` block the store lacks (one loaded from it is there already)."""
        for block_hash, slots in blocks:
            key = self.key(block_hash)
            if key in self.store:
                self.store.touch([key])
            else:
                self.saved_blocks += self.store.put(key, self.payload(slots))

    def save_cached(self, blocks: Iterable[tuple[bytes, torch.Tensor]], seconds: float) -> dict[str, Any]:
        """Save `blocks` (the prefix cache's, most recently used first, each after the blocks of its prefix) until
        the store's bound is full of them or `seconds` have passed; blocks the store holds already are kept, not
        written again. Older blocks of the store make room, and the first of `blocks` ends the most recently used
        (the last out). Returns what was done (logged)."""
        started = time.monotonic()
        room = self.store.max_bytes // (self.block_bytes + CHECKSUM_BYTES)
        kept: list[str] = []
        seen: set[str] = set()
        written, complete = 0, True
        for block_hash, slots in blocks:
            key = self.key(block_hash)
            if key in seen:
                continue
            if len(kept) >= room or time.monotonic() - started >= seconds:
                complete = False
                break
            seen.add(key)
            if key in self.store:
                self.store.touch([key])  # kept now: never the least recently used while the others are written
            elif self.store.put(key, self.payload(slots)):
                written += 1
            else:  # the disk refused it (logged by the store): its descendants could never load
                complete = False
                break
            kept.append(key)
        self.store.touch(reversed(kept))
        self.saved_blocks += written
        report = {"written_blocks": written, "kept_blocks": len(kept), "complete": complete,
                  "seconds": round(time.monotonic() - started, 3)}
        log_event(log, logging.INFO if complete else logging.WARNING,
                  "saved the cached prefix blocks to the KV tier" if complete else
                  "saved the most recently used cached prefix blocks to the KV tier; the rest did not fit its "
                  "bound or time limit", **report)
        return report

    def present(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the store holds (nothing while loading is off)."""
        if not self.loading:
            return 0
        count = 0
        for block_hash in hashes:
            if self.key(block_hash) not in self.store:
                break
            count += 1
        return count

    def read(self, hashes: list[bytes]) -> list[bytes]:
        """The payloads of `hashes`, from the first, up to the first one the store no longer has (or had
        corrupted)."""
        out = []
        for block_hash in hashes:
            payload = self.store.get(self.key(block_hash))
            if payload is None:
                break
            out.append(payload)
        return out

    def load(self, payloads: list[bytes], skip: int, slots: torch.Tensor) -> None:
        """Write the blocks `payloads` into the pool at `slots`, leaving out the first `skip` tokens of the first
        block (its head is cached already): `len(slots) == len(payloads) * block - skip`."""
        started = time.perf_counter()
        k, v = self.pool.k, self.pool.v
        layers, _, heads, dim = k.shape
        shape = (layers, len(payloads) * self.block, heads, dim)
        per_tensor = layers * self.block * heads * dim * k.element_size()
        keys = torch.cat([self._tensor(p[:per_tensor], k) for p in payloads], dim=1).reshape(shape)
        k[:, slots] = keys[:, skip:].to(k.device)
        if v is not k:
            values = torch.cat([self._tensor(p[per_tensor:], v) for p in payloads], dim=1).reshape(shape)
            v[:, slots] = values[:, skip:].to(v.device)
        elapsed = time.perf_counter() - started
        self.loaded_blocks += len(payloads)
        self.loaded_bytes += sum(len(p) for p in payloads)
        self.load_seconds += elapsed
        self._loads += 1
        self._loaded_tokens += slots.numel()
        if self._loads >= JUDGE_AFTER:
            self._check_pays(self.load_seconds / max(1, self._loaded_tokens))

    def note_prefill(self, seconds: float, tokens: int) -> None:
        """A prefill step's time: what a load is compared with (a moving average per token)."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        previous = self._prefill_s_per_token
        self._prefill_s_per_token = per_token if previous is None else 0.8 * previous + 0.2 * per_token

    def report(self) -> dict[str, Any]:
        """The tier's counters (`SchedulerInfo`'s `kv_tier_*`)."""
        return {"kv_tier_blocks": len(self.store), "kv_tier_bytes": self.store.bytes,
                "kv_tier_saved_blocks": self.saved_blocks, "kv_tier_loaded_blocks": self.loaded_blocks,
                "kv_tier_loaded_bytes": self.loaded_bytes, "kv_tier_load_seconds": self.load_seconds,
                "kv_tier_corrupt_blocks": self.store.corrupt}

    @property
    def block_bytes(self) -> int:
        """The bytes of one block's payload: K (and V, unless the pool holds one latent) of every layer."""
        k, v = self.pool.k, self.pool.v
        layers, _, heads, dim = k.shape
        return layers * self.block * heads * dim * k.element_size() * (1 if v is k else 2)

    def payload(self, slots: torch.Tensor) -> bytes:
        """The K/V bytes of one block's `block` slots, as the store keeps them."""
        k, v = self.pool.k, self.pool.v
        keys = k[:, slots].cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return keys if v is k else keys + v[:, slots].cpu().contiguous().view(torch.uint8).numpy().tobytes()

    def _tensor(self, raw: bytes, like: torch.Tensor) -> torch.Tensor:
        layers, _, heads, dim = like.shape
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype)
        return flat.reshape(layers, self.block, heads, dim)

    def _check_pays(self, load_s_per_token: float) -> None:
        prefill = self._prefill_s_per_token
        if self.loading and prefill is not None and load_s_per_token > prefill:
            self.loading = False
            log_event(log, logging.WARNING, "the KV tier loads slower than prefill computes on this host: no "
                      "more loads", load_us_per_token=round(load_s_per_token * 1e6, 1),
                      prefill_us_per_token=round(prefill * 1e6, 1))


def make_tier(pool: Any, model: torch.nn.Module, config: Any) -> KVTier:
    """The tier `config` asks for (`--kv-tier-bytes`, `--kv-tier-dir`, `--kv-tier-write-through`) over `pool`,
    keyed by `model`'s weights, its quantization and the pool's layout."""
    from pathlib import Path

    from ringserve.bus.kv_blocks import BLOCK

    store = BlockStore(config.kv_tier_bytes, Path(config.kv_tier_dir) if config.kv_tier_dir else None)
    return KVTier(pool, store, BLOCK, namespace_of(pool, model), config.kv_tier_write_through)


def namespace_of(pool: Any, model: torch.nn.Module) -> str:
    """The tier namespace of `model`'s weights and kernels as they are now (see the module's docstring)."""
    from ringserve.actors.engine.quantization.quantize import quantization_report

    plan = sorted(quantization_report(model).items())
    layout = f"{tuple(pool.k.shape[:1] + pool.k.shape[2:])} {pool.k.dtype} latent={pool.v is pool.k} {plan}"
    return weights_fingerprint(model, layout)
