"""GGUF block types read as exact codes (kernels/cpu/gguf_formats.py) and run by our kernels: every type's codes
and scales give gguf-py's own dequantization bit for bit (random blocks, and the real Gemma 3 file's K-quant
tensors), packed too; the `q8_k` kernel (kquant.cpp) against its torch reference on both ISA paths and against a
float32 matmul with the same weights; mixed types fused into one weight stay exact."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.gguf_formats import (
    BLOCK_BYTES, BLOCK_WEIGHTS, SUPPORTED_GGML_TYPES, concat_rows, decode_gguf_blocks, pack_block_codes,
)
from ringserve.kernels.cpu.packing import dequantize
from ringserve.kernels.cpu.packing_k8 import pack_q8_k, reference_k8_linear

SCALE_BYTES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}  # where each block's fp16 scales (and mins) sit


def random_blocks(ggml_type: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every block, with finite, moderate fp16 scales (any other bytes are valid codes)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // BLOCK_WEIGHTS[ggml_type]
    blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    for offset in SCALE_BYTES[ggml_type]:
        scales = (rng.standard_normal(n) * 0.01).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def reference(raw: np.ndarray, ggml_type: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]).copy())


@pytest.mark.parametrize("ggml_type", SUPPORTED_GGML_TYPES)
def test_codes_give_gguf_pys_dequantization_exactly(ggml_type: str) -> None:
    rows, cols = 19, 512  # rows not a whole tile of 16
    raw = random_blocks(ggml_type, rows, cols)
    want = reference(raw, ggml_type).reshape(rows, cols)
    codes = decode_gguf_blocks(raw, ggml_type, rows, cols)
    assert torch.equal(codes.dequantize(), want)
    packed = pack_block_codes(codes)
    assert packed.format == ({"Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}.get(ggml_type, "q8_k"))
    assert torch.equal(dequantize(packed), want)
    order = torch.randperm(rows)
    assert torch.equal(dequantize(pack_block_codes(codes.permute_rows(order))), want[order])


def test_parts_of_different_types_fuse_exactly() -> None:
    """Gemma's fused q/k/v is Q5_0 + Q5_0 + Q8_0 (one q8_0 weight); a K-quant beside them makes it q8_k."""
    parts = {t: random_blocks(t, 16, 256, seed=i) for i, t in enumerate(("Q5_0", "Q8_0", "Q4_K", "Q6_K"))}
    decoded = {t: decode_gguf_blocks(raw, t, 16, 256) for t, raw in parts.items()}
    same_kernel = pack_block_codes(concat_rows([decoded["Q5_0"], decoded["Q8_0"]]))
    assert same_kernel.format == "q8_0"
    assert torch.equal(dequantize(same_kernel), torch.cat([reference(parts[t], t).reshape(16, 256)
                                                           for t in ("Q5_0", "Q8_0")]))
    mixed = pack_block_codes(concat_rows(list(decoded.values())))
    assert mixed.format == "q8_k"
    assert torch.equal(dequantize(mixed), torch.cat([reference(raw, t).reshape(16, 256) for t, raw in parts.items()]))


def test_the_real_files_k_quant_tensors_decode_exactly() -> None:
    from tests.real_models import gemma3_gguf

    reader = gguf.GGUFReader(str(gemma3_gguf()))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in SUPPORTED_GGML_TYPES and kind not in seen and tensor.name.startswith("blk."):
            seen.add(kind)
            cols, rows = (int(d) for d in tensor.shape[:2])
            want = reference(tensor.data, kind).reshape(rows, cols)
            assert torch.equal(decode_gguf_blocks(tensor.data, kind, rows, cols).dequantize(), want), tensor.name
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen


def isas() -> list[str]:
    if not cpu_kernels.compiled():
        return []
    return ["avx2", "avx512vnni"] if cpu_kernels.best_isa() == "avx512vnni" else ["avx2"]


@pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels are not built")
@pytest.mark.parametrize("with_min", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_q8_k_kernel_matches_its_reference_on_every_isa(with_min: bool, rows: int) -> None:
    raw_type = "Q4_K" if with_min else "Q6_K"
    codes = decode_gguf_blocks(random_blocks(raw_type, 37, 512, seed=rows), raw_type, 37, 512)
    packed = pack_block_codes(codes)
    assert (packed.mins is not None) == with_min
    x = torch.randn(rows, 512)
    bias = torch.randn(37)
    want = reference_k8_linear(x, packed.qweight, packed.scales, packed.mins, packed.wsums, bias, 37)
    for isa in isas():
        cpu_kernels.set_isa(isa)
        try:
            got = cpu_kernels.packed_linear(x, packed, bias)
        finally:
            cpu_kernels.set_isa(cpu_kernels.best_isa())
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=lambda m: f"{isa}: {m}")
    exact = x @ codes.dequantize().t() + bias  # within what int8 activations cost
    assert (want - exact).abs().max() <= 0.02 * exact.abs().max()


def test_a_float_weight_packs_as_q8_k_for_timing() -> None:
    weight = torch.randn(20, 80)
    packed = pack_q8_k(weight)
    torch.testing.assert_close(dequantize(packed), weight, atol=float(weight.abs().max()) / 127, rtol=0)


@pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels are not built")
def test_the_q8_k_kernel_on_many_rows_and_threads() -> None:
    """A prefill-sized call (its activation rows quantized by several threads) gives the reference's rows."""
    codes = decode_gguf_blocks(random_blocks("Q5_K", 48, 2048, seed=9), "Q5_K", 48, 2048)
    packed = pack_block_codes(codes)
    x = torch.randn(64, 2048)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_kernels.packed_linear(x, packed, None)
    finally:
        torch.set_num_threads(previous)
    want = reference_k8_linear(x, packed.qweight, packed.scales, packed.mins, packed.wsums, None, 48)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-5)


def test_the_fused_decode_layer_declines_q8_k_weights() -> None:
    """The whole-layer op reads only the q8_0/q4_0/q4_1 layouts: a layer with a K-quant linear runs its modules."""
    from ringserve.kernels.cpu.decode_layer import fused_decode_layer

    class Backend:
        def in_place_decode_inputs(self, meta: object, layer: int) -> tuple[object, ...]:
            return (None, None, None, None)

    class Linear:
        def __init__(self, fmt: str) -> None:
            self.packed = pack_q8_k(torch.randn(32, 64)) if fmt == "q8_k" else None

        def packed_for(self, rows: int) -> object:
            return self.packed

    norm = type("Norm", (), {"eps": 1e-6, "weight": torch.ones(64)})()
    out = fused_decode_layer(torch.zeros(1, 64), torch.zeros(1, 16), torch.zeros(1, 16), (norm, norm),
                             [Linear("q8_k")] * 4, 4, 0, Backend(), None)
    assert out is None
