"""The `q4_k`, `q5_k` and `q6_k` packed forms (kbits.cpp): unsigned integer codes of 4, 5 or 6 bits, an fp32 scale
per 32 weights (per 16 for 6 bits) and an optional fp32 min per 32; `w = scale * (code - offset) + min`, offset 32
for 6 bits, else 0. GGUF's Q4_K (4 bits), Q5_K, Q5_1, Q5_0 (5 bits) and Q6_K (6 bits) run in them exactly, at
0.75 to 1 byte per weight (their files' 0.56 to 0.82) instead of q8_k's 1.4 to 1.6.

`pack_kbits(codes, scale16, min32)` packs exact codes (None when they do not fit any of the three forms);
`pack_kbits_float(weight, bits)` quantizes a float weight this way (only to time the kernel at start-up and in
tests); `unpack_kbits` / `dequantize_kbits` read a packed weight back; `reference_kbit_linear` is the kernel's
math in torch (its fallback and its test reference).
"""

from __future__ import annotations

import torch

from ringserve.kernels.cpu.packed_weight import QK, TILE, PackedWeight, interleave
from ringserve.kernels.cpu.packing_k8 import HALF, _tiles, code_weight, reference_code_linear

BITS_FORMATS = {4: "q4_k", 5: "q5_k", 6: "q6_k"}
OFFSET = {4: 0, 5: 0, 6: 32}  # subtracted from the stored (unsigned) code


def kbits_for(codes: torch.Tensor, scale16: torch.Tensor) -> int | None:
    """The fewest bits (4, 5 or 6) whose form holds `codes` with `scale16` exactly, or None."""
    low, high = int(codes.min()), int(codes.max())
    per32 = torch.equal(scale16[:, 0::2], scale16[:, 1::2])  # 4 and 5 bits keep one scale per 32
    if per32 and low >= 0 and high <= 15:
        return 4
    if per32 and low >= 0 and high <= 31:
        return 5
    return 6 if low >= -32 and high <= 31 else None


def pack_kbits(codes: torch.Tensor, scale16: torch.Tensor, min32: torch.Tensor | None,
               bits: int | None = None) -> PackedWeight | None:
    """Integer `codes` `[N, K]` with fp32 `scale16` `[N, K / 16]` and optional `min32` `[N, K / 32]` packed in the
    narrowest form that holds them exactly (or `bits`); None when none does. K a multiple of 32."""
    n, k = codes.shape
    if k % QK or scale16.shape != (n, k // HALF) or (min32 is not None and min32.shape != (n, k // QK)):
        raise ValueError(f"pack_kbits: codes [{n}, {k}], scales {list(scale16.shape)}: K a multiple of {QK}, "
                         f"a scale per {HALF} and a min per {QK}")
    bits = bits or kbits_for(codes, scale16)
    if bits is None:
        return None
    np_, kb = -(-n // TILE) * TILE, k // QK
    stored = torch.zeros(np_, kb, QK, dtype=torch.int16)  # padding rows: code 0 with scale 0
    stored[:n] = (codes.to(torch.int16) + OFFSET[bits]).reshape(n, kb, QK)
    quads = interleave(stored)  # [tiles, Kb, 8 quads, 16, 4]
    parts = [((quads[:, :, :4] & 15) | ((quads[:, :, 4:] & 15) << 4)).reshape(np_ // TILE, kb, 256)]
    for plane in range(bits - 4):  # bit 4 + plane of each code; quad i's bit at bit i of the plane's byte
        bit = (quads >> (4 + plane)) & 1
        parts.append(sum(bit[:, :, i] << i for i in range(8)).reshape(np_ // TILE, kb, 64))
    qweight = torch.cat(parts, dim=2).to(torch.uint8).reshape(-1)
    scales = torch.zeros(np_, k // HALF, dtype=torch.float32)
    scales[:n] = scale16.float()
    scales = _tiles(scales, 2) if bits == 6 else _tiles(scales[:, 0::2].contiguous(), 1)
    mins = None
    if min32 is not None:
        mins = torch.zeros(np_, kb, dtype=torch.float32)
        mins[:n] = min32.float()
        mins = _tiles(mins, 1).reshape(-1)
    return PackedWeight(qweight, scales.reshape(-1), mins, n, k, bits)


def pack_kbits_float(weight: torch.Tensor, bits: int) -> PackedWeight:
    """`weight` `[N, K]` quantized to `bits`-bit codes, packed as q4_k/q5_k (a scale and a min per 32, as Q4_K and
    Q5_K) or q6_k (a symmetric scale per 16, as Q6_K)."""
    n, k = weight.shape
    kp = -(-k // QK) * QK
    padded = torch.zeros(n, kp, dtype=torch.float32)
    padded[:, :k] = weight.detach().float()
    if bits == 6:
        halves = padded.reshape(n, kp // HALF, HALF)
        scales = halves.abs().amax(dim=2) / 31.0
        inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = (halves * inv[..., None]).round_().clamp_(-32, 31).reshape(n, kp)
        packed = pack_kbits(codes, scales, None, 6)
    else:
        groups = padded.reshape(n, kp // QK, QK)
        low, top = groups.amin(dim=2), groups.amax(dim=2)
        scales = (top - low) / (2 ** bits - 1)
        inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        codes = ((groups - low[..., None]) * inv[..., None]).round_().clamp_(0, 2 ** bits - 1).reshape(n, kp)
        packed = pack_kbits(codes, scales.repeat_interleave(2, dim=1), low, bits)
    assert packed is not None
    packed.in_features = k
    return packed


def unpack_kbits(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Signed codes (the offset taken off) `[Np, Kp]`, scales per 16 `[Np, Kp / 16]` and mins `[Np, Kp / 32]` (or
    None) of a q4_k/q5_k/q6_k weight."""
    bits, kb = packed.bits, -(-packed.in_features // QK)
    blocks = packed.qweight.reshape(-1, kb, 64 * bits).to(torch.int16)
    tiles = blocks.shape[0]
    nibbles = blocks[:, :, :256].reshape(tiles, kb, 4, TILE, 4)
    quads = torch.cat([nibbles & 15, nibbles >> 4], dim=2)  # [tiles, Kb, 8, 16, 4]
    for plane in range(bits - 4):
        byte = blocks[:, :, 256 + 64 * plane:320 + 64 * plane].reshape(tiles, kb, 1, TILE, 4)
        shifts = torch.arange(8).reshape(1, 1, 8, 1, 1)
        quads = quads | (((byte >> shifts) & 1) << (4 + plane))
    codes = quads.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, kb * QK) - OFFSET[bits]

    def rows(t: torch.Tensor, g: int) -> torch.Tensor:
        return t.reshape(tiles, kb, g, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, kb * g)

    scales = rows(packed.scales, 2) if bits == 6 else rows(packed.scales, 1).repeat_interleave(2, dim=1)
    return codes, scales, rows(packed.mins, 1) if packed.mins is not None else None


def dequantize_kbits(packed: PackedWeight) -> torch.Tensor:
    """The float32 weight `[N, K]` a q4_k/q5_k/q6_k weight stands for."""
    return code_weight(*unpack_kbits(packed))[:packed.out_features, :packed.in_features]


def reference_kbit_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                          bias: torch.Tensor | None, out_features: int, bits: int) -> torch.Tensor:
    """`kbit_linear` in torch: per half block an exact integer dot product scaled by the weight's and the
    activation block's scales, plus the min times the activation block's scale and sum."""
    codes, w_scales, w_mins = unpack_kbits(PackedWeight(qweight, scales, mins, out_features, x.shape[1], bits))
    return reference_code_linear(x, codes, w_scales, w_mins, bias, out_features)
