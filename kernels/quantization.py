"""Int8 linear layers behind one small interface, swapped into a model from outside.

`quantize_linears(model, method)` replaces the model's `nn.Linear` layers (projections and LM head) with
quantized ones; the model code knows nothing of it (gpt-fast's approach). One method so far:

- `int8`: per-output-channel symmetric int8 weights; activations quantized to int8 on each call with one
  scale per row (per token). Several rows: symmetric 8-bit, multiplied by `torch._int_mm` (int8 x int8 ->
  int32) and rescaled. One row (batch-1 decode): fbgemm's dynamic linear, whose single activation range is then
  that row's (7-bit asymmetric, so its AVX2 u8*s8 pair sums cannot saturate int16), because it is ~2x faster
  there, the LM head most of all. On AVX2 CPUs int8 is ~3x faster than float32 at batch 1, where decode is
  bound by reading weights. Scaling per row, not per batch (fbgemm's dynamic linear alone gives a whole batch
  one range), means a token's output never depends on the other rows of a multi-row batch, and the
  attention-sink token, whose activations are hundreds of times larger than the rest, no longer flattens
  every other token of a prefill to a few levels. torch marks fbgemm's quantized-tensor API deprecated; both
  kernels sit in `Int8Linear` alone, so they can be swapped (torchao) in one place.

`int8_speedup(...)` times float32 against int8 on the model's own shapes, so a server can choose per machine,
and `measure_kernel_plan(...)` does so per row count: on CPUs whose int8 matmul is slow (AVX2 without VNNI,
where `torch._int_mm` is a scalar loop) multi-row steps can run 10-25x slower in int8 than in float32. A layer
given a plan (`KernelPlan`: row-count bucket -> "int8" or "float32") keeps its float32 weight as well and runs
each call with the kernel measured faster for that many rows, so int8 never makes a step slower than float32.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

METHODS = ("int8",)
# rows.bit_length() -> "int8" or "float32"; more rows than the largest bucket follow that bucket
KernelPlan = dict[int, str]


def plan_buckets(plan: KernelPlan) -> dict[str, str]:
    """A plan as readable ranges, e.g. {"1-1 rows": "int8", "2-3 rows": "float32"} (for logs and stats)."""
    return {f"{1 << (bits - 1)}-{(1 << bits) - 1} rows": kernel for bits, kernel in sorted(plan.items())}


class Int8Linear(nn.Module):
    """`y = x W^T + b` with W as per-channel int8 and x quantized per row to int8 on each call."""

    def __init__(self, linear: nn.Linear, plan: KernelPlan | None = None) -> None:
        """`plan`, when it sends some row counts to float32, makes the layer keep the float32 weight too."""
        super().__init__()
        self.plan = plan or {}
        self._top = max(self.plan, default=0)
        keep_float = "float32" in self.plan.values()
        self.register_buffer("weight_f", linear.weight.detach().float() if keep_float else None, persistent=False)
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        qweight = (weight / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        # [in, out] as a transposed view of the [out, in] rows: the layout _int_mm reads fastest on the CPU
        self.register_buffer("qweight_t", qweight.t(), persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(), persistent=False)
        with warnings.catch_warnings():  # the deprecation is known; this class is the one place to swap it
            warnings.simplefilter("ignore", UserWarning)
            per_channel = torch._make_per_channel_quantized_tensor(
                qweight, scales.double(), torch.zeros_like(scales, dtype=torch.int64), 0)
        # the same int8 weights packed a second time for fbgemm's single-row kernel (int8 memory doubles, still
        # half of float32's)
        self._packed = torch.ops.quantized.linear_prepack(per_channel, self.bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if self.weight_f is not None and self.plan.get(min(rows.shape[0].bit_length(), self._top)) == "float32":
            y = F.linear(rows, self.weight_f, self.bias)
        elif rows.shape[0] == 1:
            y = torch.ops.quantized.linear_dynamic(rows, self._packed, True)
        else:
            row_scales = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
            qrows = (rows / row_scales).round_().to(torch.int8)
            y = torch._int_mm(qrows, self.qweight_t).float().mul_(row_scales).mul_(self.scales)
            if self.bias is not None:
                y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quantize_linears(model: nn.Module, method: str, plan: KernelPlan | None = None) -> nn.Module:
    """Replace every `nn.Linear` of `model` (on the CPU) by its `method` version, in place, each following
    `plan` (see `Int8Linear`); returns `model`."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {list(METHODS)}")
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        if module.weight.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on the CPU only; {name} is on {module.weight.device}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module, plan))
    return model


def measure_kernel_plan(shapes: list[tuple[int, int]], max_rows: int, repeats: int = 3) -> KernelPlan:
    """For each power-of-two row count up to `max_rows`, the faster of int8 and float32 over linears of `shapes`
    (out, in), timed here; a bucket where int8 is not faster runs float32."""
    layers = [nn.Linear(k, n, bias=False) for n, k in shapes]
    quantized = [Int8Linear(layer) for layer in layers]
    plan: KernelPlan = {}
    rows = 1
    while rows <= max_rows:
        faster = _speedup(layers, quantized, shapes, rows, repeats) > 1.0
        plan[rows.bit_length()] = "int8" if faster else "float32"
        rows *= 2
    return plan


def int8_speedup(shapes: list[tuple[int, int]], batch: int = 1, repeats: int = 20) -> float:
    """Time of float32 over int8 for one pass through linears of `shapes` (out, in) at `batch` rows."""
    layers = [nn.Linear(k, n, bias=False) for n, k in shapes]
    return _speedup(layers, [Int8Linear(layer) for layer in layers], shapes, batch, repeats)


def _speedup(layers: list[nn.Module], quantized: list[nn.Module], shapes: list[tuple[int, int]], batch: int,
             repeats: int) -> float:
    x = {k: torch.randn(batch, k) for _, k in shapes}

    def timed(modules: list[nn.Module]) -> float:
        with torch.no_grad():
            for module, (_, k) in zip(modules, shapes):  # warm-up
                module(x[k])
            start = time.perf_counter()
            for _ in range(repeats):
                for module, (_, k) in zip(modules, shapes):
                    module(x[k])
            return time.perf_counter() - start

    return timed(layers) / timed(quantized)
