"""The CPU kernel of `ringserve::store_kv` (kernels/cpu/kv_store.cpp) against its torch implementation
(kernels/attention/kv_store.py): the views a compiled graph passes (heads of a fused projection's output),
other layouts and dtypes, which take the torch path in C++, and slots outside the pool refused."""

from __future__ import annotations

import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.attention.kv_store import store_kv as reference_store_kv

pytestmark = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")


def pools(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 64, 2, 8).to(dtype), torch.randn(3, 64, 2, 8).to(dtype)


def written(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layer: int,
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """The pools after the op and after the torch implementation, from the same start."""
    k_pool, v_pool = pools(dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    torch.ops.ringserve.store_kv(k_pool, v_pool, layer, slots, k, v)
    reference_store_kv(want_k, want_v, layer, slots, k, v)
    return k_pool, v_pool, want_k, want_v


def test_heads_of_a_fused_projection_are_written_to_their_slots() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(5, 16 + 2 * 16)  # 5 tokens: q (2 heads of 8), k, v (2 KV heads of 8 each)
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    assert not k.is_contiguous()
    slots = torch.tensor([63, 0, 17, 18, 40])
    k_pool, v_pool, want_k, want_v = written(k, v, slots, layer=1)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert torch.equal(k_pool[1, 17], k[2]) and torch.equal(v_pool[1, 40], v[4])


@pytest.mark.parametrize("layout", ["transposed heads", "bfloat16"])
def test_other_layouts_match_the_torch_implementation(layout: str) -> None:
    torch.manual_seed(1)
    dtype = torch.bfloat16 if layout == "bfloat16" else torch.float32
    k, v = torch.randn(3, 8, 2).to(dtype), torch.randn(3, 8, 2).to(dtype)
    if layout == "transposed heads":  # [T, Hkv, D] with D not the innermost dimension
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    else:
        k, v = k.reshape(3, 2, 8), v.reshape(3, 2, 8)
    k_pool, v_pool, want_k, want_v = written(k, v, torch.tensor([5, 9, 2]), layer=2, dtype=dtype)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


def test_a_slot_outside_the_pool_is_refused_and_nothing_is_written() -> None:
    k_pool, v_pool = pools()
    before = k_pool.clone()
    k = v = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="slot 64 outside"):
        torch.ops.ringserve.store_kv(k_pool, v_pool, 0, torch.tensor([3, 64]), k, v)
    with pytest.raises(RuntimeError, match="layer 3 outside"):
        torch.ops.ringserve.store_kv(k_pool, v_pool, 3, torch.tensor([3, 4]), k, v)
    assert torch.equal(k_pool, before)
