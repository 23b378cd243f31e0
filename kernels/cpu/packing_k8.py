"""The `q8_k` packed form (kquant.cpp): exact integer codes as int8 with an fp32 scale per 16 weights and an
optional fp32 min per 32, for GGUF block types whose scales fp16 per 32 cannot hold (Q4_K, Q5_K, Q6_K, Q5_1)
and for fused weights whose parts have different types. `w = scale[half] * code (+ min)`.

`pack_k8(codes, scales16, mins32)` packs a file's own codes; `pack_q8_k(weight)` quantizes a float weight this
way (only to time the kernel at start-up and in tests); `reference_k8_linear` is the kernel's math in torch (its
fallback and its test reference), `dequantize_k8` the weight it stands for.
"""

from __future__ import annotations

import torch

from ringserve.kernels.cpu.packed_weight import QK, TILE, PackedWeight, interleave, quantize_activations

HALF = QK // 2  # weights per scale


def _tiles(per_row: torch.Tensor, groups_per_block: int) -> torch.Tensor:
    """`[Np, Kb * g]` per-group values as `[tiles, Kb, g, 16]` (the kernel's order)."""
    np_, total = per_row.shape
    kb = total // groups_per_block
    return (per_row.reshape(np_ // TILE, TILE, kb, groups_per_block).permute(0, 2, 3, 1).contiguous())


def pack_k8(codes: torch.Tensor, scales16: torch.Tensor, mins32: torch.Tensor | None) -> PackedWeight:
    """Integer `codes` `[N, K]` (|code| <= 127), fp32 `scales16` `[N, K / 16]` and optional fp32 `mins32`
    `[N, K / 32]`, packed as `q8_k`; K a multiple of 32 (GGUF's blocks are)."""
    n, k = codes.shape
    if k % QK or scales16.shape != (n, k // HALF) or (mins32 is not None and mins32.shape != (n, k // QK)):
        raise ValueError(f"pack_k8: codes [{n}, {k}], scales {list(scales16.shape)}: K a multiple of {QK}, "
                         f"a scale per {HALF} and a min per {QK}")
    np_ = -(-n // TILE) * TILE
    grouped = torch.zeros(np_, k // QK, QK, dtype=torch.int16)
    grouped[:n] = codes.to(torch.int16).reshape(n, k // QK, QK)
    qweight = interleave(grouped).to(torch.int8).reshape(-1)
    wsums = _tiles(grouped.reshape(np_, k // HALF, HALF).sum(dim=2).to(torch.int32), 2).reshape(-1)
    scales = torch.zeros(np_, k // HALF, dtype=torch.float32)
    scales[:n] = scales16.float()
    mins = None
    if mins32 is not None:
        mins = torch.zeros(np_, k // QK, dtype=torch.float32)
        mins[:n] = mins32.float()
        mins = _tiles(mins, 1).reshape(-1)
    return PackedWeight(qweight, _tiles(scales, 2).reshape(-1), mins, n, k, 8, wsums)


def pack_q8_k(weight: torch.Tensor) -> PackedWeight:
    """`weight` `[N, K]` quantized to int8 codes with an fp32 scale per 16 (amax / 127), packed as `q8_k`."""
    n, k = weight.shape
    kp = -(-k // QK) * QK
    padded = torch.zeros(n, kp, dtype=torch.float32)
    padded[:, :k] = weight.detach().float()
    halves = padded.reshape(n, kp // HALF, HALF)
    scales = halves.abs().amax(dim=2) / 127.0
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = (halves * inv[..., None]).round_().clamp_(-127, 127).reshape(n, kp)
    packed = pack_k8(codes, scales, None)
    packed.in_features = k
    return packed


def unpack_k8(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes `[Np, Kp]`, scales `[Np, Kp / 16]` and mins `[Np, Kp / 32]` (or None) of a `q8_k` weight."""
    kb = -(-packed.in_features // QK)
    tiles = packed.qweight.numel() // (kb * QK * TILE)
    codes = packed.qweight.reshape(tiles, kb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, kb * QK)

    def rows(t: torch.Tensor, g: int) -> torch.Tensor:
        return t.reshape(tiles, kb, g, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, kb * g)

    mins = rows(packed.mins, 1) if packed.mins is not None else None
    return codes, rows(packed.scales, 2), mins


def code_weight(codes: torch.Tensor, scales16: torch.Tensor, mins32: torch.Tensor | None) -> torch.Tensor:
    """The float32 weight `scales16 * codes + mins32` (a scale per 16 weights, a min per 32) of integer codes."""
    w = scales16.repeat_interleave(HALF, dim=1) * codes.float()
    return w + mins32.repeat_interleave(QK, dim=1) if mins32 is not None else w


def dequantize_k8(packed: PackedWeight) -> torch.Tensor:
    """The float32 weight `[N, K]` a `q8_k` weight stands for."""
    return code_weight(*unpack_k8(packed))[:packed.out_features, :packed.in_features]


def reference_code_linear(x: torch.Tensor, codes: torch.Tensor, scales16: torch.Tensor, mins32: torch.Tensor | None,
                          bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`x` `[M, K]` times the weight `scales16 * codes + mins32` (rows padded, K padded to whole blocks) as our
    kernels compute it: activations quantized per block of 32, per half block an exact integer dot product (in
    float32) scaled by the weight's half scale and the activation block's scale, plus the min times the
    activation block's scale and sum."""
    qa, da, sa = quantize_activations(x)  # [M, Kb, 32], [M, Kb], [M, Kb]
    m, kb, _ = qa.shape
    qa_h = qa.float().reshape(m, kb * 2, HALF)
    qw_h = codes.float().reshape(codes.shape[0], kb * 2, HALF)
    y = torch.zeros(m, codes.shape[0], dtype=torch.float32)
    da_h = da.repeat_interleave(2, dim=1)
    for h in range(kb * 2):
        y += (qa_h[:, h] @ qw_h[:, h].t()) * (da_h[:, h, None] * scales16[None, :, h])
    if mins32 is not None:
        y += (da * sa.float()) @ mins32.t()
    y = y[:, :out_features]
    return (y + bias.float() if bias is not None else y).contiguous()


def reference_k8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                        wsums: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`k8_linear` in torch (`reference_code_linear` of the unpacked codes)."""
    codes, w_scales, w_mins = unpack_k8(PackedWeight(qweight, scales, mins, out_features, x.shape[1], 8, wsums))
    return reference_code_linear(x, codes, w_scales, w_mins, bias, out_features)
