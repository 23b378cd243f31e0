"""`VisionCausalLM`: a registry text model (a `CausalLM` of the checkpoint's `text_config`, so everything the
engine does with a model works unchanged) that also turns images into embeddings for its image tokens.

A family subclass (vision/llava.py, vision/gemma3.py, vision/qwen2_vl.py) builds the tower and projector, checks
an image's tensors and says how many image tokens it makes (`check_image`); `embed_image_batch` runs them for a
batch of images. The checkpoint's tensors map onto ours by
`VISION_RENAMES` (transformers 5's in-memory `model.language_model.*`, `model.vision_tower.*`, ... and the older
saved `language_model.model.*`, `vision_tower.vision_model.*` layouts alike).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.models.spec import ArchSpec

# checkpoint name -> ours, applied before the text family's own renames and fusions
VISION_RENAMES = (
    (r"^(?:model\.)?language_model\.lm_head\.", "lm_head."),
    (r"^model\.language_model\.(?:model\.)?", "model."),
    (r"^language_model\.model\.", "model."),
    (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?", "vision_tower."),
    (r"^(?:model\.)?multi_modal_projector\.", "multi_modal_projector."),
)
# tensors a vision checkpoint may carry that no model here reads: SigLIP's pooling head, position-id buffers
UNUSED_VISION_TENSORS = ("vision_tower.head.", "vision_tower.embeddings.position_ids")


def namespace(config: Any) -> Any:
    """A sub-config as attributes: resolved configs (model_source.resolved_config) keep them as dicts."""
    return SimpleNamespace(**config) if isinstance(config, dict) else config


class VisionCausalLM(CausalLM):
    """The text model of a vision-language checkpoint, with its vision tower and projector.

    `image_token_id`: the token the processor repeats for each image's embeddings; `bidirectional_images`: an
    image's tokens attend to each other both ways in prefill (Gemma 3), so no chunk may split them.
    """

    bidirectional_images = False

    def __init__(self, config: Any, text_spec: ArchSpec, plan: ExecutionPlan = ExecutionPlan()) -> None:
        super().__init__(namespace(config.text_config), text_spec, plan)
        self.vision_config = config
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        # our renames first, then the text family's; its last change to the tensors after ours
        self.spec = dataclasses.replace(text_spec, hf_renames=VISION_RENAMES + text_spec.hf_renames,
                                        prepare_weights=self._prepare_weights)
        self._text_prepare = text_spec.prepare_weights

    def _prepare_weights(self, tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        tensors = {name: t for name, t in tensors.items() if not name.startswith(UNUSED_VISION_TENSORS)}
        return tensors if self._text_prepare is None else self._text_prepare(tensors, self.config)

    def image_tokens(self, tensors: dict[str, Any]) -> int:
        """How many image tokens the processor makes for one image with these processed tensors."""
        raise NotImplementedError

    def check_image(self, tensors: dict[str, Any]) -> int:
        """How many image tokens one image with these processed tensors makes; ValueError saying what is wrong
        with them. Here: `pixel_values` of one square image of the tower's size."""
        pixels = tensors.get("pixel_values")
        if pixels is None:
            raise ValueError(f"no pixel_values among its tensors ({', '.join(tensors)})")
        size = self.vision_tower.image_size
        shape = list(torch.as_tensor(pixels).shape)
        if shape != [1, 3, size, size]:
            raise ValueError(f"pixel_values of shape {shape}, the model takes [1, 3, {size}, {size}]")
        return self.image_tokens(tensors)

    def image_rope(self, tensors: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
        """M-RoPE models (models/mrope.py): the image's tokens' `[3, length]` rope positions after its first, and
        how far the rope position of the text after it moves on; None for every other model."""
        return None

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images `[N, 3, H, W]` -> their image tokens' embeddings `[N, image_tokens, C]` in the model's dtype."""
        raise NotImplementedError

    def embed_image_batch(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's token embeddings `[length, C]` from its tensors (`check_image` passed), in one batch."""
        return list(self.embed_images(torch.cat([image["pixel_values"] for image in images])))
