"""Apply `--quantization` to a loaded model: none, int8, int4, gguf (the GGUF file's own blocks), or auto (int8
only if it measures faster here).

For int8 and int4, which kernel each linear shape runs is measured per row-count bucket at start-up
(`measure_kernel_plan`, cached on disk per host) at the row counts the server runs: decode batches
1, 2, 4, … 64 and prefill chunks up to `--chunked-prefill-size` (the LM head, which sees one row per request,
up to 64). A bucket where no quantized kernel is faster on this CPU runs the float32 weights, so
`--quantization` never makes a step slower. Unquantized on the CPU, each linear shape runs, per row-count
bucket of the same ladder, the float32 kernel measured fastest: torch's, our GEMV at 1-3 rows, or oneDNN's
(kernels/float_linear.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.common.model_source import ModelSource
from ringserve.actors.engine.config import EngineConfig
from ringserve.kernels.cpu.packing import PackedWeight
from ringserve.kernels.float_linear import float_candidates, float_report, measure_float_plan, onednn_available, use_float_plan
from ringserve.kernels.linear_plan import KernelPlan, plan_report
from ringserve.kernels.quantization import (
    QuantLinear, layer_method, linear_shapes, measure_kernel_plan, quantize_linears, speedup,
)
from ringserve.observability.logging import log_event

log = logging.getLogger("engine")
AUTO_MIN_SPEEDUP = 1.15  # int8 costs some quality; take it only for a clear win
AUTO_BATCHES = (1, 16)
DECODE_MAX_ROWS = 64  # decode batch sizes measured (powers of two up to this)
PREFILL_MAX_ROWS = 1024  # prefill rows measured at most; larger calls follow the largest bucket
HEAD_MAX_ROWS = 64  # the LM head runs one row per request: measuring it at prefill sizes would cost seconds


def head_shape(model: nn.Module) -> tuple[int, int] | None:
    """The LM head's (out, in), if the model has one as `lm_head`."""
    head = getattr(model, "lm_head", None)
    return (head.out_features, head.in_features) if isinstance(head, nn.Linear) else None


def plan_rows(model: nn.Module, config: EngineConfig) -> dict[tuple[int, int], list[int]]:
    """Row counts to measure per linear shape (out, in): powers of two up to the largest of the decode sizes
    and the prefill chunk; the LM head's up to `HEAD_MAX_ROWS`."""
    chunk = config.chunked_prefill_size if config.chunking else config.max_prefill_tokens
    top = min(max(DECODE_MAX_ROWS, chunk), PREFILL_MAX_ROWS)
    ladder = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    if ladder[-1] < top:  # a chunk that is no power of two: measure its bucket at the next one
        ladder.append(ladder[-1] * 2)
    head = head_shape(model)
    return {shape: [r for r in ladder if r <= HEAD_MAX_ROWS] if shape == head else ladder
            for shape in linear_shapes(model)}


def measure_plan(model: nn.Module, config: EngineConfig, method: str) -> tuple[KernelPlan, dict[str, Any]]:
    """The model's kernel plan for `method`, measured (or read from the cache); with int4 the LM head's shape
    is measured among int8's kernels (`layer_method`), unless another layer shares its shape."""
    rows = plan_rows(model, config)
    head = head_shape(model)
    shapes = [(m.out_features, m.in_features) for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and layer_method(n, method) == method]
    as_head = {s: r for s, r in rows.items() if s == head and s not in shapes and method != "int8"}
    plan, measured = measure_kernel_plan({s: r for s, r in rows.items() if s not in as_head}, method)
    if as_head:
        head_plan, head_measured = measure_kernel_plan(as_head, "int8")
        plan.update(head_plan)
        measured = {**measured, "times": {**measured["times"], **head_measured["times"]},
                    "cached": measured["cached"] and head_measured["cached"]}
    return plan, measured


def model_plan(model: nn.Module) -> KernelPlan:
    """The kernel plan the model's quantized layers follow, per shape (empty when unquantized)."""
    return {(m.out_features, m.in_features): m.plan for m in model.modules() if isinstance(m, QuantLinear)}


def quantization_report(model: nn.Module) -> dict[str, str]:
    """What `/get_server_info` shows as `quantization`: the method, the kernels' ISA path and the kernel each
    linear shape runs per row count, e.g. {"method": "int8", "isa": "avx2", "576->960 1-31 rows": "q8_0",
    "576->960 32+ rows": "float32", …}; unquantized, the shapes that run another float32 kernel than torch's
    ({"method": "none", "isa": ..., "576->1536 1-3 rows": "f32_gemv", "576->1536 4+ rows": "onednn", …}),
    else {}."""
    layer = next((m for m in model.modules() if isinstance(m, QuantLinear)), None)
    if layer is None:
        chosen = float_report(model)
        return {"method": "none", "isa": cpu_kernels.isa(), **chosen} if chosen else {}
    plan = model_plan(model)
    report = {"method": layer.method, "isa": cpu_kernels.isa()}
    if not any(plan.values()):
        return {**report, "any rows": layer.default}
    return {**report, **plan_report(plan)}


def gguf_plan(model: nn.Module, config: EngineConfig, packed: dict[str, PackedWeight]) -> KernelPlan:
    """The kernel plan of a model whose linears run their GGUF blocks: each shape measured against float32
    with the block format its layers have (one format per shape, else the file cannot be run so)."""
    formats: dict[tuple[int, int], set[str]] = {}
    for name, p in packed.items():
        formats.setdefault((p.out_features, p.in_features), set()).add(p.format)
    mixed = {shape: sorted(f) for shape, f in formats.items() if len(f) > 1}
    if mixed:
        raise ValueError(f"--quantization gguf: layers of one shape hold different block types {mixed}")
    rows = plan_rows(model, config)
    plan: KernelPlan = {}
    for fmt in sorted({f for fs in formats.values() for f in fs}):
        shapes = {shape: rows[shape] for shape, fs in formats.items() if fmt in fs}
        plan.update(measure_kernel_plan(shapes, fmt)[0])
    return plan


def apply_gguf_blocks(model: nn.Module, config: EngineConfig, source: ModelSource | None) -> tuple[str, KernelPlan]:
    """Run every linear of `model` on its GGUF file's own blocks (`--quantization gguf`)."""
    from ringserve.actors.engine.models.gguf_blocks import load_packed_linears

    if source is None:
        raise ValueError("--quantization gguf needs the model's GGUF file")
    start = time.perf_counter()
    packed = load_packed_linears(source, model.config.num_hidden_layers, model.config.tie_word_embeddings)
    plan = gguf_plan(model, config, packed)
    log_event(log, logging.INFO, "gguf blocks per linear shape and step size", isa=cpu_kernels.isa(),
              formats=", ".join(sorted({p.format for p in packed.values()})),
              seconds=round(time.perf_counter() - start, 2),
              choices=", ".join(f"{k}: {v}" for k, v in plan_report(plan).items()))
    quantize_linears(model, "gguf", plan, packed)
    return "gguf", plan


def apply_quantization(model: nn.Module, config: EngineConfig, source: ModelSource | None = None
                       ) -> tuple[str, KernelPlan]:
    """Quantize `model` in place as `config` says; returns the method applied ("none", "int8", "int4" or
    "gguf") and the kernel chosen per shape and row-count bucket. `source`: where `model` was loaded from (the
    gguf method reads its file's blocks)."""
    method = config.quantization
    on_cpu = config.resolved_device() == "cpu" and config.resolved_dtype() == "float32"
    if method == "none" or (method == "auto" and not on_cpu):
        return _float32_linears(model, config, on_cpu)
    if not on_cpu:
        raise ValueError(f"--quantization {method} needs --device cpu and float32 weights")
    if method == "gguf":
        return apply_gguf_blocks(model, config, source)
    measured_as = "int8" if method == "auto" else method
    start = time.perf_counter()
    plan, measured = measure_plan(model, config, measured_as)
    log_event(log, logging.INFO, f"{measured_as} kernels per linear shape and step size",
              isa=cpu_kernels.isa(), cached=measured["cached"], seconds=round(time.perf_counter() - start, 2),
              choices=", ".join(f"{k}: {v}" for k, v in plan_report(plan).items()))
    if method == "auto":
        speedups = [speedup(measured["times"], plan, b) for b in AUTO_BATCHES]
        method = "int8" if min(speedups) >= AUTO_MIN_SPEEDUP else "none"
        log_event(log, logging.INFO, "quantization auto", chosen=method,
                  **{f"int8_speedup_batch{b}": round(s, 2) for b, s in zip(AUTO_BATCHES, speedups)})
        if method == "none":
            return _float32_linears(model, config, on_cpu)
    if not cpu_kernels.compiled():
        log_event(log, logging.WARNING, "CPU group kernels not built: quantized layers run torch's kernels or "
                  "float32 where those are slower", method=method)
    quantize_linears(model, method, plan)
    return method, plan


def _float32_linears(model: nn.Module, config: EngineConfig, on_cpu: bool) -> tuple[str, KernelPlan]:
    """Unquantized: on the CPU, each linear shape runs per row-count bucket the float32 kernel measured fastest
    here (kernels/float_linear.py); returns ("none", that plan)."""
    if not on_cpu or not (cpu_kernels.compiled() or onednn_available()):
        return "none", {}
    start = time.perf_counter()
    shapes = {(m.out_features, m.in_features) for _, m in float_candidates(model)}
    plan, measured = measure_float_plan({s: r for s, r in plan_rows(model, config).items() if s in shapes})
    use_float_plan(model, plan)
    log_event(log, logging.INFO, "float32 kernels per linear shape and step size", isa=cpu_kernels.isa(),
              cached=measured["cached"], seconds=round(time.perf_counter() - start, 2),
              choices=", ".join(f"{k}: {v}" for k, v in float_report(model).items()) or "torch's everywhere")
    return "none", plan
