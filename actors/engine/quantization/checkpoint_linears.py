"""A GPTQ or AWQ checkpoint's linears as our packed int4 weights, by our model's module names: each one's codes
read once (kernels/cpu/checkpoint_codes.py), the sibling linears our model fuses (q/k/v,
gate/up) concatenated row by row as their float weights are (`fuse_hf_state_dict`), and packed as q4_k; with
GPTQ's `desc_act`, each linear's input order too (the siblings share their input, so they must share it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ringserve.actors.common.model_source import ModelSource, resolved_config
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.models.weights import (
    checkpoint_method, checkpoint_quantization, fuse_hf_state_dict, safetensors_files,
)
from ringserve.kernels.cpu.checkpoint_codes import CODE_TENSORS, LinearCodes, read_linear_codes
from ringserve.kernels.cpu.packed_weight import PackedWeight

PARTS = ("codes", "scale32", "min32")


@dataclass
class CheckpointLinears:
    """A checkpoint's quantized linears by our module name: packed, and the input order of those reordered."""

    packed: dict[str, PackedWeight]
    input_orders: dict[str, torch.Tensor]


def checkpoint_method_of(source: ModelSource | None) -> str:
    """The quantization method of a safetensors checkpoint (its config's quantization_config), else "none"."""
    if source is None or source.gguf_file is not None:
        return "none"
    return checkpoint_method(resolved_config(source))


def read_code_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The code tensors (qweight, qzeros, scales, g_idx) of the checkpoint in `directory`, as stored."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.rpartition(".")[2] in CODE_TENSORS:
                    tensors[name] = f.get_tensor(name)
    return tensors


def checkpoint_packed_linears(model: CausalLM, source: ModelSource) -> CheckpointLinears:
    """Every quantized linear of the GPTQ/AWQ checkpoint `source` packed as q4_k, by `model`'s module name."""
    if model.spec.prepare_weights is not None:
        raise ValueError(f"a {checkpoint_method_of(source)} checkpoint of {model.spec.name} is not served: its "
                         "weights are rearranged at load, which its packed codes are not")
    quantization = checkpoint_quantization(resolved_config(source))
    codes = read_linear_codes(read_code_tensors(Path(source.directory)), quantization)
    fused = {part: fuse_hf_state_dict({f"{name}.weight": getattr(c, part) for name, c in codes.items()},
                                      model.spec.hf_fusions, model.spec.hf_renames) for part in PARTS}
    # each linear's order as a row, so that fusing stacks its siblings' orders
    orders = fuse_hf_state_dict({f"{name}.weight": (c.order if c.order is not None else torch.arange(
        c.codes.shape[1]))[None] for name, c in codes.items()}, model.spec.hf_fusions, model.spec.hf_renames)
    out = CheckpointLinears({}, {})
    for name in fused["codes"]:
        module = name.removesuffix(".weight")
        out.packed[module] = LinearCodes(*(fused[part][name] for part in PARTS)).pack()
        order = orders[name]
        if not torch.equal(order, order[:1].expand_as(order)):
            raise ValueError(f"{module}: the linears it fuses order their inputs differently (desc_act): not served")
        if not torch.equal(order[0], torch.arange(order.shape[1])):
            out.input_orders[module] = order[0].contiguous()
    return out
