"""Group-wise weight quantization, the packed layout the CPU kernels read, and the torch reference of their math.

Weights are quantized in groups of 32 along K (the input dimension), as llama.cpp's Q8_0 / Q4_0 / Q4_1:

- `q8_0`: `w ≈ d * q`, q in -127..127, `d = amax / 127` per group;
- `q4_0`: `w ≈ d * (q - 8)`, q in 0..15, `d = max / -8` (max: the group's value of largest magnitude);
- `q4_1`: `w ≈ d * q + m`, q in 0..15, `m = min`, `d = (max - min) / 15`.

Scales and mins are stored as fp16 (as GGUF does), and q is computed against the fp16-rounded scale. The
activations are quantized on each call per row and per block of 32 to int8 with an fp32 scale
(`quantize_activations`), so the product of a group is an exact integer dot product rescaled by both scales.

The packed layout (`qgemm.cpp` explains it) puts 16 output rows side by side four K values at a time. Rows are
padded to a multiple of 16 and K to a multiple of 32 with zeros. `reference_group_linear` computes the same
result as the C++ kernel from the packed tensors, in torch, up to float summation order; it is also the
kernel of the custom op when the extension cannot be built.

What every form shares (`PackedWeight`, the block geometry, the activation quantization) is in packed_weight.py;
`pack`, `dequantize` and `reference_linear` take any of its FORMATS, handing the K forms to packing_k8.py and
packing_kbits.py.
"""

from __future__ import annotations

import torch

from ringserve.kernels.cpu.packed_weight import FORMATS, QK, TILE, PackedWeight, interleave, quantize_activations
from ringserve.kernels.cpu.packing_k8 import dequantize_k8, pack_q8_k, reference_k8_linear
from ringserve.kernels.cpu.packing_kbits import dequantize_kbits, pack_kbits_float, reference_kbit_linear


def _padded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as float32 `[Np, Kb, 32]`, rows padded to whole tiles and K to whole groups with zeros."""
    n, k = weight.shape
    np_, kp = -(-n // TILE) * TILE, -(-k // QK) * QK
    out = torch.zeros(np_, kp, dtype=torch.float32)
    out[:n, :k] = weight.detach().float()
    return out.reshape(np_, kp // QK, QK)


def _tiled(per_group: torch.Tensor) -> torch.Tensor:
    """`[Np, Kb]` scales or mins as fp16 `[tiles, Kb, 16]`."""
    np_, kb = per_group.shape
    return per_group.reshape(np_ // TILE, TILE, kb).permute(0, 2, 1).contiguous().half()


def pack_q8_0(weight: torch.Tensor) -> PackedWeight:
    """Quantize `weight` `[N, K]` to groups of 32 int8 values with one fp16 scale each, packed."""
    groups = _padded(weight)
    scales = (groups.abs().amax(dim=2) / 127.0).half().float()  # q is computed against the stored scale
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = (groups * inv[..., None]).round_().clamp_(-127, 127).to(torch.int16)
    # stored as q + 128: the unsigned operand of the VNNI dot product (qgemm.cpp)
    packed = (interleave(q) + 128).to(torch.uint8).reshape(-1)
    return PackedWeight(packed, _tiled(scales), None, weight.shape[0], weight.shape[1], 8)


def pack_q4(weight: torch.Tensor, with_min: bool = True) -> PackedWeight:
    """Quantize `weight` `[N, K]` to groups of 32 4-bit values: q4_1 (scale and min) or q4_0 (scale only)."""
    groups = _padded(weight)
    if with_min:
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        mins = low.half().float()
        scales = ((high - mins) / 15.0).half().float()
        inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        q = ((groups - mins[..., None]) * inv[..., None]).round_().clamp_(0, 15)
    else:
        index = groups.abs().argmax(dim=2, keepdim=True)
        extreme = groups.gather(2, index).squeeze(2)  # signed: the value of largest magnitude maps to q = 0
        scales = (extreme / -8.0).half().float()
        inv = torch.where(scales != 0, 1.0 / scales, torch.zeros_like(scales))
        q = (groups * inv[..., None]).round_().add_(8).clamp_(0, 15)
    quads = interleave(q.to(torch.uint8))  # [tiles, Kb, 8, 16, 4]
    packed = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).contiguous().reshape(-1)  # low nibble: quads 0-3
    return PackedWeight(packed, _tiled(scales), _tiled(mins) if with_min else None,
                        weight.shape[0], weight.shape[1], 4)


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, fmt: str) -> PackedWeight:
    """A weight already quantized in `fmt`, packed without requantizing (a GGUF file's own blocks): integer
    `codes` `[N, K]` (q8_0: -127..127; q4_0 and q4_1: 0..15), fp16 `scales` `[N, K / 32]` and, for q4_1, `mins`."""
    n, k = codes.shape
    if fmt not in FORMATS or (mins is None) != (fmt != "q4_1") or k % QK:
        raise ValueError(f"pack_codes: {fmt!r} codes [{n}, {k}] (K a multiple of {QK}; mins for q4_1 only)")
    np_ = -(-n // TILE) * TILE
    grouped = torch.zeros(np_, k // QK, QK, dtype=torch.int16)
    grouped[:n] = codes.to(torch.int16).reshape(n, k // QK, QK)
    if fmt == "q4_0":
        grouped[n:] = 8  # padding rows stand for zero
    per_group = torch.zeros(np_, k // QK, dtype=torch.float32)

    def tiled(values: torch.Tensor) -> torch.Tensor:
        per_group[:n] = values.float()
        return _tiled(per_group.clone())

    if fmt == "q8_0":
        packed = (interleave(grouped) + 128).to(torch.uint8).reshape(-1)
        return PackedWeight(packed, tiled(scales), None, n, k, 8)
    quads = interleave(grouped.to(torch.uint8))
    packed = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).contiguous().reshape(-1)
    return PackedWeight(packed, tiled(scales), tiled(mins) if mins is not None else None, n, k, 4)


def pack(weight: torch.Tensor, fmt: str) -> PackedWeight:
    """`weight` packed in `fmt` (one of FORMATS)."""
    if fmt == "q8_0":
        return pack_q8_0(weight)
    if fmt in ("q4_0", "q4_1"):
        return pack_q4(weight, with_min=fmt == "q4_1")
    if fmt == "q8_k":
        return pack_q8_k(weight)
    if fmt in ("q4_k", "q5_k", "q6_k"):
        return pack_kbits_float(weight, int(fmt[1]))
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {list(FORMATS)}")


def unpack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, kb: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Packed tensors back to integer q `[Np, Kb, 32]` (signed for q8_0, q4_0's already offset by -8), float
    scales `[Np, Kb]` and mins (or None)."""
    tiles = scales.shape[0]
    if bits == 8:
        quads = qweight.reshape(tiles, kb, 8, TILE, 4).to(torch.int16) - 128
    else:
        nibbles = qweight.reshape(tiles, kb, 4, TILE, 4)
        quads = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2).to(torch.int16)
        if mins is None:
            quads = quads - 8
    q = quads.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, kb, QK)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.float().permute(0, 2, 1).reshape(tiles * TILE, kb)

    return q, rows(scales), None if mins is None else rows(mins)


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The float32 weight `[N, K]` the packed one stands for."""
    if packed.format == "q8_k":
        return dequantize_k8(packed)
    if packed.format in ("q4_k", "q5_k", "q6_k"):
        return dequantize_kbits(packed)
    kb = -(-packed.in_features // QK)
    q, scales, mins = unpack(packed.qweight, packed.scales, packed.mins, packed.bits, kb)
    w = q.float() * scales[..., None]
    if mins is not None:
        w = w + mins[..., None]
    return w.reshape(q.shape[0], -1)[:packed.out_features, :packed.in_features]


def reference_group_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                           bias: torch.Tensor | None, out_features: int, bits: int) -> torch.Tensor:
    """`group_linear` in torch: per block an exact integer dot product (in float32: |sum| < 2^24), scaled by
    the weight's and the activation's scales (plus q4_1's min times the activation block's sum)."""
    kb = -(-x.shape[1] // QK)
    qa, da, sa = quantize_activations(x)
    qw, dw, mw = unpack(qweight, scales, mins, bits, kb)
    qa_f, qw_f = qa.float(), qw.float()
    y = torch.zeros(x.shape[0], qw.shape[0], dtype=torch.float32)
    for b in range(kb):
        y += (qa_f[:, b] @ qw_f[:, b].t()) * (da[:, b, None] * dw[None, :, b])
    if mw is not None:
        y += (da * sa.float()) @ mw.t()
    y = y[:, :out_features]
    if bias is not None:
        y = y + bias.float()
    return y.contiguous()


def reference_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `kernels.cpu.packed_linear` computes for `packed`, whatever its format, in torch (the test reference)."""
    if packed.format == "q8_k":
        return reference_k8_linear(x, packed.qweight, packed.scales, packed.mins, packed.wsums, bias,
                                   packed.out_features)
    if packed.format in ("q4_k", "q5_k", "q6_k"):
        return reference_kbit_linear(x, packed.qweight, packed.scales, packed.mins, bias, packed.out_features,
                                     packed.bits)
    return reference_group_linear(x, packed.qweight, packed.scales, packed.mins, bias, packed.out_features,
                                  packed.bits)
