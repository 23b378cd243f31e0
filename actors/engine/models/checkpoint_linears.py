"""A GPTQ or AWQ checkpoint's quantized linears put into our model as they load, never as floats: each one's
codes read from the state dict (kernels/cpu/checkpoint_codes.py), the sibling linears our model fuses (q/k/v,
gate/up, each expert's) concatenated row by row as float weights are (`fuse_hf_state_dict`), packed once as
q4_k, and each becomes a `QuantLinear` of the checkpoint's method with its bias; with GPTQ's `desc_act`, its
input order too (siblings share their input, so they must share it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ringserve.actors.engine.models.hf_fusion import fuse_hf_state_dict
from ringserve.actors.engine.models.spec import ArchSpec
from ringserve.kernels.cpu.checkpoint_codes import CODE_TENSORS, LinearCodes, read_linear_codes
from ringserve.kernels.quantization import QuantLinear

PARTS = ("codes", "scale32", "min32")


def without_code_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` less every quantized linear's code tensors (qweight, qzeros, scales, g_idx)."""
    linears = {n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")}
    return {n: t for n, t in tensors.items()
            if not (n.rpartition(".")[2] in CODE_TENSORS and n.rpartition(".")[0] in linears)}


def checkpoint_linears(tensors: Mapping[str, torch.Tensor], quantization: Mapping[str, Any],
                       spec: ArchSpec) -> dict[str, tuple[LinearCodes, torch.Tensor | None]]:
    """Every quantized linear of a GPTQ/AWQ state dict by our module name: its fused codes and input order."""
    if spec.prepare_weights is not None:
        raise ValueError(f"a {quantization.get('quant_method')} checkpoint of {spec.name} is not served: its "
                         "weights are rearranged at load, which its packed codes are not")
    codes = read_linear_codes(tensors, quantization)

    def fused(part: Any) -> dict[str, torch.Tensor]:
        return fuse_hf_state_dict({f"{name}.weight": part(c) for name, c in codes.items()}, spec.hf_fusions,
                                  spec.hf_renames)

    parts = {part: fused(lambda c, part=part: getattr(c, part)) for part in PARTS}
    # each linear's order as a row, so that fusing stacks its siblings' orders
    orders = fused(lambda c: (c.order if c.order is not None else torch.arange(c.codes.shape[1]))[None])
    out: dict[str, tuple[LinearCodes, torch.Tensor | None]] = {}
    for name, order in orders.items():
        module = name.removesuffix(".weight")
        if not torch.equal(order, order[:1].expand_as(order)):
            raise ValueError(f"{module}: the linears it fuses order their inputs differently (desc_act): not served")
        same = torch.equal(order[0], torch.arange(order.shape[1]))
        out[module] = LinearCodes(*(parts[part][name] for part in PARTS)), None if same else order[0].contiguous()
    return out


def install_checkpoint_linears(model: nn.Module, linears: dict[str, tuple[LinearCodes, torch.Tensor | None]],
                               tensors: dict[str, torch.Tensor], method: str) -> None:
    """Replace each of `model`'s linears that `linears` names by a `QuantLinear` of `method` on its packed codes
    (its bias popped from `tensors`, our model's names, so the rest load as they are)."""
    for name, (codes, order) in linears.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = tensors.pop(f"{name}.bias", None)
        shape = codes.codes.shape
        linear = nn.Linear(shape[1], shape[0], bias=bias is not None, device="meta")
        layer = QuantLinear(linear, method, packed=codes.pack(), input_order=order)
        layer.bias = None if bias is None else bias.detach().float()
        setattr(parent, child, layer)
