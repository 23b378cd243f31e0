"""Float32 linears through the kernel their plan names for their row count: torch's own (`F.linear`, MKL's GEMV
and GEMM), our GEMV (`kernels/cpu/f32_gemv.cpp`) at 1-3 rows, or oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, what Inductor's freezing emits) reading the layer's own weight in place;
for a bfloat16 checkpoint also `bf16`: oneDNN's matmul of the rows rounded to bfloat16 with the checkpoint's own
bfloat16 weight, returned as float32.

On some hosts MKL runs float32 far below what the CPU does: at one row it streams the weight at a third of the
memory's speed, at 8-512 rows its GEMM is 1.2-2x slower than oneDNN's on the same weights (2-core AMD EPYC
Zen 4; docs/benchmarks.md, "Float32 linears"). Which kernel each shape runs per row-count bucket is measured,
cached and chosen by `ringserve.kernels.linear_plan`; `use_float_plan` then turns the model's `nn.Linear`
layers into `FloatLinear`s that follow it. oneDNN gets no copy of the weight: a packed one measured up to
1.3x faster still at 4-32 rows, but would double the memory of every float32 linear.

The float32 kernels compute the same float32 products and sums, in different orders, so their outputs differ
in the last bits (~1e-5 of the values); greedy output is tested against transformers' with whatever this host
chose (tests/kernels/test_float_linear.py, and every float32 equality test). `bf16` rounds the rows and its output to
bfloat16 (the weight is exactly the checkpoint's), so it computes what transformers does in bfloat16: half the
weight bytes and, on CPUs with AVX512-BF16 or AMX, twice the multiply rate (1.3-2x faster than float32 at 1-1024
rows on a 2-core AMD EPYC Zen 4, one thread). A layer whose plan runs `bf16` at every row count keeps only the
bfloat16 weight (as its `weight` Parameter, which a weight update copies into, rounding); one that also runs a
float32 kernel, or shares its weight (a tied LM head), keeps a bfloat16 copy beside it (`refresh` after a weight
update). oneDNN's bf16 matmul measured as fast as torch's `F.linear` on bfloat16 (which reaches oneDNN too)
or up to 5% faster.

`onednn_pad` is oneDNN's matmul with a one-row call run as two rows: oneDNN gives a row the same bits at every row
count from two up, so the row-invariant plans of `--enable-deterministic-inference` run it at every row count
(kernels/linear_plan/invariant.py).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.linear_plan.plan import KernelPlan, ShapePlan, kernel_for

# "float32" is torch's F.linear, the one the others must beat; "onednn_pad" is oneDNN's with a one-row call run as
# two rows, which makes its rows' bits the same at every row count (the row-invariant plan's, linear_plan/invariant.py)
FLOAT_KERNELS = ("float32", "f32_gemv", "onednn", "bf16", "onednn_pad")
BF16 = torch.bfloat16

# Declared with the low-level Library API (kernels/attention/kv_store.py says why): a compiled graph calls it
# as an opaque op, since Inductor's own lowering of `_linear_pointwise` wants a frozen, packed weight.
_LIBRARY = torch.library.Library("ringserve", "FRAGMENT")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by oneDNN's matmul, over `weight` as it is stored."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def bf16_available() -> bool:
    """Whether oneDNN runs a bfloat16 matmul on this CPU. It needs AVX-512 (or AMX); on an AVX2-only host (AMD
    Zen 3) it cannot make the primitive ("could not create a primitive descriptor"), so a bfloat16 checkpoint
    runs the float32 kernels there."""
    if not onednn_available():
        return False
    try:
        onednn_linear(torch.zeros(1, 32, dtype=BF16), torch.zeros(32, 32, dtype=BF16), None)
    except RuntimeError:
        return False
    return True


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of float32 `x` rounded to bfloat16 with a bfloat16 `weight` (and `bias`), by oneDNN's matmul
    (float32 sums, the output rounded to bfloat16), as float32."""
    return onednn_linear(x.to(BF16), weight, bias).float()


_LIBRARY.impl("onednn_linear", onednn_linear, "CPU")
_LIBRARY.impl("bf16_linear", bf16_linear, "CPU")


@torch.library.register_fake("ringserve::onednn_linear")
def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("ringserve::bf16_linear")
def _bf16_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


class FloatLinear(nn.Linear):
    """An `nn.Linear` whose calls run the kernel its `plan` names for their row count (`FLOAT_KERNELS`).

    Made from a layer by `FloatLinear(linear, plan)`, it holds that layer's own weight and bias Parameters (a
    tied LM head keeps sharing the embedding's; a weight update copying into them reaches both). A plan with
    `bf16` (a bfloat16 checkpoint's layer) makes the weight bfloat16 when it runs nothing else and `shared` is
    False (the float32 weight is then never read: only bfloat16 is kept); else a bfloat16 copy is kept beside it."""

    def __init__(self, linear: nn.Linear, plan: ShapePlan, shared: bool = False) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        unknown = set(plan.values()) - set(FLOAT_KERNELS)
        if unknown:
            raise ValueError(f"unknown float32 kernels {sorted(unknown)}; choose among {list(FLOAT_KERNELS)}")
        self.plan = dict(plan)
        self.weight, self.bias = linear.weight, linear.bias
        copies = "bf16" in self.plan.values() and (shared or set(self.plan.values()) != {"bf16"})
        if "bf16" in self.plan.values() and not copies:
            self.weight = nn.Parameter(linear.weight.detach().to(BF16), requires_grad=False)
            if linear.bias is not None:
                self.bias = nn.Parameter(linear.bias.detach().to(BF16), requires_grad=False)
        bias_bf16 = None if linear.bias is None or not copies else linear.bias.detach().to(BF16)
        self.register_buffer("weight_bf16", linear.weight.detach().to(BF16) if copies else None, persistent=False)
        self.register_buffer("bias_bf16", bias_bf16, persistent=False)
        self._gemv = cpu_kernels.f32_linear()

    def refresh(self) -> None:
        """Copy the float32 weight and bias into their bfloat16 copies, if the layer keeps any: call it after
        updating them in place (a weight update, actors/engine/models/weights.py `swap_weights`)."""
        if self.weight_bf16 is not None:
            with torch.no_grad():
                self.weight_bf16.copy_(self.weight)
                if self.bias_bf16 is not None:
                    self.bias_bf16.copy_(self.bias)

    def kernel_for(self, rows: int) -> str:
        """The kernel a call with `rows` rows runs."""
        return kernel_for(self.plan, rows, "float32")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        kernel = self.kernel_for(rows) if x.dtype == torch.float32 else "float32"
        compiling = torch.compiler.is_compiling()  # our ops (with their fakes) trace; the bare functions not
        if kernel == "bf16" or self.weight.dtype == BF16:
            weight, bias = (self.weight, self.bias) if self.weight_bf16 is None else (self.weight_bf16, self.bias_bf16)
            if compiling:
                return torch.ops.ringserve.bf16_linear(x, weight, bias)
            return bf16_linear(x, weight, bias)
        if kernel in ("onednn", "onednn_pad"):
            one_row = kernel == "onednn_pad" and rows == 1
            x2 = x.reshape(1, self.in_features).expand(2, self.in_features).contiguous() if one_row else x
            op = torch.ops.ringserve.onednn_linear if compiling else onednn_linear
            y = op(x2, self.weight, self.bias)
            return y[:1].reshape(*x.shape[:-1], self.out_features) if one_row else y
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
    `FloatLinear` following it, in place; returns how many were. A layer whose weight another module shares (a
    tied LM head) keeps it in float32."""
    counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    swapped = 0
    for name, module in float_linears(model):
        shape_plan = plan.get((module.out_features, module.in_features), {})
        if set(shape_plan.values()) - {"float32"}:
            parent_name, _, child = name.rpartition(".")
            layer = FloatLinear(module, shape_plan, shared=counts[id(module.weight)] > 1)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
            swapped += 1
    return swapped
