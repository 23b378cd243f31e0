"""Timing the candidate kernels side by side on a model's linear shapes at the row counts the server runs, and
the plan each timing gives (read from the disk cache, kernels/linear_plan/cache.py, when this host measured
the same before).

Quantized kernels are timed through a `QuantLinear` holding every candidate's weights, on one weight (the
group kernels' packed weights are a quarter to an eighth of float32's, so mostly cache-resident, as in a step
of a small model). Float32 kernels are timed each call on another copy of the weight, so that they stream
from memory as a step's calls do (`STREAM_BYTES`); `bf16` on bfloat16 copies of the same weights.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.host import time_interleaved
from ringserve.kernels.float_linear import BF16, bf16_linear, onednn_linear
from ringserve.kernels.linear_plan import cache
from ringserve.kernels.linear_plan.candidates import (
    GEMV_MAX_ROWS, candidates, choose_float_kernel, choose_kernel, float_candidates,
)
from ringserve.kernels.linear_plan.plan import Measured, Times, plan_from_times
from ringserve.kernels.quantization import QuantLinear

ShapeRows = dict[tuple[int, int], list[int]]  # (out, in) -> row counts to time
STREAM_BYTES = 96 << 20  # float32 weight copies cycled through while timing: more than a CPU's caches hold
F32_GEMV_SOURCE = Path(__file__).resolve().parent.parent / "cpu" / "f32_gemv.cpp"


def _shapes_key(shape_rows: ShapeRows) -> list[list[Any]]:
    return sorted([list(s), sorted(r)] for s, r in shape_rows.items())


def _measure(kind: str, key: dict[str, Any], measure: Callable[[], Times], choose: Callable[[dict[str, float]], str],
             order: tuple[str, ...], use_cache: bool) -> Measured:
    """The times under `key` (cached, or `measure()`d and stored) and the plan `choose` makes of them."""
    start = time.perf_counter()
    times, cached = cache.measured_times(cache.host_key(key), measure, use_cache)
    return Measured(kind, plan_from_times(times, choose), times, cached, order, time.perf_counter() - start)


def measure_quantized(shape_rows: ShapeRows, method: str = "int8", rounds: int = 5,
                      use_cache: bool = True) -> Measured:
    """Time every candidate kernel of `method` (or GGUF block format) on each shape (out, in) at each of its row
    counts, here; the plan keeps per bucket the fastest not slower than float32 (`choose_kernel`)."""
    order = candidates(method)

    def measure() -> Times:
        times = {}
        for (n, k), row_counts in shape_rows.items():
            layer = QuantLinear(nn.Linear(k, n, bias=False), method, hold=order)
            for rows in sorted(set(row_counts)):
                x = torch.randn(rows, k)
                fns = {kernel: (lambda kernel=kernel: layer.run(x, kernel)) for kernel in order}
                times[f"{n},{k},{rows}"] = time_interleaved(fns, rounds)
        return times

    key = {"method": method, "candidates": list(order), "shapes": _shapes_key(shape_rows)}
    return _measure(method, key, measure, lambda measured: choose_kernel(measured, order), order, use_cache)


def _time_float_shape(n: int, k: int, row_counts: list[int], rounds: int, bf16: bool) -> Times:
    """Seconds per call of each float32 kernel (and with `bf16` the bfloat16 one) on an `[n, k]` weight at each
    row count, the weights streaming."""
    copies = [torch.randn(n, k) for _ in range(max(1, -(-STREAM_BYTES // (n * k * 4))))]
    halves = [c.to(BF16) for c in copies] if bf16 else []
    turn = [0]

    def next_weight(bank: list[torch.Tensor]) -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(bank)
        return bank[turn[0]]

    gemv = cpu_kernels.f32_linear()
    run = {"float32": lambda x: F.linear(x, next_weight(copies)),
           "f32_gemv": lambda x: gemv(x, next_weight(copies), None),
           "onednn": lambda x: onednn_linear(x, next_weight(copies), None),
           "bf16": lambda x: bf16_linear(x, next_weight(halves), None)}
    times = {}
    for rows in sorted(set(row_counts)):
        x = torch.randn(rows, k)
        times[f"{n},{k},{rows}"] = time_interleaved(
            {kernel: (lambda kernel=kernel: run[kernel](x)) for kernel in float_candidates(rows, bf16)}, rounds)
    return times


def measure_float(shape_rows: ShapeRows, rounds: int = 5, use_cache: bool = True, bf16: bool = False) -> Measured:
    """Per float32 linear shape (out, in), the kernel of each row-count bucket, from timing the float32
    candidates at each of its row counts here (`choose_float_kernel`); `bf16`: a bfloat16 checkpoint's layers,
    which may also run the `bf16` kernel."""
    def measure() -> Times:
        times = {}
        for (n, k), row_counts in shape_rows.items():
            times.update(_time_float_shape(n, k, row_counts, rounds, bf16))
        return times

    few, many = float_candidates(1, bf16), float_candidates(GEMV_MAX_ROWS + 1, bf16)
    key = {"float32": cache.source_digest(F32_GEMV_SOURCE), "candidates": [list(few), list(many)],
           "shapes": _shapes_key(shape_rows)}
    return _measure("float32", key, measure, choose_float_kernel, tuple(dict.fromkeys(few + many)), use_cache)
