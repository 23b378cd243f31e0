"""Mixture-of-experts layers (actors/engine/models/moe.py) beyond the per-family comparisons with transformers in
tests/models/test_model_families.py: a batch whose rows choose different experts gives each row its solo output; a
one-row decode step runs only its top-k experts; quantized experts run their kernels; the compiled decode graph
keeps the routed experts inside one graph; and tensor parallelism, slicing every expert or placing whole experts
per rank (`--ep`), gives the unsharded engine's tokens and logprobs.

The model is the tiny Qwen2-MoE (a dense first layer, then 8 experts of which 2 per token, unnormalised top-k
weights, a shared expert scaled by its sigmoid gate): every piece of the block but DeepSeek's routing, which the
DeepSeek families' tests cover."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.actors.engine.models.moe import SparseMoE
from ringserve.actors.engine.quantization.quantize import apply_quantization
from ringserve.bus.messages import SamplingParams, TokenizedRequest
from ringserve.kernels.quantization import QuantLinear
from tests.engine_helpers import (assert_greedy_matches, compiled_engine, engine_for, greedy, hf_greedy,
                                  run_to_completion, tokens_of)
from tests.model_families import VOCAB, tiny_hf_model
from tests.scale_out.test_tensor_parallel import _check_close, _run_waves, _spawn_group

FAMILY = "qwen2_moe"


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_model(FAMILY)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length + i,), generator=gen).tolist() for i in range(count)]


def moe_layers(engine: Any) -> list[SparseMoE]:
    return [layer.mlp for layer in engine.runner.model.decoder_layers() if isinstance(layer.mlp, SparseMoE)]


def test_rows_that_choose_different_experts_get_their_solo_outputs(hf: Any) -> None:
    seqs = prompts(4, 9, seed=3)
    chosen: list[torch.Tensor] = []
    batched = engine_for(hf)
    hook = moe_layers(batched)[0].gate.register_forward_hook(lambda m, args, out: chosen.append(out[1].clone()))
    params = SamplingParams(max_new_tokens=8, temperature=0.0, return_logprob=True)
    rows = run_to_completion(batched, [TokenizedRequest(str(i), s, params) for i, s in enumerate(seqs)])
    hook.remove()
    decode_steps = [ids for ids in chosen if ids.shape[0] == len(seqs)]
    assert decode_steps and any(len({tuple(sorted(r.tolist())) for r in ids}) > 1 for ids in decode_steps), \
        "the batch's rows should route to different experts"
    for i, s in enumerate(seqs):
        solo = run_to_completion(engine_for(hf), [TokenizedRequest("solo", s, params)])["solo"]
        assert tokens_of(rows[str(i)]) == tokens_of(solo)
        torch.testing.assert_close(torch.tensor([lp for r in rows[str(i)] for lp in r.logprobs]),
                                   torch.tensor([lp for r in solo for lp in r.logprobs]), atol=1e-4, rtol=0)


def test_a_one_row_decode_step_runs_only_its_top_k_experts(hf: Any) -> None:
    engine = engine_for(hf)
    assert engine.add_request(TokenizedRequest("r", prompts(1, 7, seed=4)[0], greedy(4))) is None
    engine.step()  # the prefill
    calls: list[tuple[int, int, int]] = []  # (layer, expert, rows)
    hooks = [expert.register_forward_hook(lambda m, args, out, i=i, e=e: calls.append((i, e, args[0].shape[0])))
             for i, moe in enumerate(moe_layers(engine)) for e, expert in enumerate(moe.experts)]
    engine.step()  # one decode row
    for h in hooks:
        h.remove()
    layers = moe_layers(engine)
    assert sorted({i for i, _, _ in calls}) == list(range(len(layers)))
    for i, moe in enumerate(layers):
        experts = [e for layer, e, _ in calls if layer == i]
        assert len(experts) == len(set(experts)) == moe.top_k, experts
    assert all(rows == 1 for _, _, rows in calls)
    expert_bytes = sum(p.numel() * p.element_size() for p in layers[0].experts[0].parameters())
    read = sum(p.numel() * p.element_size() for i, e, _ in calls for p in layers[i].experts[e].parameters())
    assert read == len(layers) * layers[0].top_k * expert_bytes  # of the 8 experts' weights, the chosen 2's


@pytest.mark.parametrize(("method", "tolerance"), [("int8", 0.03), ("int4", 0.2)])
def test_quantized_experts_run_their_kernels_close_to_float(hf: Any, method: str, tolerance: float) -> None:
    """Every expert's linears become quantized layers, and the block's output stays within the method's error
    of the float block's (a mis-wired expert or routing weight would be off by its whole output)."""
    floats = engine_for(hf)
    quantized = engine_for(hf, quantization=method)
    apply_quantization(quantized.runner.model, quantized.config)
    x = torch.randn(6, hf.config.hidden_size, generator=torch.Generator().manual_seed(5))
    for float_moe, quant_moe in zip(moe_layers(floats), moe_layers(quantized)):
        assert all(isinstance(linear, QuantLinear) for expert in quant_moe.experts
                   for linear in (expert.gate_up_proj, expert.down_proj))
        want, got = float_moe(x), quant_moe(x)
        assert ((got - want).norm() / want.norm()).item() < tolerance


def test_the_compiled_decode_graph_keeps_the_experts_in_one_graph(hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = compiled_engine(hf, monkeypatch, max_bs=2)
    seq = prompts(1, 8, seed=6)[0]
    rows = run_to_completion(engine, [TokenizedRequest("g", seq, greedy(10))])
    assert_greedy_matches(hf, seq, hf_greedy(hf, seq, 10, None), tokens_of(rows["g"]))


def _waves() -> list[list[tuple[str, list[int], int]]]:
    return [[(f"m{i}", p, 8) for i, p in enumerate(prompts(3, 6, seed=7))]]


# experts sliced (--tp 2) and placed whole (--ep 2) also run through the ring
# (tests/models/test_server_model_families.py)
@pytest.mark.parametrize("expert_parallel", [True], ids=["expert-parallel"])
def test_two_ranks_give_the_unsharded_tokens(hf: Any, expert_parallel: bool) -> None:
    want = _run_waves(engine_for(hf, chunked_prefill_size=4), _waves())
    scenario = ("moe", {"model": FAMILY, "expert_parallel": expert_parallel, "chunked_prefill_size": 4}, _waves())
    results, _ = _spawn_group(2, [scenario])
    assert isinstance(results[0], dict), results
    _check_close(want, results[0]["moe"])
