"""`BlockStore`: whole KV blocks by key, bounded in bytes, least recently used out; in host memory, or in files
under a directory (which a restarted replica reads again).

A block is stored as one record: a 16-byte blake2b checksum of the payload, then the payload (the block's K and
V bytes as the pool holds them). A record whose checksum does not match (a truncated or corrupted file) is
dropped and reported as a miss, so its tokens are computed instead. A record is written to a temporary file and
renamed into place, so a process killed while writing loses only that record. Each file's mtime is set from a
strictly increasing clock: a restarted store drops the least recently used files first, as this one would.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

CHECKSUM_BYTES = 16
SUFFIX = ".kv"
log = logging.getLogger("engine.kv_tier")
STALE_TMP_SECONDS = 60.0  # a half-written record older than this was left by a process that died writing it


def _checksum(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).digest()


class BlockStore:
    """Blocks by `key` (hex text), at most `max_bytes` in all; in memory, or as files in `directory`."""

    def __init__(self, max_bytes: int, directory: Path | None = None) -> None:
        self.max_bytes = max_bytes
        self.directory = directory
        self.bytes = 0
        self.corrupt = 0  # records dropped for a bad checksum
        self.write_errors = 0  # records not written (the first is logged)
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> record bytes, least recently used first
        self._memory: dict[str, bytes] = {}
        self._last_stamp = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            for tmp in directory.glob(".*.tmp"):  # another live replica may be writing a fresh one
                try:
                    if time.time() - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                        tmp.unlink()
                except OSError:
                    pass
            files = sorted(directory.glob("*" + SUFFIX), key=lambda f: f.stat().st_mtime_ns)
            for file in files:  # what an earlier process left: oldest first out
                self._sizes[file.stem] = file.stat().st_size
                self.bytes += file.stat().st_size
            self._trim()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def put(self, key: str, payload: bytes) -> bool:
        """Keep `payload` under `key` (replacing it), then drop the least recently used past the bound; whether
        it was kept (not when larger than the bound, or when the disk refused it)."""
        record = _checksum(payload) + payload
        if len(record) > self.max_bytes:
            return False
        self._forget(key)
        if self.directory is None:
            self._memory[key] = record
        else:
            tmp = self.directory / f".{key}.tmp"
            try:
                tmp.write_bytes(record)
                os.replace(tmp, self._path(key))  # a reader never sees half a record
            except OSError as exc:  # a full or failing disk: the block is computed when next needed
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                if not self.write_errors:
                    log.warning("the KV tier could not write a block to %s: %s", self.directory, exc)
                self.write_errors += 1
                return False
            self._stamp(key)
        self._sizes[key] = len(record)
        self.bytes += len(record)
        self._trim()
        return True

    def touch(self, keys: Iterable[str]) -> None:
        """Make each of `keys` the most recently used, in order (the last one is the last out)."""
        for key in keys:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                if self.directory is not None:
                    self._stamp(key)

    def get(self, key: str) -> bytes | None:
        """The payload under `key`, or None (absent, or dropped now for a bad checksum)."""
        if key not in self._sizes:
            return None
        try:
            record = self._memory[key] if self.directory is None else self._path(key).read_bytes()
        except OSError:
            record = b""
        payload = record[CHECKSUM_BYTES:]
        if len(record) < CHECKSUM_BYTES or _checksum(payload) != record[:CHECKSUM_BYTES]:
            self.corrupt += 1
            self._forget(key)
            return None
        self.touch([key])
        return payload

    def _stamp(self, key: str) -> None:
        """Set the file's mtime later than every one set before (the file system's own clock is coarse)."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        try:
            os.utime(self._path(key), ns=(self._last_stamp, self._last_stamp))
        except OSError:
            pass

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / (key + SUFFIX)

    def _forget(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        self.bytes -= size
        if self.directory is None:
            self._memory.pop(key, None)
        else:
            self._path(key).unlink(missing_ok=True)

    def _trim(self) -> None:
        while self.bytes > self.max_bytes and self._sizes:
            self._forget(next(iter(self._sizes)))
