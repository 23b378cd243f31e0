"""The vision tower: a ViT as CLIP and SigLIP build it (transformers' `CLIPVisionModel`/`SiglipVisionModel`,
checkpoint names kept): a patch convolution, learned positions (CLIP: after a class embedding), CLIP's pre-norm,
pre-norm encoder blocks (LayerNorm, self-attention over all patches, LayerNorm, MLP) and a post-norm.

Linears take `[rows, features]` inputs (patches of all images flattened), so quantized or planned linears
(kernels/) run them as they run the language model's. SigLIP's attention-pooling head is not built (no vision-
language model here reads it; its tensors are dropped at load).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.kernels.activations import ACTIVATIONS

TOWER_TYPES = ("clip_vision_model", "siglip_vision_model")


def activation(name: str) -> Any:
    """The activation a vision config names (`hidden_act`, `projector_hidden_act`): CLIP's quick_gelu or one of
    the text models' (kernels/activations.py)."""
    if name == "quick_gelu":  # CLIP's
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r}: implemented are quick_gelu, {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    """Multi-head self-attention over one image's patches (no mask), q/k/v fused into `qkv_proj`."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        """`x` `[N * L, D]` (N images of L patches) -> `[N * L, D]`."""
        q, k, v = self.qkv_proj(x).reshape(images, -1, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)  # [N, H, L, Dh]
        return self.out_proj(out.transpose(1, 2).reshape(x.shape))


class VisionLayer(nn.Module):
    """`x + attn(norm1(x))`, then `x + mlp(norm2(x))`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(dim, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, config.intermediate_size)
        self.mlp.fc2 = nn.Linear(config.intermediate_size, dim)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), images)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VisionTower(nn.Module):
    """CLIP's or SigLIP's vision transformer (`config.model_type` says which)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.model_type not in TOWER_TYPES:
            raise ValueError(f"unsupported vision tower {config.model_type!r}: served are {', '.join(TOWER_TYPES)}")
        self.clip = config.model_type == "clip_vision_model"
        dim, self.patch, self.image_size = config.hidden_size, config.patch_size, config.image_size
        patches = (config.image_size // config.patch_size) ** 2
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(config.num_channels, dim, self.patch, self.patch,
                                                    bias=not self.clip)
        if self.clip:
            self.embeddings.class_embedding = nn.Parameter(torch.empty(dim))
            self.pre_layrnorm = nn.LayerNorm(dim, eps=config.layer_norm_eps)  # (sic: the checkpoint's name)
        self.embeddings.position_embedding = nn.Embedding(patches + self.clip, dim, _weight=torch.empty(
            patches + self.clip, dim))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(dim, eps=config.layer_norm_eps)

    def hidden_states(self, pixel_values: torch.Tensor, upto: int) -> list[torch.Tensor]:
        """The encoder's hidden states `[N, L, D]` as transformers' `hidden_states` numbers them (0: the
        embeddings, i: after layer i), through layer `upto` only (the later layers are not run)."""
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"pixel values of {height}x{width}, the vision tower takes {self.image_size}x"
                             f"{self.image_size}")
        weight = self.embeddings.patch_embedding.weight
        x = self.embeddings.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, D]
        if self.clip:
            x = torch.cat([self.embeddings.class_embedding.to(x.dtype).expand(n, 1, -1), x], dim=1)
        x = x + self.embeddings.position_embedding.weight
        if self.clip:
            x = self.pre_layrnorm(x)
        shape = x.shape
        states = [x]
        h = x.reshape(-1, shape[-1])
        for layer in self.encoder.layers[:upto]:
            h = layer(h, n)
            states.append(h.reshape(shape))
        return states

    def last_hidden_state(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The last layer's output `[N, L, D]`, post-normed as SigLIP's `last_hidden_state` is."""
        return self.post_layernorm(self.hidden_states(pixel_values, len(self.encoder.layers))[-1])
