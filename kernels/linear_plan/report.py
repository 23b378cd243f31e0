"""What a model's linears run, for `/get_server_info` and the start-up log, read from the layers' own plans,
and the speedup `--quantization auto` weighs."""

from __future__ import annotations

from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.float_linear import FloatLinear
from ringserve.kernels.linear_plan.invariant import is_row_invariant
from ringserve.kernels.linear_plan.plan import KernelPlan, Measured, Times, entries, plan_report
from ringserve.kernels.quantization import CHECKPOINT_METHODS, FLOAT_WEIGHT_KERNELS, QuantLinear


def float_report(model: nn.Module) -> dict[str, str]:
    """The kernel each `FloatLinear` shape runs per row count: {"576->1536 1-3 rows": "f32_gemv",
    "576->1536 4+ rows": "onednn", …} (in->out features); {} when none."""
    return plan_report({(m.out_features, m.in_features): m.plan for m in model.modules() if isinstance(m, FloatLinear)})


def quantization_report(model: nn.Module, deterministic: bool = False) -> dict[str, str]:
    """What `/get_server_info` shows as `quantization`: the method, the kernels' ISA path and the kernel each
    linear shape runs per row count, e.g. {"method": "int8", "isa": "avx2", "576->960 1-31 rows": "q8_0",
    "576->960 32+ rows": "float32", …}; unquantized, the shapes that run another float32 kernel than torch's
    ({"method": "none", "isa": ..., "576->1536 1-3 rows": "f32_gemv", "576->1536 4+ rows": "onednn", …}),
    else {}; a GPTQ or AWQ checkpoint's method with the kernel each of its shapes runs at every row count
    ({"method": "gptq", "isa": ..., "576->1728 any rows": "q4_k", …}). With `deterministic`
    (`--enable-deterministic-inference`), `deterministic_inference` says "on" when every linear follows a plan
    of row-invariant kernels (kernels/linear_plan/invariant.py), else names the first layer that does not."""
    if deterministic:
        return {**_report(model), "deterministic_inference": _invariance(model)}
    return _report(model)


def _invariance(model: nn.Module) -> str:
    """"on", or what breaks row invariance: a linear without a plan, or a plan with another kernel."""
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, FloatLinear)):
            kernels = set(m.plan.values()) or {getattr(m, "default", "float32")}
            if not all(is_row_invariant(k) for k in kernels):
                return f"off: {name} runs {sorted(kernels)}"
        elif isinstance(m, nn.Linear):
            return f"off: {name} runs torch's float32"
    return "on"


def _report(model: nn.Module) -> dict[str, str]:
    layer = next((m for m in model.modules() if isinstance(m, QuantLinear)), None)
    if layer is None:
        chosen = float_report(model)
        return {"method": "none", "isa": cpu_kernels.isa(), **chosen} if chosen else {}
    plan = {(m.out_features, m.in_features): m.plan for m in model.modules() if isinstance(m, QuantLinear)}
    report = {"method": layer.method, "isa": cpu_kernels.isa()}
    if not any(plan.values()) and layer.method in CHECKPOINT_METHODS:  # a GPTQ/AWQ checkpoint's codes, per shape
        return {**report, **{f"{m.in_features}->{m.out_features} any rows": m.default
                             for m in model.modules() if isinstance(m, QuantLinear)}}
    if not any(plan.values()):
        return {**report, "any rows": layer.default}
    return {**report, **plan_report(plan)}


def choices(measured: Measured) -> str:
    """A measuring pass's choices for the log: every shape's kernels per row count; for float32, only the shapes
    where anything but torch's won (the layers that run another kernel), or "torch's everywhere"."""
    plan = measured.plan
    if measured.kind == "float32":
        plan = {shape: p for shape, p in plan.items() if set(p.values()) - {"float32"}}
    return ", ".join(f"{k}: {v}" for k, v in plan_report(plan).items()) or "torch's everywhere"


def speedup(times: Times, plan: KernelPlan, rows: int) -> float:
    """The fastest float32 kernel's time over the plan's for one pass through every measured shape at `rows`
    rows (what `--quantization auto` weighs: unquantized, the float32 linears run their fastest kernel too)."""
    base = chosen = 0.0
    for n, k, r, measured in entries(times):
        if r == rows:
            base += min(measured[kernel] for kernel in FLOAT_WEIGHT_KERNELS if kernel in measured)
            chosen += measured[plan[(n, k)][r.bit_length()]]
    return base / chosen if chosen else 1.0
