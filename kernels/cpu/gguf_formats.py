"""A GGUF tensor's quantized blocks as exact integer codes and scales, ready to pack for our group kernels.

`decode_gguf_blocks(raw, ggml_type, rows, cols)` reads a tensor's bytes (llama.cpp's block layouts of ggml-common.h)
into `BlockCodes`: each weight's integer code, an fp32 scale per 16 weights and an optional fp32 min per 32, such
that `scale * code + min` is the block format's own dequantized value, bit for bit. Types whose scales are fp16
per 32 (Q8_0, Q4_0, Q4_1, and Q5_0, whose codes fit int8) also keep that form (`native`), which runs on the
q8_0/q4_0/q4_1 kernels as they are. `pack_block_codes` packs the fewest bytes per weight that hold the codes
exactly in one form per weight shape (`pack_by_shape`: Q4_0/Q4_1 as they are, Q4_K in `q4_k`, Q5_K/Q5_1/Q5_0 in
`q5_k`, Q6_K in `q6_k` (kbits.cpp), Q8_0 in `q8_0`, and what fits none of them in `q8_k` (kquant.cpp));
`pack_block_codes` packs one weight (by default in a form its block types alone decide).
Rows can be reordered (`permute_rows`: Llama's q/k) and parts stacked (`concat_rows`: fused q/k/v, gate/up). F32/F16/BF16 tensors are not blocks: `SUPPORTED_GGML_TYPES` lists what is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ringserve.kernels.cpu.packing import QK, PackedWeight, pack_codes
from ringserve.kernels.cpu.packing_k8 import code_weight, pack_k8
from ringserve.kernels.cpu.packing_kbits import BITS_FORMATS, kbits_for, pack_kbits

QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {t: (QK_K if t.endswith("_K") else QK) for t in BLOCK_BYTES}
SUPPORTED_GGML_TYPES = tuple(BLOCK_BYTES)


@dataclass
class BlockCodes:
    """Exact codes of a `[rows, cols]` weight: `scale16[r, j // 16] * codes[r, j] + min32[r, j // 32]` (no min:
    0). `native`: the q8_0/q4_0/q4_1 form (format, codes as pack_codes takes them, fp16 scales and mins per 32)
    when the type has one."""

    codes: torch.Tensor  # int16 [rows, cols]
    scale16: torch.Tensor  # float32 [rows, cols / 16]
    min32: torch.Tensor | None  # float32 [rows, cols / 32]
    native: tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def permute_rows(self, order: torch.Tensor) -> BlockCodes:
        """The same weight with its rows in `order`."""
        native = None
        if self.native is not None:
            fmt, codes, scales, mins = self.native
            native = (fmt, codes[order], scales[order], mins[order] if mins is not None else None)
        return replace(self, codes=self.codes[order], scale16=self.scale16[order],
                       min32=self.min32[order] if self.min32 is not None else None, native=native)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        return code_weight(self.codes, self.scale16, self.min32)


def concat_rows(parts: list[BlockCodes]) -> BlockCodes:
    """`parts` stacked row-wise: in their native form when they all share one, else in the `q8_k` form."""
    formats = {p.native[0] if p.native is not None else None for p in parts}
    native = None
    if len(formats) == 1 and None not in formats:
        mins = [p.native[3] for p in parts]
        native = (formats.pop(), torch.cat([p.native[1] for p in parts]), torch.cat([p.native[2] for p in parts]),
                  torch.cat(mins) if mins[0] is not None else None)
    with_min = any(p.min32 is not None for p in parts)
    mins = [p.min32 if p.min32 is not None else torch.zeros(p.codes.shape[0], p.codes.shape[1] // QK)
            for p in parts] if with_min else None
    return BlockCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scale16 for p in parts]),
                      torch.cat(mins) if mins is not None else None, native)


def packed_forms(codes: BlockCodes) -> tuple[str, ...]:
    """The packed forms that hold `codes` exactly, fewest bytes per weight first (q8_k holds every one)."""
    native = codes.native[0] if codes.native is not None else None
    forms = [native] if native in ("q4_0", "q4_1") else []
    unsigned = _unsigned_per32(codes)
    bits = kbits_for(unsigned.codes, unsigned.scale16)
    forms += [BITS_FORMATS[b] for b in (4, 5, 6) if bits is not None and b >= bits]
    return tuple(forms + ([native] if native == "q8_0" else []) + ["q8_k"])


def pack_block_codes(codes: BlockCodes, fmt: str | None = None) -> PackedWeight:
    """The packed weight our kernels run, in `fmt` (one of `packed_forms(codes)`). By default the form depends only
    on the block types, so that layers of one shape agree however a file mixes types across them (the kernel plan
    runs one form per shape): the type's own q8_0/q4_0/q4_1 form where it has one (Q5_0 runs as q8_0), else q6_k
    (every K-quant and Q5_1), else q8_k. `pack_by_shape` packs a whole model in fewer bytes."""
    forms = packed_forms(codes)
    if fmt is None:
        fmt = codes.native[0] if codes.native is not None else "q6_k" if "q6_k" in forms else "q8_k"
    if fmt not in forms:
        raise ValueError(f"codes do not fit {fmt!r} exactly; these forms hold them: {forms}")
    if codes.native is not None and fmt == codes.native[0]:
        _, native_codes, scales, mins = codes.native
        return pack_codes(native_codes, scales, mins, fmt)
    if fmt == "q8_k":
        return pack_k8(codes.codes, codes.scale16, codes.min32)
    unsigned = _unsigned_per32(codes)
    packed = pack_kbits(unsigned.codes, unsigned.scale16, unsigned.min32, int(fmt[1]))
    assert packed is not None  # packed_forms said it fits
    return packed


def pack_by_shape(codes: dict[str, BlockCodes]) -> dict[str, PackedWeight]:
    """Every weight of `codes` (by name) packed, all weights of one shape in one form: the fewest bytes per weight
    that holds each of them exactly (a Q4_K_M file's Q4_K and Q6_K down projections both as q6_k, its Q5_0
    gate/up projections as q5_k)."""
    shapes: dict[tuple[int, ...], list[str]] = {}
    for name, c in codes.items():
        shapes.setdefault(tuple(c.codes.shape), []).append(name)
    out: dict[str, PackedWeight] = {}
    for names in shapes.values():
        common = set.intersection(*(set(packed_forms(codes[name])) for name in names))
        fmt = next(f for f in packed_forms(codes[names[0]]) if f in common)
        out.update({name: pack_block_codes(codes[name], fmt) for name in names})
    return out


def _unsigned_per32(codes: BlockCodes) -> BlockCodes:
    """`codes` with each row of codes in -16..15, one scale per 32 and no min (Q5_0's) shifted to 0..31 with a
    min of -16 * scale, where that is bit for bit the same weight; the other rows as they are."""
    scale32 = codes.scale16[:, 0::2]
    rows = (codes.codes.amin(dim=1) < 0) & (codes.codes.amin(dim=1) >= -16) & (codes.codes.amax(dim=1) <= 15)
    rows &= torch.equal(scale32, codes.scale16[:, 1::2])
    if codes.min32 is not None:
        rows &= (codes.min32 == 0).all(dim=1)
    if not bool(rows.any()):
        return codes
    shifted, mins = codes.codes.clone(), (codes.min32.clone() if codes.min32 is not None
                                         else torch.zeros_like(scale32))
    shifted[rows] += 16
    mins[rows] = -16 * scale32[rows]
    out = BlockCodes(shifted, codes.scale16, mins)
    return out if torch.equal(out.dequantize(), codes.dequantize()) else codes


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes `[..., 2]` as float32 `[...]`."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Bytes `[..., n]` as their low nibbles then their high nibbles `[..., 2n]` (llama.cpp's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of each block's little-endian `qh` bytes, j < `count`, as 0 or 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]
    return bits.astype(np.int16) << 4


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins `[..., 12]` as two `[..., 8]` arrays."""
    s = scales.astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), np.int32)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., :4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _decode(blocks: np.ndarray, ggml_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`[n, bytes]` blocks -> codes `[n, w]`, scale per 16 `[n, w / 16]`, min per 32 `[n, w / 32]` or None."""
    if ggml_type == "Q8_0":
        return blocks[:, 2:].view(np.int8).astype(np.int16), np.repeat(_f16(blocks[:, None, :2]), 2, 1), None
    d = _f16(blocks[:, None, 0:2])
    if ggml_type in ("Q4_0", "Q4_1"):
        start = 4 if ggml_type == "Q4_1" else 2
        codes = _low_high(blocks[:, start:]).astype(np.int16)
        if ggml_type == "Q4_0":
            return codes - 8, np.repeat(d, 2, 1), None
        return codes, np.repeat(d, 2, 1), _f16(blocks[:, None, 2:4])
    if ggml_type in ("Q5_0", "Q5_1"):
        start = 8 if ggml_type == "Q5_1" else 6
        codes = _low_high(blocks[:, start:]).astype(np.int16) | _fifth_bits(blocks[:, start - 4:start], 32)
        if ggml_type == "Q5_0":
            return codes - 16, np.repeat(d, 2, 1), None
        return codes, np.repeat(d, 2, 1), _f16(blocks[:, None, 2:4])
    if ggml_type in ("Q4_K", "Q5_K"):
        dmin = _f16(blocks[:, None, 2:4])
        sc, mn = _k_scales_mins(blocks[:, 4:16])
        qs = blocks[:, -128:].reshape(-1, 4, 32)  # four chunks of 64 weights: low nibbles, then high
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.int16)
        if ggml_type == "Q5_K":
            qh = blocks[:, 16:48]  # bit 2c (2c + 1) of qh[l] is weight l's fifth bit in sub-block 2c (2c + 1)
            bits = np.unpackbits(qh[:, :, None], axis=2, bitorder="little")  # [n, 32, 8]
            codes |= bits.transpose(0, 2, 1).astype(np.int16) << 4
        scale = d * sc.astype(np.float32)  # d1 = d * sc, as llama.cpp
        return codes.reshape(-1, QK_K), np.repeat(scale, 2, 1), -(dmin * mn.astype(np.float32))
    if ggml_type == "Q6_K":
        ql, qh = blocks[:, :128].reshape(-1, 2, 64), blocks[:, 128:192].reshape(-1, 2, 32)
        sc, dd = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks[:, None, 208:210])
        low = np.concatenate([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4],
                             axis=2)  # [n, 2 halves, 128]: weights l, l + 32, l + 64, l + 96 of each half
        high = np.concatenate([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)
        codes = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
        return codes.reshape(-1, QK_K), dd * sc, None
    raise ValueError(f"GGML type {ggml_type} is not a block format read here; these are: "
                     f"{', '.join(SUPPORTED_GGML_TYPES)}")


SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}  # where each block's fp16 scales (and mins) sit


def random_gguf_blocks(ggml_type: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a `[rows, cols]` tensor (`[rows, bytes per row]` uint8) with finite, moderate fp16 scales:
    every other byte is a valid code, so these cover each format's whole code range (tests and benchmarks)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // BLOCK_WEIGHTS[ggml_type]
    blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = (rng.standard_normal(n) * 0.01).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def decode_gguf_blocks(raw: np.ndarray, ggml_type: str, rows: int, cols: int) -> BlockCodes:
    """A quantized GGUF tensor's bytes (`[rows, cols / block weights * block bytes]`, any shape of that many
    bytes) as `BlockCodes` of a `[rows, cols]` weight."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"GGML type {ggml_type} is not a block format; these are: {', '.join(SUPPORTED_GGML_TYPES)}")
    per_block = BLOCK_WEIGHTS[ggml_type]
    if cols % per_block:
        raise ValueError(f"a {ggml_type} tensor of {cols} columns: not whole blocks of {per_block}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES[ggml_type])
    codes, scale16, min32 = _decode(blocks, ggml_type)
    out = BlockCodes(torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols)),
                     torch.from_numpy(np.ascontiguousarray(scale16, np.float32).reshape(rows, cols // 16)),
                     None if min32 is None else torch.from_numpy(
                         np.ascontiguousarray(min32, np.float32).reshape(rows, cols // QK)))
    native_format = {"Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}.get(ggml_type)
    if native_format is not None:
        scales = out.scale16[:, ::2].half()
        mins = out.min32.half() if out.min32 is not None else None
        native_codes = out.codes + 8 if ggml_type == "Q4_0" else out.codes  # pack_codes takes q4_0's nibbles
        out.native = (native_format, native_codes, scales, mins)
    return out
