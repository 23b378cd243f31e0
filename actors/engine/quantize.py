"""Apply `--quantization` to a loaded model: none, int8, or auto (int8 only if it measures faster here).

With int8, which kernel runs is measured per row count at start-up (`measure_kernel_plan`): a step size where
int8 is not faster on this CPU runs the float32 weights, so `--quantization int8` never makes a step slower.
"""

from __future__ import annotations

import logging

from torch import nn

from actors.engine.config import EngineConfig
from kernels.quantization import (
    Int8Linear, KernelPlan, int8_speedup, measure_kernel_plan, plan_buckets, quantize_linears,
)
from observability.logging import log_event

log = logging.getLogger("engine")
AUTO_MIN_SPEEDUP = 1.15  # int8 costs some quality; take it only for a clear win
AUTO_BATCHES = (1, 16)
PLAN_MAX_ROWS = 64  # row counts measured for the kernel plan; larger calls (prefill) follow the largest bucket


def quantization_report(model: nn.Module) -> dict[str, str]:
    """The kernel each step size's linears run, e.g. {"1-1 rows": "int8", "2-3 rows": "float32"}; {} unquantized."""
    layer = next((m for m in model.modules() if isinstance(m, Int8Linear)), None)
    if layer is None:
        return {}
    return plan_buckets(layer.plan) if layer.plan else {"any rows": "int8"}


def apply_quantization(model: nn.Module, config: EngineConfig) -> tuple[str, KernelPlan]:
    """Quantize `model` in place as `config` says; returns the method applied ("none" or "int8") and, for int8,
    the kernel chosen per row-count bucket."""
    method = config.quantization
    if method == "none":
        return "none", {}
    on_cpu = config.resolved_device() == "cpu" and config.resolved_dtype() == "float32"
    shapes = sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)})
    if method == "auto":
        if not on_cpu:
            return "none", {}
        speedups = [int8_speedup(shapes, batch=b) for b in AUTO_BATCHES]
        method = "int8" if min(speedups) >= AUTO_MIN_SPEEDUP else "none"
        log_event(log, logging.INFO, "quantization auto", chosen=method,
                  **{f"int8_speedup_batch{b}": round(s, 2) for b, s in zip(AUTO_BATCHES, speedups)})
        if method == "none":
            return "none", {}
    if not on_cpu:
        raise ValueError("--quantization int8 needs --device cpu and float32 weights")
    plan = measure_kernel_plan(shapes, PLAN_MAX_ROWS)
    log_event(log, logging.INFO, "int8 kernels per step size, as measured",
              choices=", ".join(f"{k}: {v}" for k, v in plan_buckets(plan).items()))
    quantize_linears(model, method, plan)
    return method, plan
