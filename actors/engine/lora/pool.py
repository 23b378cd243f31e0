"""The engine's adapters: registered names, an LRU of loaded adapters in host memory, and the per-step slots.

`LoraPool` wraps the model's adaptable linears (after quantization, so the base keeps its kernels) in
`LoraLinear`s sharing one `LoraState`. Registered adapters (name -> directory) are checked at registration and
kept loaded, up to `max_loaded` (0: no bound), least recently used first out (read again from disk when next
needed). Before each forward `prepare` gives every adapter of the step a slot (copying one in where it is not
there yet, into a slot no row of this step uses) and writes each token's slot. The scheduler admits at most
`slots` distinct adapters among the running requests, so a step's adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ringserve.actors.engine.lora.adapter import Adapter, load_adapter
from ringserve.actors.engine.lora.lora_linear import LoraLinear, LoraState, local_linear
from ringserve.actors.engine.models.adapter_names import ADAPTABLE, check_adaptable, fused_rows
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.bus.errors import ApiError
from ringserve.kernels.host_copy import host_to_device


class LoraPool:
    """Adapters by name, `slots` of rank up to `rank` per step, at most `max_loaded` held in host memory."""

    def __init__(self, model: CausalLM, slots: int, rank: int, max_loaded: int, max_tokens: int) -> None:
        check_adaptable(model)
        self.model, self.max_rank, self.max_loaded = model, rank, max_loaded
        self.device = model.model.embed_tokens.weight.device
        self.state = LoraState(slots, rank, max_tokens, model.dtype, self.device)
        self.linears: dict[tuple[int, str], LoraLinear] = {}
        for i, layer in enumerate(model.decoder_layers()):
            for path in ADAPTABLE:
                owner_name, _, leaf = path.partition(".")
                owner = getattr(layer, owner_name)
                base = local_linear(owner, leaf)
                holder, attr = (owner, leaf) if base is getattr(owner, leaf) else (getattr(owner, leaf), "linear")
                rows = fused_rows(owner, path) if leaf in ("qkv_proj", "gate_up_proj") else [base.out_features]
                wrapped = LoraLinear(base, rows, self.state)
                setattr(holder, attr, wrapped)
                self.linears[(i, path)] = wrapped
        self.paths: dict[str, str] = {}
        self.registrations: dict[str, int] = {}  # name -> times registered (a replaced adapter keys its KV apart)
        self.loaded: OrderedDict[str, Adapter] = OrderedDict()
        self.slot_names: list[str | None] = [None] * slots
        self.slot_used: list[int] = [0] * slots  # the step that last used each slot
        self.steps = 0
        self.step_names: list[str | None] = []  # the last step's adapter per row

    def read(self, name: str, path: str) -> Adapter:
        """The adapter at `path` for `name`, read and checked (AdapterError when it cannot be served); changes
        nothing, so it may run beside the steps."""
        return load_adapter(name, path, self.model, self.max_rank)

    def register(self, name: str, path: str, adapter: Adapter | None = None) -> Adapter:
        """Serve the adapter at `path` (read now unless `adapter` is what `read` gave) under `name`, replacing
        one of that name; AdapterError when it cannot be served, leaving what was registered as it was."""
        adapter = self.read(name, path) if adapter is None else adapter
        self.unregister(name)
        self.paths[name] = path
        self.registrations[name] = self.registrations.get(name, 0) + 1
        self._keep(adapter)
        return adapter

    def cache_name(self, name: str) -> str:
        """The name `name`'s KV is cached under (prefix cache, KV tier): the name itself for its first
        registration (what the router hashes by), then `name#n`, so KV computed under an adapter since replaced
        or unloaded and loaded again is never reused for the new one."""
        n = self.registrations.get(name, 1)
        return name if n <= 1 else f"{name}#{n}"

    def versions(self, names: list[str | None]) -> dict[str, list]:
        """`[path, times registered]` of each adapter `names` holds: what a tensor-parallel follower's pool
        needs to serve a step of rank 0's (`sync`)."""
        return {n: [self.paths[n], self.registrations[n]] for n in dict.fromkeys(names) if n is not None}

    def sync(self, versions: dict[str, list]) -> None:
        """Register what rank 0's `versions` names and this pool lacks or holds in another version (a
        follower sees no load or unload command: only the steps that use adapters)."""
        for name, (path, registered) in versions.items():
            if self.paths.get(name) != path or self.registrations.get(name) != registered:
                self.register(name, path)
                self.registrations[name] = registered

    def unregister(self, name: str) -> bool:
        """Forget `name` (its slot freed); False if it was not registered."""
        self.loaded.pop(name, None)
        if name in self.slot_names:
            self.slot_names[self.slot_names.index(name)] = None
        return self.paths.pop(name, None) is not None

    def adapter(self, name: str) -> Adapter:
        """The registered adapter `name`, read again from disk when the LRU let it go."""
        adapter = self.loaded.get(name)
        if adapter is None:
            adapter = load_adapter(name, self.paths[name], self.model, self.max_rank)
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: Adapter) -> None:
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        while self.max_loaded and len(self.loaded) > self.max_loaded:
            self.loaded.popitem(last=False)

    def prepare(self, names: list[str | None], tokens: list[int]) -> None:
        """Slots for the adapters of a step whose rows name `names` (None: the base model) and compute
        `tokens` tokens each, and each token's slot (-1: the base model) written in place."""
        self.steps += 1
        self.step_names = list(names)  # what a tensor-parallel rank 0 tells its followers
        needed = list(dict.fromkeys(n for n in names if n is not None))
        assert len(needed) <= len(self.slot_names), "the scheduler admits at most --max-loras-per-batch adapters"
        for name in needed:
            if name not in self.slot_names:
                free = [s for s, n in enumerate(self.slot_names) if n not in needed]
                slot = min(free, key=lambda s: (self.slot_names[s] is not None, self.slot_used[s], s))
                self._copy_in(slot, self.adapter(name))
            self.slot_used[self.slot_names.index(name)] = self.steps
        slot_of = [-1 if n is None else self.slot_names.index(n) for n in names]
        per_token = torch.tensor(slot_of, dtype=torch.int64).repeat_interleave(torch.tensor(tokens))
        t, ids = per_token.numel(), self.state.slot_ids
        if t > ids.shape[0]:  # an eager step larger than planned for: grow (graphs never are)
            ids = self.state.slot_ids = torch.full((t,), -1, dtype=torch.int64, device=self.device)
        ids[:t] = host_to_device(per_token, self.device)
        ids[t:] = -1  # the rows a graph pads its batch with compute nothing
        if not self.state.fixed:
            self.state.active = max(slot_of, default=-1) + 1

    def _copy_in(self, slot: int, adapter: Adapter) -> None:
        for key, linear in self.linears.items():
            linear.set_slot(slot, adapter.weights.get(key, {}))
        self.slot_names[slot] = adapter.name


def lora_not_found(name: str, known: list[str]) -> ApiError:
    """OpenAI's 404 for an adapter this engine does not hold (the shape /v1/models uses for a model)."""
    return ApiError(f"the LoRA adapter {name!r} is not loaded; loaded are {known}", 404, "lora_name",
                    "model_not_found")
