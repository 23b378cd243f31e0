"""The vision tower of Qwen2-VL and Qwen2.5-VL (transformers' `Qwen2VisionTransformerPretrainedModel` and
`Qwen2_5_VisionTransformerPretrainedModel`, checkpoint names kept): dynamic resolution.

An image arrives as the processor flattens it: `pixel_values` `[t*h*w, C*T*P*P]` (one row per patch, patches in
2x2 merge-block order) with its grid `[t, h, w]`. The patch embedding is a Conv3d whose kernel is its stride, so a
linear over each row. Blocks attend within one image (Qwen2.5-VL: within windows of `window_size` pixels, but in
`fullatt_block_indexes`), rotating queries and keys by a 2-D rotary of each patch's (row, column). The merger
concatenates each 2x2 block of patches and projects it to the text width: one image token per block.

Qwen2-VL's blocks: LayerNorm, QuickGELU MLP (`fc1`, `fc2`), LayerNorm merger. Qwen2.5-VL's: RMSNorm, gated SiLU MLP
with biases, RMSNorm merger. Several images run as one batch: attention stays within each image's segments.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.actors.engine.execution_plan import NormRotaryKernels
from ringserve.actors.engine.models.blocks import make_norm
from ringserve.actors.engine.models.rope import rotate_half
from ringserve.actors.engine.models.vision.vit import activation

NORM_EPS = 1e-6


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Attention `[N, H, D]` within each run of `lengths` consecutive rows (no mask inside a run), the runs padded
    to the longest and computed in one batch."""
    longest = max(lengths)
    device = q.device
    sizes = torch.tensor(lengths, device=device)
    starts = torch.cumsum(sizes, 0) - sizes
    offsets = torch.arange(longest, device=device)
    valid = offsets[None, :] < sizes[:, None]  # [S, L]
    index = (starts[:, None] + offsets[None, :]).clamp(max=q.shape[0] - 1)
    qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [S, H, L, D]
    mask = None if all(n == longest for n in lengths) else valid[:, None, None, :]
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)[valid]  # [N, H, D], the runs' rows in order


class VisionAttention(nn.Module):
    """Self-attention within segments, queries and keys turned by the patches' 2-D rotary (in float32)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, self.heads, -1).unbind(1)  # [N, H, D] each
        c, s = cos[:, None, :], sin[:, None, :]
        q = (q.float() * c + rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(v.dtype)
        return self.proj(segment_attention(q, k, v, lengths).reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    """`x + attn(norm1(x))`, then `x + mlp(norm2(x))`; Qwen2.5-VL's (`gated`) with RMSNorms (built as `kernels`
    says, `blocks.make_norm`) and a gated MLP."""

    def __init__(self, config: Any, gated: bool, kernels: NormRotaryKernels = "torch") -> None:
        super().__init__()
        dim = config.hidden_size if gated else config.embed_dim
        norm = ((lambda: make_norm(dim, NORM_EPS, kernels=kernels)) if gated
                else (lambda: nn.LayerNorm(dim, eps=NORM_EPS)))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = VisionAttention(dim, config.num_heads)
        self.mlp = nn.Module()
        if gated:
            inner = config.intermediate_size
            self.mlp.gate_up_proj = nn.Linear(dim, 2 * inner)  # gate_proj and up_proj, fused at load as the text's
            self.mlp.down_proj = nn.Linear(inner, dim)
        else:
            inner = int(dim * config.mlp_ratio)
            self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, inner), nn.Linear(inner, dim)
        self.gated = gated
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        h = self.norm2(x)
        if self.gated:
            gate, up = self.mlp.gate_up_proj(h).chunk(2, dim=-1)
            return x + self.mlp.down_proj(self.act(gate) * up)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(h)))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each merge block's `m*m` patches, a 2-layer GELU MLP to the text width."""

    def __init__(self, dim: int, out_dim: int, merge: int, gated: bool, kernels: NormRotaryKernels = "torch") -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = make_norm(dim, NORM_EPS, kernels=kernels) if gated else nn.LayerNorm(dim, eps=NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class Qwen2VisionTower(nn.Module):
    """Images' flattened patches and grids -> each image's merged tokens `[t*h*w / merge^2, text width]`."""

    def __init__(self, config: Any, gated: bool, kernels: NormRotaryKernels = "torch") -> None:
        super().__init__()
        dim = config.hidden_size if gated else config.embed_dim
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.in_features = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(self.in_features, dim, bias=False)  # the Conv3d, flattened at load
        self.blocks = nn.ModuleList(VisionBlock(config, gated, kernels) for _ in range(config.depth))
        self.merger = PatchMerger(dim, config.out_hidden_size if gated else config.hidden_size, self.merge, gated,
                                   kernels)
        # Qwen2.5-VL: blocks outside `fullatt_block_indexes` attend within windows of `window_size` pixels
        self.full_blocks = set(config.fullatt_block_indexes) if gated else set(range(config.depth))
        self.window = config.window_size // self.merge // self.patch_size if gated else 0
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        axis_dim = dim // config.num_heads // 2  # rows turn half of a head's dims, columns the other half
        steps = torch.arange(0, axis_dim, 2, dtype=torch.float, device="cpu")  # not on the meta device models load on
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / theta ** (steps / axis_dim), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """`pixel_values` `[sum of patches, C*T*P*P]` of the images whose grids are `grids` -> each image's tokens."""
        weight = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(weight.dtype))  # [N, D]
        emb = torch.cat([self._angles(t, h, w) for t, h, w in grids])  # [N, D_head / 2]
        emb = torch.cat([emb, emb], dim=-1)
        image_lengths = [t * h * w for t, h, w in grids]
        order, window_lengths = self._windows(grids)
        if order is not None:  # each window's patches together; merge blocks stay whole
            x, emb = x[order], emb[order]
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_lengths if i in self.full_blocks else window_lengths)
        merged = self.merger(x)  # [N / merge^2, text width]
        if order is not None:
            merged = merged[torch.argsort(order[::self.merge ** 2] // self.merge ** 2)]
        return list(merged.split([n // self.merge ** 2 for n in image_lengths]))

    def _angles(self, t: int, h: int, w: int) -> torch.Tensor:
        """`[t*h*w, D_head / 2]`: each patch's row angles then column angles, patches in merge-block order."""
        m = self.merge
        device = self.inv_freq.device
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        rows, cols = (p.reshape(h // m, m, w // m, m).transpose(1, 2).flatten() for p in (rows, cols))
        angles = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        return angles.repeat(t, 1)

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[int]]:
        """Qwen2.5-VL: the patch order that puts each window's merge blocks together, and the windows' lengths in
        patches (images one after another); None and no windows when every block attends whole images."""
        if len(self.full_blocks) == len(self.blocks):
            return None, []
        m, size = self.merge, self.window
        units: list[torch.Tensor] = []
        lengths: list[int] = []
        first = 0
        for t, h, w in grids:
            bh, bw = h // m, w // m  # merge blocks per column and row
            nh, nw = -(-bh // size), -(-bw // size)
            index = F.pad(torch.arange(t * bh * bw).reshape(t, bh, bw), (0, nw * size - bw, 0, nh * size - bh),
                          value=-1)
            index = index.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, size * size)
            counts = (index >= 0).sum(1)
            units.append(index[index >= 0] + first)
            lengths += [int(c) * m * m for c in counts if c > 0]
            first += t * bh * bw
        unit_order = torch.cat(units).to(self.inv_freq.device)
        order = (unit_order[:, None] * m * m + torch.arange(m * m, device=unit_order.device)).flatten()
        return order, lengths
