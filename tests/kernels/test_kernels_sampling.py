"""Sampling: greedy is argmax of processed logits, filters restrict the support, seeded draws are reproducible
and follow the probabilities, penalties/bias/bans follow their formulas, logprobs come from the raw logits."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels.sampling import PenaltyState, SamplingRow, sample

VOCAB = 100
CPU = torch.device("cpu")


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return sample(logits, rows).tokens.tolist()


def support(probs: list[float], n: int = 400, **settings: float) -> set[int]:
    """Tokens drawn from `probs` over `n` positions of one seeded request (all in one batch)."""
    logits = torch.tensor(probs).log().expand(n, -1)
    return set(tokens(logits, [SamplingRow(1.0, seed=5, position=i, **settings) for i in range(n)]))


def chi_square(drawn: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(drawn), minlength=len(probs)).float()
    expected = probs * len(drawn)
    return float(((observed - expected) ** 2 / expected).sum())


def test_greedy_rows_are_exact_argmax_next_to_sampled_rows() -> None:
    logits = randn(6, VOCAB, seed=0)
    out = sample(logits, [SamplingRow(0.0), SamplingRow(1.0, seed=1)] * 3)
    assert out.tokens.dtype == torch.int64 and out.tokens.shape == (6,)
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    assert out.tokens[0::2].tolist() == logits.argmax(-1)[0::2].tolist()
    assert out.tokens[1::2].tolist() != logits.argmax(-1)[1::2].tolist()


def test_greedy_matches_argmax_of_bf16_logits_with_ties() -> None:
    logits = randn(4, VOCAB, seed=1).bfloat16()
    logits[:, 7] = logits[:, 30] = 10.0  # exact tie: argmax takes the first
    assert tokens(logits, [SamplingRow(0.0)] * 4) == logits.argmax(-1).tolist() == [7] * 4


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = randn(8, VOCAB, seed=2)
    argmax = logits.argmax(-1).tolist()
    assert tokens(logits, [SamplingRow(1.0, top_k=1, seed=b) for b in range(8)]) == argmax
    assert tokens(logits, [SamplingRow(1.5, top_p=1e-6, seed=b) for b in range(8)]) == argmax


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform, so draws depend on (seed, position) only

    def draws(seed: int) -> list[int]:
        return [tokens(logits, [SamplingRow(1.0, seed=seed, position=i)])[0] for i in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 10  # positions give fresh draws
    assert draws(2**63 - 1) != draws(-1)  # the high seed bits count too


def test_top_k_and_top_p_restrict_support() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    assert support(probs, top_p=0.5) == {0, 1}  # 0.4 < 0.5 needs the second token; 0.7 >= 0.5 cuts the rest
    assert support(probs, top_k=3) == {0, 1, 2}
    assert support(probs) == {0, 1, 2, 3}


def test_min_p_restricts_support_after_temperature() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    assert support(probs, min_p=0.25) == {0, 1, 2}  # threshold 0.125
    assert support(probs, min_p=0.7) == {0}
    assert support(probs, min_p=0.5) == {0, 1}  # ratios to the max: 0.6, 0.3, 0.1
    # At temperature 2 the ratios are their square roots (0.77, 0.55, 0.32), so a third token passes.
    logits = torch.tensor(probs).log().expand(400, -1)
    drawn = tokens(logits, [SamplingRow(2.0, min_p=0.5, seed=5, position=i) for i in range(400)])
    assert set(drawn) == {0, 1, 2}


def test_draws_do_not_depend_on_batch_composition_or_order() -> None:
    logits = randn(40, VOCAB, seed=3)
    rows = [SamplingRow(1.0, top_p=0.9, min_p=0.01, seed=42, position=p) for p in range(40)]
    alone = [tokens(logits[p : p + 1], [rows[p]])[0] for p in range(40)]
    others = randn(40, VOCAB, seed=4)
    other_rows = [SamplingRow(0.7 * (p % 3), top_k=5, seed=p, position=p) for p in range(40)]
    mixed = torch.cat([logits, others]).flip(0)  # different neighbours, reversed order
    batched = tokens(mixed, (rows + other_rows)[::-1])[::-1][:40]
    assert batched == alone
    assert len(set(alone)) > 5


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_seeded_draws_follow_the_probabilities(temperature: float) -> None:
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    n = 4000
    logits = probs.log().expand(n, -1)
    over_positions = tokens(logits, [SamplingRow(temperature, seed=11, position=i) for i in range(n)])
    over_seeds = tokens(logits, [SamplingRow(temperature, seed=i, position=3) for i in range(n)])
    # 7 degrees of freedom: P(chi2 > 30) is about 1e-4; the seeds are fixed, so this cannot flake.
    assert chi_square(over_positions, expected) < 30
    assert chi_square(over_seeds, expected) < 30


def test_uniform_draws_cover_a_flat_vocab_evenly() -> None:
    n = 20000
    drawn = tokens(torch.zeros(n, VOCAB), [SamplingRow(1.0, seed=9, position=i) for i in range(n)])
    assert chi_square(drawn, torch.full((VOCAB,), 1 / VOCAB)) < 160  # 99 dof: mean 99, sd 14


def greedy_with(logits: list[float], prompt: list[int], output: list[int], **penalties: float) -> int:
    """The greedy pick from `logits` for a request with this prompt and output so far."""
    state = PenaltyState(prompt, len(logits), CPU)
    for token in output:
        state.record(torch.tensor([token]))
    return tokens(torch.tensor([logits]), [SamplingRow(0.0, penalties=state, **penalties)])[0]


def test_frequency_and_presence_penalties_follow_their_formulas() -> None:
    logits, prompt, output = [3.0, 2.5, 1.0, 0.0], [2], [0, 0]
    # Token 0 appeared twice: frequency subtracts 2f, presence subtracts p once; the prompt does not count.
    assert greedy_with(logits, prompt, output, frequency_penalty=0.2) == 0  # 3 - 0.4 = 2.6 > 2.5
    assert greedy_with(logits, prompt, output, frequency_penalty=0.3) == 1  # 3 - 0.6 = 2.4 < 2.5
    assert greedy_with(logits, prompt, output, presence_penalty=0.3) == 0  # 3 - 0.3 = 2.7 > 2.5
    assert greedy_with(logits, prompt, output, presence_penalty=0.6) == 1  # 3 - 0.6 = 2.4
    assert greedy_with([0.0, 0.0, 1.0, 0.9], prompt, output, presence_penalty=2.0) == 2  # prompt-only: free
    assert greedy_with([1.0, 0.0, 0.0, 1.1], prompt, output, frequency_penalty=-0.1) == 0  # rewards repeats


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    for prompt, output in (([0], []), ([], [0])):  # seen in the prompt or in the output counts the same
        assert greedy_with([2.0, 1.5, 0.0], prompt, output, repetition_penalty=1.2) == 0  # 2 / 1.2 = 1.67 > 1.5
        assert greedy_with([2.0, 1.5, 0.0], prompt, output, repetition_penalty=1.5) == 1  # 2 / 1.5 = 1.33
        assert greedy_with([-1.0, -1.2, -5.0], prompt, output, repetition_penalty=1.5) == 1  # -1.5 < -1.2
        assert greedy_with([-1.0, -1.2, -5.0], prompt, output, repetition_penalty=1.1) == 0  # -1.1 > -1.2
        assert greedy_with([1.0, 1.5, 0.0], prompt, output, repetition_penalty=0.5) == 0  # r < 1: 1 / 0.5 = 2


def test_penalty_without_state_is_an_error() -> None:
    with pytest.raises(ValueError, match="PenaltyState"):
        sample(torch.zeros(1, 4), [SamplingRow(0.0, presence_penalty=1.0)])


def test_penalty_state_records_chosen_tokens() -> None:
    a, b = PenaltyState([5, 6], VOCAB, CPU), PenaltyState([], VOCAB, CPU)
    assert a.seen.nonzero().flatten().tolist() == [5, 6] and not a.counts.any() and not b.seen.any()
    logits = torch.zeros(3, VOCAB)
    logits[0, 10] = logits[1, 20] = logits[2, 30] = 50.0
    rows = [SamplingRow(0.0, penalties=a), SamplingRow(1.0, penalties=b, seed=1), SamplingRow(0.0)]
    assert tokens(logits, rows) == [10, 20, 30]
    assert tokens(logits, rows) == [10, 20, 30]
    assert a.counts.nonzero().flatten().tolist() == [10] and a.counts[10] == 2
    assert a.seen.nonzero().flatten().tolist() == [5, 6, 10]
    assert b.counts.nonzero().flatten().tolist() == [20] and b.counts[20] == 2 and b.seen[20]


def test_logit_bias_and_banned_ids() -> None:
    logits = randn(3, VOCAB, seed=5)
    before = logits.clone()
    top2 = logits.topk(2, dim=-1).indices
    rows = [
        SamplingRow(0.0, logit_bias={3: 100.0}),
        SamplingRow(0.0, logit_bias={int(top2[1, 0]): -100.0, 7: 0.5}),
        SamplingRow(0.0, banned_ids=[int(top2[2, 0])]),
    ]
    assert tokens(logits, rows) == [3, int(top2[1, 1]), int(top2[2, 1])]
    assert torch.equal(logits, before)  # float32 input is not modified in place
    assert tokens(logits, [SamplingRow(1.0, logit_bias={3: 100.0}, seed=s) for s in range(3)]) == [3] * 3
    all_but_one = [t for t in range(VOCAB) if t != 42]
    for settings in ({}, {"top_p": 0.5}, {"min_p": 0.5}, {"top_k": 3}):
        rows = [SamplingRow(t, banned_ids=all_but_one, seed=s, **settings) for s, t in enumerate((0.0, 1.0, 7.0))]
        assert tokens(logits, rows) == [42] * 3


def test_logprobs_are_raw_log_softmax_at_chosen_tokens_and_top_k() -> None:
    logits = randn(4, VOCAB, seed=6) * 3
    state = PenaltyState([0, 1, 2], VOCAB, CPU)
    rows = [
        SamplingRow(0.0, num_top_logprobs=-1),
        SamplingRow(0.7, seed=3, num_top_logprobs=0, logit_bias={5: 4.0}),
        SamplingRow(0.0, num_top_logprobs=3, repetition_penalty=1.3, penalties=state),
        SamplingRow(1.3, seed=4, top_p=0.8, num_top_logprobs=5),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    assert torch.allclose(out.logprobs, raw.gather(1, out.tokens[:, None]).squeeze(1))
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5) and out.top_ids.dtype == torch.int64
    expected = raw.topk(5, dim=-1)
    assert torch.equal(out.top_ids, expected.indices)
    assert torch.allclose(out.top_logprobs, expected.values)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()

    only_chosen = sample(logits, [SamplingRow(0.0, num_top_logprobs=0)] * 4)
    assert only_chosen.logprobs is not None and only_chosen.top_ids is None and only_chosen.top_logprobs is None


def test_extreme_settings_do_not_crash_and_behave_as_greedy_or_off() -> None:
    logits = randn(8, VOCAB, seed=7) * 1000
    assert tokens(logits, [SamplingRow(1e-40, seed=b) for b in range(8)]) == logits.argmax(-1).tolist()
    assert tokens(logits, [SamplingRow(2e-5, seed=b) for b in range(8)]) == logits.argmax(-1).tolist()
    flat = torch.zeros(64, VOCAB)
    off = tokens(flat, [SamplingRow(1.0, seed=1, position=p) for p in range(64)])
    for settings in ({"top_k": 2**62}, {"top_k": VOCAB}, {"top_k": VOCAB + 1}, {"top_p": 1.0}, {"min_p": 0.0}):
        assert tokens(flat, [SamplingRow(1.0, seed=1, position=p, **settings) for p in range(64)]) == off
    # Sorting for a binding filter elsewhere in the batch must not change a filter-free row's draw.
    spread = randn(32, VOCAB, seed=8)
    free = [SamplingRow(1.0, seed=1, position=p) for p in range(32)]
    assert tokens(spread, free) == tokens(torch.cat([spread, flat[:1]]), [*free, SamplingRow(1.0, top_k=2)])[:32]
    out = sample(logits, [SamplingRow(1.0, top_k=2**62, top_p=1e-9, min_p=1.0, num_top_logprobs=VOCAB + 5)] * 8)
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    assert out.top_ids is not None and out.top_ids.shape == (8, VOCAB) and not out.top_logprobs.isnan().any()


def _exact_fmix32(h: int) -> int:
    """MurmurHash3's finaliser in Python's unbounded ints: the reference for the in-place int32 tensor form."""
    mask = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def test_the_gumbel_noise_is_the_exact_32_bit_hash_of_key_and_token() -> None:
    """The tensor hash runs in place in int32, where products wrap and values above 2**31 are negative: every
    value (keys and token ids across the whole 32-bit range, a [1, V] id row broadcast and a [S, V] one) must
    still be the exact 32-bit hash, and the noise the same float32 arithmetic on it."""
    from ringserve.kernels.sampling import _as_int32, _gumbel

    gen = torch.Generator().manual_seed(11)
    unsigned_keys = torch.randint(0, 2**32, (4, 2), generator=gen).tolist()
    unsigned_keys[0] = [0xFFFFFFFF, 0x80000000]
    keys = torch.tensor([[_as_int32(k) for k in row] for row in unsigned_keys], dtype=torch.int32)
    for token_ids in (torch.arange(300)[None, :], torch.randint(0, 2**32, (4, 300), generator=gen)):
        got = _gumbel(keys, token_ids)
        ids = token_ids.expand(4, -1).tolist()
        exact = [[_exact_fmix32((_exact_fmix32(t ^ k0) + k1) & 0xFFFFFFFF) for t in row]
                 for row, (k0, k1) in zip(ids, unsigned_keys)]
        u = ((torch.tensor(exact) >> 9) * 2 + 1).float() * 2.0**-24
        assert torch.equal(got, -torch.log(-torch.log(u)))
        assert got.shape == (4, 300) and torch.isfinite(got).all()
