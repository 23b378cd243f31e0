"""Speculative decoding in the engine (`--speculative-algorithm ngram`): greedy output token-identical to decoding
one token a step, through chunked prefill, the overlap loop, the prefix cache and retraction, with stop tokens
and max_new_tokens landing inside an accepted run; the KV of rejected drafts freed at once; requests that opt out
or are not greedy never speculate; the counters move. Prompts repeat a random phrase, so drafts are accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import SamplingParams, TokenizedRequest
from tests.engine_helpers import engine_for, run_to_completion, tiny_hf_llama, tokens_of

VOCAB = 500


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_llama()


def phrase_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase (drafts hit), one that repeats a short one, and one of random tokens."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (12,), generator=gen).tolist()
    return [phrase * 4, phrase[:5] * 6, torch.randint(3, VOCAB, (20,), generator=gen).tolist(), phrase * 2]


def run(hf: Any, requests: list[TokenizedRequest], **config: Any) -> tuple[dict[str, Any], Any]:
    """Each request's (tokens, finish type), and the engine."""
    engine = engine_for(hf, max_total_tokens=config.pop("max_total_tokens", 4096), **config)
    rows = run_to_completion(engine, requests)
    return {rid: (tokens_of(r), r[-1].finish.type if r[-1].finish else None) for rid, r in rows.items()}, engine


def requests_for(seqs: list[list[int]], stop_token: int | None = None) -> list[TokenizedRequest]:
    out = [TokenizedRequest(f"r{i}", s, SamplingParams(max_new_tokens=30 + 3 * i, temperature=0.0, ignore_eos=True))
           for i, s in enumerate(seqs)]
    if stop_token is not None:  # lands inside a run of accepted drafts of the first request
        out.append(TokenizedRequest("stop", seqs[0], SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                     stop_token_ids=[stop_token])))
    return out


SCENARIOS = {
    "plain": {},
    "chunked": {"chunked_prefill_size": 5},
    "overlap": {"overlap_schedule": "on"},
    "retraction": {"max_total_tokens": 160},
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_output_is_identical_with_speculation_on_and_off(hf: Any, scenario: str) -> None:
    seqs = phrase_prompts(seed=1)
    off, _ = run(hf, requests_for(seqs), **SCENARIOS[scenario])
    stop_token = off["r0"][0][17]
    off, _ = run(hf, requests_for(seqs, stop_token), **SCENARIOS[scenario])
    on, engine = run(hf, requests_for(seqs, stop_token), speculative_algorithm="ngram", **SCENARIOS[scenario])
    assert on == off
    assert off["stop"][1] == "stop" and len(off["stop"][0]) < 40
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 10 and stats.spec_verify_rows > 0, stats
    assert stats.spec_emitted_tokens == stats.spec_accepted_tokens + stats.spec_verify_rows
    if scenario == "retraction":
        assert engine.counters.num_retractions > 0


def test_a_second_round_hits_the_prefix_cache_and_keeps_the_tokens(hf: Any) -> None:
    seqs = phrase_prompts(seed=2)
    engine = engine_for(hf, max_total_tokens=4096, speculative_algorithm="ngram")
    first = run_to_completion(engine, requests_for(seqs))
    second = run_to_completion(engine, [TokenizedRequest(f"again-{r.rid}", r.input_ids, r.sampling)
                                        for r in requests_for(seqs)])
    assert all(tokens_of(second[f"again-{rid}"]) == tokens_of(rows) for rid, rows in first.items())
    assert all(rows[0].cached_tokens > 0 for rows in second.values())


def test_rejected_drafts_free_their_kv_at_once(hf: Any) -> None:
    """After every step each running request holds KV for exactly its tokens but the newest (no slot of a
    rejected draft is kept), and the pool's slots are partitioned as ever."""
    engine = engine_for(hf, max_total_tokens=4096, speculative_algorithm="ngram")
    for request in requests_for(phrase_prompts(seed=3)):
        assert engine.add_request(request) is None
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        for req in engine.decode.running:
            assert req.cached_len == req.seq_len - 1, (req.rid, req.cached_len, req.seq_len)
    stats = engine.stats()
    assert stats.spec_drafted_tokens > stats.spec_accepted_tokens > 0  # some drafts were rejected
    assert stats.kv_running_tokens == 0


@pytest.mark.parametrize("params", [
    {"temperature": 0.3, "seed": 3}, {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 4},
    {"temperature": 0.0, "logit_bias": {5: 1.0}}, {"temperature": 0.0, "repetition_penalty": 1.05},
    {"temperature": 0.0, "frequency_penalty": 0.05, "presence_penalty": 0.05}])
def test_sampled_biased_and_penalised_requests_speculate_with_the_same_tokens(hf: Any,
                                                                              params: dict[str, Any]) -> None:
    """A seeded draw is a pure function of seed, position and logits: each verify row draws the token decoding
    one token a step draws at its position, so sampled output is token for token the same, not only alike;
    penalties count the drafts before each row."""
    seqs = phrase_prompts(seed=4)
    requests = [TokenizedRequest(f"r{i}", s, SamplingParams(max_new_tokens=40, ignore_eos=True, **params))
                for i, s in enumerate(seqs)]
    off, _ = run(hf, requests)
    on, engine = run(hf, requests, speculative_algorithm="ngram")
    assert on == off
    assert engine.stats().spec_accepted_tokens > 0


def test_every_emitted_token_carries_its_own_logprobs(hf: Any) -> None:
    seqs = phrase_prompts(seed=6)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, return_logprob=True,
                            top_logprobs_num=2)
    got = {}
    for algorithm in ("none", "ngram"):
        engine = engine_for(hf, max_total_tokens=4096, speculative_algorithm=algorithm)
        rows = run_to_completion(engine, [TokenizedRequest(f"r{i}", s, params) for i, s in enumerate(seqs)])
        got[algorithm] = {rid: ([t for r in rs for t in r.token_ids], [lp for r in rs for lp in r.logprobs],
                                [ids for r in rs for ids in r.top_ids]) for rid, rs in rows.items()}
    assert engine.stats().spec_accepted_tokens > 0
    for rid, (tokens, logprobs, top_ids) in got["none"].items():
        on_tokens, on_logprobs, on_top_ids = got["ngram"][rid]
        assert on_tokens == tokens and on_top_ids == top_ids and len(on_logprobs) == len(tokens)
        torch.testing.assert_close(torch.tensor(on_logprobs), torch.tensor(logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", [{"speculative": False}, {"min_new_tokens": 25, "stop_token_ids": [7]}])
def test_requests_that_opt_out_or_are_under_a_ban_do_not_speculate(hf: Any, params: dict[str, Any]) -> None:
    """Opted out; a min_new_tokens ban holds it off until the ban ends (here: past the end)."""
    seqs = phrase_prompts(seed=4)[:2]
    requests = [TokenizedRequest(f"r{i}", s, SamplingParams(max_new_tokens=20, **{"temperature": 0.0, **params}))
                for i, s in enumerate(seqs)]
    off, _ = run(hf, requests)
    on, engine = run(hf, requests, speculative_algorithm="ngram")
    assert on == off
    assert engine.stats().spec_verify_rows == 0


def test_a_request_whose_drafts_miss_stops_drafting_for_a_while_then_tries_again() -> None:
    """Fully rejected drafts halve the draft length; the second miss in a row skips 2 steps, the third 4; a fully
    accepted draft grows it again."""
    from ringserve.actors.engine.core.request import Req
    from ringserve.actors.engine.speculative.speculator import Speculator

    speculator = Speculator(num_draft_tokens=4)
    ids = [7, 8, 9, 10, 11] * 4
    req = Req("r", len(ids), list(ids), SamplingParams(max_new_tokens=100, temperature=0.0), seed=0)

    def propose() -> list[int]:
        return speculator.propose([req], context_length=1000, room=100).get(req, [])

    drafts = propose()
    assert drafts == [7, 8, 9, 10]
    speculator.verify(req, drafts, [0] * 5)  # first miss: length 2, no pause
    assert propose() == [7, 8]
    speculator.verify(req, [7, 8], [0] * 3)  # second miss: length 1, 2 steps without drafts
    assert [propose() for _ in range(3)] == [[], [], [7]]
    speculator.verify(req, [7], [0, 0])  # third miss: 4 steps without drafts
    assert [propose() for _ in range(5)] == [[], [], [], [], [7]]
    assert speculator.verify(req, [7], [7, 8]) == [7, 8]  # accepted: the draft and the target's next token
    assert propose() == [7, 8]
    stats = speculator.stats
    assert (stats.drafted, stats.accepted, stats.emitted, stats.verify_rows) == (8, 1, 5, 4)


def test_a_constrained_request_speculates_within_its_grammar() -> None:
    """A JSON-schema request on the real SmolLM2: drafts are cut where the grammar refuses them and each verify
    row is masked by the grammar's state after the drafts before it; the output is valid and equals decoding
    without speculation."""
    import json

    from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    schema = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                          "colour": {"type": "string"}},
                                         "required": ["name", "colour"]}, "minItems": 4, "maxItems": 4}
    got: dict[str, Any] = {}
    for algorithm in ("none", "ngram"):
        engine = EngineCore.from_source(resolve_model(DEFAULT_MODEL), EngineConfig(
            device="cpu", torch_threads=1, max_total_tokens=2048, disable_cuda_graph=True,
            disable_jump_forward=True,  # else the grammar's forced tokens (the JSON's structure) come at once
            speculative_algorithm=algorithm))
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "List four fruits with their colours as JSON."}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        params = SamplingParams(max_new_tokens=120, temperature=0.0, json_schema=json.dumps(schema))
        rows = run_to_completion(engine, [TokenizedRequest("json", ids, params)])["json"]
        got[algorithm] = (tokens_of(rows), rows[-1].finish.type)
        if algorithm == "ngram":
            assert engine.stats().spec_accepted_tokens > 0
            items = json.loads(engine.tokenizer.decode(tokens_of(rows), skip_special_tokens=True))
            assert len(items) == 4 and all(set(item) == {"name", "colour"} for item in items)
    assert got["ngram"] == got["none"]


def draft_engine_pair(hf: Any, draft_hf: Any, **config: Any) -> Any:
    """An engine of `hf` drafting with `draft_hf` (`--speculative-algorithm draft`), both in this process."""
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.models.weights import model_from_hf
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    settings = dict(device="cpu", torch_threads=1, max_total_tokens=4096, **config)
    return EngineCore(model_from_hf(hf.config, hf.state_dict()), EngineConfig(
        **settings, speculative_algorithm="draft", speculative_draft_model_path="(in process)"),
        draft=engine_for(draft_hf, **settings))


@pytest.mark.parametrize("draft", ["the model itself", "another model"])
def test_drafts_from_a_draft_model_keep_the_tokens(hf: Any, draft: str) -> None:
    """The model drafting for itself has every draft accepted; another model (other weights, one layer) some or
    none; the tokens are those of decoding without speculation either way, sampled ones included."""
    from tests.engine_helpers import tiny_hf_llama as other

    draft_hf = hf if draft == "the model itself" else other(seed=7, num_hidden_layers=1)
    seqs = phrase_prompts(seed=8)
    requests = requests_for(seqs) + [TokenizedRequest("sampled", seqs[2], SamplingParams(
        max_new_tokens=30, temperature=0.7, seed=5, ignore_eos=True))]
    off, _ = run(hf, requests)
    engine = draft_engine_pair(hf, draft_hf)
    rows = run_to_completion(engine, requests)
    on = {rid: (tokens_of(r), r[-1].finish.type if r[-1].finish else None) for rid, r in rows.items()}
    assert on == off
    stats = engine.stats()
    assert stats.spec_verify_rows > 0
    if draft == "the model itself":
        assert stats.spec_accepted_tokens > 0.9 * stats.spec_drafted_tokens, stats


def test_a_draft_model_with_another_tokenizer_is_refused() -> None:
    from ringserve.actors.engine.speculative.draft_model import check_same_tokenizer

    class Vocab:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    check_same_tokenizer(Vocab({"a": 0, "b": 1}), Vocab({"a": 0, "b": 1}), "same")
    with pytest.raises(ValueError, match="its tokenizer is not the served model's"):
        check_same_tokenizer(Vocab({"a": 0, "b": 1}), Vocab({"a": 1, "b": 0}), "other")
