"""M-RoPE (Qwen2-VL, Qwen2.5-VL): each token has three rope positions, temporal, height and width, and the rotary
frequencies are split among them by `mrope_section` (section `i` of the `dim / 2` frequencies turns by position
`i % 3`).

A text token's three positions are equal, and then M-RoPE is the plain rotary: the model takes 1-D rope positions
`[T]` as any model does (`MRotary` is a `Rotary`). An image's tokens take `start + (t, h, w)` over its merged grid
(`image_offsets`), given per step for the image tokens it computes (`EmbedOverride.rope_positions`), whose rows
`mrope_tables` writes over the step's cos/sin. The text after an image continues at `start + max(h, w)`, not at
the image's end: its rope position is its sequence position plus a shift (`image_offsets`' `advance` minus the
image's length, summed over the images before it), which only the rotary sees.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ringserve.actors.engine.models.rope import Rotary, rope_parameters

# rotary variants whose frequencies do not depend on the position: the same for each of the three ids
MROPE_TYPES = ("default", "linear", "llama3", "yarn")


def mrope_section(config: Any) -> list[int] | None:
    """The text config's `mrope_section` (in `rope_parameters` or the older `rope_scaling`), None without one."""
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        if isinstance(params, dict) and params.get("mrope_section"):
            return [int(n) for n in params["mrope_section"]]
    return None


class MRotary(Rotary):
    """A `Rotary` that also turns `[3, n]` positions (`multi`)."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_positions: int, section: list[int]) -> None:
        super().__init__(params, head_dim, max_positions)
        if self.rope_type not in MROPE_TYPES:
            raise ValueError(f"M-RoPE over rope_type {self.rope_type!r} is not implemented: served are {MROPE_TYPES}")
        if sum(section) != self.dim // 2:
            raise ValueError(f"mrope_section {section} covers {sum(section)} frequencies, the rotary has "
                             f"{self.dim // 2}")
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.int64, device="cpu") for i, n in enumerate(section)])
        self.axis: torch.Tensor
        self.register_buffer("axis", axis, persistent=False)

    def multi(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[n, dim]` of tokens at `[3, n]` (temporal, height, width) positions."""
        picked = positions.to(self.axis.device)[self.axis].T.float()  # [n, dim/2]: each frequency's own id
        emb = torch.cat([picked * self.inv_freq[None, :]] * 2, dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def use_mrope(stack: nn.Module, config: Any) -> bool:
    """Replace `stack`'s rotaries (a `DecoderStack`'s `rotary`) by M-RoPE ones when `config` has an
    `mrope_section`; whether it has."""
    section = mrope_section(config)
    if section is None:
        return False
    for kind, rotary in list(stack.rotary.items()):
        params = rope_parameters(config, None if kind == "default" else kind)
        stack.rotary[kind] = MRotary(params, rotary.dim, rotary.max_positions, section).to(rotary.inv_freq.device)
    return True


def mrope_tables(rotary: nn.ModuleDict, tables: dict[str, tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor,
                 positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`tables` (each rotary kind's cos/sin `[T, dim]`) with rows `index` `[n]` turned by `positions` `[3, n]`."""
    out = {}
    for kind, (cos, sin) in tables.items():
        mcos, msin = rotary[kind].multi(positions, cos.dtype)
        out[kind] = (cos.index_copy(0, index, mcos), sin.index_copy(0, index, msin))
    return out


def image_offsets(grid: tuple[int, int, int], merge: int) -> tuple[torch.Tensor, int]:
    """An image's tokens' rope positions relative to its first `[3, t * h/merge * w/merge]` (the merged grid's
    (t, row, column), row-major as the merger emits them), and how far the text after it moves on: `max(h, w)`
    of the merged grid (transformers' `get_rope_index`)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1), max(h, w)
