"""Apply `--quantization` to a loaded model: none, int8, int4, gguf (the GGUF file's own blocks), or auto (int8
only if it measures faster here).

The engine decides the method (off the CPU or below float32 only `none` runs), asks the kernel-plan module
once (`ringserve.kernels.linear_plan.planner.plan_linears`: which kernel each linear shape runs per row-count
bucket, measured at start-up and cached on disk per host) at the row counts the server runs (`plan_rows`),
swaps the layers that follow it in, and logs what it chose. A bucket where no quantized kernel is faster on
this CPU runs the float32 weights, so `--quantization` never makes a step slower; unquantized, each float32
linear shape runs the float32 kernel measured fastest (kernels/float_linear.py), and for a bfloat16 checkpoint
(`checkpoint_dtype`) with `--float-kernels auto` the bfloat16 kernel is measured among them. With
`--enable-deterministic-inference` every linear runs one row-invariant kernel instead, unmeasured
(kernels/linear_plan/invariant.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.common import startup_cache
from ringserve.actors.common.model_source import ModelSource
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import checkpoint_dtype
from ringserve.kernels.cpu.packing import PackedWeight
from ringserve.kernels.float_linear import BF16, FLOAT_KERNELS, FloatLinear, use_float_plan
from ringserve.kernels.linear_plan.plan import KernelPlan, plan_report
from ringserve.kernels.linear_plan.planner import LinearPlan, linear_shapes, plan_linears
from ringserve.kernels.linear_plan.report import choices, quantization_report
from ringserve.kernels.quantization import CHECKPOINT_METHODS, QuantLinear, quantize_linears
from ringserve.observability.logging import log_event

if TYPE_CHECKING:
    from ringserve.actors.engine.models.causal_lm import CausalLM

__all__ = ["apply_quantization", "plan_rows", "quantization_report"]

log = logging.getLogger("engine")
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


def load_gguf_blocks(model: CausalLM, source: ModelSource | None) -> dict[str, PackedWeight]:
    """Every linear's GGUF blocks, packed as the file stores them (`--quantization gguf`)."""
    from ringserve.actors.engine.models.gguf_blocks import load_packed_linears

    if source is None:
        raise ValueError("--quantization gguf needs the model's GGUF file")
    return load_packed_linears(source, model.num_layers, model.tied_embeddings)


def checkpoint_method_of(model: nn.Module) -> str:
    """The method of a GPTQ/AWQ checkpoint whose linears `model` runs on their codes (made as it loaded), else
    "none"."""
    return next((m.method for m in model.modules() if isinstance(m, QuantLinear) and m.method in CHECKPOINT_METHODS),
                "none")


def bf16_allowed(config: EngineConfig, source: ModelSource | None) -> bool:
    """Whether the unquantized linears may run the bfloat16 kernel: `--float-kernels auto`, `--quantization`
    none or auto, and `source` a checkpoint whose matrices are bfloat16 (the kernel's weight is then exactly
    the checkpoint's). The caller has checked that the model computes in float32 on a CPU."""
    return (config.float_kernels == "auto" and config.quantization in ("none", "auto") and source is not None
            and checkpoint_dtype(source) == torch.bfloat16)


def apply_quantization(model: nn.Module, config: EngineConfig, source: ModelSource | None = None
                       ) -> tuple[str, KernelPlan]:
    """Quantize `model` in place as `config` says, or, for a GPTQ/AWQ checkpoint, run its own 4-bit codes (method
    "gptq"/"awq", its linears packed once from them); returns the method applied ("none", "int8", "int4", "gguf",
    "gptq" or "awq") and the kernel chosen per shape and row-count bucket. `source`: where `model` was loaded from (the
    gguf method reads its file's blocks; a bfloat16 checkpoint may run the bfloat16 kernel, `bf16_allowed`)."""
    checkpoint = checkpoint_method_of(model)  # a GPTQ/AWQ checkpoint runs its own codes (no --quantization)
    method = config.quantization if checkpoint == "none" else checkpoint
    deterministic = config.enable_deterministic_inference
    on_cpu = config.resolved_device() == "cpu" and config.resolved_dtype() == "float32"
    if not on_cpu:
        if checkpoint != "none":
            raise ValueError(f"a {checkpoint} checkpoint's 4-bit codes run on the CPU with float32 activations only "
                             "(--device cpu, --dtype float32)")
        if method not in ("none", "auto"):
            raise ValueError(f"--quantization {method} needs --device cpu and float32 weights")
        if deterministic:
            raise ValueError("--enable-deterministic-inference runs on a CPU with float32 weights only")
        return "none", {}
    start = time.perf_counter()
    packed = load_gguf_blocks(model, source) if method == "gguf" else None
    if checkpoint != "none":  # its linears were made from their codes as they loaded (models/checkpoint_linears.py)
        packed = {name: m.packed[m.default] for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    chosen = plan_linears(model, plan_rows(model, config), method, packed, bf16_allowed(config, source),
                          deterministic)
    _log(chosen, time.perf_counter() - start, packed)
    if chosen.method != "none":
        quantize_linears(model, chosen.method, chosen.plan, packed)
    if chosen.method == "none" or deterministic:  # deterministic: a gguf file's float layers follow it too
        use_float_plan(model, {shape: p for shape, p in chosen.plan.items() if set(p.values()) <= set(FLOAT_KERNELS)})
        _log_bf16(model)
    if deterministic:
        log_event(log, logging.INFO, "row-invariant kernels (--enable-deterministic-inference)", isa=cpu_kernels.isa(),
                  choices=", ".join(f"{k}: {v}" for k, v in plan_report(chosen.plan).items()))
    return chosen.method, chosen.plan


def _log(chosen: LinearPlan, seconds: float, packed: dict[str, PackedWeight] | None) -> None:
    """One event per measuring pass (the gguf one timed with reading the file's blocks; the float32 one naming
    the kernels it timed, `bf16` among them for a bfloat16 checkpoint), auto's verdict after its int8 pass, and
    a warning where quantized layers run without our group kernels."""
    isa = cpu_kernels.isa()
    if chosen.method in CHECKPOINT_METHODS and packed is not None:
        log_event(log, logging.INFO, f"{chosen.method} checkpoint: its linears run their own codes", isa=isa,
                  layers=len(packed), formats=", ".join(sorted({p.format for p in packed.values()})),
                  seconds=round(seconds, 2))
    for i, measured in enumerate(chosen.passes):
        startup_cache.note(f"{measured.kind} kernel plan", measured.cached)
        if packed is not None:
            log_event(log, logging.INFO, f"{chosen.method} packed weights per linear shape and step size", isa=isa,
                      formats=", ".join(sorted({p.format for p in packed.values()})), cached=measured.cached,
                      seconds=round(seconds, 2),
                      choices=choices(measured))
            continue
        timed = {"candidates": ", ".join(measured.candidates)} if measured.kind == "float32" else {}
        log_event(log, logging.INFO, f"{measured.kind} kernels per linear shape and step size", isa=isa,
                  cached=measured.cached, seconds=round(measured.seconds, 2), choices=choices(measured), **timed)
        if i == 0 and chosen.auto_speedups:
            log_event(log, logging.INFO, "quantization auto", chosen=chosen.method,
                      **{f"int8_speedup_batch{b}": round(s, 2) for b, s in chosen.auto_speedups.items()})
    if chosen.method in ("int8", "int4") and not cpu_kernels.compiled():
        log_event(log, logging.WARNING, "CPU group kernels not built: quantized layers run torch's kernels or "
                  "float32 where those are slower", method=chosen.method)



def _log_bf16(model: nn.Module) -> None:
    """Where the plan runs the bfloat16 kernel: how many layers, and the memory that changed (layers running
    only it keep only bfloat16 weights; the others, and a tied LM head, keep a bfloat16 copy as well)."""
    layers = [m for m in model.modules() if isinstance(m, FloatLinear) and "bf16" in m.plan.values()]
    if not layers:
        return
    only = [m for m in layers if m.weight.dtype == BF16]
    freed = sum(m.weight.numel() * 2 for m in only)  # float32 bytes dropped, less the bfloat16 kept
    copies = sum(m.weight_bf16.numel() * 2 for m in layers if m.weight_bf16 is not None)
    log_event(log, logging.INFO, "bfloat16 linears (a bfloat16 checkpoint; --float-kernels float32 turns them off)",
              layers=len(layers), bf16_only=len(only), freed_mib=round(freed / 2**20, 1),
              copies_mib=round(copies / 2**20, 1))
