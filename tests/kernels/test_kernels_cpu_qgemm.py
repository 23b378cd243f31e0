"""Our CPU group-quantized GEMV/GEMM (kernels/cpu): the C++ kernel against the torch reference of the same
math on odd shapes, 1..33 rows, 1 and 2 threads and every ISA path this CPU has; the reference against the
float32 matmul within the quantization error; the op's fake implementation; and the fallback without a build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.packing import (
    FORMATS, dequantize, pack, quantize_activations, reference_linear, unpack,
)

ROOT = Path(__file__).resolve().parents[2]
needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")
# (out N, in K): N odd or not a multiple of 16, K not a multiple of 64 (or of 32), and SmolLM2's o_proj
SHAPES = [(33, 96), (50, 70), (17, 32), (7, 200), (576, 576)]
ROWS = [1, 2, 3, 4, 5, 8, 13, 33]
# relative error of the quantized product against float32 on Gaussian data (measured ~0.008 and ~0.08)
FLOAT_TOLERANCE = {"q8_0": 0.02, "q4_0": 0.15, "q4_1": 0.15, "q8_k": 0.02, "q4_k": 0.15, "q5_k": 0.08, "q6_k": 0.08}
GROUP_FORMATS = ("q8_0", "q4_0", "q4_1")  # fp16 scales per 32 (`unpack` reads them); the K forms: their own tests


def isa_paths() -> list[str]:
    """The ISA paths this host can run: both on an AVX-512 VNNI CPU, AVX2 alone elsewhere."""
    if not cpu_kernels.compiled():
        return []
    return ["avx512vnni", "avx2"] if cpu_kernels.best_isa() == "avx512vnni" else ["avx2"]


def each_isa_path_and_thread_count() -> Iterator[tuple[str, int]]:
    """Run the kernels on every ISA path and on 1 and 2 threads in turn, yielding each (path, threads); both
    restored after."""
    best, previous = cpu_kernels.isa(), torch.get_num_threads()
    try:
        for path in isa_paths():
            cpu_kernels.set_isa(path)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                yield path, threads
    finally:
        cpu_kernels.set_isa(best)
        torch.set_num_threads(previous)


def run(x: torch.Tensor, fmt: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """(the op's output, the reference's) for `x` times `weight` packed as `fmt`."""
    p = pack(weight, fmt)
    return cpu_kernels.packed_linear(x, p, bias), reference_linear(x, p, bias)


@needs_build
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_matches_the_reference_on_every_isa_path_shape_row_count_and_thread_count(fmt: str) -> None:
    torch.manual_seed(0)
    for path, threads in each_isa_path_and_thread_count():
        for n, k in SHAPES:
            weight, bias = torch.randn(n, k), torch.randn(n)
            for rows in ROWS:
                x = torch.randn(rows, k) * 3
                got, want = run(x, fmt, weight, bias if rows % 2 else None)
                assert got.shape == (rows, n)
                # the integer dot products are exact; only the float sums' order differs
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item(),
                                           msg=f"{fmt} {path} threads={threads} N={n} K={k} rows={rows}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_quantized_product_is_close_to_float32(fmt: str) -> None:
    torch.manual_seed(1)
    for n, k in [(33, 96), (64, 200)]:
        weight, x = torch.randn(n, k), torch.randn(9, k)
        exact = x @ weight.t()
        got, want = run(x, fmt, weight)
        assert (want - exact).norm() / exact.norm() < FLOAT_TOLERANCE[fmt]
        assert (got - exact).norm() / exact.norm() < FLOAT_TOLERANCE[fmt]
        # the weight alone: every value within half a step of its group's scale (plus q4_1's fp16 min rounding);
        # q4_0 maps -8..7 steps, so the extreme opposite the group's largest magnitude may clamp by one step
        packed = pack(weight, fmt)
        w = dequantize(packed)
        assert w.shape == weight.shape
        if fmt not in GROUP_FORMATS:
            continue
        _, scales, _ = unpack(packed.qweight, packed.scales, packed.mins, packed.bits, -(-k // 32))
        step = scales[:n].abs().repeat_interleave(32, dim=1)[:, :k] * (1.0 if fmt == "q4_0" else 0.5)
        assert ((w - weight).abs() <= step + 2e-3 * weight.abs().amax()).all()


def test_activation_blocks_are_scaled_on_their_own() -> None:
    """A huge activation (an attention sink) flattens only its own block of 32 and its own row."""
    x = torch.randn(2, 96)
    q, d, s = quantize_activations(x)
    assert q.shape == (2, 3, 32) and d.shape == (2, 3) and torch.equal(s, q.int().sum(dim=2))
    sink = x.clone()
    sink[0, 5] = 1000.0
    q2, d2, _ = quantize_activations(sink)
    assert torch.equal(q2[0, 1:], q[0, 1:]) and torch.equal(q2[1], q[1]) and d2[0, 0] > 100 * d[0, 0]


@needs_build
def test_rows_do_not_depend_on_their_batch_and_zeros_give_the_bias() -> None:
    torch.manual_seed(2)
    weight, bias, x = torch.randn(40, 64), torch.randn(40), torch.randn(6, 64)
    for fmt in FORMATS:
        p = pack(weight, fmt)
        alone = cpu_kernels.packed_linear(x[2:3], p, bias)
        together = cpu_kernels.packed_linear(torch.cat([x[:2] * 500, x[2:]]), p, bias)
        assert torch.equal(together[2:3], alone)
        torch.testing.assert_close(cpu_kernels.packed_linear(torch.zeros(3, 64), p, bias), bias.expand(3, -1))


def test_the_op_has_a_fake_implementation_and_traces_whole() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = pack(torch.randn(24, 40), "q4_1")
    with FakeTensorMode() as mode:
        fake = torch.ops.ringserve_cpu.group_linear(mode.from_tensor(torch.randn(5, 40)), mode.from_tensor(p.qweight),
                                                    mode.from_tensor(p.scales), mode.from_tensor(p.mins), None, 24, 4)
    assert fake.shape == (5, 24) and fake.dtype == torch.float32

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ringserve_cpu.group_linear(x, p.qweight, p.scales, p.mins, None, 24, 4).relu()

    x = torch.randn(3, 40)
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(x), f(x))


def test_without_a_build_the_torch_fallback_runs_the_same_math(tmp_path: Path) -> None:
    script = """
import torch, ringserve.kernels.cpu as k
from ringserve.kernels.cpu.packing import pack, reference_group_linear
assert not k.compiled() and k.isa() == "torch"
p = pack(torch.randn(20, 50), "q8_0")
x = torch.randn(3, 50)
assert torch.equal(k.group_linear(x, p), reference_group_linear(x, p.qweight, p.scales, None, None, 20, 8))
from ringserve.kernels.linear_plan.candidates import candidates
from ringserve.kernels.float_linear import onednn_available
floats = ("float32", "onednn") if onednn_available() else ("float32",)
assert candidates("int8") in (floats, floats + ("int_mm",)) and candidates("int4") == floats
print("ok")
"""
    env = {**os.environ, "RINGSERVE_CPU_KERNELS": "0", "RINGSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@needs_build
def test_an_isa_the_cpu_lacks_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown ISA"):
        cpu_kernels.set_isa("sse2")
    if cpu_kernels.best_isa() == "avx2":
        with pytest.raises(RuntimeError, match="does not support"):
            cpu_kernels.set_isa("avx512vnni")
