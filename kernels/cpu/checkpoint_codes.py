"""The 4-bit codes of a GPTQ or AWQ checkpoint, read as the formats define them and kept as our kernels' int4
form (kernels/cpu/packing_kbits.py's q4_k: unsigned 4-bit codes with an fp32 scale and min per 32 weights).

GPTQ (v1 `gptq` layout): `qweight` int32 `[K / 8, N]` packs eight 4-bit codes along the input features (code i at
bits 4i), `qzeros` int32 `[groups, N / 8]` packs the zero points along the output features and stores each one
less than it is (v1's "+1"), `scales` fp16 `[groups, N]`, `g_idx` `[K]` the group of each input feature. The
`gptq_v2` layout (`checkpoint_format`) is the same but stores the zero points as they are.
AWQ (GEMM layout): `qweight` int32 `[K, N / 8]` and `qzeros` int32 `[groups, N / 8]` pack eight codes along the
output features in the order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds column `AWQ_ORDER[i]` of its eight),
`scales` fp16 `[groups, N]`, group `k // group_size`; no "+1".

Both mean `w = scale * (code - zero)`, which is exactly `w = d * code + m` with `d = scale` and
`m = -scale * zero` in float32 (an fp16 scale times an integer of at most 5 bits is exact), so a group of 128
is four of our 32-groups with the same scale and min. GPTQ's `desc_act` puts inputs of one group anywhere
(`g_idx`): the columns are then sorted by group (stably), and the layer reorders its inputs the same way before
the kernel (`order`); groups whose sizes are not multiples of 32 even so have no such form and are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ringserve.kernels.cpu.packed_weight import QK, PackedWeight
from ringserve.kernels.cpu.packing_kbits import pack_kbits

BITS = 4
PER_WORD = 32 // BITS
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
CODE_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's tensors, after its name


@dataclass
class LinearCodes:
    """One quantized linear `[N, K]` as our int4 form's parts: codes, and a scale and min per 32 inputs."""

    codes: torch.Tensor  # int16 [N, K], 0..15, the inputs in `order`
    scale32: torch.Tensor  # float32 [N, K / 32]
    min32: torch.Tensor  # float32 [N, K / 32]
    order: torch.Tensor | None = None  # int64 [K]: column j holds input order[j] (None: the inputs' own order)

    def pack(self) -> PackedWeight:
        """The codes as our q4_k packed weight (no float copy)."""
        packed = pack_kbits(self.codes, self.scale32.repeat_interleave(2, dim=1), self.min32, BITS)
        assert packed is not None
        return packed


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 `words` `[..., W]` as their eight 4-bit values `[..., W, 8]`, value i from bits 4i."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & (2 ** BITS - 1)).to(torch.int16)


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               group_size: int, name: str, v2: bool = False) -> LinearCodes:
    """A GPTQ linear's tensors (v1 layout, or `v2`) as `LinearCodes` (without `g_idx`, input k is in group
    k // `group_size`, -1: one group); ValueError naming `name` when its groups do not fit."""
    codes = _nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1]).t()  # [N, K]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + (0 if v2 else 1)  # [groups, N], v1 stores zero - 1
    k = codes.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // (k if group_size == -1 else group_size)
    return _linear_codes(codes, zeros, scales, groups, name)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
              name: str) -> LinearCodes:
    """An AWQ GEMM linear's tensors as `LinearCodes` (input k in group k // `group_size`); ValueError naming
    `name` when its groups do not fit."""
    inverse = torch.tensor([AWQ_ORDER.index(i) for i in range(PER_WORD)])

    def columns(words: torch.Tensor) -> torch.Tensor:  # [rows, N / 8] -> [rows, N] in column order
        return _nibbles(words)[..., inverse].reshape(words.shape[0], -1)

    codes = columns(qweight).t()  # [N, K]
    k = codes.shape[1]
    groups = torch.arange(k) // group_size
    return _linear_codes(codes, columns(qzeros), scales, groups, name)


def _linear_codes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
                  name: str) -> LinearCodes:
    """Codes `[N, K]` with zeros and scales `[groups, N]` and each input's group `[K]`, one group per 32 inputs."""
    n, k = codes.shape
    if zeros.shape != scales.shape or scales.shape[1] != n or groups.shape != (k,) or int(groups.max()) >= len(scales):
        raise ValueError(f"{name}: codes [{n} out, {k} in], zeros {list(zeros.shape)}, scales {list(scales.shape)} "
                         "and groups do not fit one another: not the layout its quant_method names")
    if k % QK:
        raise ValueError(f"{name}: {k} input features, not a multiple of {QK}: no int4 form of ours holds it")
    order = None
    if not _one_group_per_block(groups):  # desc_act: the inputs sorted by group, reordered so at each call
        order = torch.sort(groups, stable=True).indices
        codes, groups = codes[:, order], groups[order]
        if not _one_group_per_block(groups):
            raise ValueError(f"{name}: its g_idx groups are not multiples of {QK} inputs: no int4 form of ours "
                             "holds them")
    block_group = groups.reshape(k // QK, QK)[:, 0]
    scale32 = scales.float()[block_group].t().contiguous()  # [N, K / 32]
    zero32 = zeros.float()[block_group].t()
    return LinearCodes(codes.contiguous(), scale32, (-scale32 * zero32).contiguous(), order)


def _one_group_per_block(groups: torch.Tensor) -> bool:
    """Whether every block of 32 consecutive inputs lies in one group."""
    blocks = groups.reshape(-1, QK)
    return torch.equal(blocks, blocks[:, :1].expand_as(blocks))


def is_quantized_checkpoint(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether a state dict holds GPTQ/AWQ linears (a `.qweight` tensor)."""
    return any(name.endswith(".qweight") for name in tensors)


def read_linear_codes(tensors: Mapping[str, torch.Tensor],
                      quantization: Mapping[str, Any]) -> dict[str, LinearCodes]:
    """Every quantized linear of a state dict quantized as `quantization` (its config's quantization_config:
    GPTQ or AWQ), by its name (the prefix of its tensors)."""
    method = str(quantization.get("quant_method")).lower()
    group_size = int(quantization.get("group_size", quantization.get("q_group_size", -1)))
    v2 = quantization.get("checkpoint_format") == "gptq_v2"
    out: dict[str, LinearCodes] = {}
    for name in [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]:
        parts = [tensors[f"{name}.{part}"] for part in ("qweight", "qzeros", "scales")]
        if method == "gptq":
            out[name] = gptq_codes(*parts, tensors.get(f"{name}.g_idx"), group_size, name, v2)
        elif method == "awq":
            out[name] = awq_codes(*parts, group_size, name)
        else:
            raise ValueError(f"quantized checkpoint method {method!r} is not read")
    return out
