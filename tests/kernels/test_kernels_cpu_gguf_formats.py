"""GGUF block types read as exact codes (kernels/cpu/gguf_formats.py) and run by our kernels: every type's codes
and scales give gguf-py's own dequantization bit for bit (random blocks, and the real Gemma 3 file's K-quant
tensors), packed too, in the fewest bytes that hold them (q4_k/q5_k/q6_k of kbits.cpp, q8_0, q4_0/q4_1, else
q8_k of kquant.cpp); each K kernel against its torch reference on both ISA paths and against a float32 matmul
with the same weights, eagerly and in a compiled graph; mixed types fused into one weight stay exact; the fused
decode-layer op leaves layers with these weights to their modules."""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.gguf_formats import (
    SUPPORTED_GGML_TYPES, concat_rows, decode_gguf_blocks, pack_block_codes, pack_by_shape, packed_forms,
    random_gguf_blocks,
)
from ringserve.kernels.cpu.packing import dequantize, pack, reference_linear

FEWEST_BYTES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_k", "Q5_1": "q5_k", "Q4_K": "q4_k",
                "Q5_K": "q5_k", "Q6_K": "q6_k"}
BY_TYPE = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q8_0"}  # pack_block_codes' default; else q6_k
K_FORMS = ("q4_k", "q5_k", "q6_k", "q8_k")


def reference(raw: np.ndarray, ggml_type: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]).copy())


@pytest.mark.parametrize("ggml_type", SUPPORTED_GGML_TYPES)
def test_codes_give_gguf_pys_dequantization_exactly(ggml_type: str) -> None:
    rows, cols = 19, 512  # rows not a whole tile of 16
    raw = random_gguf_blocks(ggml_type, rows, cols)
    want = reference(raw, ggml_type).reshape(rows, cols)
    codes = decode_gguf_blocks(raw, ggml_type, rows, cols)
    assert torch.equal(codes.dequantize(), want)
    assert pack_block_codes(codes).format == BY_TYPE.get(ggml_type, "q6_k")
    forms = packed_forms(codes)
    assert forms[0] == FEWEST_BYTES[ggml_type] and forms[-1] == "q8_k"
    for fmt in forms:  # every form that holds the codes holds them exactly
        packed = pack_block_codes(codes, fmt)
        assert packed.format == fmt
        assert torch.equal(dequantize(packed), want), fmt
    order = torch.randperm(rows)
    assert torch.equal(dequantize(pack_block_codes(codes.permute_rows(order), forms[0])), want[order])


@pytest.mark.parametrize(("types", "fmt"), [
    (("Q5_0", "Q5_0", "Q8_0"), "q8_0"),  # Gemma 3's fused q/k/v
    (("Q5_0", "Q5_0"), "q5_k"),  # its gate/up
    (("Q4_K", "Q6_K"), "q6_k"),
    (("Q4_K", "Q5_K", "Q5_1"), "q5_k"),
    (("Q5_0", "Q8_0", "Q4_K", "Q6_K"), "q8_k"),
])
def test_parts_of_different_types_fuse_exactly(types: tuple[str, ...], fmt: str) -> None:
    raws = [random_gguf_blocks(t, 16, 256, seed=i) for i, t in enumerate(types)]
    codes = concat_rows([decode_gguf_blocks(raw, t, 16, 256) for raw, t in zip(raws, types)])
    assert packed_forms(codes)[0] == fmt
    want = torch.cat([reference(raw, t).reshape(16, 256) for raw, t in zip(raws, types)])
    for form in packed_forms(codes):
        assert torch.equal(dequantize(pack_block_codes(codes, form)), want), form
    assert torch.equal(dequantize(pack_block_codes(codes)), want)


def test_weights_of_one_shape_share_the_fewest_bytes_form_that_holds_each() -> None:
    """As Gemma 3's Q4_K_M file mixes them across layers: down Q4_K or Q6_K, q/k/v Q5_0 alone or with a Q8_0 v."""
    def codes(types: tuple[str, ...], seed: int) -> object:
        return concat_rows([decode_gguf_blocks(random_gguf_blocks(t, 16, 256, seed=seed + i), t, 16, 256)
                            for i, t in enumerate(types)])

    model = {"down.0": codes(("Q4_K",), 0), "down.1": codes(("Q6_K",), 1), "qkv.0": codes(("Q5_0", "Q5_0"), 3),
             "qkv.1": codes(("Q5_0", "Q8_0"), 5)}
    packed = pack_by_shape(model)
    assert {name: p.format for name, p in packed.items()} == {"down.0": "q6_k", "down.1": "q6_k", "qkv.0": "q8_0",
                                                                "qkv.1": "q8_0"}
    assert pack_by_shape({"up.0": codes(("Q5_0",), 2)})["up.0"].format == "q5_k"
    for name, p in packed.items():
        assert torch.equal(dequantize(p), model[name].dequantize()), name


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


def weight_in(fmt: str, rows: int, cols: int, seed: int) -> tuple[object, torch.Tensor]:
    """A packed `fmt` weight made from a file's blocks (q8_k: Q4_K and Q8_0 fused), and the weight it stands for."""
    types = {"q4_k": ("Q4_K",), "q5_k": ("Q5_K",), "q6_k": ("Q6_K",), "q8_k": ("Q4_K", "Q8_0")}[fmt]
    parts = [decode_gguf_blocks(random_gguf_blocks(t, rows, cols, seed=seed + i), t, rows, cols)
             for i, t in enumerate(types)]
    codes = concat_rows(parts)
    packed = pack_block_codes(codes, fmt)
    return packed, codes.dequantize()


@pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels are not built")
@pytest.mark.parametrize("fmt", K_FORMS)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_each_k_kernel_matches_its_reference_on_every_isa(fmt: str, rows: int) -> None:
    packed, weight = weight_in(fmt, 37, 512, seed=rows)
    x = torch.randn(rows, 512)
    bias = torch.randn(packed.out_features)
    want = reference_linear(x, packed, bias)
    for isa in isas():
        cpu_kernels.set_isa(isa)
        try:
            got = cpu_kernels.packed_linear(x, packed, bias)
        finally:
            cpu_kernels.set_isa(cpu_kernels.best_isa())
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=lambda m: f"{isa}: {m}")
    exact = x @ weight.t() + bias  # within what int8 activations cost
    assert (want - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("fmt", K_FORMS)
def test_a_float_weight_packs_in_each_k_form_for_timing(fmt: str) -> None:
    weight = torch.randn(20, 80)
    packed = pack(weight, fmt)
    assert packed.format == fmt and packed.in_features == 80
    steps = {"q4_k": 15, "q5_k": 31, "q6_k": 31, "q8_k": 127}[fmt]  # q6_k: symmetric, -32..31 over amax
    bound = float(weight.abs().max()) * 2 / steps if fmt != "q6_k" else float(weight.abs().max()) / steps
    torch.testing.assert_close(dequantize(packed), weight, atol=bound, rtol=0)


@pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels are not built")
@pytest.mark.parametrize("fmt", ["q6_k", "q8_k"])
def test_a_k_kernel_on_many_rows_and_threads(fmt: str) -> None:
    """A prefill-sized call (its activation rows quantized by several threads) gives the reference's rows."""
    packed, _ = weight_in(fmt, 48, 2048, seed=9)
    x = torch.randn(64, 2048)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_kernels.packed_linear(x, packed, None)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, reference_linear(x, packed, None), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q5_k", "q8_k"])
def test_k_forms_trace_into_a_compiled_graph(fmt: str) -> None:
    """packed_linear inside torch.compile (the ops' fakes give the shapes) computes what it does eagerly."""
    packed, _ = weight_in(fmt, 24, 256, seed=3)
    x = torch.randn(2, 256)

    def step(rows: torch.Tensor) -> torch.Tensor:
        return torch.relu(cpu_kernels.packed_linear(rows, packed, None))

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))


@pytest.mark.parametrize("fmt", K_FORMS)
def test_the_fused_decode_layer_declines_k_forms(fmt: str) -> None:
    """The whole-layer op reads only the q8_0/q4_0/q4_1 layouts: a layer with a K-form linear runs its modules."""
    from ringserve.kernels.cpu.decode_layer import fused_decode_layer

    class Backend:
        def in_place_decode_inputs(self, meta: object, layer: int) -> tuple[object, ...]:
            return (None, None, None, None)

    class Linear:
        def __init__(self, packed: object) -> None:
            self.packed = packed

        def packed_for(self, rows: int) -> object:
            return self.packed

    norm = type("Norm", (), {"eps": 1e-6, "weight": torch.ones(64)})()
    others = [Linear(pack(torch.randn(32, 64), "q8_0")) for _ in range(3)]
    out = fused_decode_layer(torch.zeros(1, 64), torch.zeros(1, 16), torch.zeros(1, 16), (norm, norm),
                             [Linear(pack(torch.randn(32, 64), fmt))] + others, 4, 0, Backend(), None)
    assert out is None
