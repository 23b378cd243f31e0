"""A Hugging Face state dict in our model's names: renames, stacked experts split per expert, and the sibling
linears our model fuses (q/k/v, gate/up) concatenated row by row."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch


def fuse_hf_state_dict(tensors: dict[str, torch.Tensor], fusions: Mapping[str, tuple[str, ...]],
                       renames: tuple[tuple[str, str], ...] = ()) -> dict[str, torch.Tensor]:
    """A HF state dict in our model's names: `renames` applied, stacked experts (`experts.gate_up_proj`
    `[E, 2I, C]`, as transformers holds them in memory) split into one linear per expert, and the sibling
    linears `fusions` names (q/k/v, gate/up; weights and biases) concatenated into our fused linear's."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        stacked = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if stacked is not None and tensor.dim() == 3:
            out.update({f"{stacked[1]}.{e}.{stacked[2]}.weight": w for e, w in enumerate(tensor.unbind(0))})
        else:
            out[name] = tensor
    for fused, parts in fusions.items():
        for match in [m for m in map(re.compile(rf"(|.*\.){parts[0]}\.(weight|bias)").fullmatch, list(out)) if m]:
            parent, kind = match[1], match[2]
            names = [f"{parent}{part}.{kind}" for part in parts]
            if all(n in out for n in names):
                out[f"{parent}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out
