"""Weight-only quantized linear layers behind one small interface, swapped into a model from outside.

`quantize_linears(model, method)` replaces the model's `nn.Linear` layers (projections and LM head) with
quantized ones; the model code knows nothing of it (gpt-fast's approach). One method so far:

- `int8`: per-output-channel symmetric int8 weights run by fbgemm's dynamic-int8 linear
  (`torch.ops.quantized.linear_dynamic`: activations are quantized per call). On AVX2 CPUs it is ~3x faster
  than float32 at batch 1, where decode is bound by reading weights. torch marks its quantized-tensor API
  deprecated; the kernel is kept in `Int8DynamicLinear` alone so it can be swapped (torchao) in one place.

`int8_speedup(...)` times float32 against int8 on the model's own shapes, so a server can choose per machine.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

METHODS = ("int8",)


class Int8DynamicLinear(nn.Module):
    """`y = x W^T + b` with W stored as per-channel int8 (fbgemm-packed); x stays float32."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():  # the deprecation is known; this class is the one place to swap it
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # reduce_range: 7-bit activations, so fbgemm's AVX2 u8*s8 pair sums cannot saturate int16
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float(), self._packed, True)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def quantize_linears(model: nn.Module, method: str) -> nn.Module:
    """Replace every `nn.Linear` of `model` (on the CPU) by its `method` version, in place; returns `model`."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {list(METHODS)}")
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        if module.weight.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on the CPU only; {name} is on {module.weight.device}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8DynamicLinear(module))
    return model


def int8_speedup(shapes: list[tuple[int, int]], batch: int = 1, repeats: int = 20) -> float:
    """Time of float32 over int8 for one pass through linears of `shapes` (out, in) at `batch` rows."""
    layers = [nn.Linear(k, n, bias=False) for n, k in shapes]
    quantized = [Int8DynamicLinear(layer) for layer in layers]
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
