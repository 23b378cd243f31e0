"""Quantized linear layers behind one small interface, swapped into a model from outside, each call running the
kernel measured fastest on this host for its shape and row count.

`quantize_linears(model, method, plan)` replaces the model's `nn.Linear` layers (projections and LM head) with
`QuantLinear`s; the model code knows nothing of it (gpt-fast's approach). Methods and their kernels:

- `int8`: `q8_0`, our C++ group kernel (`ringserve.kernels.cpu`: int8 weights with an fp16 scale per 32 input values,
  activations quantized to int8 per block of 32, AVX-512 VNNI or AVX2), or `int_mm`: per-output-channel int8
  weights with one activation scale per row, multiplied by `torch._int_mm` (fbgemm's dynamic linear for a
  single row). `int_mm` has no fast path on AVX2 CPUs without VNNI, where it is a scalar loop (10-25x slower
  than float32 at 8-32 rows), and its per-row scales cost quality (SmolLM2 greedy agreement 26% of tokens).
- `int4`: `q4_1`, our group kernel with 4-bit weights, an fp16 scale and min per 32 (llama.cpp's Q4_1). The
  LM head stays int8, as llama.cpp's 4-bit files keep it (SmolLM2's Q4_1 GGUF has a Q8_0 embedding/head):
  on SmolLM2 a 4-bit head cut greedy agreement with float32 from 54% of tokens to 22%.
- `gguf`: each layer's weight as its GGUF file stores it (`q8_0`, `q4_0` or `q4_1` blocks, packed as they are
  by actors/engine/models/gguf_blocks.py, never requantized), through our group kernel of that format.
- Every method may also run its float32 weight (the layer then keeps it as well) by torch's `float32` or by
  oneDNN's `onednn` matmul (kernels/float_linear.py), where those measure faster than its quantized kernels.

A `KernelPlan` (kernels/linear_plan.py) maps each linear shape `(out, in)` to its kernel per row-count bucket.
`measure_kernel_plan` times every candidate side by side on the model's own shapes at the row counts the
server runs and keeps the fastest that is not slower than float32, so `--quantization` never makes a step
slower; the result is cached on disk per host (`ringserve.kernels.cpu.plan_cache`). A token's output never depends on
the other rows of its batch: every kernel scales activations per row (or per row and block).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu import plan_cache
from ringserve.kernels.cpu.packing import FORMATS, PackedWeight, pack
from ringserve.kernels.float_linear import onednn_available, onednn_linear
from ringserve.kernels.linear_plan import KernelPlan, ShapePlan, kernel_for, plan_from_times

log = logging.getLogger("ringserve.kernels.quantization")
METHODS = ("int8", "int4", "gguf")
GROUP_KERNELS = FORMATS  # one per packed weight format (kernels/cpu/packing.py)
# candidates per method (or per GGUF block format) in order of quality (a better one wins a near tie, see
# choose_kernel)
CANDIDATES = {"int8": ("q8_0", "int_mm"), "int4": ("q4_1",), **{fmt: (fmt,) for fmt in GROUP_KERNELS}}
HEAD_NAMES = ("lm_head",)  # linears int4 keeps at int8
FLOAT_WEIGHT_KERNELS = ("float32", "onednn")  # the kernels that read the float32 weight
FLOAT_MARGIN = 0.95  # another kernel must measure at least 5% faster than torch's float32 to be chosen (noise)
NEAR_TIE = 1.10  # a better-quality kernel within 10% of the fastest is taken instead


# fbgemm's packed weights of every int_mm layer, by its int8 weight's address. A compiled decode graph cannot take
# the packed weight (a TorchScript object Dynamo does not trace: "Failed to convert args/kwargs to proxy"), so
# it calls `ringserve::int8_row_linear` with the layer's tensors, and the op finds the packed weight here.
_FBGEMM_PACKED: dict[int, Any] = {}
_LIBRARY = torch.library.Library("ringserve", "FRAGMENT")
_LIBRARY.define("int8_row_linear(Tensor x, Tensor qweight_t) -> Tensor")


def _int8_row_linear(x: torch.Tensor, qweight_t: torch.Tensor) -> torch.Tensor:
    """fbgemm's single-row dynamic int8 linear with the packed weight made for `qweight_t` (bias included)."""
    return torch.ops.quantized.linear_dynamic(x, _FBGEMM_PACKED[qweight_t.data_ptr()], True)


_LIBRARY.impl("int8_row_linear", _int8_row_linear, "CPU")


def _forget_packed(key: int, packed: Any) -> None:
    """Drop a freed layer's packed weight, unless a newer layer's weight took its address meanwhile."""
    if _FBGEMM_PACKED.get(key) is packed:
        del _FBGEMM_PACKED[key]


@torch.library.register_fake("ringserve::int8_row_linear")
def _int8_row_linear_fake(x: torch.Tensor, qweight_t: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight_t.shape[1])


def default_kernel(method: str) -> str:
    """The kernel a layer of `method` (or of a GGUF block format) runs without a plan: our group kernel (its
    torch fallback if not built)."""
    return {"int8": "q8_0", "int4": "q4_1"}.get(method, method)


class QuantLinear(nn.Module):
    """`y = x W^T + b` with W quantized; each call runs the kernel its `plan` names for that many rows."""

    def __init__(self, linear: nn.Linear, method: str = "int8", plan: ShapePlan | None = None,
                 hold: tuple[str, ...] = (), packed: PackedWeight | None = None) -> None:
        """Keeps only the weight formats the plan's kernels (and `hold`'s, for timing) read: float32 too when
        the plan has it. `packed`: the weight already quantized (a GGUF file's blocks, method "gguf"), used as
        it is for its format instead of quantizing `linear`'s."""
        super().__init__()
        if method not in METHODS and method not in GROUP_KERNELS:
            raise ValueError(f"unknown quantization {method!r}; choose one of {list(METHODS)}")
        if (method == "gguf") != (packed is not None):
            raise ValueError("a gguf layer is made from its packed blocks, and only it")
        self.method = method
        self.plan = dict(plan or {})
        self.default = packed.format if packed is not None else default_kernel(method)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        kernels = (set(self.plan.values()) or {self.default}) | set(hold)
        weight = linear.weight.detach().float()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(), persistent=False)
        # float32 weights are shared, not copied (a tied LM head keeps sharing the embedding's)
        self.register_buffer("weight_f", weight if kernels & set(FLOAT_WEIGHT_KERNELS) else None, persistent=False)
        self.packed: dict[str, PackedWeight] = {k: packed if packed is not None and k == packed.format
                                                else pack(weight, k) for k in kernels if k in GROUP_KERNELS}
        cpu_kernels.linear()  # loads the library (and the overload packed_linear calls)
        self.qweight_t = self.scales = self._fbgemm = None
        if "int_mm" in kernels:
            self._prepare_int_mm(weight)

    def _prepare_int_mm(self, weight: torch.Tensor) -> None:
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        qweight = (weight / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.qweight_t = qweight.t()  # [in, out] as a transposed view: the layout _int_mm reads fastest
        self.scales = scales
        with warnings.catch_warnings():  # the deprecation is known; this is the one place that uses it
            warnings.simplefilter("ignore", UserWarning)
            per_channel = torch._make_per_channel_quantized_tensor(
                qweight, scales.double(), torch.zeros_like(scales, dtype=torch.int64), 0)
        # fbgemm's single-row kernel (its one activation range is that row's: 7-bit asymmetric)
        self._fbgemm = torch.ops.quantized.linear_prepack(per_channel, self.bias)
        key = qweight.data_ptr()
        _FBGEMM_PACKED[key] = self._fbgemm
        weakref.finalize(self, _forget_packed, key, self._fbgemm)  # a swapped-out layer's goes with it

    def kernel_for(self, rows: int) -> str:
        """The kernel a call with `rows` rows runs."""
        return kernel_for(self.plan, rows, self.default)

    def packed_for(self, rows: int) -> PackedWeight | None:
        """The packed weight a call with `rows` rows reads, or None when its kernel is not a group kernel."""
        return self.packed.get(self.kernel_for(rows))

    def run(self, rows: torch.Tensor, kernel: str) -> torch.Tensor:
        """`rows` `[M, in]` float32 through `kernel` (one the layer holds the weights for)."""
        if kernel == "float32":
            return F.linear(rows, self.weight_f, self.bias)
        if kernel == "onednn":
            if torch.compiler.is_compiling():
                return torch.ops.ringserve.onednn_linear(rows, self.weight_f, self.bias)
            return onednn_linear(rows, self.weight_f, self.bias)
        if kernel in self.packed:
            return cpu_kernels.packed_linear(rows, self.packed[kernel], self.bias)
        if kernel == "int_mm":
            if rows.shape[0] == 1:
                if torch.compiler.is_compiling():
                    return torch.ops.ringserve.int8_row_linear(rows, self.qweight_t)
                return torch.ops.quantized.linear_dynamic(rows, self._fbgemm, True)
            row_scales = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
            qrows = (rows / row_scales).round_().to(torch.int8)
            y = torch._int_mm(qrows, self.qweight_t).float().mul_(row_scales).mul_(self.scales)
            return y.add_(self.bias) if self.bias is not None else y
        raise ValueError(f"this layer holds no weights for kernel {kernel!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        y = self.run(rows.contiguous(), self.kernel_for(rows.shape[0]))
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


Int8Linear = QuantLinear  # the name before int4 and the group kernels


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (out_features, in_features) of the model's `nn.Linear` layers."""
    return sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)})


def layer_method(name: str, method: str) -> str:
    """The method the linear called `name` is quantized with: int4 keeps the LM head at int8."""
    return "int8" if method == "int4" and name.rpartition(".")[2] in HEAD_NAMES else method


def quantize_linears(model: nn.Module, method: str, plan: KernelPlan | None = None,
                     packed: dict[str, PackedWeight] | None = None) -> nn.Module:
    """Replace every `nn.Linear` of `model` (on the CPU) by a `QuantLinear` of `method` (`layer_method`), in
    place, each following its shape's entry of `plan` (without one: the method's default for every row count).
    With method "gguf", `packed` holds every linear's weight (module name -> its GGUF blocks, packed)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {list(METHODS)}")
    packed = packed or {}
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        if module.weight.device.type != "cpu":
            raise ValueError(f"{method} quantization runs on the CPU only; {name} is on {module.weight.device}")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        shape_plan = (plan or {}).get((module.out_features, module.in_features))
        if method == "gguf" and name not in packed:
            raise ValueError(f"--quantization gguf: the GGUF file has no quantized weight for {name}")
        setattr(parent, child, QuantLinear(module, layer_method(name, method), shape_plan, packed=packed.get(name)))
    return model


def candidates(method: str) -> tuple[str, ...]:
    """Kernels timed for `method` on this host in quality order: the float32 weight's first (torch's, then
    oneDNN's where torch has it), then the method's. Our group kernels only when compiled (their torch fallback
    is far slower than float32); `int_mm` needs fbgemm."""
    out = ["float32", *(["onednn"] if onednn_available() else [])]
    for kernel in CANDIDATES[method]:
        if kernel in GROUP_KERNELS and not cpu_kernels.compiled():
            continue
        if kernel == "int_mm" and "fbgemm" not in torch.backends.quantized.supported_engines:
            continue
        out.append(kernel)
    return tuple(out)


def choose_kernel(times: dict[str, float], order: tuple[str, ...]) -> str:
    """The kernel to run given seconds per call: torch's float32 unless another kernel beats it by the margin;
    among those, the fastest, or the best-quality one (earliest in `order`) within `NEAR_TIE` of it."""
    fast = {k: t for k, t in times.items() if k != "float32" and t <= FLOAT_MARGIN * times["float32"]}
    if not fast:
        return "float32"
    best = min(fast.values())
    return next(k for k in order if k in fast and fast[k] <= NEAR_TIE * best)


def measure_kernel_plan(shape_rows: dict[tuple[int, int], list[int]], method: str = "int8", rounds: int = 5,
                        use_cache: bool = True) -> tuple[KernelPlan, dict[str, Any]]:
    """Time every candidate kernel of `method` on each shape (out, in) at each of its row counts, here; returns
    the plan (shape -> bucket -> kernel) and the measurements ({"times": {"out,in,rows": {kernel: seconds}},
    "cached": bool}). Cached on disk by host, torch, kernels and thread count."""
    order = candidates(method)
    key = plan_cache.host_key({"method": method, "candidates": list(order),
                               "shapes": sorted([list(s), sorted(r)] for s, r in shape_rows.items())})

    def measure() -> dict[str, dict[str, float]]:
        times = {}
        for (n, k), row_counts in shape_rows.items():
            layer = QuantLinear(nn.Linear(k, n, bias=False), method, hold=order)
            for rows in sorted(set(row_counts)):
                x = torch.randn(rows, k)
                fns = {kernel: (lambda kernel=kernel: layer.run(x, kernel)) for kernel in order}
                times[f"{n},{k},{rows}"] = plan_cache.time_interleaved(fns, rounds)
        return times

    times, cached = plan_cache.measured_times(key, measure, use_cache)
    plan = plan_from_times(times, lambda measured: choose_kernel(measured, order))
    return plan, {"times": times, "cached": cached, "candidates": order}


def speedup(times: dict[str, dict[str, float]], plan: KernelPlan, rows: int) -> float:
    """The fastest float32 kernel's time over the plan's for one pass through every measured shape at `rows`
    rows (what `--quantization auto` weighs: unquantized, the float32 linears run their fastest kernel too)."""
    base = chosen = 0.0
    for entry, measured in times.items():
        n, k, r = (int(v) for v in entry.split(","))
        if r == rows:
            base += min(measured[kernel] for kernel in FLOAT_WEIGHT_KERNELS if kernel in measured)
            chosen += measured[plan[(n, k)][r.bit_length()]]
    return base / chosen if chosen else 1.0

