"""A kernel plan: which kernel each linear shape runs at each row count, as measured on this host.

A `ShapePlan` maps a row-count bucket (`rows.bit_length()`: 1 row, 2-3, 4-7, 8-15, …) to a kernel's name;
more rows than the largest bucket follow it. A `KernelPlan` holds one per linear shape `(out, in)`. The
layers (kernels/quantization.py, kernels/float_linear.py) read their shape's plan with `kernel_for`; the rest
of this package measures and chooses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ShapePlan = dict[int, str]  # rows.bit_length() -> kernel
KernelPlan = dict[tuple[int, int], ShapePlan]  # (out_features, in_features) -> its ShapePlan
Times = dict[str, dict[str, float]]  # "out,in,rows" -> {kernel: seconds per call}


@dataclass
class Measured:
    """One measuring pass (kernels of one kind on some shapes): the plan it chose, the times it chose from
    (`cached`: read from the disk cache), the kernels it timed, and how long it took."""

    kind: str  # "int8", "int4", "float32", or a GGUF block format
    plan: KernelPlan
    times: Times
    cached: bool
    candidates: tuple[str, ...] = ()
    seconds: float = 0.0


def kernel_for(plan: ShapePlan, rows: int, default: str) -> str:
    """The kernel `plan` names for a call of `rows` rows (`default` when the plan has no bucket for it). Called
    on every eager forward of a layer: a hit on the bucket itself costs one dict lookup."""
    kernel = plan.get(rows.bit_length())
    if kernel is not None:
        return kernel
    top = max(plan, default=0)
    return plan[top] if 0 < top < rows.bit_length() else default


def entries(times: Times) -> list[tuple[int, int, int, dict[str, float]]]:
    """The measured `times` as (out, in, rows, {kernel: seconds})."""
    out = []
    for entry, measured in times.items():
        n, k, rows = (int(v) for v in entry.split(","))
        out.append((n, k, rows, measured))
    return out


def plan_from_times(times: Times, choose: Callable[[dict[str, float]], str]) -> KernelPlan:
    """The plan measured `times` give when `choose` picks each one's kernel."""
    plan: KernelPlan = {}
    for n, k, rows, measured in entries(times):
        plan.setdefault((n, k), {})[rows.bit_length()] = choose(measured)
    return plan


def plan_buckets(plan: ShapePlan) -> dict[str, str]:
    """One shape's plan as readable ranges, adjacent buckets of one kernel merged, the last open-ended:
    e.g. {"1-15 rows": "q8_0", "16+ rows": "float32"}."""
    out: dict[str, str] = {}
    items = sorted(plan.items())
    start = 0
    for i, (bits, kernel) in enumerate(items):
        if i + 1 < len(items) and items[i + 1][1] == kernel:
            continue
        low = 1 << (items[start][0] - 1)
        out[f"{low}+ rows" if i + 1 == len(items) else f"{low}-{(1 << bits) - 1} rows"] = kernel
        start = i + 1
    return out


def plan_report(plan: KernelPlan) -> dict[str, str]:
    """A whole plan for logs and `/get_server_info`: {"576->960 1-15 rows": "q8_0", ...} (in->out features)."""
    return {f"{k}->{n} {rows}": kernel for (n, k), shape_plan in sorted(plan.items())
            for rows, kernel in plan_buckets(shape_plan).items()}
