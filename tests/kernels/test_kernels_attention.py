"""The torch paged attention backend against dense per-request causal attention, its decode rows both through
the gather and through the CPU paged kernel (kernels/cpu) where it is built."""

from __future__ import annotations

import math

import pytest
import torch

from ringserve.kernels.attention import ForwardInfo, TorchPagedBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_SLOTS, NUM_LAYERS = 6, 2, 8, 128, 2


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last `len(q)` positions over `k`, `v` `[kv_len, Hkv, D]`, HF-style GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [kv, H, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    prefix = k.shape[0] - q.shape[0]
    allowed = torch.arange(k.shape[0])[None, :] <= prefix + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "shape",
    [
        [(0, 5), (7, 1), (3, 4), (0, 1), (10, 1)],  # mixed: prefills, an extend over a prefix, decodes
        [(4, 1), (9, 1), (1, 1)],  # decode only
        [(0, 12)],  # a single prefill
    ],
)
@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "cpu-kernel"])
def test_extend_matches_dense_attention(shape: list[tuple[int, int]], in_place: bool) -> None:
    torch.manual_seed(0)
    k_pool = torch.zeros(NUM_LAYERS, NUM_SLOTS, NUM_KV_HEADS, HEAD_DIM)
    v_pool = torch.zeros_like(k_pool)
    backend = TorchPagedBackend(k_pool, v_pool, NUM_HEADS)
    if in_place and not backend.in_place_decode:
        pytest.skip("the CPU kernels did not build here")
    backend.in_place_decode = in_place
    layer = 1
    slots = torch.randperm(NUM_SLOTS)  # scattered pages, as after many allocations and frees
    used = 0
    pages, keys, values, out_slots = [], [], [], []
    for prefix, q_len in shape:
        page = slots[used : used + prefix + q_len]
        used += prefix + q_len
        seq_k = torch.randn(prefix + q_len, NUM_KV_HEADS, HEAD_DIM)
        seq_v = torch.randn(prefix + q_len, NUM_KV_HEADS, HEAD_DIM)
        k_pool[layer, page[:prefix]] = seq_k[:prefix]
        v_pool[layer, page[:prefix]] = seq_v[:prefix]
        pages.append(page)
        keys.append(seq_k)
        values.append(seq_v)
        out_slots.append(page[prefix:])
    q_lens = [q_len for _, q_len in shape]
    kv_lens = [prefix + q_len for prefix, q_len in shape]
    # Table rows in reverse order, with a spare row, so row b of the table is not request b.
    table = torch.zeros(len(shape) + 1, max(kv_lens) + 3, dtype=torch.int64)
    rows = torch.arange(len(shape), 0, -1)
    for b, page in enumerate(pages):
        table[rows[b], : len(page)] = page
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM)
    new_k = torch.cat([k[-n:] for k, n in zip(keys, q_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(values, q_lens)])

    meta = backend.prepare(ForwardInfo(q_lens, kv_lens, rows, table, torch.cat(out_slots)))
    out = backend.forward(q, new_k, new_v, layer, meta)

    start = 0
    for b, n in enumerate(q_lens):
        expected = dense_reference(q[start : start + n], keys[b], values[b])
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_pool[layer, out_slots[b]], keys[b][-n:])
        torch.testing.assert_close(v_pool[layer, out_slots[b]], values[b][-n:])
        start += n
    assert k_pool[0].abs().sum() == 0, "only the requested layer is written"


def test_replan_guard_waits_for_the_last_plan_of_the_same_wrapper_only() -> None:
    """FlashInfer's plan race: a wrapper is planned again only after the copy its last plan queued has run."""
    from ringserve.kernels.attention.plan_guard import ReplanGuard

    log: list[str] = []

    class FakeEvent:
        count = 0

        def __init__(self) -> None:
            FakeEvent.count += 1
            self.name = f"e{FakeEvent.count}"

        def record(self) -> None:
            log.append(f"record {self.name}")

        def synchronize(self) -> None:
            log.append(f"wait {self.name}")

    guard = ReplanGuard(FakeEvent)
    guard.plan("decode", lambda: log.append("plan decode 1"))
    guard.plan("prefill", lambda: log.append("plan prefill 1"))
    guard.plan("decode", lambda: log.append("plan decode 2"))
    guard.plan("decode", lambda: log.append("plan decode 3"))
    assert log == ["plan decode 1", "record e1", "plan prefill 1", "record e2",
                   "wait e1", "plan decode 2", "record e3", "wait e3", "plan decode 3", "record e4"]
