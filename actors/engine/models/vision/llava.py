"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP tower, the hidden states of `vision_feature_layer`
(one layer, or several concatenated), the first token (CLIP's class token) dropped under the "default" strategy
(kept under "full"), and a 2-layer projector (`linear_1`, `projector_hidden_act`, `linear_2`) into any registry text family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.models.spec import ArchSpec
from ringserve.actors.engine.models.vision.vision_lm import VisionCausalLM, namespace
from ringserve.actors.engine.models.vision.vit import VisionTower, activation

STRATEGIES = ("default", "full")


class LlavaProjector(nn.Module):
    """`linear_2(act(linear_1(features)))`."""

    def __init__(self, config: Any, vision_dim: int, text_dim: int, layers: int) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(vision_dim * layers, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        self.act = activation(config.projector_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Llava(VisionCausalLM):
    """LLaVA over the text family of its `text_config`."""

    def __init__(self, config: Any, text_spec: ArchSpec, plan: ExecutionPlan = ExecutionPlan()) -> None:
        super().__init__(config, text_spec, plan)
        vision = namespace(config.vision_config)
        self.vision_tower = VisionTower(vision)
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r}: served are "
                             f"{', '.join(STRATEGIES)}")
        layers = config.vision_feature_layer
        count = vision.num_hidden_layers
        self.feature_layers = [x if x >= 0 else count + 1 + x for x in ([layers] if isinstance(layers, int)
                                                                        else layers)]
        self.multi_modal_projector = LlavaProjector(config, vision.hidden_size, self.config.hidden_size,
                                                    len(self.feature_layers))
        patches = (vision.image_size // vision.patch_size) ** 2
        # "default" drops the first token, as transformers does whatever the tower: CLIP's class token (SigLIP's
        # first patch, which its processor counts out too)
        self._tokens = patches + self.vision_tower.clip - (self.strategy == "default")

    def image_tokens(self, tensors: dict[str, Any]) -> int:
        return self._tokens

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower.hidden_states(pixel_values, max(self.feature_layers))
        picked = [states[i] for i in self.feature_layers]
        if self.strategy == "default":
            picked = [s[:, 1:] for s in picked]
        features = torch.cat(picked, dim=-1)  # [N, L, D * layers]
        n, length, _ = features.shape
        out = self.multi_modal_projector(features.reshape(n * length, -1))
        return out.reshape(n, length, -1).to(self.dtype)
