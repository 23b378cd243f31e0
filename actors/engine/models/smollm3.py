"""SmolLM3: Llama's layer with no rotary embedding in every fourth layer (`no_rope_layers[i]` is 0 there: a
NoPE layer attends by content alone), and sliding windows on the layers `layer_types` names when
`use_sliding_window` is set. The fused CPU decode-layer op computes its rotary layers."""

from typing import Any

from ringserve.actors.engine.models.spec import ArchSpec


def _rotary_layer(config: Any, layer: int) -> bool:
    return bool(config.no_rope_layers[layer])


SPEC = ArchSpec(name="smollm3", rotary_layer=_rotary_layer, fused_cpu_decode=True)
