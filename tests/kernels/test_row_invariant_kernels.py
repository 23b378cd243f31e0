"""The kernels a row-invariant plan may choose (kernels/linear_plan/invariant.py) give a row the same bits at every
row count, on one thread and two, on both ISA paths; and the plan runs one of them per shape at every row count,
without measuring. (The engine-level property, a request's tokens alone, batched and speculated:
tests/engine/test_deterministic_inference.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.float_linear import FloatLinear, onednn_available
from ringserve.kernels.linear_plan.invariant import invariant_plan, is_row_invariant
from ringserve.kernels.quantization import GROUP_KERNELS, QuantLinear

ROWS = (1, 2, 3, 4, 5, 8, 17, 33, 64)
OUT, IN = 80, 512  # a partial 16-row tile; K a multiple of the K-quants' 256

pytestmark = pytest.mark.skipif(not cpu_kernels.compiled(), reason="our CPU kernels are not built here")


def assert_rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, what: str) -> None:
    """Each of the first rows of `x` through `fn` has the same bits at every row count of ROWS, on 1 and 2
    threads, on each ISA path this CPU has."""
    threads, isa = torch.get_num_threads(), cpu_kernels.isa()
    try:
        for path in dict.fromkeys((cpu_kernels.best_isa(), "avx2")):
            cpu_kernels.set_isa(path)
            want = torch.cat([fn(x[i:i + 1]) for i in range(ROWS[-1])])
            for count in (1, 2):
                torch.set_num_threads(count)
                for m in ROWS:
                    assert torch.equal(fn(x[:m]), want[:m]), f"{what} on {path}, {count} threads: {m} rows differ"
    finally:
        torch.set_num_threads(threads)
        cpu_kernels.set_isa(isa)


@pytest.mark.parametrize("fmt", GROUP_KERNELS)
def test_each_group_kernel_computes_a_row_alike_at_every_row_count(fmt: str) -> None:
    torch.manual_seed(0)
    layer = QuantLinear(nn.Linear(IN, OUT), fmt, hold=(fmt,))
    x = torch.randn(ROWS[-1], IN)
    assert_rows_invariant(lambda rows: layer.run(rows.contiguous(), fmt), x, fmt)


@pytest.mark.parametrize("kernel", ["onednn_pad", "f32_gemv"])
def test_the_row_invariant_float32_kernels_compute_a_row_alike_at_every_row_count(kernel: str) -> None:
    if kernel == "onednn_pad" and not onednn_available():
        pytest.skip("torch has no oneDNN here")
    torch.manual_seed(0)
    layer = FloatLinear(nn.Linear(IN, OUT), {bits: kernel for bits in range(1, 8)})
    x = torch.randn(ROWS[-1], IN)
    with torch.no_grad():
        assert_rows_invariant(lambda rows: layer(rows.contiguous()), x, kernel)


def test_the_plan_runs_one_row_invariant_kernel_per_shape_at_every_row_count() -> None:
    rows = {(OUT, IN): [1, 2, 4, 64, 512], (OUT * 2, IN): [1, 8]}
    plan = invariant_plan({(OUT, IN): "int4", (OUT * 2, IN): "none"}, rows)
    assert plan[(OUT, IN)] == {bits: "q4_1" for bits in (1, 2, 3, 7, 10)}
    float_kernel = "onednn_pad" if onednn_available() else "f32_gemv"
    assert plan[(OUT * 2, IN)] == {1: float_kernel, 4: float_kernel}
    assert all(is_row_invariant(k) for p in plan.values() for k in p.values())
    assert not is_row_invariant("float32") and not is_row_invariant("onednn") and not is_row_invariant("int_mm")
