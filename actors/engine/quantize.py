"""Apply `--quantization` to a loaded model: none, int8, or auto (int8 only if it measures faster here)."""

from __future__ import annotations

import logging

from torch import nn

from actors.engine.config import EngineConfig
from kernels.quantization import int8_speedup, quantize_linears
from observability.logging import log_event

log = logging.getLogger("engine")
AUTO_MIN_SPEEDUP = 1.15  # int8 costs some quality; take it only for a clear win
AUTO_BATCHES = (1, 16)


def apply_quantization(model: nn.Module, config: EngineConfig) -> str:
    """Quantize `model` in place as `config` says; returns the method applied ("none" or "int8")."""
    method = config.quantization
    if method == "none":
        return "none"
    on_cpu = config.resolved_device() == "cpu" and config.resolved_dtype() == "float32"
    if method == "auto":
        if not on_cpu:
            return "none"
        shapes = sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)})
        speedups = [int8_speedup(shapes, batch=b) for b in AUTO_BATCHES]
        method = "int8" if min(speedups) >= AUTO_MIN_SPEEDUP else "none"
        log_event(log, logging.INFO, "quantization auto", chosen=method,
                  **{f"int8_speedup_batch{b}": round(s, 2) for b, s in zip(AUTO_BATCHES, speedups)})
        if method == "none":
            return "none"
    if not on_cpu:
        raise ValueError("--quantization int8 needs --device cpu and float32 weights")
    quantize_linears(model, method)
    return method
