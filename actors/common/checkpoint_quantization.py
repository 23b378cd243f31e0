"""What a checkpoint says of its own quantization (`quantization_config` in config.json), read without torch, so
the launcher refuses one we do not serve before any actor starts, in one line that names its method and what we
serve; and `--quantization` on top of a checkpoint that is already quantized, saying why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The methods whose codes the engine reads at load and keeps (actors/engine/models/weights.py).
SERVED_METHODS: tuple[str, ...] = ()


class UnservedQuantization(ValueError):
    """A checkpoint quantized in a way we do not serve, or a quantization flag it cannot take; says why."""


def checkpoint_quantization(directory: str | Path) -> dict[str, Any] | None:
    """The `quantization_config` of the model directory `directory`'s config.json; None when it has none (a
    float checkpoint) or no readable config.json."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return quantization if isinstance(quantization, dict) else None


def quant_method(quantization: dict[str, Any]) -> str:
    """The method a `quantization_config` names (`quant_method`, lower case; "unnamed" when it names none)."""
    return str(quantization.get("quant_method") or "unnamed").lower()


def check_checkpoint_quantization(directory: str | Path, requested: str) -> None:
    """Raise UnservedQuantization when the checkpoint in `directory` is quantized by a method we do not serve, or
    when `requested` (`--quantization`) would quantize a checkpoint that already is."""
    quantization = checkpoint_quantization(directory)
    if quantization is None:
        return
    method = quant_method(quantization)
    if method not in SERVED_METHODS:
        served = ", ".join(SERVED_METHODS) if SERVED_METHODS else "none yet"
        raise UnservedQuantization(
            f"{directory} is quantized by {method!r} (quantization_config.quant_method): not served; quantized "
            f"checkpoints served: {served}; serve the model's float checkpoint (--quantization int8/int4 "
            "quantizes it here)")
    if requested not in ("none",):
        raise UnservedQuantization(
            f"--quantization {requested} on {directory}, a checkpoint already quantized by {method!r}: its own codes "
            "are served as they are, never quantized again; leave --quantization out")
