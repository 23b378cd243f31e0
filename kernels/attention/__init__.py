"""Attention backends over the paged KV pool, created by name (`--attention-backend`).

`torch` is always there. `triton` is registered when the `triton` package is installed and `flashinfer` when
`flashinfer` is; their modules are imported only when such a backend is created, so importing ringserve never
needs either package. The names need no torch: the backends themselves (and torch) are imported at first use,
so the launcher can check `--attention-backend` without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ringserve.kernels.attention.backend import AttentionBackend, AttentionMetadata, ForwardInfo, LayerAttention
    from ringserve.kernels.attention.torch_paged import TorchPagedBackend

_EXPORTED = {"AttentionBackend": "ringserve.kernels.attention.backend", "AttentionMetadata": "ringserve.kernels.attention.backend",
             "ForwardInfo": "ringserve.kernels.attention.backend", "LayerAttention": "ringserve.kernels.attention.backend",
             "TorchPagedBackend": "ringserve.kernels.attention.torch_paged"}

# name -> (module, class), imported on first use; `requires` names the package that must be importable
_LAZY: dict[str, tuple[str, str, str]] = {
    "triton": ("ringserve.kernels.attention.triton_backend", "TritonBackend", "triton"),
    "flashinfer": ("ringserve.kernels.attention.flashinfer_backend", "FlashInferBackend", "flashinfer"),
}


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def known_backend_names() -> tuple[str, ...]:
    """Every backend name ringserve has, installed here or not (for docs that must not depend on the machine)."""
    return ("torch", *_LAZY)


def backend_names() -> tuple[str, ...]:
    """Names `create_backend` accepts: `torch`, plus `triton`/`flashinfer` when their packages are installed."""
    return ("torch",) + tuple(name for name, (_, _, package) in _LAZY.items() if _installed(package))


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as `name`; ValueError names the choices otherwise."""
    if name == "torch":
        from ringserve.kernels.attention.torch_paged import TorchPagedBackend

        return TorchPagedBackend
    if name not in backend_names():
        hint = f" (the {name!r} backend needs the {_LAZY[name][2]!r} package)" if name in _LAZY else ""
        raise ValueError(f"unknown attention backend {name!r}{hint}; choose one of {list(backend_names())}")
    module, cls, _ = _LAZY[name]
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int,
                   layers: Sequence[LayerAttention] | None = None) -> AttentionBackend:
    """The backend registered as `name`, over the given pools, each layer attending as `layers` says (default:
    plain causal attention); ValueError names the choices otherwise."""
    return backend_class(name)(k_pool, v_pool, num_heads, layers)


def __getattr__(name: str) -> Any:
    """The backend classes, imported (with torch) when first named."""
    if name in _EXPORTED:
        return getattr(importlib.import_module(_EXPORTED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardInfo", "LayerAttention", "TorchPagedBackend", "backend_class",
           "backend_names", "create_backend"]
