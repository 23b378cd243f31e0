"""Float32 linears through the kernel their plan names for their row count: torch's own (`F.linear`, MKL's GEMV
and GEMM), our GEMV (`kernels/cpu/f32_gemv.cpp`) at 1-3 rows, or oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, what Inductor's freezing emits) reading the layer's own weight in place.

On some hosts MKL runs float32 far below what the CPU does: at one row it streams the weight at a third of the
memory's speed, at 8-512 rows its GEMM is 1.2-2x slower than oneDNN's on the same weights (2-core AMD EPYC
Zen 4; docs/benchmarks.md, "Float32 linears"). Which kernel each shape runs per row-count bucket is measured,
cached and chosen by `ringserve.kernels.linear_plan`; `use_float_plan` then turns the model's `nn.Linear`
layers into `FloatLinear`s that follow it. oneDNN gets no copy of the weight: a packed one measured up to
1.3x faster still at 4-32 rows, but would double the memory of every float32 linear.

All compute the same float32 products and sums, in different orders, so their outputs differ in the last
bits (~1e-5 of the values); greedy output is tested against transformers' with whatever this host chose
(tests/test_float_linear.py, and every float32 equality test).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.linear_plan.plan import KernelPlan, ShapePlan, kernel_for

FLOAT_KERNELS = ("float32", "f32_gemv", "onednn")  # "float32" is torch's F.linear, the one the others must beat

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


def float_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's linears a float plan can run: plain `nn.Linear`s with contiguous float32 weights on the CPU."""
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
            and m.weight.is_contiguous() and (m.bias is None or m.bias.is_contiguous())]


def use_float_plan(model: nn.Module, plan: KernelPlan) -> int:
    """Make each of the model's `float_linears` whose shape's plan runs anything but torch's at some row count a
    `FloatLinear` following it, in place; returns how many were."""
    swapped = 0
    for name, module in float_linears(model):
        shape_plan = plan.get((module.out_features, module.in_features), {})
        if set(shape_plan.values()) - {"float32"}:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, FloatLinear(module, shape_plan))
            swapped += 1
    return swapped
