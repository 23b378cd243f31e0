"""The CPU paged decode attention kernel (kernels/cpu/paged_attention.cpp) against its torch reference: GQA
group sizes 1-4, head dims on the vector path and off it (not a multiple of 8), context lengths 1 to 1500
through scattered slots of a shared table, 1 and 2 threads (the same numbers on either); a sliding window and a
logit soft-cap; its fake implementation; the fallback without a build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.cpu.attention import reference_paged_decode_attention

ROOT = Path(__file__).resolve().parents[2]
needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")


def case(heads: int, kv_heads: int, head_dim: int, lens: list[int], slots: int = 4096) -> tuple[torch.Tensor, ...]:
    """q, K/V of one pool layer, a table whose rows hold scattered slots, the rows used and their lengths."""
    k = torch.randn(slots, kv_heads, head_dim)
    v = torch.randn(slots, kv_heads, head_dim)
    width = max(lens) + 5
    table = torch.stack([torch.randperm(slots)[:width] for _ in range(len(lens) + 2)])
    rows = torch.randperm(len(lens) + 2)[: len(lens)]
    q = torch.randn(len(lens), heads, head_dim) * 2  # larger scores: a peaked softmax tests the max shift
    return q, k, v, table, rows, torch.tensor(lens)


@needs_build
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (6, 2, 12), (3, 1, 5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_matches_the_reference(heads: int, kv_heads: int, head_dim: int, threads: int) -> None:
    torch.manual_seed(heads * 100 + head_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, table, rows, lens = case(heads, kv_heads, head_dim, [1, 2, 7, 8, 9, 64, 333, 1500])
        scale = head_dim**-0.5
        got = cpu_kernels.paged_decode_attention(q, k, v, table, rows, lens, scale)
        want = reference_paged_decode_attention(q, k, v, table, rows, lens, scale)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@needs_build
@pytest.mark.parametrize("heads,kv_heads,head_dim,lens", [(9, 3, 64, [300]), (8, 2, 16, [9]), (6, 1, 64, [40, 7]),
                                                          (3, 1, 5, [17])])
def test_the_output_does_not_depend_on_the_thread_count(heads: int, kv_heads: int, head_dim: int,
                                                        lens: list[int]) -> None:
    """One or two requests (a few work items, split unevenly over two threads): two threads give one thread's
    output bit for bit (the thread tuner switches counts between steps, and a request's greedy tokens must not
    change with it)."""
    torch.manual_seed(heads + head_dim)
    q, k, v, table, rows, kv_lens = case(heads, kv_heads, head_dim, lens)
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_decode_attention(q, k, v, table, rows, kv_lens, scale)
        torch.set_num_threads(2)
        two = cpu_kernels.paged_decode_attention(q, k, v, table, rows, kv_lens, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two, one)
    torch.testing.assert_close(two, reference_paged_decode_attention(q, k, v, table, rows, kv_lens, scale),
                               atol=2e-6, rtol=1e-5)


@needs_build
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 12)], ids=["vector", "scalar"])
@pytest.mark.parametrize("window,soft_cap", [(37, 0.0), (0, 5.0), (200, 3.0), (1, 0.0)])
def test_a_sliding_window_and_a_soft_cap_match_the_reference(heads: int, kv_heads: int, head_dim: int, window: int,
                                                             soft_cap: float) -> None:
    """Lengths below, at and past the window (the kernel starts at the window's first key), capped logits large
    enough for tanh to bend them."""
    torch.manual_seed(window + head_dim)
    q, k, v, table, rows, lens = case(heads, kv_heads, head_dim, [1, 2, 7, 36, 37, 38, 333, 1500])
    scale = head_dim**-0.5
    got = cpu_kernels.paged_decode_attention(q, k, v, table, rows, lens, scale, window, soft_cap)
    want = reference_paged_decode_attention(q, k, v, table, rows, lens, scale, window, soft_cap)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    if window:  # the same as attending over only the window's slots
        last = [table[rows[b], max(0, int(n) - window) : int(n)] for b, n in enumerate(lens)]
        short = torch.stack([torch.cat([s, s.new_zeros(window - len(s))]) for s in last])
        alone = reference_paged_decode_attention(q, k, v, short, torch.arange(len(lens)),
                                                 torch.tensor([len(s) for s in last]), scale, 0, soft_cap)
        torch.testing.assert_close(got, alone, atol=2e-6, rtol=1e-5)


@needs_build
def test_the_kernel_reads_one_layer_of_the_pool_in_place() -> None:
    """A layer view of the [layers, slots, Hkv, D] pool (what the backend passes), and a bad length refused."""
    torch.manual_seed(1)
    pool_k, pool_v = torch.randn(3, 512, 2, 16), torch.randn(3, 512, 2, 16)
    table = torch.randperm(512)[:100].reshape(1, 100)
    q, rows, lens = torch.randn(1, 4, 16), torch.tensor([0]), torch.tensor([100])
    got = cpu_kernels.paged_decode_attention(q, pool_k[2], pool_v[2], table, rows, lens, 0.25)
    torch.testing.assert_close(got, reference_paged_decode_attention(q, pool_k[2], pool_v[2], table, rows, lens, 0.25))
    with pytest.raises(RuntimeError, match="kv_len"):
        cpu_kernels.paged_decode_attention(q, pool_k[2], pool_v[2], table, rows, torch.tensor([101]), 0.25)


def test_the_fake_implementation_gives_the_output_shape() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, table, rows, lens = case(6, 2, 8, [3, 4], slots=64)
        out = torch.ops.ringserve_cpu.paged_decode_attention(q, k, v, table, rows, lens, 0.5)
    assert out.shape == q.shape and out.dtype == torch.float32


def test_without_a_build_the_torch_reference_runs(tmp_path: Path) -> None:
    script = ("import torch, ringserve.kernels.cpu as c; from ringserve.kernels.cpu.attention import reference_paged_decode_attention as r\n"
              "assert not c.compiled()\n"
              "q, k, v = torch.randn(2, 4, 8), torch.randn(32, 2, 8), torch.randn(32, 2, 8)\n"
              "t, rows, n = torch.randperm(32).reshape(2, 16), torch.tensor([1, 0]), torch.tensor([16, 5])\n"
              "torch.testing.assert_close(c.paged_decode_attention(q, k, v, t, rows, n, 0.3), r(q, k, v, t, rows, n, 0.3))\n"
              "torch.testing.assert_close(c.paged_decode_attention(q, k, v, t, rows, n, 0.3, 4, 2.0),\n"
              "                           r(q, k, v, t, rows, n, 0.3, 4, 2.0))\n"
              "print('ok')\n")
    env = {**os.environ, "RINGSERVE_CPU_KERNELS": "0", "RINGSERVE_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
