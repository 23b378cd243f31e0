"""The engine's LoRA side as the scheduler drives it: adapters loaded at start, read beside the steps, served,
unloaded (`EngineCore.adapters`; the pool and the per-step slots are `pool.py`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.lora.adapter import Adapter, AdapterError
from ringserve.actors.engine.lora.pool import LoraPool, lora_not_found
from ringserve.bus.errors import ApiError


class LoraServing:
    """The adapters a `LoraPool` serves, checked against the live requests that use them."""

    def __init__(self, pool: LoraPool | None, lora_dir: str, live: Mapping[str, Req]) -> None:
        """`pool`: None without LoRA; `lora_dir`: where `load` may read adapters from (`--lora-dir`, "" for
        anywhere); `live`: the engine's live requests by rid."""
        self.pool, self.lora_dir, self.live = pool, lora_dir, live

    def start(self, graphs: bool, modules: Mapping[str, str]) -> None:
        """Fix the slots' shapes when decode `graphs` run and register `modules` (`--lora-modules`: name -> path).
        (No decode layer runs the fused CPU op, which knows no adapters: the execution plan keeps it off.)"""
        assert self.pool is not None
        self.pool.state.fixed = graphs  # graphs keep every slot's shapes
        for name, path in modules.items():
            self.pool.register(name, path)

    def read(self, name: str, path: str) -> Adapter | ApiError:
        """The adapter at `path` for `name`, read and checked, or why not; serves nothing yet and changes no
        state, so it may run on another thread while steps run (the scheduler reads there: a load never holds
        the steps for as long as the disk takes)."""
        if self.pool is None:
            return ApiError("this server serves no LoRA adapters (start it with --enable-lora)", param="lora_name")
        if not name:
            return ApiError("lora_name must not be empty", param="lora_name")
        root = self.lora_dir
        if root and not Path(path).resolve().is_relative_to(Path(root).resolve()):
            return ApiError(f"lora_path {path!r} is outside --lora-dir {root!r}", param="lora_path")
        try:
            return self.pool.read(name, path)
        except AdapterError as e:
            return ApiError(str(e), param="lora_path")

    def load(self, name: str, path: str, adapter: Adapter | ApiError | None = None) -> ApiError | None:
        """Register the adapter at `path` as `name` (replacing one of that name), or say why not; `adapter`:
        what `read` gave for them already."""
        adapter = self.read(name, path) if adapter is None else adapter
        if isinstance(adapter, ApiError):
            return adapter
        error = self._in_use(name)
        if error is not None:
            return error
        assert self.pool is not None
        self.pool.register(name, path, adapter)
        return None

    def unload(self, name: str) -> ApiError | None:
        """Forget the adapter `name`, or say why not (unknown, or requests still use it)."""
        if self.pool is None or name not in self.pool.paths:
            return lora_not_found(name, self.names())
        error = self._in_use(name)
        if error is not None:
            return error
        self.pool.unregister(name)
        return None

    def request_error(self, name: str | None) -> ApiError | None:
        """Why a request for the adapter `name` cannot run (not served: 404; unreadable now: 400), or None
        (also for no adapter). The adapter is read again from disk here if the LRU let it go."""
        if name is None:
            return None
        if self.pool is None or name not in self.pool.paths:
            return lora_not_found(name, self.names())
        try:
            self.pool.adapter(name)
        except AdapterError as e:
            return ApiError(str(e), param="lora_name")
        return None

    def cache_name(self, name: str | None) -> str | None:
        """The name the adapter `name`'s KV is cached under (`LoraPool.cache_name`); None for the base model."""
        return self.pool.cache_name(name) if name is not None and self.pool is not None else None

    def _in_use(self, name: str) -> ApiError | None:
        """A 409 while live requests run with the adapter `name` (replacing or dropping it would change them)."""
        users = sum(r.params.lora_name == name for r in self.live.values())
        if users:
            return ApiError(f"LoRA adapter {name!r} is in use by {users} request(s); retry when they finish",
                            409, "lora_name")
        return None

    def names(self) -> list[str]:
        """The registered adapters' names."""
        return sorted(self.pool.paths) if self.pool is not None else []
