"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP tower's last hidden state, average-pooled to
`mm_tokens_per_image` tokens, Gemma's RMSNorm (`mm_soft_emb_norm`) and a projection matrix
(`mm_input_projection_weight`) into the Gemma 3 text model. An image's tokens attend to each other both ways in
prefill (transformers' `token_type_ids` mask), so its run is never split across prefill chunks. Pan-and-scan
crops come from the tokenizer as images of their own (actors/tokenizer/images.py), each its own run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.actors.engine.models.blocks import RMSNorm
from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.models.spec import ArchSpec
from ringserve.actors.engine.models.vision.vision_lm import VisionCausalLM, namespace
from ringserve.actors.engine.models.vision.vit import VisionTower


class Gemma3Projector(nn.Module):
    """Pool the `P x P` patch grid to `T x T` tokens, RMS-normalize, project to the text width."""

    def __init__(self, vision: Any, text_dim: int, tokens: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_dim))
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, unit_offset=True)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.kernel = self.patches_per_side // int(tokens ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(n, dim, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [N, T, D]
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(VisionCausalLM):
    """Gemma 3 with its SigLIP tower."""

    bidirectional_images = True

    def __init__(self, config: Any, text_spec: ArchSpec, plan: ExecutionPlan = ExecutionPlan()) -> None:
        super().__init__(config, text_spec, plan)
        vision = namespace(config.vision_config)
        self.vision_tower = VisionTower(vision)
        self._tokens = int(config.mm_tokens_per_image)
        self.multi_modal_projector = Gemma3Projector(vision, self.config.hidden_size, self._tokens)

    def image_tokens(self, tensors: dict[str, Any]) -> int:
        return self._tokens

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower.last_hidden_state(pixel_values)).to(self.dtype)
