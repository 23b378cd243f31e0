"""Which kernels are candidates for a linear on this host, and the rules that choose among their timings.

Quantized layers (kernels/quantization.py) time their method's kernels beside the float32 weight's: torch's
`float32` first (the one every other must beat), oneDNN's `onednn` where torch has it, then the method's in
order of quality (`int8`: our `q8_0` group kernel, then `int_mm`; `int4`: `q4_1`; a GGUF block format: its
group kernel, `packing.FORMATS`). Float32 layers (kernels/float_linear.py) time torch's, our `f32_gemv` at
1-3 rows and oneDNN's, and, for a bfloat16 checkpoint, `bf16` (oneDNN's bfloat16 matmul: the one candidate
that changes the outputs by more than the sums' order, so a float32 kernel within `NEAR_TIE` of it is taken
instead, as a better-quality kernel is in a quantized layer's near tie). Our kernels are candidates only when compiled (their torch fallback is far slower than
float32); `int_mm` needs fbgemm (and on AVX2 CPUs without VNNI `torch._int_mm` is a scalar loop, 10-25x
slower than float32 at 8-32 rows: measured, it is never chosen there).
"""

from __future__ import annotations

import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.packing import FORMATS
from ringserve.kernels.float_linear import bf16_available, onednn_available

# candidates per method (or per GGUF block format) in order of quality (a better one wins a near tie)
CANDIDATES = {"int8": ("q8_0", "int_mm"), "int4": ("q4_1",), **{fmt: (fmt,) for fmt in FORMATS}}
MARGIN = 0.95  # another kernel must measure at least 5% faster than torch's float32 to be chosen (noise)
NEAR_TIE = 1.10  # a better-quality kernel within 10% of the fastest is taken instead
GEMV_MAX_ROWS = 3  # our GEMV is a candidate for the buckets of 1 and 2-3 rows (past 4 it reads the weight again)


def candidates(method: str) -> tuple[str, ...]:
    """Kernels timed for a quantized `method` (or GGUF block format) on this host in quality order: the
    float32 weight's first (torch's, then oneDNN's where torch has it), then the method's."""
    out = ["float32", *(["onednn"] if onednn_available() else [])]
    for kernel in CANDIDATES[method]:
        if kernel in FORMATS and not cpu_kernels.compiled():
            continue
        if kernel == "int_mm" and "fbgemm" not in torch.backends.quantized.supported_engines:
            continue
        out.append(kernel)
    return tuple(out)


def float_candidates(rows: int, bf16: bool = False) -> tuple[str, ...]:
    """The float32 kernels timed at `rows` rows on this host: torch's, ours where built and the rows few,
    oneDNN's; and with `bf16` (a bfloat16 checkpoint's layers) oneDNN's bfloat16 matmul, where this CPU runs it."""
    return ("float32", *(("f32_gemv",) if cpu_kernels.compiled() and rows <= GEMV_MAX_ROWS else ()),
            *(("onednn",) if onednn_available() else ()), *(("bf16",) if bf16 and bf16_available() else ()))


def float_plan_possible() -> bool:
    """Whether a float32 layer has any candidate but torch's here (else unquantized layers are not measured)."""
    return cpu_kernels.compiled() or onednn_available()


def choose_kernel(times: dict[str, float], order: tuple[str, ...]) -> str:
    """The kernel to run given seconds per call: torch's float32 unless another kernel beats it by the margin;
    among those, the fastest, or the best-quality one (earliest in `order`) within `NEAR_TIE` of it."""
    fast = {k: t for k, t in times.items() if k != "float32" and t <= MARGIN * times["float32"]}
    if not fast:
        return "float32"
    best = min(fast.values())
    return next(k for k in order if k in fast and fast[k] <= NEAR_TIE * best)


def choose_float_kernel(times: dict[str, float]) -> str:
    """The float32 kernel to run given seconds per call: the fastest, if it beats torch's by the margin (the
    float32 kernels compute the same sums, so no quality order among them); `bf16` only if it also beats the
    chosen float32 kernel by more than the near tie."""
    exact = {k: t for k, t in times.items() if k != "bf16"}
    best = min(exact, key=exact.__getitem__)
    chosen = best if exact[best] <= MARGIN * times["float32"] else "float32"
    fast_bf16 = "bf16" in times and times["bf16"] <= MARGIN * times["float32"]
    return "bf16" if fast_bf16 and NEAR_TIE * times["bf16"] < times[chosen] else chosen
