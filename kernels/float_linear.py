"""Float32 linears through the kernel measured fastest on this host for their shape and row count: torch's own
(`F.linear`, MKL's GEMV and GEMM), our GEMV (`kernels/cpu/f32_gemv.cpp`) at 1-3 rows, or oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, what Inductor's freezing emits) reading the layer's own weight in place.

On some hosts MKL runs float32 far below what the CPU does: at one row it streams the weight at a third of the
memory's speed, at 8-512 rows its GEMM is 1.2-2x slower than oneDNN's on the same weights (2-core AMD EPYC
Zen 4; docs/benchmarks.md, "Float32 linears"). `measure_float_plan` times the candidates side by side on the
model's own shapes at the row counts the server runs (the buckets of `ringserve.kernels.linear_plan`), each call on
another copy of the weight so that they stream from memory as a step's do, and keeps per bucket the fastest
(another than torch's only when faster by `MARGIN`); the result is cached on disk per host
(`ringserve.kernels.cpu.plan_cache`). `use_float_plan` then turns the model's `nn.Linear` layers into `FloatLinear`s
that follow it. oneDNN gets no copy of the weight: a packed one measured up to 1.3x faster still at 4-32
rows, but would double the memory of every float32 linear.

All compute the same float32 products and sums, in different orders, so their outputs differ in the last
bits (~1e-5 of the values); greedy output is tested against transformers' with whatever this host chose
(tests/test_float_linear.py, and every float32 equality test).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu import plan_cache
from ringserve.kernels.linear_plan import KernelPlan, ShapePlan, kernel_for, plan_from_times, plan_report

FLOAT_KERNELS = ("float32", "f32_gemv", "onednn")  # "float32" is torch's F.linear, the one the others must beat
GEMV_MAX_ROWS = 3  # our GEMV is a candidate for the buckets of 1 and 2-3 rows (past 4 it reads the weight again)
MARGIN = 0.95  # another kernel must measure at least 5% faster than torch's to be chosen (noise)
STREAM_BYTES = 96 << 20  # weight copies cycled through while timing: more than a CPU's caches hold
_SOURCE = Path(__file__).with_name("cpu") / "f32_gemv.cpp"

# Declared with the low-level Library API (kernels/attention/kv_store.py says why): a compiled graph calls it
# as an opaque op, since Inductor's own lowering of `_linear_pointwise` wants a frozen, packed weight.
_LIBRARY = torch.library.Library("ringserve", "FRAGMENT")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by oneDNN's matmul, over `weight` as it is stored."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_LIBRARY.impl("onednn_linear", onednn_linear, "CPU")


@torch.library.register_fake("ringserve::onednn_linear")
def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class FloatLinear(nn.Linear):
    """An `nn.Linear` whose calls run the kernel its `plan` names for their row count (`FLOAT_KERNELS`).

    Made from a layer by `FloatLinear(linear, plan)`, it holds that layer's own weight and bias Parameters (a
    tied LM head keeps sharing the embedding's; a weight update copying into them reaches both)."""

    def __init__(self, linear: nn.Linear, plan: ShapePlan) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        unknown = set(plan.values()) - set(FLOAT_KERNELS)
        if unknown:
            raise ValueError(f"unknown float32 kernels {sorted(unknown)}; choose among {list(FLOAT_KERNELS)}")
        self.plan = dict(plan)
        self._gemv = cpu_kernels.f32_linear()

    def kernel_for(self, rows: int) -> str:
        """The kernel a call with `rows` rows runs."""
        return kernel_for(self.plan, rows, "float32")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        kernel = self.kernel_for(rows) if x.dtype == torch.float32 else "float32"
        compiling = torch.compiler.is_compiling()  # our ops (with their fakes) trace; the bare functions not
        if kernel == "onednn":
            if compiling:
                return torch.ops.ringserve.onednn_linear(x, self.weight, self.bias)
            return onednn_linear(x, self.weight, self.bias)
        if kernel == "f32_gemv":
            flat = x.reshape(rows, self.in_features).contiguous()
            if compiling:
                y = torch.ops.ringserve_cpu.f32_linear(flat, self.weight, self.bias)
            else:
                y = self._gemv(flat, self.weight, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def float_candidates(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's linears a float plan can run: plain `nn.Linear`s with contiguous float32 weights on the CPU."""
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
            and m.weight.is_contiguous() and (m.bias is None or m.bias.is_contiguous())]


def kernels_at(rows: int) -> tuple[str, ...]:
    """The kernels timed at `rows` rows on this host: torch's, ours where built and the rows few, oneDNN's."""
    return ("float32", *(("f32_gemv",) if cpu_kernels.compiled() and rows <= GEMV_MAX_ROWS else ()),
            *(("onednn",) if onednn_available() else ()))


def choose_float_kernel(times: dict[str, float]) -> str:
    """The kernel to run given seconds per call: the fastest, if it beats torch's by the margin."""
    best = min(times, key=times.__getitem__)
    return best if times[best] <= MARGIN * times["float32"] else "float32"


def _time_shape(n: int, k: int, row_counts: list[int], rounds: int) -> dict[str, dict[str, float]]:
    """Seconds per call of each kernel on an `[n, k]` weight at each row count, the weights streaming."""
    copies = [torch.randn(n, k) for _ in range(max(1, -(-STREAM_BYTES // (n * k * 4))))]
    turn = [0]

    def next_weight() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(copies)
        return copies[turn[0]]

    gemv = cpu_kernels.f32_linear()
    run = {"float32": lambda x: F.linear(x, next_weight()), "f32_gemv": lambda x: gemv(x, next_weight(), None),
           "onednn": lambda x: onednn_linear(x, next_weight(), None)}
    times = {}
    for rows in sorted(set(row_counts)):
        x = torch.randn(rows, k)
        times[f"{n},{k},{rows}"] = plan_cache.time_interleaved(
            {kernel: (lambda kernel=kernel: run[kernel](x)) for kernel in kernels_at(rows)}, rounds)
    return times


def measure_float_plan(shape_rows: dict[tuple[int, int], list[int]], rounds: int = 5, use_cache: bool = True
                       ) -> tuple[KernelPlan, dict[str, Any]]:
    """Per linear shape (out, in), the float32 kernel of each row-count bucket, from timing the candidates at
    each of its row counts here; and the measurements ({"times": {"out,in,rows": {kernel: seconds}},
    "cached": bool}). Cached on disk by host, torch, kernels and thread count."""
    key = plan_cache.host_key({"float32": hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16],
                               "candidates": [list(kernels_at(1)), list(kernels_at(GEMV_MAX_ROWS + 1))],
                               "shapes": sorted([list(s), sorted(r)] for s, r in shape_rows.items())})

    def measure() -> dict[str, dict[str, float]]:
        times = {}
        for (n, k), row_counts in shape_rows.items():
            times.update(_time_shape(n, k, row_counts, rounds))
        return times

    times, cached = plan_cache.measured_times(key, measure, use_cache)
    return plan_from_times(times, choose_float_kernel), {"times": times, "cached": cached}


def use_float_plan(model: nn.Module, plan: KernelPlan) -> int:
    """Make each of the model's `float_candidates` whose shape's plan runs anything but torch's at some row count a
    `FloatLinear` following it, in place; returns how many were."""
    swapped = 0
    for name, module in float_candidates(model):
        shape_plan = plan.get((module.out_features, module.in_features), {})
        if set(shape_plan.values()) - {"float32"}:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, FloatLinear(module, shape_plan))
            swapped += 1
    return swapped


def float_report(model: nn.Module) -> dict[str, str]:
    """The kernel each `FloatLinear` shape runs per row count, for logs and `/get_server_info`:
    {"576->1536 1-3 rows": "f32_gemv", "576->1536 4+ rows": "onednn", …} (in->out features); {} when none."""
    return plan_report({(m.out_features, m.in_features): m.plan for m in model.modules() if isinstance(m, FloatLinear)})
