"""EXAONE 4: OLMo 2's post-norm layer with per-head q/k norms, three sliding-window layers to each global one
(`sliding_window_pattern`, `layer_types`); where the model has sliding layers, its global layers take no rotary
embedding (NoPE), as transformers' Exaone4Attention runs them."""

from typing import Any

from ringserve.actors.engine.models.spec import ArchSpec, layer_type


def _rotary_layer(config: Any, layer: int) -> bool:
    return config.sliding_window is None or layer_type(config, layer) == "sliding_attention"


SPEC = ArchSpec(name="exaone4", qk_norm=True, post_norms=True, rotary_layer=_rotary_layer)
