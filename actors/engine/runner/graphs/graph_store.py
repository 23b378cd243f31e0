"""Compiled decode graphs kept on disk, so that a restart loads each in about three seconds instead of tracing it.

Even when Inductor's caches hit, `torch.compile` traces the model's Python with Dynamo again on every start:
20-35 s per graph on a 2-core host (57% of it tracing), during which steps run eagerly. A graph compiled with
Dynamo's ahead-of-time entry point (`torch.compile(...).aot_compile`) is a self-contained function, its guards
and Inductor's output bundled, that can be written to a file and loaded again without tracing (the C++ kernels
it calls still come from Inductor's cache, so a load after that cache was cleared compiles them again).

A file is named by everything the graph was compiled from (`GraphStore.identity`): the graph key (batch size,
torch threads), torch and Python versions, the CPU model and ISA flags, the source of the engine and kernels
packages, the model's configuration, the shapes, strides and dtypes of the module's parameters and buffers and
of the inputs, every submodule's plain attributes (a quantized layer's kernel plan, the attention backend's
settings) and the compile options. A change to any is another
file, never a stale graph. What the name cannot see the graph's own guards check when it is loaded (tensor
shapes, dtypes, torch's global state such as the thread count): a file whose guards fail, or that does not
load, is compiled again and replaced. Loading unpickles the file, as Inductor does with its own cache: the
directory (`$RINGSERVE_CACHE/decode_graphs`) must be as trusted as the code. The `MAX_FILES` most recently used
graphs are kept. `RINGSERVE_GRAPH_STORE=0` neither reads nor writes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ringserve.kernels.cpu import cache_dir
from ringserve.kernels.cpu.host import cpu_info
from ringserve.observability.logging import log_event

log = logging.getLogger("engine.graphs")

STORE_VERSION = 1  # bump when what a file holds, or how it is keyed, changes
MAX_FILES = 64  # graphs kept (~3 MB each): the least recently used beyond these are deleted when one is saved
_PACKAGES = ("actors/engine", "kernels")  # the code a decode graph is traced from
_ROOT = Path(__file__).resolve().parents[4]  # the folder holding actors/ and kernels/ (a checkout, or ringserve/ in a wheel)


def enabled() -> bool:
    """Whether compiled graphs are read from and written to disk (`RINGSERVE_GRAPH_STORE`, default on)."""
    return os.environ.get("RINGSERVE_GRAPH_STORE", "1") != "0"


def source_digest() -> str:
    """A digest of the engine's and kernels' source files (Python and C++), which the graphs are traced from."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*")):
            if path.suffix in (".py", ".cpp") and path.is_file():
                digest.update(str(path.relative_to(_ROOT)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def _tensor_layout(t: torch.Tensor) -> list[Any]:
    return [str(t.dtype), list(t.shape), list(t.stride()), t.device.type]


def _value_layout(value: Any, depth: int = 0) -> Any:
    """What of a value a graph depends on: a tensor's layout, a plain value itself, a dataclass, container or
    plain object (an attention backend) field by field, down to a few levels (deeper objects by type name:
    their state is the code's, under `source_digest`)."""
    if isinstance(value, torch.Tensor):
        return _tensor_layout(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 3:
        return type(value).__name__
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _value_layout(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_value_layout(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _value_layout(v, depth + 1) for k, v in value.items()}
    if depth <= 1 and hasattr(value, "__dict__") and not callable(value):
        return {"type": type(value).__name__,
                **{name: _value_layout(v, depth + 1) for name, v in sorted(vars(value).items())}}
    return type(value).__name__


class GraphStore:
    """Compiled graphs of one module (`save`/`load` by graph key) in `directory`; see the module docstring."""

    def __init__(self, module: torch.nn.Module, options: dict[str, Any], directory: Path | None = None) -> None:
        self.module = module
        self.directory = directory or cache_dir() / "decode_graphs"
        self._base = self._base_identity(module, options)

    @staticmethod
    def _base_identity(module: torch.nn.Module, options: dict[str, Any]) -> dict[str, Any]:
        cpu = cpu_info()
        config = getattr(getattr(module, "model", module), "config", None)
        # every module's own plain attributes: what Dynamo baked in without a guard that survives storing (a
        # quantized layer's kernel plan, its packed weights' layouts, a backend's settings)
        modules = {name: {attr: _value_layout(value) for attr, value in sorted(vars(m).items())
                          if not attr.startswith("_") and not isinstance(value, torch.nn.Module)}
                   for name, m in module.named_modules()}
        return {
            "version": STORE_VERSION, "torch": torch.__version__, "python": platform.python_version(),
            "cpu": cpu["model"], "flags": sorted(cpu["flags"].split()), "source": source_digest(),
            "module": type(module).__qualname__,
            "config": repr(config.to_dict() if hasattr(config, "to_dict") else config),
            "tensors": {name: _tensor_layout(t) for name, t in
                        [*module.named_parameters(), *module.named_buffers()]},
            "modules": modules,
            "options": {k: getattr(v, "__qualname__", repr(v)) for k, v in sorted(options.items())},
        }

    def identity(self, key: tuple[int, int], inputs: tuple[Any, ...]) -> str:
        """The file name of graph `key` compiled on `inputs`: a digest of everything it was compiled from."""
        full = {**self._base, "key": list(key), "inputs": _value_layout(list(inputs))}
        return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def path(self, key: tuple[int, int], inputs: tuple[Any, ...]) -> Path:
        """Where graph `key` compiled on `inputs` is kept."""
        return self.directory / f"{self.identity(key, inputs)}.graph"

    def load(self, key: tuple[int, int], inputs: tuple[Any, ...]) -> Any | None:
        """The stored graph `key`, if there is one whose guards pass on `inputs` (None otherwise: compile it)."""
        path = self.path(key, inputs)
        if not enabled() or not path.exists():
            return None
        try:
            with path.open("rb") as f:
                graph = torch.compiler.load_compiled_function(f, external_data={"module": self.module})
            if not graph.guard_check(self.module, *inputs):
                raise ValueError("its guards fail on this engine's inputs")
            os.utime(path)  # recently used: kept by `prune`
        except Exception as exc:  # any unusable file is compiled again and replaced
            log_event(log, logging.WARNING, "stored decode graph not used; compiling it again", path=str(path),
                      error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        return graph

    def save(self, key: tuple[int, int], inputs: tuple[Any, ...], graph: Any) -> None:
        """Keep `graph` (an `aot_compile` result for `key` on `inputs`); a failure to write is logged only."""
        if not enabled():
            return
        path = self.path(key, inputs)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path), external_data={"module": self.module})
            prune(self.directory)
        except Exception as exc:
            log_event(log, logging.WARNING, "could not store a compiled decode graph", path=str(path),
                      error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def prune(directory: Path, keep: int = MAX_FILES) -> None:
    """Delete all but the `keep` most recently used graphs in `directory` (every code or model change names
    new files, so old ones would pile up)."""
    files = sorted(directory.glob("*.graph"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[keep:]:
        old.unlink(missing_ok=True)
