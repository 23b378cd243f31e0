"""Quantized linear layers behind one small interface, swapped into a model from outside, each call running the
kernel its plan names for its row count.

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

A `KernelPlan` maps each linear shape `(out, in)` to its kernel per row-count bucket. The plan is measured,
cached and chosen by `ringserve.kernels.linear_plan` (the fastest kernel not slower than float32, so
`--quantization` never makes a step slower); a layer only runs it (`kernel_for`, `run`). Within one kernel a
token's output never depends on the other rows of its batch (every kernel scales activations per row, or per
row and block); but the plan may choose another kernel for another row count, so a token computed in a batch
of 4 may differ slightly from the same token computed alone, unless the plan is row-invariant
(`--enable-deterministic-inference`, kernels/linear_plan/invariant.py).
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
from ringserve.kernels.cpu.packing import FORMATS, PackedWeight, pack
from ringserve.kernels.float_linear import onednn_linear
from ringserve.kernels.linear_plan.plan import KernelPlan, ShapePlan, kernel_for

log = logging.getLogger("ringserve.kernels.quantization")
# the methods whose layers are made from codes already packed (a GGUF file's blocks; a GPTQ or AWQ checkpoint's
# 4-bit groups, kernels/cpu/checkpoint_codes.py), never quantized here
CHECKPOINT_METHODS = ("gptq", "awq")  # their layers run the codes' kernel at every row count: no float copy is kept
PACKED_METHODS = ("gguf", *CHECKPOINT_METHODS)
METHODS = ("int8", "int4", *PACKED_METHODS)
GROUP_KERNELS = FORMATS  # one per packed weight format (kernels/cpu/packing.py)
HEAD_NAMES = ("lm_head",)  # linears int4 keeps at int8
FLOAT_WEIGHT_KERNELS = ("float32", "onednn")  # the kernels that read the float32 weight


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
                 hold: tuple[str, ...] = (), packed: PackedWeight | None = None,
                 input_order: torch.Tensor | None = None) -> None:
        """Keeps only the weight formats the plan's kernels (and `hold`'s, for timing them) read: float32 too when
        the plan has it. `packed`: the weight already quantized (a GGUF file's blocks, method "gguf"), used as
        it is for its format instead of quantizing `linear`'s. `input_order`: the packed weight's columns are the
        inputs in this order (a GPTQ `desc_act` checkpoint's, sorted by group), so each call's rows are reordered
        the same way first."""
        super().__init__()
        if method not in METHODS and method not in GROUP_KERNELS:
            raise ValueError(f"unknown quantization {method!r}; choose one of {list(METHODS)}")
        if (method in PACKED_METHODS) != (packed is not None):
            raise ValueError(f"a {'/'.join(PACKED_METHODS)} layer is made from its packed codes, and only it")
        self.method = method
        self.plan = dict(plan or {})
        self.default = packed.format if packed is not None else default_kernel(method)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        kernels = (set(self.plan.values()) or {self.default}) | set(hold)
        weight = linear.weight.detach().float()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float(), persistent=False)
        self.register_buffer("input_order", input_order, persistent=False)
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
        """The packed weight a call with `rows` rows reads, or None when its kernel is not a group kernel or its
        inputs are reordered first (`input_order`: only `forward` does that)."""
        return None if self.input_order is not None else self.packed.get(self.kernel_for(rows))

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
        if self.input_order is not None:
            rows = rows.index_select(1, self.input_order)
        y = self.run(rows.contiguous(), self.kernel_for(rows.shape[0]))
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


Int8Linear = QuantLinear  # the name before int4 and the group kernels


def layer_method(name: str, method: str) -> str:
    """The method the linear called `name` is quantized with: int4 keeps the LM head at int8."""
    return "int8" if method == "int4" and name.rpartition(".")[2] in HEAD_NAMES else method


def quantize_linears(model: nn.Module, method: str, plan: KernelPlan | None = None,
                     packed: dict[str, PackedWeight] | None = None) -> nn.Module:
    """Replace every `nn.Linear` of `model` (on the CPU) by a `QuantLinear` of `method` (`layer_method`), in
    place, each following its shape's entry of `plan` (without one: the method's default for every row count).
    With a method of PACKED_METHODS, `packed` holds the linears' GGUF blocks or checkpoint codes (module name ->
    packed); a linear it lacks (the file stores it as floats) stays as it is."""
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
        if method in PACKED_METHODS and name not in packed:
            continue  # stored as floats in the file: it runs its float weights
        setattr(parent, child, QuantLinear(module, layer_method(name, method), shape_plan, packed=packed.get(name)))
    return model
