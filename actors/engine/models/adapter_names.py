"""Where a PEFT adapter's checkpoint module names land in our models: the one place LoRA code learns names.

An adapter names the Hugging Face module it adapts (`model.layers.0.self_attn.q_proj`); our model renames
some of them (the family's `hf_renames`) and fuses sibling projections (`hf_fusions`: q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`). `adapter_target` maps a name to our linear and the part of its rows the
adapter's B fills; `fused_rows` gives those parts' sizes. Only the dense decoder projections take adapters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ringserve.actors.engine.models.causal_lm import CausalLM

ADAPTABLE = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
LAYER_PATH = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class AdapterTarget:
    """Our linear (`layer`, `module` as in `ADAPTABLE`) and which of its fused parts (`part` of `parts`)."""

    layer: int
    module: str
    part: int
    parts: int


def check_adaptable(model: CausalLM) -> None:
    """ValueError unless `model` is a dense family whose layers all have the `ADAPTABLE` linears."""
    if model.spec.moe is not None or model.spec.mla:
        raise ValueError(f"LoRA adapters are served for dense families only, not {model.spec.name!r} "
                         "(mixture-of-experts or latent attention)")


def adapter_target(model: CausalLM, hf_module: str) -> AdapterTarget:
    """Our linear for the HF module path `hf_module`; ValueError naming it when it is not one we adapt."""
    check_adaptable(model)
    name = hf_module + ".weight"
    for pattern, replacement in model.spec.hf_renames:
        name = re.sub(pattern, replacement, name)
    name = name.removesuffix(".weight")
    parent, _, leaf = name.rpartition(".")
    fused, part, parts = leaf, 0, 1
    for fused_name, members in model.spec.hf_fusions.items():
        if leaf in members:
            fused, part, parts = fused_name, members.index(leaf), len(members)
    match = LAYER_PATH.fullmatch(f"{parent}.{fused}")
    if match is None or match[2] not in ADAPTABLE or int(match[1]) >= model.num_layers:
        raise ValueError(f"LoRA on {hf_module!r} is not supported: adapters may target the decoder layers' "
                         "q/k/v/o and gate/up/down projections only")
    return AdapterTarget(int(match[1]), match[2], part, parts)


def fused_rows(owner: nn.Module, module: str) -> list[int]:
    """The output rows of each part of our linear `module` (an `ADAPTABLE` leaf) of `owner` (its attention or
    MLP block), in row order."""
    leaf = module.rpartition(".")[2]
    if leaf == "qkv_proj":
        return [owner.q_size, owner.kv_size, owner.kv_size]
    if leaf == "gate_up_proj":
        return [owner.inner, owner.inner]
    return [getattr(owner, leaf).out_features]
