"""Every architecture family against transformers on a tiny random model (tests/model_families.py): logits through
prefill, extend and decode over a paged pool; greedy tokens and prompt logprobs through the engine (chunked
prefill, the prefix cache, compiled decode graphs), with prompts that cross the sliding windows and rope-scaled
models past their original context."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import (assert_greedy_matches, compiled_engine, engine_for, greedy, hf_greedy,
                                  run_to_completion, tokens_of)
from tests.model_families import CONFIGS, ORIGINAL_CONTEXT, VOCAB, WINDOW, tiny_hf_model
from tests.models.test_engine_model import PagedRunner, assert_steps_match, hf_last_logits

FAMILIES = sorted(CONFIGS)


@pytest.fixture(scope="module", params=FAMILIES)
def family_hf(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return request.param, tiny_hf_model(request.param)


def prompts(count: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(count)]


def test_logits_match_transformers_through_prefill_extend_and_decode(family_hf: tuple[str, Any]) -> None:
    family, hf = family_hf
    model = model_from_hf(hf.config, hf.state_dict())
    assert_steps_match(model, hf, prompts(3, (4, 3 * WINDOW, 2 * WINDOW + 3)), tol=2e-4, name=family)


@pytest.mark.parametrize("chunk", [0, 5])
def test_greedy_tokens_match_transformers_through_the_engine(family_hf: tuple[str, Any], chunk: int) -> None:
    """Batched, with chunked prefill crossing windows, and past the rope-scaled models' original context, while
    decoding (Phi-3's longrope then encodes the whole sequence again, as its `generate` does) and already in the
    prompt (chunks before the original context are rotated for the whole prompt's length, as transformers'
    one-forward prefill does); the second round of the same prompts hits the prefix cache."""
    family, hf = family_hf
    engine = engine_for(hf, max_total_tokens=2048, chunked_prefill_size=chunk)
    seqs = prompts(4, (3, 2 * WINDOW + 1, ORIGINAL_CONTEXT - 4, ORIGINAL_CONTEXT + 3))
    new_tokens = 12
    for round_ in range(2):
        requests = [TokenizedRequest(f"{round_}-{i}", s, greedy(new_tokens)) for i, s in enumerate(seqs)]
        rows = run_to_completion(engine, requests)
        for i, s in enumerate(seqs):
            expected = hf_greedy(hf, s, new_tokens, None)
            assert_greedy_matches(hf, s, expected, tokens_of(rows[f"{round_}-{i}"]))
    assert engine.stats().kv_running_tokens == 0


def test_prompt_logprobs_match_transformers(family_hf: tuple[str, Any]) -> None:
    family, hf = family_hf
    engine = engine_for(hf, max_total_tokens=512, chunked_prefill_size=4)
    ids = prompts(1, (3 * WINDOW + 2,))[0]
    request = TokenizedRequest("p", ids, greedy(0, return_logprob=True, top_logprobs_num=1, logprob_start_len=0))
    row = run_to_completion(engine, [request])["p"][0]
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    expected = raw.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(row.prompt_logprobs[1:]), expected, atol=2e-3, rtol=0)


COMPILED = ("gemma2", "gemma3", "mistral", "phi3", "olmo3")  # every block variant; Llama's graph is SmolLM2's, tested elsewhere


def test_the_compiled_decode_graph_gives_transformers_tokens(family_hf: tuple[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU decode graph (torch.compile of the whole model's decode step) compiles (a fallback to eager is an
    error in the tests) and its tokens are transformers', for the families that between them use every block
    variant (soft-caps, sandwich and post norms, q/k norms per head and per projection, per-type rotary, windows,
    partial rotary, longrope)."""
    family, hf = family_hf
    if family not in COMPILED:
        pytest.skip("its blocks' graph is covered by the families in COMPILED")
    engine = compiled_engine(hf, monkeypatch)
    seq = prompts(1, (WINDOW + 2,), seed=5)[0]
    rows = run_to_completion(engine, [TokenizedRequest("g", seq, greedy(2 * WINDOW))])
    assert_greedy_matches(hf, seq, hf_greedy(hf, seq, 2 * WINDOW, None), tokens_of(rows["g"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_loads_in_float32(dtype: torch.dtype, tmp_path: Any) -> None:
    """A bfloat16/float16 safetensors directory is read as it is and computed in float32: transformers' logits
    for the same file read in float32."""
    from transformers import AutoModelForCausalLM

    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.models.weights import load_model

    tiny_hf_model("qwen3").to(dtype).save_pretrained(tmp_path)
    ours = load_model(resolve_model(str(tmp_path)), torch.float32, "cpu")
    assert ours.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompts(1, (9,))[0]
    runner = PagedRunner(ours, 1)
    torch.testing.assert_close(runner.feed([ids])[0], hf_last_logits(hf, ids), atol=2e-4, rtol=2e-4)


def test_tensor_parallelism_refuses_a_qk_norm_over_a_whole_projection() -> None:
    """OLMo's q/k norms span every head of the projection, so a rank's heads alone cannot be normed: sharding
    such a layer is refused with what to pass instead, not run wrong."""
    from ringserve.actors.engine.parallel.tensor_parallel import shard_attention

    hf = tiny_hf_model("olmo2")
    attention = model_from_hf(hf.config, hf.state_dict()).model.layers[0].self_attn
    with pytest.raises(ValueError, match="--tp 1"):
        shard_attention(attention, hf.config, group=None)  # type: ignore[arg-type]  # refused before it is read
