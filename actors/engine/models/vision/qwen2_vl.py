"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the
dynamic-resolution tower of vision/qwen2_vl_tower.py (`visual.*`) over a Qwen2 text model rotating by M-RoPE
(models/mrope.py).

An image is its processor's flattened patches `[t*h*w, C*T*P*P]` and its `image_grid_thw` `[1, 3]`; it makes
`t*h*w / merge^2` image tokens, in merge-block row-major order, whose rope positions are the merged grid's
(t, row, column) after the image's start (`image_rope`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.models.mrope import image_offsets, use_mrope
from ringserve.actors.engine.models.spec import ArchSpec
from ringserve.actors.engine.models.vision.qwen2_vl_tower import Qwen2VisionTower
from ringserve.actors.engine.models.vision.vision_lm import VisionCausalLM, namespace

# checkpoint name -> ours: transformers 5's `model.visual.*` and the older saved `visual.*`
TOWER_RENAMES = ((r"^(?:model\.)?visual\.", "visual."),)
PATCH_WEIGHT = "visual.patch_embed.proj.weight"


class Qwen2VL(VisionCausalLM):
    """Qwen2-VL, or Qwen2.5-VL (`gated`: its windowed tower with RMSNorms and gated MLPs)."""

    gated = False

    def __init__(self, config: Any, text_spec: ArchSpec, plan: ExecutionPlan = ExecutionPlan()) -> None:
        super().__init__(config, text_spec, plan)
        vision = namespace(config.vision_config)
        self.visual = Qwen2VisionTower(vision, self.gated, plan.norm_rotary_kernels)
        self.merge = int(vision.spatial_merge_size)
        if not use_mrope(self.model, self.config):
            raise ValueError("a Qwen2-VL text config without an mrope_section in its rope parameters")
        self.spec = dataclasses.replace(self.spec, hf_renames=TOWER_RENAMES + self.spec.hf_renames)

    def _prepare_weights(self, tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        patch = tensors.get(PATCH_WEIGHT)
        if patch is not None and patch.dim() == 5:  # the Conv3d's [D, C, T, P, P] as a linear's [D, C*T*P*P]
            tensors = {**tensors, PATCH_WEIGHT: patch.reshape(patch.shape[0], -1)}
        return super()._prepare_weights(tensors, config)

    def _grid(self, tensors: dict[str, Any]) -> tuple[int, int, int]:
        grid = tensors.get("image_grid_thw")
        if grid is None:
            raise ValueError(f"no image_grid_thw among its tensors ({', '.join(tensors)})")
        values = [int(v) for v in torch.as_tensor(grid).reshape(-1).tolist()]
        if len(values) != 3 or min(values) < 1 or values[1] % self.merge or values[2] % self.merge:
            raise ValueError(f"image_grid_thw {values}: the model takes one [t, h, w] grid of h and w multiples "
                             f"of {self.merge}")
        return values[0], values[1], values[2]

    def check_image(self, tensors: dict[str, Any]) -> int:
        t, h, w = self._grid(tensors)
        shape = list(torch.as_tensor(tensors["pixel_values"]).shape)
        if shape != [t * h * w, self.visual.in_features]:
            raise ValueError(f"pixel_values of shape {shape}, the model takes [{t * h * w}, "
                             f"{self.visual.in_features}] for grid {[t, h, w]}")
        return self.image_tokens(tensors)

    def image_tokens(self, tensors: dict[str, Any]) -> int:
        t, h, w = self._grid(tensors)
        return t * h * w // self.merge ** 2

    def image_rope(self, tensors: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
        return image_offsets(self._grid(tensors), self.merge)

    def embed_image_batch(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = torch.cat([image["pixel_values"] for image in images])
        return [e.to(self.dtype) for e in self.visual(pixels, [self._grid(image) for image in images])]


class Qwen2_5_VL(Qwen2VL):
    """Qwen2.5-VL."""

    gated = True
