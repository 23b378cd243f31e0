"""Sampling: greedy rows are argmax, filters restrict the support, generators make draws reproducible."""

from __future__ import annotations

import torch
from tests.engine_helpers import torch_single_thread  # noqa: F401  (autouse fixture)

from kernels.sampling import SamplingRow, sample

VOCAB = 100


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_rows_are_exact_argmax_next_to_sampled_rows() -> None:
    logits = torch.randn(6, VOCAB, generator=seeded(0))
    rows = [SamplingRow(0.0), SamplingRow(1.0, generator=seeded(1))] * 3
    tokens = sample(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[b] for b in (0, 2, 4)] == [argmax[b] for b in (0, 2, 4)]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(8, VOCAB, generator=seeded(2))
    argmax = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingRow(1.0, top_k=1, generator=seeded(b)) for b in range(8)]) == argmax
    assert sample(logits, [SamplingRow(1.5, top_p=1e-6, generator=seeded(b)) for b in range(8)]) == argmax


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform, so draws depend on the generator only

    def draws(seed: int) -> list[int]:
        g = seeded(seed)
        return [sample(logits, [SamplingRow(1.0, generator=g)])[0] for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_k_and_top_p_restrict_support() -> None:
    g = seeded(3)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None, :]
    top_p = {sample(logits, [SamplingRow(1.0, top_p=0.5, generator=g)])[0] for _ in range(200)}
    assert top_p == {0, 1}  # 0.4 < 0.5, so the second token is needed; 0.7 >= 0.5 cuts the rest
    top_k = {sample(logits, [SamplingRow(1.0, top_k=3, generator=g)])[0] for _ in range(200)}
    assert top_k == {0, 1, 2}
    everything = {sample(logits, [SamplingRow(1.0, generator=g)])[0] for _ in range(200)}
    assert everything == {0, 1, 2, 3}
