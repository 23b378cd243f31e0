"""The quantized kernels' AVX2 one-row path (a decode step at batch 1 runs a whole-tile loop of its own there) and
the AVX-512 VNNI path give the same bits as each other and as the multi-row kernel, with a zero-padded last
block and a bias. (Row counts 1-64 on one path at a time: tests/kernels/test_row_invariant_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.packing import FORMATS, pack, reference_linear

needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels are not built here")


@needs_build
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row_and_a_batch_agree_bit_for_bit_on_every_isa_path(fmt: str) -> None:
    torch.manual_seed(3)
    weight, bias = torch.randn(40, 200), torch.randn(40)  # a partial last tile; K 200: a zero-padded last block
    x = torch.randn(9, 200) * 2
    packed = pack(weight, fmt)
    paths = ["avx512vnni", "avx2"] if cpu_kernels.best_isa() == "avx512vnni" else ["avx2"]
    best, outputs = cpu_kernels.isa(), []
    try:
        for path in paths:
            cpu_kernels.set_isa(path)
            batch = cpu_kernels.packed_linear(x, packed, bias)
            alone = torch.cat([cpu_kernels.packed_linear(x[r:r + 1], packed, bias) for r in range(x.shape[0])])
            assert torch.equal(alone, batch), f"{fmt} {path}: a row alone differs from the same row in a batch"
            torch.testing.assert_close(batch, reference_linear(x, packed, bias), rtol=1e-5,
                                       atol=1e-4 * batch.abs().max().item())
            outputs.append(batch)
    finally:
        cpu_kernels.set_isa(best)
    # exact integer sums, then the same float operations in the same order on both paths
    assert all(torch.equal(out, outputs[0]) for out in outputs), f"{fmt}: the ISA paths differ"
