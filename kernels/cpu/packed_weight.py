"""What every packed weight form shares: the block geometry, the `PackedWeight` the CPU kernels read, the
interleaving of 16 output rows four K values at a time (`qgemm.cpp` explains the layout), and the per-row int8
quantization of the activations that every form's torch reference multiplies by.

The forms themselves: q8_0, q4_0 and q4_1 in packing.py (which also picks a form's packer and reference by
name), q8_k in packing_k8.py, q4_k, q5_k and q6_k in packing_kbits.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # values per quantization group (weights) and per activation block
TILE = 16  # output rows per packed tile
# q8_k: kernels/cpu/packing_k8.py; q4_k, q5_k, q6_k: kernels/cpu/packing_kbits.py (GGUF's own blocks)
FORMATS = ("q8_0", "q4_0", "q4_1", "q8_k", "q4_k", "q5_k", "q6_k")


@dataclass
class PackedWeight:
    """A linear layer's weight `[out_features, in_features]` quantized and packed for `group_linear`."""

    qweight: torch.Tensor  # uint8, the packed groups
    scales: torch.Tensor  # fp16 [tiles, K blocks, 16]
    mins: torch.Tensor | None  # fp16 like scales (q4_1 only)
    out_features: int
    in_features: int
    bits: int
    wsums: torch.Tensor | None = None  # q8_k only: int32 code sums per half block (packing_k8.py)

    @property
    def format(self) -> str:
        """"q8_0", "q4_0", "q4_1", "q8_k", "q4_k", "q5_k" or "q6_k" (the K forms: fp32 scales)."""
        if self.wsums is not None:
            return "q8_k"
        if self.bits in (5, 6) or self.scales.dtype == torch.float32:
            return f"q{self.bits}_k"
        return "q8_0" if self.bits == 8 else "q4_1" if self.mins is not None else "q4_0"

    def nbytes(self) -> int:
        """Bytes the packed weight occupies (what a GEMV reads per call)."""
        extra = sum(t.nbytes for t in (self.mins, self.wsums) if t is not None)
        return self.qweight.nbytes + self.scales.nbytes + extra


def interleave(q: torch.Tensor) -> torch.Tensor:
    """Integer q `[Np, Kb, 32]` as `[tiles, Kb, 8 quads, 16 rows, 4]`: four K values of 16 rows per 64 bytes."""
    np_, kb, _ = q.shape
    return q.reshape(np_ // TILE, TILE, kb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of `x` `[M, K]` to int8 per block of 32: q `[M, Kb, 32]`, fp32 scales `[M, Kb]` (amax / 127) and
    the blocks' sums of q `[M, Kb]`; the same arithmetic (round half to even of `x * (1 / d)`) as the kernel."""
    m, k = x.shape
    kp = -(-k // QK) * QK
    blocks = torch.zeros(m, kp, dtype=torch.float32)
    blocks[:, :k] = x.float()
    blocks = blocks.reshape(m, kp // QK, QK)
    d = blocks.abs().amax(dim=2) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = (blocks * inv[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8), d, q.sum(dim=2).to(torch.int32)
