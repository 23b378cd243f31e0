"""ringserve from Python: `Engine` runs a ring for offline batches (SGLang's `Engine`, vLLM's `LLM`), `Client` talks
to a running one over NATS, and the results have `/generate`'s shape.

    import ringserve

    with ringserve.Engine() as engine:  # the packaged SmolLM2-135M-Instruct; any `ringserve serve` flag works
        results = engine.generate(["The capital of France is", "1, 2, 3,"], {"max_new_tokens": 16, "temperature": 0})
        print([r.text for r in results])

Importing this package is cheap (no torch, no NATS connection): the names below load on first use. See
docs/python.md.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# `ringserve.actors`, `.bus`, `.kernels` and `.observability` are the repository's top-level folders. A wheel
# installs them inside this package (setup.py's package_dir); in a source checkout (an editable install, the
# tests, `python -m ringserve.actors.<role>`) they are found beside this folder. They have no __init__.py, so a
# top-level `import kernels` (Hugging Face's package, which transformers imports) never finds ours, even with
# the checkout on sys.path (docs/development.md, "One import name").
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "actors" / "launcher").is_dir() and (_CHECKOUT / "bus" / "subjects.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821  (this package's own search path)

if TYPE_CHECKING:
    from ringserve.bus.errors import ApiError
    from ringserve.client import Client
    from ringserve.engine import Engine
    from ringserve.results import ChatResult, GenerateDelta, GenerateResult

__all__ = ["ApiError", "ChatResult", "Client", "Engine", "GenerateDelta", "GenerateResult"]
_WHERE = {"ApiError": "ringserve.bus.errors", "ChatResult": "ringserve.results", "Client": "ringserve.client",
          "Engine": "ringserve.engine", "GenerateDelta": "ringserve.results", "GenerateResult": "ringserve.results"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ringserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
