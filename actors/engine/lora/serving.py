"""The engine's LoRA side as the scheduler drives it: adapters loaded at start, read beside the steps, served,
unloaded (`EngineCore` takes these methods; the pool and the per-step slots are `pool.py`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringserve.actors.engine.lora.adapter import Adapter, AdapterError
from ringserve.actors.engine.lora.pool import LoraPool, lora_not_found
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.bus.errors import ApiError


class LoraServing:
    """`EngineCore`'s adapter methods; it sets `lora` (a `LoraPool`, None without LoRA), `config`, `runner`,
    `prefill`, `decode` and `live`."""

    lora: LoraPool | None
    config: Any
    runner: Any
    prefill: Any
    decode: Any
    live: dict[str, Any]

    def _start_lora(self, model: CausalLM) -> None:
        """Bound the running adapters, keep decode layers off the fused CPU op (it knows no adapters) and load
        `--lora-modules`."""
        assert self.lora is not None
        self.lora.state.fixed = self.runner.graphs is not None  # graphs keep every slot's shapes
        for layer in model.decoder_layers():
            layer.fused_decode = False
        self.prefill.adapter_limit = self.config.max_loras_per_batch
        self.prefill.running_adapters = lambda: {r.params.lora_name for r in self.decode.running}
        for name, path in self.config.lora_module_map().items():
            self.lora.register(name, path)

    def read_lora(self, name: str, path: str) -> Adapter | ApiError:
        """The adapter at `path` for `name`, read and checked, or why not; serves nothing yet and changes no
        state, so it may run on another thread while steps run (the scheduler reads there: a load never holds
        the steps for as long as the disk takes)."""
        if self.lora is None:
            return ApiError("this server serves no LoRA adapters (start it with --enable-lora)", param="lora_name")
        if not name:
            return ApiError("lora_name must not be empty", param="lora_name")
        root = self.config.lora_dir
        if root and not Path(path).resolve().is_relative_to(Path(root).resolve()):
            return ApiError(f"lora_path {path!r} is outside --lora-dir {root!r}", param="lora_path")
        try:
            return self.lora.read(name, path)
        except AdapterError as e:
            return ApiError(str(e), param="lora_path")

    def load_lora(self, name: str, path: str, adapter: Adapter | ApiError | None = None) -> ApiError | None:
        """Register the adapter at `path` as `name` (replacing one of that name), or say why not; `adapter`:
        what `read_lora` gave for them already."""
        adapter = self.read_lora(name, path) if adapter is None else adapter
        if isinstance(adapter, ApiError):
            return adapter
        error = self._lora_in_use(name)
        if error is not None:
            return error
        assert self.lora is not None
        self.lora.register(name, path, adapter)
        return None

    def unload_lora(self, name: str) -> ApiError | None:
        """Forget the adapter `name`, or say why not (unknown, or requests still use it)."""
        if self.lora is None or name not in self.lora.paths:
            return lora_not_found(name, self.lora_names())
        error = self._lora_in_use(name)
        if error is not None:
            return error
        self.lora.unregister(name)
        return None

    def _adapter_error(self, name: str | None) -> ApiError | None:
        """Why a request for the adapter `name` cannot run (not served: 404; unreadable now: 400), or None
        (also for no adapter). The adapter is read again from disk here if the LRU let it go."""
        if name is None:
            return None
        if self.lora is None or name not in self.lora.paths:
            return lora_not_found(name, self.lora_names())
        try:
            self.lora.adapter(name)
        except AdapterError as e:
            return ApiError(str(e), param="lora_name")
        return None

    def lora_cache_name(self, name: str | None) -> str | None:
        """The name the adapter `name`'s KV is cached under (`LoraPool.cache_name`); None for the base model."""
        return self.lora.cache_name(name) if name is not None and self.lora is not None else None

    def _lora_in_use(self, name: str) -> ApiError | None:
        """A 409 while live requests run with the adapter `name` (replacing or dropping it would change them)."""
        users = sum(r.params.lora_name == name for r in self.live.values())
        if users:
            return ApiError(f"LoRA adapter {name!r} is in use by {users} request(s); retry when they finish",
                            409, "lora_name")
        return None

    def lora_names(self) -> list[str]:
        """The registered adapters' names."""
        return sorted(self.lora.paths) if self.lora is not None else []
