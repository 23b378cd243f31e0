"""Int8 weight quantization: close to float32, swapped in from outside the model, usable by the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bus.messages import TokenizedRequest
from actors.engine.weights import model_from_hf
from kernels.quantization import Int8Linear, measure_kernel_plan, plan_buckets, quantize_linears
from tests.engine_helpers import (
    engine_for,
    greedy,
    run_to_completion,
    tiny_hf_llama,
    tokens_of,
)


def test_int8_linear_is_close_to_float() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    x = torch.randn(5, 3, 64)
    expected = linear(x)
    got = Int8Linear(linear)(x)
    assert got.shape == expected.shape
    relative = (got - expected).norm() / expected.norm()
    assert relative < 0.02, relative


def test_int8_rows_do_not_depend_on_their_batch() -> None:
    """Activations are scaled per row: a token with huge activations (an attention sink) in the same batch
    changes nothing for the others."""
    torch.manual_seed(1)
    quantized = Int8Linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(4, 64)
    alone = quantized(x)
    sink = torch.zeros(1, 64)
    sink[0, 3] = 500.0
    together = quantized(torch.cat([sink, x]))[1:]
    assert torch.equal(together, alone)
    # a single row runs fbgemm's kernel (its one range is that row's): same quantization grid up to rounding
    single = quantized(x[2:3])
    assert (single - alone[2:3]).norm() / alone[2:3].norm() < 0.02


def test_quantize_linears_replaces_every_projection_and_the_head() -> None:
    hf = tiny_hf_llama()
    model = model_from_hf(hf.config, hf.state_dict())
    quantize_linears(model, "int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="int3"):
        quantize_linears(model, "int3")


def test_the_engine_runs_int8_weights_with_logits_close_to_float32() -> None:
    hf = tiny_hf_llama()
    prompt = [5, 17, 42, 99, 7]
    exact = engine_for(hf, device="cpu")
    quantized = engine_for(hf, device="cpu")
    quantize_linears(quantized.runner.model, "int8")
    params = greedy(8, return_logprob=True, top_logprobs_num=5)
    a = run_to_completion(exact, [TokenizedRequest("a", prompt, params)])["a"]
    b = run_to_completion(quantized, [TokenizedRequest("b", prompt, params)])["b"]
    assert len(tokens_of(b)) == 8
    # the first token's distribution (same context for both) barely moves
    assert a[0].top_ids[0][:2] == b[0].top_ids[0][:2]
    assert a[0].top_logprobs[0][0] == pytest.approx(b[0].top_logprobs[0][0], abs=0.25)


def test_a_kernel_plan_runs_float32_where_int8_was_measured_slower() -> None:
    torch.manual_seed(3)
    linear = nn.Linear(64, 32)
    layer = Int8Linear(linear, plan={1: "int8", 2: "float32"})  # 1 row: int8; 2-3 rows and more: float32
    with torch.no_grad():
        for rows in (2, 3, 8):  # 8 rows: above the largest bucket, so it follows that bucket
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), linear(x), rtol=0, atol=0)
        one = torch.randn(1, 64)
        assert not torch.equal(layer(one), linear(one))  # int8 there
        torch.testing.assert_close(layer(one), linear(one), rtol=0.05, atol=0.05)
    assert Int8Linear(linear).weight_f is None  # without float32 buckets no float copy is kept


def test_int8_measures_its_kernels_and_reports_them() -> None:
    from actors.engine.config import EngineConfig
    from actors.engine.quantize import apply_quantization, quantization_report
    from actors.engine.weights import model_from_hf

    plan = measure_kernel_plan([(32, 64)], max_rows=8, repeats=1)
    assert set(plan) == {1, 2, 3, 4} and set(plan.values()) <= {"int8", "float32"}
    model = model_from_hf(tiny_hf_llama().config, tiny_hf_llama().state_dict(), "cpu")
    method, plan = apply_quantization(model, EngineConfig(device="cpu", quantization="int8"))
    assert method == "int8" and plan
    report = quantization_report(model)
    assert report == plan_buckets(plan) and "1-1 rows" in report
    assert quantization_report(model_from_hf(tiny_hf_llama().config, tiny_hf_llama().state_dict(), "cpu")) == {}
