"""A kernel plan: which kernel each linear shape runs at each row count, as measured on this host.

A `ShapePlan` maps a row-count bucket (`rows.bit_length()`: 1 row, 2-3, 4-7, 8-15, …) to a kernel's name;
more rows than the largest bucket follow it. A `KernelPlan` holds one per linear shape `(out, in)`. Quantized
layers (kernels/quantization.py) and float32 ones (kernels/float_linear.py) follow plans of their own kernels.
"""

from __future__ import annotations

from typing import Callable

ShapePlan = dict[int, str]  # rows.bit_length() -> kernel
KernelPlan = dict[tuple[int, int], ShapePlan]  # (out_features, in_features) -> its ShapePlan


def kernel_for(plan: ShapePlan, rows: int, default: str) -> str:
    """The kernel `plan` names for a call of `rows` rows (`default` when the plan has no bucket for it). Called
    on every eager forward of a layer: a hit on the bucket itself costs one dict lookup."""
    kernel = plan.get(rows.bit_length())
    if kernel is not None:
        return kernel
    top = max(plan, default=0)
    return plan[top] if 0 < top < rows.bit_length() else default


def plan_from_times(times: dict[str, dict[str, float]], choose: Callable[[dict[str, float]], str]) -> KernelPlan:
    """The plan measured `times` ("out,in,rows" -> {kernel: seconds}) give when `choose` picks each one's kernel."""
    plan: KernelPlan = {}
    for entry, measured in times.items():
        n, k, rows = (int(v) for v in entry.split(","))
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
