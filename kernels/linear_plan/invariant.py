"""Row-invariant kernel plans (`--enable-deterministic-inference`): every row of a linear gets the same bits at
every row count, so a request's tokens do not depend on the batch it lands in or on speculation.

A measured plan may run one kernel at one row and another at eight (float32 alone, q4_1 in a verify step),
and kernels that compute other sums give other bits. A row-invariant plan runs one kernel per shape at every
row count, and only a kernel whose own per-row arithmetic is the same at every row count:

- our group kernels (`q8_0`, `q4_0`, `q4_1`, the K-quants): each row's activations are quantized by
  themselves and its sums run in one order whatever the register block (integer sums are exact); measured
  bit-identical at 1-512 rows, 1 and 2 threads, on both ISA paths (tests/engine/test_deterministic_inference.py).
- `onednn_pad` for float32 weights: oneDNN's matmul gives each row the same bits from two rows up (measured
  at 2-512 rows, 1 and 2 threads; at one row it takes another path), so a one-row call runs as two.
  torch's `F.linear` (MKL) differs between most row counts and is never chosen; our `f32_gemv` is
  row-invariant but reads the weight again every four rows, so it is the fallback without oneDNN only.

`int_mm` (one activation scale per row, but fbgemm's own kernel at one row) and `bf16` are never chosen.
No measuring: the plan follows from the method, so a deterministic start skips the kernel timing.
"""

from __future__ import annotations

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.float_linear import onednn_available
from ringserve.kernels.linear_plan.plan import KernelPlan
from ringserve.kernels.quantization import GROUP_KERNELS, default_kernel

FLOAT_INVARIANT = ("onednn_pad", "f32_gemv")  # in order of preference (f32_gemv re-reads the weight past 4 rows)


def float_invariant_kernel() -> str | None:
    """The row-invariant float32 kernel this host has: `onednn_pad`, else our `f32_gemv`, else None."""
    if onednn_available():
        return "onednn_pad"
    return "f32_gemv" if cpu_kernels.compiled() else None


def invariant_plan(shape_kinds: dict[tuple[int, int], str], rows: dict[tuple[int, int], list[int]]) -> KernelPlan:
    """One row-invariant kernel per shape at every bucket of its `rows`: a quantized shape's group kernel
    (`shape_kinds` maps it to its method or GGUF block format), an unquantized one's ("none")
    `float_invariant_kernel`. ValueError where the host has no such kernel."""
    plan: KernelPlan = {}
    for shape, kind in shape_kinds.items():
        kernel = float_invariant_kernel() if kind == "none" else default_kernel(kind)
        if kernel is None or (kind != "none" and kernel in GROUP_KERNELS and not cpu_kernels.compiled()):
            raise ValueError(f"--enable-deterministic-inference: no row-invariant kernel for {kind} linears here "
                             "(our CPU kernels are not built, and torch has no oneDNN)")
        plan[shape] = {r.bit_length(): kernel for r in rows.get(shape, [1])}
    return plan


def is_row_invariant(kernel: str) -> bool:
    """Whether `kernel` gives a row the same bits at every row count (the kernels `invariant_plan` chooses)."""
    return kernel in FLOAT_INVARIANT or kernel in GROUP_KERNELS
